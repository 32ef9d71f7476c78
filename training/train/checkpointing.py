"""A training run's checkpoint: the model checkpoint plus optimizer, scheduler and loss state, and the
restore that falls back past an unusable one. ``state`` is a ``training.train.step.TrainState``."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from training.model.checkpoint import CheckpointError, load_checkpoint, load_extra, save_checkpoint

_log = logging.getLogger(__name__)
TRAIN_STATE_FILE = "train_state.pt"
T = TypeVar("T")


def checkpoint_extra(state: Any) -> dict[str, Any]:
    """What a checkpoint carries besides the weights (``extra.json``)."""
    cfg = state.cfg
    return {
        "step": state.step,
        "epoch": state.epoch,
        "samples_seen": state.step * cfg.global_batch_size,
        "history": state.history,
        "attempts": state.attempts,
        "metrics": state.logged,
        "loss": cfg.loss.name,
        # How masked captions were made ("mask" | "drop"): the eval's original ⊂ masked analysis masks alike.
        "text_mask_mode": cfg.data.text_mask_mode,
        # Inference (training/infer/encode.py) must normalise pixels as this run did.
        "pixel_mean": list(cfg.data.mean),
        "pixel_std": list(cfg.data.std),
    }


def save_state(directory: str, state: Any, tokenizer: Any) -> None:
    """Weights, model config, tokenizer and extra (training/model/two_tower.py) plus optimizer/scheduler/loss state."""
    module = state.module
    loss_values = {k: float(v) for k, v in module.loss.state_dict().items() if v.numel() == 1}
    extra = {**checkpoint_extra(state), "loss_state": loss_values}
    save_checkpoint(directory, module.model, state.mcfg, tokenizer, extra)
    torch.save(
        {
            "optimizer": state.opt.state_dict(),
            "scheduler": state.sched.state_dict(),
            "loss": module.loss.state_dict(),
        },
        os.path.join(directory, TRAIN_STATE_FILE),
    )


def restore(module: Any, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights and loss scalars from a checkpoint directory; (extra.json, optimizer/scheduler state)."""
    model, _, _ = load_checkpoint(directory)
    module.model.load_state_dict(model.state_dict())
    saved = torch.load(os.path.join(directory, TRAIN_STATE_FILE), map_location="cpu", weights_only=True)
    module.loss.load_state_dict(saved["loss"])
    return load_extra(directory), saved


def restore_with_fallback(
    candidates: Sequence[str],
    fetch: Callable[[str, str], None],
    build: Callable[[str], T],
    warn: Callable[[str], None] = _log.warning,
) -> tuple[T, str]:
    """``build`` from the newest usable checkpoint of ``candidates`` (newest first): (result, its path).

    Each candidate is ``fetch``ed (path, private temp dir) and ``build`` reads the copy; a candidate that
    fails (corrupt or missing file, weights that do not match) is skipped with a warning naming the
    checkpoint's own path, never the temp copy. None usable: ``CheckpointError`` naming every path.
    """
    failures = []
    for i, path in enumerate(candidates):
        with tempfile.TemporaryDirectory(prefix="prolip-restore-") as d:
            try:
                fetch(path, d)
                return build(d), path
            except Exception as exc:  # any unreadable checkpoint: try the older one
                why = f"{type(exc).__name__}: {exc}".replace(d, path)
        failures.append(f"{path} ({why})")
        nxt = candidates[i + 1] if i + 1 < len(candidates) else None
        warn(f"checkpoint {path} is unusable ({why}); " + (f"falling back to {nxt}" if nxt else "none left"))
    raise CheckpointError("no usable checkpoint: " + "; ".join(failures or ["none given"]))
