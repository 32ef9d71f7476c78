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
heads. Our tokenizer adds ``<pad>`` and ``<mask>`` after CLIP's 49,408 ids; the table keeps its 49,408 rows
and the pad embeds as id 0, open_clip's padding (the end-token state never sees it under causal attention).
An ``open_clip_config.json`` beside the weights (open_clip's hub layout, and our export's) gives the head
counts, QuickGELU and the text LayerNorm's eps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from training.imports.common import block_keys, build_and_check, map_blocks, take, tower_shapes
from training.model.checkpoint import CheckpointError
from training.model.config import ModelConfig, text_table
from training.model.two_tower import ProLIP

HUB_FILE = "open_clip_model.safetensors"  # open_clip's file name on the Hugging Face hub


def open_clip_config(
    state: Mapping[str, torch.Tensor],
    tokenizer: Any,
    quick_gelu: bool,
    model_cfg: Mapping[str, Any] | None = None,
) -> ModelConfig:
    """Our ``ModelConfig`` for an open_clip ViT CLIP state dict; head counts from open_clip's ``model_cfg``
    (its ``open_clip_config.json``) when given, else from a head width of 64."""
    rows = take(state, "token_embedding.weight").shape[0]
    table = text_table(tokenizer, eot=True)
    if table > rows:
        raise CheckpointError(f"the tokenizer has {table} ids but the token table holds {rows} rows")
    shapes = {**tower_shapes(state, "", False, rows), "vocab_size": rows}
    vision, text = (model_cfg or {}).get("vision_cfg") or {}, (model_cfg or {}).get("text_cfg") or {}
    if "head_width" in vision:
        shapes["vision_heads"] = shapes["vision_width"] // int(vision["head_width"])
    if "heads" in text:
        shapes["text_heads"] = int(text["heads"])
    eps = float((text.get("norm_kwargs") or {}).get("eps", 1e-5))
    return ModelConfig(
        **shapes,
        text_causal=True,
        pad_id=tokenizer.pad_id,
        activation="quick_gelu" if quick_gelu or (model_cfg or {}).get("quick_gelu") else "gelu",
        text_pool="eot",
        text_ln_eps=eps,
    )


def convert_open_clip(
    state: Mapping[str, torch.Tensor],
    tokenizer: Any,
    quick_gelu: bool = False,
    model_cfg: Mapping[str, Any] | None = None,
) -> tuple[ProLIP, dict[str, Any]]:
    """(our model with the weights, extra metadata) from an open_clip CLIP state dict."""
    cfg = open_clip_config(state, tokenizer, quick_gelu, model_cfg)
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
        "text.token_embed.weight": take(state, "token_embedding.weight"),
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
