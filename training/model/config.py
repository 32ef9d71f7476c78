"""Architecture configuration of both towers: ``ModelConfig`` and the named presets (``MODEL_CONFIGS``:
``tiny`` and ``demo-32px`` for CPUs, the ViT-B sizes of the papers).

Kept apart from the training config because the model, the checkpoint importers and the FLOP counts read it
without the rest of the training settings (and without the losses).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pipeline.common.config import (
    ConfigError,
    NonNegative,
    Positive,
    PositiveFloat,
    config_class,
    load,
    require,
    to_dict,
)


@config_class
class ModelConfig:
    """Architecture of both towers. Widths/layers/heads per tower; ``embed_dim`` is the shared space."""

    image_size: Positive
    patch_size: Positive
    vision_width: Positive
    vision_layers: NonNegative
    vision_heads: Positive
    text_width: Positive
    text_layers: Positive
    text_heads: Positive
    context_length: Positive
    vocab_size: Positive
    embed_dim: Positive
    mlp_ratio: PositiveFloat = 4.0
    probabilistic: bool = True
    unc_bias_init: float = -10.0  # §4.1: log σ² starts at −10, σ² ≈ 4.5e−5
    text_causal: bool = False
    pad_id: NonNegative = 0
    grad_checkpointing: bool = False
    # Variants for imported weights (training/imports/): OpenAI CLIP's MLP activation, CLIP's end-token text
    # pooling (deterministic only), and the official ProLIP code's text tower and heads (training/model/towers.py).
    activation: Literal["gelu", "quick_gelu"] = "gelu"
    text_pool: Literal["cls", "eot"] = (
        "cls"  # cls (appended CLS token) | eot (the end token's position, as CLIP)
    )
    text_mask_padding: bool = True  # False: padding keys are attended, as the official ProLIP code does
    text_proj_bias: bool = False
    text_ln_eps: PositiveFloat = 1e-5
    head_variant: Literal["paper", "prolip_official"] = "paper"
    # How pixels become tokens: "patch" (ViT's linear patch projection) or "conv" (3×3 convolutions down to
    # the same grid, training/model/towers.py ConvStem).
    vision_stem: Literal["patch", "conv"] = "patch"
    # The image state the heads read: the CLS token's output, or the mean of the patch tokens' ("mean",
    # which also allows vision_layers=0: the stem alone, a small CNN with global average pooling).
    vision_pool: Literal["cls", "mean"] = "cls"

    def __post_init__(self) -> None:
        """Rules across fields; each field's own range and choices are in its type."""
        # A mean-pooled image tower may have no transformer layer (the stem alone) unless it is
        # probabilistic: its UNC token would then see no image.
        require(
            self.vision_layers >= 1 or (self.vision_pool == "mean" and not self.probabilistic),
            "vision_layers",
            "must be >= 1 (0 only with vision_pool='mean' and probabilistic=false)",
            self.vision_layers,
        )
        for tower in ("vision", "text"):
            width, heads = getattr(self, f"{tower}_width"), getattr(self, f"{tower}_heads")
            require(
                width % heads == 0, f"{tower}_width", f"must be a multiple of {tower}_heads={heads}", width
            )
        require(
            not (self.text_pool == "eot" and self.probabilistic),
            "text_pool",
            "'eot' needs probabilistic=false (UNC/CLS are appended)",
            self.text_pool,
        )
        require(
            self.head_variant != "prolip_official" or self.text_width == self.embed_dim,
            "head_variant",
            "'prolip_official' needs text_width == embed_dim",
            self.head_variant,
        )
        require(
            self.image_size % self.patch_size == 0,
            "image_size",
            f"must be a multiple of patch_size={self.patch_size}",
            self.image_size,
        )
        p = self.patch_size
        require(
            self.vision_stem != "conv" or (p >= 2 and not p & (p - 1)),
            "patch_size",
            "must be a power of two >= 2 for vision_stem='conv'",
            p,
        )
        # An end-token-pooled text tower may pad with an id past its table (our tokenizer's added <pad> on
        # CLIP's 49,408 ids): padding embeds as id 0, open_clip's padding, and only follows the end token.
        require(
            self.pad_id < self.vocab_size or self.text_pool == "eot",
            "pad_id",
            f"must lie inside the vocabulary ({self.vocab_size}) unless text_pool='eot'",
            self.pad_id,
        )

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """From a checkpoint's ``model_config.json`` (lax types, unknown keys refused)."""
        return load(cls, data, prefix="ModelConfig.")


