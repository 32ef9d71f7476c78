"""bf16 autocast through the real forward and loss: on CPU always, on CUDA when a GPU is present.

The train step runs bf16 autocast on CUDA (training/train/step.py ``autocast``); no GPU exists where the suite
usually runs, so the same path is exercised under CPU autocast, and the ``gpu``-marked test repeats it on
CUDA when one is available (skipped otherwise, see tests/conftest.py). A whole optimizer step
(``training.train.step.train_step``) also runs under CPU bf16 autocast with both loss reductions.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.training.train.test_distributed import PAD, global_batch, tiny_module
from training.config import LossConfig, OptimConfig, TrainConfig
from training.model.param_groups import is_unc_param
from training.train.step import autocast, loss_shares, setup_state, train_step


def _loss_and_grads(name: str, device: str, precision: str) -> tuple[float, list[torch.Tensor]]:
    module = tiny_module(name).to(device)
    batch = {k: v.to(device) for k, v in global_batch().items()}
    masked_index = torch.tensor([0, 3], device=device)
    with autocast(torch.device(device), precision):
        feats = module(
            batch["images"], batch["tokens"], batch["masked_tokens"], batch["keep_idx"], masked_index
        )
    terms = loss_shares(module.loss, module.spec, feats, masked_index)
    terms["total"].backward()
    grads = [p.grad.detach().float().cpu() for p in module.parameters() if p.grad is not None]
    return float(terms["total"].detach()), grads


def _compare(name: str, device: str) -> None:
    loss32, grads32 = _loss_and_grads(name, device, "fp32")
    loss16, grads16 = _loss_and_grads(name, device, "bf16")
    assert torch.isfinite(torch.tensor(loss16)) and all(torch.isfinite(g).all() for g in grads16)
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    flat32, flat16 = torch.cat([g.flatten() for g in grads32]), torch.cat([g.flatten() for g in grads16])
    cos = torch.nn.functional.cosine_similarity(flat32, flat16, dim=0)
    assert cos > 0.98, float(cos)  # bf16 keeps ~3 significant digits; the gradient direction must hold


@pytest.mark.parametrize("name", ["prolip", "clip"])
def test_bf16_autocast_step_on_cpu_matches_fp32(name: str) -> None:
    _compare(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["prolip", "siglip", "clip", "pcmepp"])
def test_bf16_autocast_step_on_cuda_matches_fp32(name: str) -> None:
    _compare(name, "cuda")


def _one_train_step(precision: str, reduction: str) -> tuple[dict[str, float], list[torch.Tensor], Any]:
    """``training.train.step.train_step`` (forward, loss, backward, clipping, AdamW, schedule) on the ``tiny``
    model, from the same initial weights whatever the precision."""
    cfg = TrainConfig(
        model="tiny",
        global_batch_size=8,
        samples_seen=16,
        precision=precision,
        loss=LossConfig(reduction=reduction),
        optim=OptimConfig(warmup_steps=1, grad_clip=1.0, unc_lr_mult=10.0),
    )
    state = setup_state(cfg, SimpleNamespace(vocab_size=64, pad_id=PAD), torch.device("cpu"), 0)
    g = torch.Generator().manual_seed(2)
    small = global_batch()
    batch = {
        "images": torch.randn(8, 3, 64, 64, generator=g),
        "tokens": small["tokens"],
        "masked_tokens": small["masked_tokens"],
        "keep_idx": torch.stack([torch.randperm(64, generator=g)[:16].sort().values for _ in range(8)]),
        "masked_index": torch.tensor([0, 3]),
    }
    terms, _ = train_step(state, batch)
    grads = [p.grad.detach().float() for p in state.module.parameters() if p.grad is not None]
    return {k: float(v) for k, v in terms.items()}, grads, state


@pytest.mark.parametrize("reduction", ["joint", "official"])
def test_full_train_step_under_bf16_autocast_on_cpu(reduction: str) -> None:
    terms32, grads32, _ = _one_train_step("fp32", reduction)
    terms16, grads16, state = _one_train_step("bf16", reduction)
    assert all(math.isfinite(v) for v in terms16.values()), terms16
    # Four bf16 layers per tower at 64 px: the total (at logit scale 10) differs by ~2% from fp32.
    assert terms16["total"] == pytest.approx(terms32["total"], rel=5e-2)
    flat32, flat16 = torch.cat([g.flatten() for g in grads32]), torch.cat([g.flatten() for g in grads16])
    assert torch.isfinite(flat16).all()
    assert torch.nn.functional.cosine_similarity(flat32, flat16, dim=0) > 0.98
    assert all(torch.isfinite(p).all() for p in state.module.parameters())
    # The σ heads train in their own AdamW groups at 10× the base LR; every other parameter at the base LR.
    unc = {id(p) for n, p in state.module.named_parameters() if is_unc_param(n)}
    assert unc, "no σ-head parameters found"
    for group in state.opt.param_groups:
        ids = {id(p) for p in group["params"]}
        assert ids <= unc or not ids & unc
        assert group["initial_lr"] == pytest.approx(state.cfg.optim.lr * (10.0 if ids <= unc else 1.0))
