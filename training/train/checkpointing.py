"""A training run's checkpoint: the model checkpoint plus optimizer, scheduler and loss state, and the
restore that falls back past an unusable one, checked against its checksums first
(training/train/run_checkpoints.py). ``state`` is a ``training.train.step.TrainState``."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from pipeline.common import faults
from training.model.checkpoint import CheckpointError, load_checkpoint, load_extra, save_checkpoint
from training.train.run_checkpoints import CHECKSUMMED, verify_checkpoint, write_checksums

_log = logging.getLogger(__name__)
TRAIN_STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.json"
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
        # data.exact_position: where the next step's rows are (pipeline/ingest/data_position.py): epoch, the
        # step it began at, and the epoch's next sample index (step in epoch × global batch, any world size).
        **({"data_position": data_position(state)} if cfg.data.exact_position else {}),
    }


def data_position(state: Any) -> dict[str, int]:
    step_in_epoch = state.step - state.epoch_start
    return {
        "epoch": state.epoch,
        "epoch_start_step": state.epoch_start,
        "step_in_epoch": step_in_epoch,
        "sample_index": step_in_epoch * state.cfg.global_batch_size,
    }


def save_state(directory: str, state: Any, tokenizer: Any, metrics: dict[str, Any] | None = None) -> None:
    """Weights, model config, tokenizer and extra (training/model/two_tower.py) plus optimizer/scheduler/loss
    state (and ``metrics.json``), then ``checksums.json`` (training/train/run_checkpoints.py): a save cut
    short has none."""
    module = state.module
    loss_values = {k: float(v) for k, v in module.loss.state_dict().items() if v.numel() == 1}
    extra = {**checkpoint_extra(state), "loss_state": loss_values, CHECKSUMMED: True}
    save_checkpoint(directory, module.model, state.mcfg, tokenizer, extra)
    faults.point("checkpoint.save")
    torch.save(
        {
            "optimizer": state.opt.state_dict(),
            "scheduler": state.sched.state_dict(),
            "loss": module.loss.state_dict(),
            **({"loss_scale": state.update.loss_scale.state_dict()} if state.update.loss_scale else {}),
        },
        os.path.join(directory, TRAIN_STATE_FILE),
    )
    if metrics is not None:
        with open(os.path.join(directory, METRICS_FILE), "w") as f:
            json.dump(metrics, f)
    write_checksums(directory)


def restore(module: Any, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights and loss scalars from a checkpoint directory; (extra.json, optimizer/scheduler state)."""
    model, _, _ = load_checkpoint(directory)
    module.model.load_state_dict(model.state_dict())
    saved = torch.load(os.path.join(directory, TRAIN_STATE_FILE), map_location="cpu", weights_only=True)
    module.loss.load_state_dict(saved["loss"])
    return load_extra(directory), saved


SCRATCH_PREFIX = "prolip-restore-"


def scratch_path(name: str) -> str:
    """Where the copy of a checkpoint named ``name`` lies while a restore reads it."""
    return os.path.join(tempfile.gettempdir(), SCRATCH_PREFIX + name)


@contextlib.contextmanager
def restore_scratch(name: str) -> Iterator[str]:
    """``scratch_path(name)``, made for one candidate's copy and removed after, held under an exclusive
    ``flock`` on ``<dir>.lock`` meanwhile: a copy left by a process killed mid-restore (the kernel frees its
    lock) is removed by the next restore on this machine, and a live one is never touched."""
    sweep_abandoned_scratch()
    path = scratch_path(name)
    lock = path + ".lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break  # still the file at that path: a sweeper did not remove it while this one waited
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.makedirs(path, exist_ok=True)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.unlink(lock)
        os.close(fd)


def sweep_abandoned_scratch() -> list[str]:
    """Remove every restore copy in the temp dir whose lock no process holds (its restorer was killed);
    the directories removed."""
    root = tempfile.gettempdir()
    removed = []
    for entry in os.listdir(root):
        if not (entry.startswith(SCRATCH_PREFIX) and entry.endswith(".lock")):
            continue
        lock = os.path.join(root, entry)
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # held: a restore in progress
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                shutil.rmtree(lock.removesuffix(".lock"), ignore_errors=True)
                os.unlink(lock)
                removed.append(lock.removesuffix(".lock"))
        except FileNotFoundError:
            pass  # its owner finished and removed it meanwhile
        finally:
            os.close(fd)
    return removed


class SingleProcess:
    """How one process restores alone: a private temp copy per candidate, its own verdict."""

    @contextlib.contextmanager
    def shared_dir(self, index: int) -> Iterator[str]:
        with restore_scratch(uuid.uuid4().hex) as d:
            yield d

    def agree(self, check: Callable[[], str | None]) -> str | None:
        return check()


def restore_with_fallback(
    candidates: Sequence[str],
    fetch: Callable[[str, str], None],
    build: Callable[[str], T],
    warn: Callable[[str], None] = _log.warning,
    verify: Callable[[str], str | None] = verify_checkpoint,
    node: Any = None,
) -> tuple[T, str]:
    """``build`` from the newest usable checkpoint of ``candidates`` (newest first): (result, its path).

    Each candidate is ``fetch``ed (path, a temp dir) and checked against its checksums (``verify``) before
    ``build`` reads the copy; a candidate that fails (corrupt or missing file, weights that do not match)
    is skipped with a warning naming the checkpoint's own path, never the temp copy. None usable:
    ``CheckpointError`` naming every path. ``node`` shares the work between the workers of one machine
    (training/train/loop.py: one download per node, one verdict for all); default: this process alone.
    """
    node = node or SingleProcess()
    failures = []
    for i, path in enumerate(candidates):
        with node.shared_dir(i) as d:
            why = node.agree(lambda p=path, d=d: _fetched_problem(fetch, verify, p, d))
            if why is None:
                try:
                    return build(d), path
                except Exception as exc:  # any unreadable checkpoint: try the older one
                    why = f"{type(exc).__name__}: {exc}"
            why = why.replace(d, path)
        failures.append(f"{path} ({why})")
        nxt = candidates[i + 1] if i + 1 < len(candidates) else None
        warn(f"checkpoint {path} is unusable ({why}); " + (f"falling back to {nxt}" if nxt else "none left"))
    raise CheckpointError("no usable checkpoint: " + "; ".join(failures or ["none given"]))


def _fetched_problem(fetch: Callable[[str, str], None], verify: Callable[[str], str | None], path: str,
                     d: str) -> str | None:  # fmt: skip
    """Fetch ``path`` into ``d`` and verify the copy: what is wrong, or None."""
    try:
        faults.point("checkpoint.fetch")
        fetch(path, d)
    except Exception as exc:  # a missing or unreadable checkpoint in storage
        return f"{type(exc).__name__}: {exc}"
    return verify(d)
