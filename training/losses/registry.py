"""The training objectives by name: every ``LossConfig`` class (``training/losses/objectives.py``), and the
modules they build.

A loss is written once: the pure tensor function with its formula and the ``nn.Module`` holding its
learnable scalars in its own module (``contrastive`` for ProLIP, SigLIP and CLIP, ``pcmepp`` for PCME++),
and one ``LossConfig`` class carrying its parameters and what the loop reads (columns, masked variants, soft
labels, logged scalars). Everything here is read from that class.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from training.losses.objectives import LossConfig

LOSS_SPECS: dict[str, type[LossConfig]] = LossConfig.members()  # the objectives defined at import, by name


def loss_spec(name: str) -> type[LossConfig]:
    if name not in LossConfig.members():
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LossConfig.members())}")
    return LossConfig.members()[name]


def build_loss(name: str, **params: Any) -> nn.Module:
    """LossConfig module by name (prolip, siglip, clip, pcmepp); ``params``: its class's parameters."""
    return loss_spec(name)(**params).build()


def build_loss_from_config(loss_cfg: LossConfig) -> tuple[nn.Module, LossConfig]:
    """The module a ``TrainConfig.loss`` asks for, and that config (what the loop reads)."""
    return loss_cfg.build(), loss_cfg


def logit_scalars(loss: nn.Module, spec: LossConfig | type[LossConfig]) -> tuple[float, float]:
    """(logit scale a, logit bias b) as logged; b = 0 for losses without one (CLIP)."""
    raw = float(getattr(loss, spec.scale).detach())
    scale = math.exp(raw) if spec.scale_is_log else raw
    return scale, float(getattr(loss, spec.bias).detach()) if spec.bias else 0.0
