"""Model checkpoints: a directory with the weights, the model config, the tokenizer and extra JSON.

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

from pipeline.common.errors import InputError
from training.model.config import ModelConfig
from training.model.two_tower import ProLIP, unwrap

if TYPE_CHECKING:
    from pipeline.ingest.tokenizer import TextTokenizer

WEIGHTS_FILE = "weights.pt"
SAFETENSORS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"
EXTRA_FILE = "extra.json"


class CheckpointError(InputError, RuntimeError):
    """A checkpoint file is missing, unreadable or does not match the model; the message names the file."""


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
    state = {k: v.detach().cpu().contiguous() for k, v in unwrap(model).state_dict().items()}
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
    with open(weights_path, "rb") as fh:
        if fh.read(4) != b"PK\x03\x04":  # torch.save's zip; torch's own error for anything else is a number
            raise CheckpointError(
                f"checkpoint file {weights_path}: not a torch.save weights file (a zip archive)"
            )
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
    if not directory.is_dir():
        what = "a file, not a checkpoint directory" if directory.exists() else "not found"
        raise CheckpointError(f"checkpoint {directory}: {what} ({CONFIG_FILE} and {WEIGHTS_FILE})")
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
