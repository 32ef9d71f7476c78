"""The registry of training objectives: every loss's ``LossSpec``, collected from the modules that define them.

A loss is written once, in its own module (``training/losses/contrastive.py`` for ProLIP, SigLIP and CLIP;
``training/losses/pcmepp.py`` for PCME++): the pure tensor function with its formula, the ``nn.Module`` holding its
learnable scalars, and a ``LossSpec`` in that module's ``SPECS``. Everything else — the config's list of
names and constructor arguments, which columns the train loop gathers across workers, whether it builds
masked variants or mixed images, which scalars it logs — is read from the spec here. Adding a loss to one
of those modules therefore touches that module and its tests; a new module adds itself to ``_MODULES``.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from training.losses import contrastive as losses
from training.losses import pcmepp
from training.losses.names import LOSS_NAMES
from training.losses.spec import LossSpec

_MODULES = (losses, pcmepp)
LOSS_SPECS: dict[str, LossSpec] = {spec.name: spec for module in _MODULES for spec in module.SPECS}
if {name: spec.probabilistic for name, spec in LOSS_SPECS.items()} != LOSS_NAMES:
    raise RuntimeError(f"training/losses/names.py must list every registered loss: {sorted(LOSS_SPECS)}")


def loss_spec(name: str) -> LossSpec:
    if name not in LOSS_SPECS:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSS_SPECS)}")
    return LOSS_SPECS[name]


def build_loss(name: str, **kwargs: Any) -> nn.Module:
    """Loss module by name (prolip, siglip, clip, pcmepp); ``kwargs`` go to its constructor."""
    return loss_spec(name).module(**kwargs)


def build_loss_from_config(loss_cfg: Any) -> tuple[nn.Module, LossSpec]:
    """The module a ``training.config.LossConfig`` asks for, and its spec."""
    spec = loss_spec(loss_cfg.name)
    return spec.module(**spec.kwargs(loss_cfg)), spec


def logit_scalars(loss: nn.Module, spec: LossSpec) -> tuple[float, float]:
    """(logit scale a, logit bias b) as logged; b = 0 for losses without one (CLIP)."""
    raw = float(getattr(loss, spec.scale).detach())
    scale = math.exp(raw) if spec.scale_is_log else raw
    return scale, float(getattr(loss, spec.bias).detach()) if spec.bias else 0.0
