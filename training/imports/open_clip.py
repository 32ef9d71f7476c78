"""open_clip CLIP state dicts (OpenAI and LAION/DataComp ViT weights) → our deterministic model.

Key layout read (open_clip's ``CLIP`` with a ViT image tower; ViT-B/32, B/16, L/14 alike):

- image: ``visual.conv1.weight`` (D, 3, p, p), ``visual.class_embedding`` (D),
  ``visual.positional_embedding`` (1 + N, D), ``visual.ln_pre``, ``visual.transformer.resblocks.N.*``,
  ``visual.ln_post``, ``visual.proj`` (D, E);
- text: ``token_embedding.weight`` (V, W), ``positional_embedding`` (C, W), ``transformer.resblocks.N.*``,
  ``ln_final``, ``text_projection`` (W, E); ``logit_scale`` (and ``logit_bias``) are kept in ``extra.json``.

Architecture from the shapes; head counts from open_clip's head width of 64 (every CLIP ViT config);
QuickGELU when the model name ends in ``-quickgelu`` (OpenAI's weights) or ``quick_gelu=True`` — it cannot
be read from the weights. The model is CLIP's: causal text attention, pooling at the end token, no σ
heads. Our tokenizer adds ``<pad>`` and ``<mask>`` after CLIP's 49,408 ids, so the token table gains two
zero rows (pad keys are masked; the end-token state never sees them under causal attention).
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

HUB_FILE = "open_clip_model.safetensors"  # open_clip's file name on the Hugging Face hub


def open_clip_config(state: Mapping[str, torch.Tensor], vocab_size: int, pad_id: int, quick_gelu: bool):
    """Our ``ModelConfig`` for an open_clip ViT CLIP state dict."""
    return ModelConfig(
        **tower_shapes(state, "", False, vocab_size),
        text_causal=True,
        pad_id=pad_id,
        activation="quick_gelu" if quick_gelu else "gelu",
        text_pool="eot",
    )


def convert_open_clip(
    state: Mapping[str, torch.Tensor], tokenizer: Any, quick_gelu: bool = False
) -> tuple[ProLIP, dict[str, Any]]:
    """(our model with the weights, extra metadata) from an open_clip CLIP state dict."""
    cfg = open_clip_config(state, tokenizer.vocab_size, tokenizer.pad_id, quick_gelu)
    n_v, n_t = cfg.vision_layers, cfg.text_layers
    ours = {
        "visual.patch_embed.weight": take(state, "visual.conv1.weight").reshape(cfg.vision_width, -1),
        "visual.cls_token": take(state, "visual.class_embedding"),
        "visual.pos_embed": take(state, "visual.positional_embedding"),
        "visual.ln_pre.weight": take(state, "visual.ln_pre.weight"),
        "visual.ln_pre.bias": take(state, "visual.ln_pre.bias"),
        "visual.ln_post.weight": take(state, "visual.ln_post.weight"),
        "visual.ln_post.bias": take(state, "visual.ln_post.bias"),
        "visual.head.mu_proj.weight": take(state, "visual.proj").T,
        "text.token_embed.weight": grow_rows(take(state, "token_embedding.weight"), cfg.vocab_size),
        "text.pos_embed": take(state, "positional_embedding"),
        "text.ln_post.weight": take(state, "ln_final.weight"),
        "text.ln_post.bias": take(state, "ln_final.bias"),
        "text.head.mu_proj.weight": take(state, "text_projection").T,
        **map_blocks(state, "visual.transformer.", "visual.transformer.", n_v),
        **map_blocks(state, "transformer.", "text.transformer.", n_t),
    }
    scalars = {k: float(state[k]) for k in ("logit_scale", "logit_bias") if k in state}
    used = _used_keys(n_v, n_t) | set(scalars) | ({"attn_mask"} & set(state))
    model = build_and_check(cfg, {k: v.contiguous() for k, v in ours.items()}, used, state)
    return model, {"source": "open_clip", "loss": "clip", **scalars}


def _used_keys(n_v: int, n_t: int) -> set[str]:
    keys = {
        "visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding", "visual.proj",
        "visual.ln_pre.weight", "visual.ln_pre.bias", "visual.ln_post.weight", "visual.ln_post.bias",
        "token_embedding.weight", "positional_embedding", "ln_final.weight", "ln_final.bias",
        "text_projection",
    }  # fmt: skip
    return keys | block_keys("visual.transformer.", n_v) | block_keys("transformer.", n_t)
