"""ProLIP model: configuration presets, the two-tower module, weight-decay grouping and checkpoints.

Presets (``MODEL_CONFIGS``):

- ``tiny``: CPU tests and ``jobs.train --preset demo`` (64 px, patch 8, 4×128 per tower, context 32, vocab
  4096 = the default of ``pipeline.ingest.tokenizer.train_tokenizer``); ≈2.2M parameters.
- ``demo-32px``: the track demo's (``make demo``) — ``tiny`` at 32 px with 2 layers per tower; ``demo-32px-cnn`` the
  same with a small CNN (convolutional stem, mean-pooled, no transformer) as the image tower (CLIP only).
- ``ViT-B-32``: the DataComp small-track architecture (CLIP ViT-B/32 with a 12×512 causal text tower,
  context 77, vocab 49408 = CLIP BPE). Table C.6 "ViT-B/32": 151.7M base parameters.
- ``ViT-B-16-ProLIP``: the paper's model (§4.1): ViT-B/16 at 224 px, 12×768 text tower, context 64,
  embedding 768 "following SigLIP ViT-B/16", hence SigLIP's 32000-token vocabulary and its bidirectional
  text attention. Table C.6 "ViT-B/16-768": 197.3M base parameters; with vocab 49408 the count would be
  ≈210M, 6% off, so 32000 is the vocabulary the paper's table implies.

A tokenizer that adds tokens (a [MASK] or [PAD] that CLIP's BPE lacks) changes ``vocab_size`` and
``pad_id``: build the config with ``model_config(name, vocab_size=tok.vocab_size, pad_id=tok.pad_id)``.

Weight decay (App. B.1: "not on gains, biases, logit scale/bias"): ``param_groups`` also exempts the
positional embeddings and the CLS/UNC token vectors — they are additive per-position biases, not weight
matrices (the ViT/MAE convention). The [MASK] row lives in the token-embedding table, which decays as a
whole like every other vocabulary row (CLIP's convention).

Checkpoints are directories: ``weights.pt`` (a plain state dict, loaded with ``weights_only=True``; a
``model.safetensors`` is read instead when present), ``model_config.json``, optionally the tokenizer
(``tokenizer.json`` + ``special_tokens.json``) and ``extra.json``. Nothing is ever unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from training.config import MODEL_CONFIGS, ModelConfig, model_config  # noqa: F401 (re-exported)
from training.model.towers import TextTower, VisionTower

if TYPE_CHECKING:
    from pipeline.ingest.tokenizer import TextTokenizer

WEIGHTS_FILE = "weights.pt"
SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"
EXTRA_FILE = "extra.json"

# Parameter names (last component) that never decay although they are 2-D or more (ProLIP App. B.1: no
# decay on embeddings and tokens). Gains, biases and the losses' learnable scalars (``log_scale``, ``bias``,
# ``scale``, ``shift``: 0-d) are 1-D or less and never decay by rank alone.
NO_DECAY_NAMES = frozenset({"pos_embed", "cls_token", "unc_token"})


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, unreadable or does not match the model; the message names the file."""


class ProLIP(nn.Module):
    """Two towers mapping images and texts to diagonal Gaussians ``(mu, logvar)`` in one space.

    ``mu`` is L2-normalised (B, E) float32; ``logvar`` is (B, E) float32, or None when the config is
    deterministic (CLIP/SigLIP baselines).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTower(config)
        self.text = TextTower(config)
        self.set_grad_checkpointing(config.grad_checkpointing)

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        self.visual.transformer.grad_checkpointing = enabled
        self.text.transformer.grad_checkpointing = enabled

    def encode_image(
        self, images: torch.Tensor, keep_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """images (B, 3, H, W) normalised floats; keep_idx (B, K) patch indices to keep (patch drop)."""
        return self.visual(images, keep_idx)

    def encode_text(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens (B, L) int64, L ≤ context_length, padded with ``config.pad_id``."""
        return self.text(tokens)

    def forward(
        self, images: torch.Tensor, tokens: torch.Tensor, keep_idx: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor | None]:
        image_mu, image_logvar = self.encode_image(images, keep_idx)  # (B, E), (B, E) | None
        text_mu, text_logvar = self.encode_text(tokens)  # (B, E), (B, E) | None
        return {
            "image_mu": image_mu,
            "image_logvar": image_logvar,
            "text_mu": text_mu,
            "text_logvar": text_logvar,
        }