MODEL_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        image_size=64, patch_size=8, context_length=32, vocab_size=4096, embed_dim=128,
        vision_width=128, vision_layers=4, vision_heads=4, text_width=128, text_layers=4, text_heads=4,
    ),
    # open_clip's ViT-B-32 parameter for parameter (its model_configs/ViT-B-32.json; CLIP's text tower: causal,
    # context 77, CLIP BPE's 49,408 ids, pooled at the end token). A ProLIP on it appends its CLS/UNC tokens
    # instead (training/train/step.py ``build_module``).
    "ViT-B-32": ModelConfig(
        image_size=224, patch_size=32, context_length=77, vocab_size=49408, embed_dim=512, text_causal=True,
        vision_width=768, vision_layers=12, vision_heads=12, text_width=512, text_layers=12, text_heads=8,
        probabilistic=False, text_pool="eot",
    ),
    # ProLIP B/16 (ProLIP App. B.1): SigLIP-style bidirectional text, context 64.
    "ViT-B-16-ProLIP": ModelConfig(
        image_size=224, patch_size=16, context_length=64, vocab_size=32000, embed_dim=768,
        vision_width=768, vision_layers=12, vision_heads=12, text_width=768, text_layers=12, text_heads=12,
    ),
}  # fmt: skip


# The track demo's model: ``tiny``'s widths at 32 px (16 patches) with 2 layers per tower, ~4× the samples/s
# of ``tiny`` on a 2-core CPU; shape, colour and position of the demo pictures survive the downscale.
MODEL_CONFIGS["demo-32px"] = dataclasses.replace(
    MODEL_CONFIGS["tiny"], image_size=32, vision_layers=2, text_layers=2
)
# The demo track's subset model: ``demo-32px`` with a small CNN image tower (the convolutional stem,
# mean-pooled, no transformer layer) and one text layer; CLIP/SigLIP only, no [UNC] token
# (docs/decisions/0002-demo-subset-model.md).
MODEL_CONFIGS["demo-32px-cnn"] = dataclasses.replace(
    MODEL_CONFIGS["demo-32px"],
    vision_stem="conv",
    vision_pool="mean",
    vision_layers=0,
    text_layers=1,
    probabilistic=False,
)

# The demo track's scorer: ``demo-32px`` with the convolutional stem, mean-pooled, and one transformer layer so
# that the [UNC] token attends to the picture (docs/decisions/0001-demo-scorer-model.md).
MODEL_CONFIGS["demo-32px-cnn-unc"] = dataclasses.replace(
    MODEL_CONFIGS["demo-32px"], vision_stem="conv", vision_pool="mean", vision_layers=1
)

# The tiny track's subset model: ``demo-32px`` shaped as open_clip's CLIP (end-token pooling, causal text), so
# its checkpoints export to open_clip (training/imports/export.py) as a ViT-B-32 subset model does.
MODEL_CONFIGS["demo-32px-clip"] = dataclasses.replace(
    MODEL_CONFIGS["demo-32px"], probabilistic=False, text_pool="eot", text_causal=True
)


def model_config(name: str, **overrides: Any) -> ModelConfig:
    """The named preset with ``overrides`` applied; an unknown name or field raises with that name."""
    if name not in MODEL_CONFIGS:
        raise ConfigError(f"unknown model config {name!r}; known: {', '.join(MODEL_CONFIGS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
    # No coercion here: a programmatic override of the wrong type is an error, not a string to parse.
    return dataclasses.replace(MODEL_CONFIGS[name], **overrides)


def text_table(tokenizer: Any, eot: bool) -> int:
    """Rows of the token table for ``tokenizer``: its ids, less a ``<pad>``/``<mask>`` it added after them when
    the text tower pools the end token (CLIP's 49,408 ids stay open_clip's table; the pad embeds as id 0)."""
    rows = tokenizer.vocab_size
    while eot and rows - 1 in (tokenizer.pad_id, tokenizer.mask_id):
        rows -= 1
    return rows


def objective_model_config(name: str, probabilistic: bool, **overrides: Any) -> ModelConfig:
    """The preset ``name`` as an objective trains it: a Gaussian (ProLIP) model keeps its own text tower
    (UNC and CLS appended) on a CLIP-shaped preset such as ViT-B-32, whose CLIP pools the end token."""
    pool = "cls" if probabilistic else MODEL_CONFIGS[name].text_pool if name in MODEL_CONFIGS else "cls"
    return model_config(name, probabilistic=probabilistic, text_pool=pool, **overrides)
