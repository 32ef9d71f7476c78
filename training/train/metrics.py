"""The train loop's figures between two reports: accumulated on the device every step, reduced at a report.

``Window.add`` only adds device tensors (no ``.item()``, so a step never waits for the GPU); a report
(``window_metrics``, every ``run.log_every`` steps) reduces them across ranks in one all-reduce and reads
them once. A skipped step (non-finite loss or gradient, training/train/optimizer.py) adds nothing to the
loss means; the run's count of skipped steps is reported as ``skipped_steps``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from training.losses.registry import logit_scalars
from training.train.distributed import all_reduce_sum, rank_and_world


class Window:
    """Per-step figures between two reports, kept as device tensors (no per-step host sync)."""

    def __init__(self) -> None:
        self.terms: dict[str, Tensor] = {}
        self.var: dict[str, Tensor] = {}
        self.good: Tensor | float = 0.0  # steps with a finite loss
        self.norm: Tensor | float = 0.0  # summed gradient norms of those steps
        self.steps, self.wait, self.busy = 0, 0.0, 0.0
        self.t0 = time.perf_counter()

    def add(
        self, terms: Mapping[str, Tensor], feats: Mapping[str, Tensor | None], wait: float, total: float
    ) -> None:
        ok = torch.isfinite(terms["total"].detach())  # () bool on the device
        for k, v in terms.items():
            self.terms[k] = self.terms.get(k, 0.0) + torch.where(ok, v.detach().double(), 0.0)
        for k in ("logvar_v", "logvar_t"):
            if feats.get(k) is not None:
                var = feats[k].detach().double().exp().mean()
                self.var[k] = self.var.get(k, 0.0) + torch.where(ok, var, 0.0)
        if feats.get("grad_norm") is not None:
            norm = feats["grad_norm"].double()
            self.norm = self.norm + torch.where(ok & torch.isfinite(norm), norm, 0.0)
        self.good = self.good + ok.double()
        self.steps, self.wait, self.busy = self.steps + 1, self.wait + wait, self.busy + total


def window_metrics(window: Window, state: Any) -> dict[str, Any]:
    """Global metrics of a window: loss terms summed over ranks, σ² means and wait fraction averaged.

    ``state`` is the worker's ``training.train.step.TrainState``."""
    _, world = rank_and_world()
    device = next(state.module.parameters()).device
    names = sorted(window.terms)
    zero = torch.zeros((), dtype=torch.float64, device=device)

    def dev(v: Tensor | float) -> Tensor:
        return torch.as_tensor(v, dtype=torch.float64, device=device)

    local = [window.terms[k] for k in names]
    local += [window.var.get("logvar_v", zero), window.var.get("logvar_t", zero)]
    local += [dev(window.wait), dev(window.busy), dev(window.good), dev(window.norm)]
    summed = all_reduce_sum(torch.stack([dev(v) for v in local])).tolist()  # the report's one host read
    var_v, var_t, wait, busy, good, norm = summed[len(names) :]
    n = max(good / world, 1.0)  # steps with a finite loss (the same on every rank)
    metrics: dict[str, Any] = {f"loss/{k}": summed[i] / n for i, k in enumerate(names)}
    scale, bias = logit_scalars(state.module.loss, state.module.spec)
    global_batch = state.cfg.global_batch_size
    metrics.update(
        {
            "step": state.step,
            "epoch": state.epoch,
            "world_size": world,
            "micro_batches": getattr(state, "micro", 1),  # a local batch's micro-batches (accumulation)
            "samples_seen": state.step * global_batch,
            "lr": state.sched.get_last_lr()[0],
            "logit_scale": scale,
            "logit_bias": bias,
            "sigma2_image": var_v / (n * world),
            "sigma2_text": var_t / (n * world),
            "grad_norm": norm / (n * world),
            "skipped_steps": int(state.update.skipped),
            "samples_per_s": window.steps * global_batch / max(time.perf_counter() - window.t0, 1e-9),
            "data_wait_fraction": wait / max(busy, 1e-9),
        }
    )
    return metrics
