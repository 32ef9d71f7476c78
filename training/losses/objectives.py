"""Every training objective as one class: its typed parameters (each default written here once, with its
source) and what the train loop reads about it, without torch (a job's ``--help`` answers before torch
loads). ``TrainConfig.loss`` holds one of them (``--set loss.name=clip``, ``--set loss=prolip:beta=2e-4``).

A class names its ``nn.Module`` by import path (``module``), built with the class's parameters as keyword
arguments by ``build``. Defining a subclass of ``LossConfig`` registers it (``pipeline/common/components.py``):
a new objective is one class here, or in its own module once that module is imported.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Literal

from pipeline.common.components import Component
from pipeline.common.config import Fraction, NonNegativeFloat, config_class


class LossConfig(Component, family="loss", default="prolip"):
    """What the train loop and the config read about an objective.

    ``columns``: the features gathered from every worker (with gradients) as the global columns each local
    row is scored against; ``terms``: the named terms ``forward`` returns besides ``total``;
    ``probabilistic``: needs the σ² heads; ``uses_masked``: takes the masked image/text variants (ProLIP
    Eq. 6); ``uses_soft_labels``: takes PCME++'s mixed-image soft labels; ``scale``/``bias``: the names of
    the learnable logit scale and bias parameters (``scale_is_log``: the parameter holds log a), logged as
    ``logit_scale``/``logit_bias``; ``module``: ``"package.module:Class"`` of its ``nn.Module``;
    ``not_for_module``: parameters the train step reads itself rather than the module's constructor.
    """

    columns: ClassVar[tuple[str, ...]]
    terms: ClassVar[tuple[str, ...]]
    module: ClassVar[str]
    probabilistic: ClassVar[bool] = False
    uses_masked: ClassVar[bool] = False
    uses_soft_labels: ClassVar[bool] = False
    scale: ClassVar[str] = "log_scale"
    scale_is_log: ClassVar[bool] = True
    bias: ClassVar[str | None] = "bias"
    not_for_module: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def upgrade(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The flat form every objective once shared (``pcme_alpha``, ``pcme_beta``, every loss's keys in one
        mapping): PCME++'s two weights renamed, the keys of other objectives dropped."""
        if not any(k.startswith("pcme_") for k in data):
            return data
        own = {"pcme_alpha": "alpha", "pcme_beta": "beta"} if cls.__dict__["name"] == "pcmepp" else {}
        data = {**data, **{new: data[old] for old, new in own.items() if old in data}}
        return {k: v for k, v in data.items() if k in cls.__dataclass_fields__}  # type: ignore[attr-defined]

    def module_class(self) -> type:
        path, _, attr = self.module.partition(":")
        return getattr(importlib.import_module(path), attr)

    def kwargs(self) -> dict[str, Any]:
        """The module's constructor arguments."""
        return {k: v for k, v in self.params().items() if k not in self.not_for_module}

    def build(self) -> Any:
        """The ``nn.Module`` (imports torch)."""
        return self.module_class()(**self.kwargs())


@config_class
class ProLIPLossConfig(LossConfig):
    """ProLIP (Chun et al., ICLR 2025, Eq. 6): PPCL + inclusion + VIB."""

    columns = ("mu_t", "logvar_t")
    terms = ("ppcl", "inc_vt", "inc_masked_v", "inc_masked_t", "vib_v", "vib_t")
    module = "training.losses.contrastive:ProLIPLoss"
    probabilistic = True
    uses_masked = True

    name: Literal["prolip"] = "prolip"  # the objective (prolip, siglip, clip, pcmepp, …)
    # Initial logit bias b. SigLIP's −10 ≈ −log(32k), i.e. p ≈ 1/B at its batch of 32k; at a small batch,
    # −log(B) starts at the same prior instead of first collapsing every embedding together to lift all
    # logits (the plateau of docs/environment.md at B = 128).
    init_bias: float = -10.0
    alpha1: float = 1e-7  # L_inc(v ⊂ t) weight (ProLIP B.1)
    alpha2: float = 1e-3  # masked inclusion weight (ProLIP B.1)
    beta: float = 1e-4  # VIB weight (the official runs)
    c: float = 1000.0  # inclusion-loss scale, with log ε = −20 (the paper's runs)
    log_eps: float = -20.0  # inclusion loss: log ε inside its log (the paper's runs)
    # How the inclusion and VIB terms reduce over the D dimensions (docs/fidelity.md): "joint" = the paper's
    # formulas (one sigmoid per sample on H summed over d; KL summed over d), "official" = the official
    # code's (one sigmoid per dimension, inclusion and KL averaged over d), under which α₁, α₂, β were tuned.
    reduction: Literal["joint", "official"] = "joint"


@config_class
class SigLIPLossConfig(LossConfig):
    """SigLIP (Zhai et al. 2023) on the means."""

    columns = ("mu_t",)
    terms = ("siglip",)
    module = "training.losses.contrastive:SigLIPLoss"

    name: Literal["siglip"] = "siglip"  # the objective (prolip, siglip, clip, pcmepp, …)
    init_bias: float = ProLIPLossConfig.init_bias  # initial logit bias b (SigLIP's −10, as ProLIP)


@config_class
class CLIPLossConfig(LossConfig):
    """CLIP's symmetric InfoNCE (Radford et al. 2021) on the means."""

    columns = ("mu_v", "mu_t")
    terms = ("clip",)
    module = "training.losses.contrastive:CLIPLoss"
    bias = None

    name: Literal["clip"] = "clip"  # the objective (prolip, siglip, clip, pcmepp, …)


@config_class
class PCMEppLossConfig(LossConfig):
    """PCME++ (Chun, ICLR 2024): soft-label matching, pseudo-positives, VIB, mixed images."""

    columns = ("mu_t", "logvar_t")
    terms = ("match", "pseudo_pos", "vib_v", "vib_t")
    module = "training.losses.pcmepp:PCMEppLoss"
    probabilistic = True
    uses_soft_labels = True
    scale = "scale"
    scale_is_log = False
    bias = "shift"
    not_for_module = ("mix_fraction",)

    name: Literal["pcmepp"] = "pcmepp"  # the objective (prolip, siglip, clip, pcmepp, …)
    alpha: NonNegativeFloat = 0.1  # pseudo-positive weight (PCME++ Sec. 2.3)
    beta: NonNegativeFloat = ProLIPLossConfig.beta  # VIB weight (ProLIP's Eq. A.2 weight)
    mix_fraction: Fraction = 0.25  # Mixup/CutMix share of a local batch (PCME++ Sec. 2.4)
