"""Our checkpoints out to the libraries they came from: the inverse of ``open_clip.py`` and
``prolip_official.py``.

- ``export_open_clip``: a deterministic, open_clip-shaped model (patch stem, CLS image state, end-token
  text pooling, causal text attention — ``ViT-B-32`` or ``demo-32px-clip``) → ``open_clip_model.safetensors``
  in open_clip's key layout plus ``open_clip_config.json`` (``model_cfg``, ``preprocess_cfg``: open_clip's
  hub layout), so ``open_clip.create_model_and_transforms("local-dir:DIR")`` — or ``("ViT-B-32",
  pretrained=FILE)`` for a ViT-B-32 — builds the same model. The text pooling is written as open_clip's
  ``argmax`` when the end token has the largest id of the table (CLIP's BPE), else as ``eos`` with its id.
- ``export_prolip``: a ProLIP with ``head_variant="prolip_official"`` (the released code's arithmetic; an
  imported ProLIP, or one trained so) → ``model.safetensors`` in the released key layout plus a
  ``config.json`` of the fields the released configs carry. A ProLIP with the paper's heads cannot be
  written there: the released code would compute other embeddings from the same weights.

Both copy our tokenizer files beside the weights and record where the weights came from (``prolip_ray``
in the JSON, and the safetensors metadata); ``training/imports/load.py`` reads the directories back, and
import(export(x)) equals x tensor for tensor.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from training.imports.common import BLOCK_MAP
from training.imports.open_clip import HUB_FILE as OPEN_CLIP_FILE
from training.imports.prolip_official import HUB_CONFIG
from training.imports.prolip_official import HUB_FILE as PROLIP_FILE
from training.model.checkpoint import CheckpointError, load_checkpoint, load_extra
from training.model.config import ModelConfig

OPEN_CLIP_CONFIG = "open_clip_config.json"
TOKENIZER_FILES = ("tokenizer.json", "special_tokens.json")


class ExportError(CheckpointError):
    """A checkpoint that the target layout cannot hold; the message names the field that differs."""


def _require(cfg: ModelConfig, target: str, **want: Any) -> None:
    for name, value in want.items():
        if getattr(cfg, name) != value:
            raise ExportError(
                f"cannot export to {target}: model config {name}={getattr(cfg, name)!r}, the layout needs {value!r}"
            )


def _blocks(state: Mapping[str, torch.Tensor], src: str, dst: str, n: int) -> dict[str, torch.Tensor]:
    """Our ``src``blocks.i.* → the libraries' ``dst``resblocks.i.*."""
    return {
        f"{dst}resblocks.{i}.{theirs}": state[f"{src}blocks.{i}.{ours}"]
        for i in range(n)
        for theirs, ours in BLOCK_MAP.items()
    }


def _scalars(extra: Mapping[str, Any]) -> dict[str, float]:
    """logit_scale (the log of the inverse temperature, as both libraries store it) and logit_bias: a trained
    run's loss state, or what an import kept."""
    loss = extra.get("loss_state") or {}
    out = {}
    if "log_scale" in loss or "logit_scale" in extra:
        out["logit_scale"] = float(loss.get("log_scale", extra.get("logit_scale")))
    if "bias" in loss or "logit_bias" in extra:
        out["logit_bias"] = float(loss.get("bias", extra.get("logit_bias")))
    return out


def _vision(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    p = cfg.patch_size
    return {
        "visual.conv1.weight": state["visual.patch_embed.weight"].reshape(cfg.vision_width, 3, p, p),
        "visual.class_embedding": state["visual.cls_token"],
        "visual.positional_embedding": state["visual.pos_embed"],
        "visual.ln_pre.weight": state["visual.ln_pre.weight"],
        "visual.ln_pre.bias": state["visual.ln_pre.bias"],
        "visual.ln_post.weight": state["visual.ln_post.weight"],
        "visual.ln_post.bias": state["visual.ln_post.bias"],
        "visual.proj": state["visual.head.mu_proj.weight"].T,
        **_blocks(state, "visual.transformer.", "visual.transformer.", cfg.vision_layers),
    }


def _write(out: Path, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], src: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "prolip_ray": json.dumps(config["prolip_ray"], sort_keys=True)}
    save_file(
        {k: v.detach().float().contiguous() for k, v in tensors.items()}, str(out / name), metadata=meta
    )
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copyfile(src / f, out / f)
    return out


def _provenance(src: Path, extra: Mapping[str, Any], info: Mapping[str, Any] | None) -> dict[str, Any]:
    keep = ("loss", "samples_seen", "step", "imported_from")
    return {"checkpoint": str(src), **{k: extra[k] for k in keep if k in extra}, **dict(info or {})}


def open_clip_model_cfg(cfg: ModelConfig, end_id: int, scalars: Mapping[str, float]) -> dict[str, Any]:
    """open_clip's ``model_cfg`` (the schema of its ``model_configs/*.json``) for ``cfg``."""
    text: dict[str, Any] = {
        "context_length": cfg.context_length,
        "vocab_size": cfg.vocab_size,
        "width": cfg.text_width,
        "heads": cfg.text_heads,
        "layers": cfg.text_layers,
    }
    if end_id != cfg.vocab_size - 1:  # open_clip's argmax pooling finds CLIP's end token only
        text.update(pool_type="eos", eos_id=end_id)
    if cfg.text_ln_eps != 1e-5:
        text["norm_kwargs"] = {"eps": cfg.text_ln_eps}
    vision = {
        "image_size": cfg.image_size,
        "layers": cfg.vision_layers,
        "width": cfg.vision_width,
        "patch_size": cfg.patch_size,
    }
    if cfg.vision_width // cfg.vision_heads != 64:
        vision["head_width"] = cfg.vision_width // cfg.vision_heads
    if cfg.mlp_ratio != 4.0:
        vision["mlp_ratio"] = text["mlp_ratio"] = cfg.mlp_ratio
    out: dict[str, Any] = {"embed_dim": cfg.embed_dim, "vision_cfg": vision, "text_cfg": text}
    if cfg.activation == "quick_gelu":
        out["quick_gelu"] = True
    if "logit_bias" in scalars:
        out["init_logit_bias"] = scalars["logit_bias"]
    return out


