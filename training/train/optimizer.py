"""The optimizer update of the train step: AdamW, fused where torch has a fused kernel, behind a finite guard.

- ``make_adamw``: ``torch.optim.AdamW(fused=True)`` (one kernel over all parameters, on CUDA and on CPU
  in the torch versions we install), else the ``foreach`` implementation.
- ``GuardedUpdate``: global gradient norm → optional clipping → AdamW, unless the loss or the norm is
  not finite. A bad step (an overflow, a poisoned batch) then changes no weight and no optimizer moment,
  is counted, and training goes on; the LR schedule and the step count still advance, so samples seen and
  the schedule are those of a run without the bad batch's update. The decision stays on the device: the
  flag is max-reduced across ranks (every rank skips together) and handed to the fused kernel as its
  ``found_inf`` (the mechanism ``torch.amp.GradScaler`` uses), so no step waits for the host. The
  ``foreach`` fallback has no such input and reads the flag on the host.
- ``LossScale``: float16 amp's dynamic loss scale (``precision="amp"``, DataComp's setting), the rule of
  ``torch.amp.GradScaler`` with its defaults: the loss is multiplied by the scale S before ``backward``, the
  gradients divided by S before the norm; a non-finite step (the guard above) halves S, 2,000 finite steps
  in a row double it. Everything stays on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from training.train.distributed import all_reduce_max


def make_adamw(
    groups: Sequence[dict[str, Any]], optim: Any, fused: bool = True
) -> tuple[torch.optim.AdamW, bool]:
    """(AdamW over ``groups`` with ``optim``'s lr/betas/eps, whether it is the fused kernel); ``fused=False``
    asks for the ``foreach`` implementation."""
    kw = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps}
    if fused:
        try:
            return torch.optim.AdamW(groups, fused=True, **kw), True
        except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
            pass
    return torch.optim.AdamW(groups, foreach=True, **kw), False


class LossScale:
    """float16 amp's dynamic loss scale (module docstring); ``state_dict`` goes into the run's checkpoint."""

    def __init__(
        self, device: torch.device, init: float = 2.0**16, growth_interval: int = 2000, factor: float = 2.0
    ) -> None:
        self.scale = torch.full((), init, dtype=torch.float32, device=device)
        self.good_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.growth_interval, self.factor = growth_interval, factor

    def update(self, bad: Tensor) -> None:
        """After a step: ``bad`` (a 0-d float, 1 = the step was not finite) halves the scale and restarts the
        count; the ``growth_interval``-th finite step in a row doubles it."""
        bad = bad.bool()
        self.good_steps = torch.where(bad, torch.zeros_like(self.good_steps), self.good_steps + 1)
        grow = self.good_steps >= self.growth_interval
        self.scale = torch.where(
            bad, self.scale / self.factor, torch.where(grow, self.scale * self.factor, self.scale)
        )
        self.good_steps = torch.where(grow, torch.zeros_like(self.good_steps), self.good_steps)

    def state_dict(self) -> dict[str, Tensor]:
        return {"scale": self.scale.detach().cpu(), "good_steps": self.good_steps.detach().cpu()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.scale = state["scale"].to(self.scale)
        self.good_steps = state["good_steps"].to(self.good_steps)


class GuardedUpdate:
    """One optimizer update after ``backward``: ``update(loss)`` returns the step's gradient norm.

    ``skipped`` counts the steps whose update was skipped (a device tensor, read at report time).
    ``loss_scale`` (float16 amp): ``backward(loss)`` scales the loss, the update unscales the gradients.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        fused: bool,
        params: Iterable[nn.Parameter],
        grad_clip: float,
        loss_scale: bool = False,
    ) -> None:
        self.opt, self.fused, self.grad_clip = opt, fused, float(grad_clip)
        self.params = [p for p in params if p.requires_grad]
        device = self.params[0].device if self.params else torch.device("cpu")
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.loss_scale = LossScale(device) if loss_scale else None

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()``, times the loss scale under float16 amp."""
        (loss if self.loss_scale is None else loss * self.loss_scale.scale).backward()

    def __call__(self, loss: Tensor) -> Tensor:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.loss_scale is not None and grads:
            torch._foreach_div_(grads, self.loss_scale.scale)  # back to the loss's own gradient
        norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else loss.new_zeros(())
        if self.grad_clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, norm, foreach=True)
        bad = ~(torch.isfinite(norm) & torch.isfinite(loss.detach()))
        bad = all_reduce_max(bad.to(torch.float32))  # () on every rank alike; a device collective
        if self.fused:
            self.opt.found_inf = bad  # the fused kernel skips params, moments and step count when it is 1
            try:
                self.opt.step()
            finally:
                del self.opt.found_inf
        elif not bool(bad):  # the fallback's one host read per step
            self.opt.step()
        self.skipped += bad.to(torch.int64)
        if self.loss_scale is not None:
            self.loss_scale.update(bad)
        return norm.detach()
