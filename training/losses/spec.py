"""``LossSpec``: what the train loop and the config read about one objective, declared beside its loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class LossSpec:
    """Everything the train loop and the config need to know about one objective, declared beside it.

    ``columns``: the features gathered from every worker (with gradients) as the global columns each local
    row is scored against; ``uses_masked``: takes the masked image/text variants (ProLIP Eq. 6);
    ``uses_soft_labels``: takes PCME++'s mixed-image soft labels; ``probabilistic``: needs the σ² heads;
    ``config_kwargs``: (``LossConfig`` field, constructor argument) pairs; ``scale``/``bias``: the names of
    the learnable logit scale and bias parameters (``scale_is_log``: the parameter holds log a), logged as
    ``logit_scale``/``logit_bias``; ``terms``: the named terms ``forward`` returns besides ``total``.
    """

    name: str
    module: type[nn.Module]
    columns: tuple[str, ...]
    terms: tuple[str, ...]
    probabilistic: bool = False
    uses_masked: bool = False
    uses_soft_labels: bool = False
    config_kwargs: tuple[tuple[str, str], ...] = ()
    scale: str = "log_scale"
    scale_is_log: bool = True
    bias: str | None = "bias"

    def kwargs(self, loss_cfg: Any) -> dict[str, Any]:
        """Constructor arguments taken from a ``training.config.LossConfig``."""
        return {arg: getattr(loss_cfg, field) for field, arg in self.config_kwargs}