def open_clip_state(
    state: Mapping[str, torch.Tensor], cfg: ModelConfig, scalars: Mapping[str, float]
) -> dict[str, torch.Tensor]:
    """Our deterministic model's state dict in open_clip's ``CLIP`` key layout (``logit_scale`` from
    ``scalars``, 0 when absent; ``logit_bias`` only when given)."""
    out = {
        **_vision(state, cfg),
        "token_embedding.weight": state["text.token_embed.weight"],
        "positional_embedding": state["text.pos_embed"],
        "ln_final.weight": state["text.ln_post.weight"],
        "ln_final.bias": state["text.ln_post.bias"],
        "text_projection": state["text.head.mu_proj.weight"].T,
        "logit_scale": torch.tensor(scalars.get("logit_scale", 0.0)),
        **_blocks(state, "text.transformer.", "transformer.", cfg.text_layers),
    }
    if "logit_bias" in scalars:
        out["logit_bias"] = torch.tensor(scalars["logit_bias"])
    return out


def export_open_clip(checkpoint: str | Path, out: str | Path, info: Mapping[str, Any] | None = None) -> Path:
    """``checkpoint`` (our directory) as an open_clip directory ``out``; ``info`` joins the provenance."""
    src = Path(checkpoint)
    model, cfg, tok = load_checkpoint(src)
    _require(cfg, "open_clip", probabilistic=False, vision_stem="patch", vision_pool="cls", text_pool="eot",
             text_causal=True, head_variant="paper", text_proj_bias=False)  # fmt: skip
    extra = load_extra(src)
    scalars = _scalars(extra)
    tensors = open_clip_state(model.state_dict(), cfg, scalars)
    end_id = tok.end_id if tok is not None else cfg.vocab_size - 1
    mean, std = extra.get("pixel_mean"), extra.get("pixel_std")
    preprocess = {"image_size": cfg.image_size, "interpolation": "bicubic", "resize_mode": "shortest"}
    if mean and std:
        preprocess.update(mean=list(mean), std=list(std))
    config = {
        "model_cfg": open_clip_model_cfg(cfg, end_id, scalars),
        "preprocess_cfg": preprocess,
        "prolip_ray": _provenance(src, extra, info),
    }
    out = _write(Path(out), OPEN_CLIP_FILE, tensors, config, src)
    (out / OPEN_CLIP_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_prolip(checkpoint: str | Path, out: str | Path, info: Mapping[str, Any] | None = None) -> Path:
    """``checkpoint`` (a ProLIP with the released heads) in the released layout, into ``out``."""
    src = Path(checkpoint)
    model, cfg, _ = load_checkpoint(src)
    _require(cfg, "the released ProLIP layout", probabilistic=True, head_variant="prolip_official",
             vision_stem="patch", vision_pool="cls", text_pool="cls", text_mask_padding=False,
             text_causal=False)  # fmt: skip
    extra = load_extra(src)
    s = model.state_dict()
    proj = "text.text_projection.weight" if cfg.text_proj_bias else "text.text_projection"
    tensors = {
        **_vision(s, cfg),
        "visual.unc_embedding": s["visual.unc_token"],
        "visual.uncertainty_proj.weight": s["visual.head.logvar_proj.weight"],
        "visual.uncertainty_proj.bias": s["visual.head.logvar_proj.bias"],
        "text.token_embedding.weight": s["text.token_embed.weight"],
        "text.positional_embedding": s["text.pos_embed"],
        "text.cls_emb": s["text.cls_token"],
        "text.unc_emb": s["text.unc_token"],
        "text.ln_final.weight": s["text.ln_post.weight"],
        "text.ln_final.bias": s["text.ln_post.bias"],
        proj: s["text.head.mu_proj.weight"] if cfg.text_proj_bias else s["text.head.mu_proj.weight"].T,
        "text.text_uncertainty_projection.weight": s["text.head.logvar_proj.weight"],
        "text.text_uncertainty_projection.bias": s["text.head.logvar_proj.bias"],
        **_blocks(s, "text.transformer.", "text.transformer.", cfg.text_layers),
        **{k: torch.tensor(v) for k, v in _scalars(extra).items()},
    }
    if cfg.text_proj_bias:
        tensors["text.text_projection.bias"] = s["text.head.mu_proj.bias"]
    config = {
        "embed_dim": cfg.embed_dim,
        "quick_gelu": cfg.activation == "quick_gelu",
        "vision_cfg": {"image_size": cfg.image_size, "patch_size": cfg.patch_size, "width": cfg.vision_width,
                       "layers": cfg.vision_layers},
        "text_cfg": {"context_length": cfg.context_length, "vocab_size": cfg.vocab_size,
                     "width": cfg.text_width, "layers": cfg.text_layers, "norm_kwargs": {"eps": cfg.text_ln_eps}},
        "prolip_ray": _provenance(src, extra, info),
    }  # fmt: skip
    out = _write(Path(out), PROLIP_FILE, tensors, config, src)
    (out / HUB_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out