def num_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (works for models built on the ``meta`` device)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP keeps the model in ``.module``, torch.compile in ``._orig_mod``.
    for attr in ("_orig_mod", "module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            model = inner
    return model


def decay_split(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of trainable parameters that get weight decay and those that do not (see module docstring)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        (no_decay if p.ndim < 2 or leaf in NO_DECAY_NAMES else decay).append(name)
    return decay, no_decay


UNC_PARAM_NAMES = frozenset({"logvar_proj", "unc_token"})  # the σ heads: log σ² projections and [UNC]


def is_unc_param(name: str) -> bool:
    """Whether parameter ``name`` belongs to a σ head (a tower's log σ² projection or its [UNC] token)."""
    return any(part in UNC_PARAM_NAMES for part in name.split("."))


def param_groups(
    model: nn.Module,
    weight_decay: float,
    lr: float | None = None,
    unc_lr_mult: float = 1.0,
    unc_lr_mult_image: float | None = None,
) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices decay by ``weight_decay``; gains, biases, scalars, embeddings not.

    With ``unc_lr_mult`` != 1 the σ-head parameters (``is_unc_param``) get their own groups at
    ``lr * unc_lr_mult`` (same decay rule); ``unc_lr_mult_image`` (None: the same) sets the image tower's
    σ head apart from the text tower's. The LR schedule scales every group alike.
    """
    params = dict(model.named_parameters())
    decay, no_decay = decay_split(model)
    image_mult = unc_lr_mult if unc_lr_mult_image is None else unc_lr_mult_image
    split = lr is not None and (unc_lr_mult != 1.0 or image_mult != 1.0)

    def mult(name: str) -> float:
        return image_mult if "visual" in name.split(".") else unc_lr_mult

    groups = []
    for names, wd in ((decay, weight_decay), (no_decay, 0.0)):
        unc = [n for n in names if split and is_unc_param(n)]
        groups.append(
            {"params": [params[n] for n in names if not (split and is_unc_param(n))], "weight_decay": wd}
        )
        for m in dict.fromkeys(mult(n) for n in unc):  # one group per multiplier, in first-seen order
            ps = [params[n] for n in unc if mult(n) == m]
            groups.append({"params": ps, "weight_decay": wd, "lr": lr * m})  # type: ignore[operator]
    return groups


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    config: ModelConfig,
    tokenizer: TextTokenizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write weights, config (and tokenizer, extra JSON) into ``directory``; returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in _unwrap(model).state_dict().items()}
    torch.save(state, directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(directory)
    if extra is not None:
        (directory / EXTRA_FILE).write_text(json.dumps(dict(extra), indent=2) + "\n")
    return directory


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e


def _read_state_dict(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    safetensors_path, weights_path = directory / SAFETENSORS_FILE, directory / WEIGHTS_FILE
    if safetensors_path.is_file():
        try:
            from safetensors.torch import load_file
        except ImportError as e:
            raise CheckpointError(f"{safetensors_path} needs the 'safetensors' package") from e
        try:
            return load_file(str(safetensors_path), device="cpu"), safetensors_path
        except Exception as e:  # safetensors raises its own error types for truncated/invalid files
            raise CheckpointError(f"cannot read checkpoint file {safetensors_path}: {e}") from e
    if not weights_path.is_file():
        raise CheckpointError(f"checkpoint file missing: {weights_path} (nor {SAFETENSORS_FILE})")
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt zip, truncated file or a pickle that weights_only refuses
        raise CheckpointError(f"cannot read checkpoint file {weights_path}: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"checkpoint file {weights_path} does not hold a state dict of tensors")
    return state, weights_path


def load_checkpoint(directory: str | Path) -> tuple[ProLIP, ModelConfig, TextTokenizer | None]:
    """Rebuild the model from ``directory`` (on CPU); the tokenizer is None if none was saved."""
    directory = Path(directory)
    config_path = directory / CONFIG_FILE
    try:
        config = ModelConfig.from_dict(_read_json(config_path))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"invalid model config in {config_path}: {e}") from e
    state, weights_path = _read_state_dict(directory)
    model = ProLIP(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"weights in {weights_path} do not match {config_path}: {e}") from e
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        from pipeline.ingest.tokenizer import TextTokenizer

        tokenizer = TextTokenizer.load(directory)
    return model, config, tokenizer


def load_extra(directory: str | Path) -> dict[str, Any]:
    """The ``extra`` mapping given to ``save_checkpoint`` (empty if none was saved)."""
    path = Path(directory) / EXTRA_FILE
    return _read_json(path) if path.is_file() else {}
