"""Released ProLIP checkpoints (the official repository's ``ProLIP`` module, safetensors) → our ProLIP.

Key layout read (``visual.`` and ``text.`` towers, open_clip-style blocks):

- image: ``visual.conv1.weight``, ``visual.class_embedding``, ``visual.unc_embedding``,
  ``visual.positional_embedding`` (2 + N rows: CLS, UNC, patches), ``visual.ln_pre``,
  ``visual.transformer.resblocks.N.*``, ``visual.ln_post``, ``visual.proj`` (D, E),
  ``visual.uncertainty_proj.{weight,bias}``;
- text: ``text.token_embedding.weight``, ``text.positional_embedding`` (C + 2 rows: tokens, UNC, CLS),
  ``text.cls_emb``, ``text.unc_emb``, ``text.transformer.resblocks.N.*``, ``text.ln_final``,
  ``text.text_projection.{weight,bias}`` (a matrix (W, E) when built without bias),
  ``text.text_uncertainty_projection.{weight,bias}``; ``logit_scale``/``logit_bias`` go to ``extra.json``.

The released models' arithmetic differs from the paper's description in three places, reproduced by
``head_variant="prolip_official"`` (training/model/towers.py): the image CLS state passes ``ln_post`` twice; the
text σ head reads the projected text mean; text attention is bidirectional over the padded row (no key
mask). Their text LayerNorms use eps 1e-6 (``norm_kwargs`` of the released configs); their tokenizer is
SigLIP's (context 64, ``canonicalize`` cleaning), which the caller passes in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from training.imports.common import (
    block_keys,
    build_and_check,
    grow_rows,
    map_blocks,
    take,
    tower_shapes,
)
from training.model.config import ModelConfig
from training.model.two_tower import ProLIP

HUB_FILE = "model.safetensors"  # what the official ``ProLIPHF`` (a hub mixin) writes
HUB_CONFIG = "config.json"


def prolip_config(
    state: Mapping[str, torch.Tensor], vocab_size: int, pad_id: int, text_ln_eps: float, quick_gelu: bool
) -> ModelConfig:
    return ModelConfig(
        **tower_shapes(state, "text.", True, vocab_size),
        text_causal=False,
        pad_id=pad_id,
        activation="quick_gelu" if quick_gelu else "gelu",
        text_mask_padding=False,
        text_proj_bias="text.text_projection.bias" in state,
        text_ln_eps=text_ln_eps,
        head_variant="prolip_official",
    )


def convert_prolip(
    state: Mapping[str, torch.Tensor], tokenizer: Any, text_ln_eps: float = 1e-6, quick_gelu: bool = False
) -> tuple[ProLIP, dict[str, Any]]:
    """(our ProLIP with the weights, extra metadata) from an official ProLIP state dict."""
    cfg = prolip_config(state, tokenizer.vocab_size, tokenizer.pad_id, text_ln_eps, quick_gelu)
    n_v, n_t = cfg.vision_layers, cfg.text_layers
    linear_proj = "text.text_projection.weight" in state
    proj = take(state, "text.text_projection.weight" if linear_proj else "text.text_projection")
    ours = {
        "visual.patch_embed.weight": take(state, "visual.conv1.weight").reshape(cfg.vision_width, -1),
        "visual.cls_token": take(state, "visual.class_embedding"),
        "visual.unc_token": take(state, "visual.unc_embedding"),
        "visual.pos_embed": take(state, "visual.positional_embedding"),
        "visual.head.mu_proj.weight": take(state, "visual.proj").T,
        "visual.head.logvar_proj.weight": take(state, "visual.uncertainty_proj.weight"),
        "visual.head.logvar_proj.bias": take(state, "visual.uncertainty_proj.bias"),
        "text.token_embed.weight": grow_rows(take(state, "text.token_embedding.weight"), cfg.vocab_size),
        "text.pos_embed": take(state, "text.positional_embedding"),
        "text.cls_token": take(state, "text.cls_emb"),
        "text.unc_token": take(state, "text.unc_emb"),
        "text.ln_post.weight": take(state, "text.ln_final.weight"),
        "text.ln_post.bias": take(state, "text.ln_final.bias"),
        "text.head.mu_proj.weight": proj if linear_proj else proj.T,
        "text.head.logvar_proj.weight": take(state, "text.text_uncertainty_projection.weight"),
        "text.head.logvar_proj.bias": take(state, "text.text_uncertainty_projection.bias"),
        **map_blocks(state, "visual.transformer.", "visual.transformer.", n_v),
        **map_blocks(state, "text.transformer.", "text.transformer.", n_t),
    }
    for part in ("ln_pre", "ln_post"):
        for leaf in ("weight", "bias"):
            ours[f"visual.{part}.{leaf}"] = take(state, f"visual.{part}.{leaf}")
    if cfg.text_proj_bias:
        ours["text.head.mu_proj.bias"] = take(state, "text.text_projection.bias")
    scalars = {k: float(state[k]) for k in ("logit_scale", "logit_bias") if k in state}
    used = set(_SOURCE_KEYS) | block_keys("visual.transformer.", n_v) | block_keys("text.transformer.", n_t)
    used |= set(scalars) | ({"text.text_projection.weight", "text.text_projection.bias"} & set(state))
    model = build_and_check(cfg, {k: v.contiguous() for k, v in ours.items()}, used, state)
    return model, {"source": "prolip_official", "loss": "prolip", **scalars}


_SOURCE_KEYS = (
    "visual.conv1.weight", "visual.class_embedding", "visual.unc_embedding", "visual.positional_embedding",
    "visual.proj", "visual.uncertainty_proj.weight", "visual.uncertainty_proj.bias",
    "visual.ln_pre.weight", "visual.ln_pre.bias", "visual.ln_post.weight", "visual.ln_post.bias",
    "text.token_embedding.weight", "text.positional_embedding", "text.cls_emb", "text.unc_emb",
    "text.ln_final.weight", "text.ln_final.bias", "text.text_projection",
    "text.text_uncertainty_projection.weight", "text.text_uncertainty_projection.bias",
)  # fmt: skip
