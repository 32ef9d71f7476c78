"""The locked recipe: DataComp fixes how every subset model trains, so a track refuses a change to it.

The recipe is each preset's subset-model training (``recipe`` names the preset): the model, samples seen,
batch, objective, optimizer and schedule, augmentation, sampling and precision. A config whose ``train``
differs there stops at start with one line naming the key, unless ``unofficial=true``; an unofficial run
says so in the first line of its report, in ``track_results.json``, in every submission and in the
metadata of every exported checkpoint.
"""

from __future__ import annotations

from typing import Any

from pipeline.common.config import ConfigError, to_dict

LOCKED = {
    "": ("model", "samples_seen", "global_batch_size", "precision", "tokenizer", "tokenizer_clean"),
    "loss": None,  # every key
    "optim": None,
    "data": ("augment", "crop_scale", "crop_ratio", "color_jitter", "color_jitter_p", "grayscale_p", "mean",
             "std", "sampling", "shuffle_window", "mask_fraction", "text_mask_ratio", "patch_keep_ratio"),
}  # fmt: skip


def recipe_of(train: Any) -> dict[str, Any]:
    """The locked keys of a ``TrainConfig`` as dotted key → value."""
    plain = to_dict(train)
    out = {}
    for section, keys in LOCKED.items():
        values = plain if not section else plain[section]
        for key in keys if keys is not None else sorted(values):
            out[f"{section}.{key}" if section else key] = values[key]
    return out


def recipe_changes(train: Any, locked: Any) -> list[str]:
    """``train.KEY: locked → given`` for every locked key that differs."""
    mine, fixed = recipe_of(train), recipe_of(locked)
    return [f"train.{k}: {fixed[k]!r} → {mine[k]!r}" for k in fixed if mine[k] != fixed[k]]


def check_recipe(cfg: Any, recipes: dict[str, Any]) -> None:
    """Stop (``ConfigError``, one line naming the first key) on a recipe change without ``unofficial``."""
    if cfg.unofficial or cfg.recipe not in recipes:
        return
    changes = recipe_changes(cfg.train, recipes[cfg.recipe])
    if changes:
        raise ConfigError(
            f"{changes[0]} changes the fixed {cfg.recipe} recipe of every subset model (DataComp's rule: only "
            f"the data differs); set unofficial=true to run it as an unofficial track"
            + (f" ({len(changes) - 1} more change(s))" if len(changes) > 1 else "")
        )


def unofficial_line(cfg: Any, recipes: dict[str, Any]) -> str:
    """The report's first line for an unofficial run ('' for an official one)."""
    if not cfg.unofficial:
        return ""
    changes = recipe_changes(cfg.train, recipes[cfg.recipe]) if cfg.recipe in recipes else []
    what = "; ".join(changes) if changes else "no change to the recipe, but marked so"
    return f"**UNOFFICIAL RUN** (unofficial=true): its numbers do not stand beside DataComp's ({what})."
