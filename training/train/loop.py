"""The per-worker training loop run by Ray Train's ``TorchTrainer`` (``train_loop_per_worker(config)``).

The Ray shell around the pure parts of training/train/step.py: the worker's context (rank, device, threads), the
epoch iterator over this worker's Ray Data shard (``get_dataset_shard("train").iter_torch_batches``,
masked variants added in its collate step, pipeline/ingest/transforms.py), and reports/checkpoints.

CPU precision: subnormals are flushed to zero (``torch.set_flush_denormal``): saturated inclusion terms
(ProLIP Eq. 5, c = 1000) send gradients of ~1e-39 through the masked forward, and subnormal arithmetic
made CPU steps 5–15× slower.

Data position on resume: with ``data.exact_position`` each rank reads its rows of every step itself, in
an order planned from (seed, epoch, shard row counts) (pipeline/ingest/data_position.py), and a resumed run
continues at the checkpoint's epoch and step, at any world size. Otherwise Ray Data cannot seek into a
streaming epoch, so a resumed run starts a fresh pass (epoch + 1, new shard order and masks), as open_clip
does; the step count, LR schedule and samples seen continue from the checkpoint either way.

Reports: every ``log_every`` steps, at every checkpoint and at the last step, every rank computes the
window's global metrics (loss terms summed over ranks — the shares add up to the global loss — σ² means
and the data-wait fraction averaged over ranks); rank 0 logs them (TensorBoard, the progress actor, the
run's metric list). Only checkpoint steps call ``ray.train.report`` (a barrier, so every rank calls it at
the same steps; rank 0 attaches the checkpoint). A report blocks until Ray Train's controller takes the
previous one, which it polls for every 2 s (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``), so reporting metrics
alone every 10 fast steps held a demo model at ~1 s per report: 64 s against 45 s for one 200-step run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import CheckpointUploadMode

from pipeline.common import faults
from pipeline.ingest.dataset import RayTrainCollate, exact_batches, publish_progress, read_counters
from pipeline.ingest.masking import drop_masked_tokens
from pipeline.ingest.prefetch import device_batches
from pipeline.ingest.transforms import DecodedCache, MaskedVariants, TrainCollate, tokenizer_from_state
from training.config import from_plain
from training.train.checkpointing import restore_scratch, restore_with_fallback, save_state, scratch_path
from training.train.distributed import EpochEnd, local_batch_sizes
from training.train.metrics import Window, window_metrics
from training.train.run_checkpoints import fresh_name, local_save_dir, upload_checkpoint
from training.train.step import TrainState, setup_state, train_step

_log = logging.getLogger(__name__)


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train entry point. ``config``: ``train`` (plain TrainConfig), ``tokenizer`` (state),
    ``counters`` (IngestCounters actor name or None), ``tensorboard_dir`` (local path or None)."""
    cfg = from_plain(config["train"])
    os.environ.update(config.get("faults") or {})  # the fault suite's kill points (pipeline/common/faults.py)
    tokenizer = tokenizer_from_state(config["tokenizer"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = _worker_device(cfg)
    warnings: list[str] = []
    state = _restored_state(cfg, tokenizer, device, rank, world, warnings)
    writer = _tensorboard(config.get("tensorboard_dir")) if rank == 0 else None
    cache = DecodedCache() if cfg.data.cache_decoded else None
    masker = _masker(state, tokenizer) if state.module.spec.uses_masked else None
    pad_id = tokenizer.pad_id if cfg.data.trim_text_padding else None
    _run_epochs(state, config, tokenizer, (masker, pad_id), cache, rank, writer)
    if writer is not None:
        writer.close()
    return {
        "history": state.history,
        "attempts": state.attempts,
        "start_step": state.start_step,
        "final_step": state.step,
        "epoch": state.epoch,
        "world_size": world,
        "cached_rows": cache.n_rows if cache is not None else 0,
        "metrics": state.logged,
        "restore_warnings": warnings,  # the driver prints them: worker logs do not reach its console
    }


def _worker_device(cfg: Any) -> torch.device:
    device = ray.train.torch.get_device()
    threads = cfg.scaling.torch_threads
    if threads:
        torch.set_num_threads(threads if threads > 0 else os.cpu_count() or 1)
    if device.type == "cpu":
        # The saturated inclusion terms back-propagate gradients below 1e-38 through the masked branch;
        # x86 runs subnormal arithmetic ~100x slower (steps went from 0.45 s to 2–7 s). Flush to zero.
        torch.set_flush_denormal(True)
    else:
        # What autocast leaves in float32 (the heads, the losses' matrix products) may use TF32 tensor cores.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device


def _restored_state(
    cfg: Any, tokenizer: Any, device: torch.device, rank: int, world: int, warnings: list[str]
) -> TrainState:
    checkpoint = ray.train.get_checkpoint()
    wrap = ray.train.torch.prepare_model
    if checkpoint is None:
        return setup_state(cfg, tokenizer, device, rank, wrap=wrap, world=world)
    fs = checkpoint.filesystem

    def fetch(path: str, d: str) -> None:
        ray.train.Checkpoint(path, filesystem=fs).to_directory(d)

    def build(d: str) -> TrainState:
        return setup_state(cfg, tokenizer, device, rank, restore_dir=d, wrap=wrap, world=world)

    def warn(line: str) -> None:
        warnings.append(line)
        _log.warning(line)

    # A corrupt latest checkpoint falls back to the previous kept one. One download per node, into a
    # directory its workers share once it is whole, and one verdict for every rank (``NodeGroup``); the
    # warning and the error name the checkpoint, not the copy.
    node = NodeGroup(device) if dist.is_available() and dist.is_initialized() else None
    state, _ = restore_with_fallback(
        checkpoint_candidates(checkpoint.path, fs), fetch, build, warn, node=node
    )
    faults.point("checkpoint.restored")  # every rank: the fault suite counts restores against downloads
    return state


class NodeGroup:
    """The workers of one run restoring together: the first worker of each node downloads a candidate
    into a directory named by a token rank 0 draws, the node's other workers read that copy once every
    worker has passed a collective (so no one reads a file still being written), and the verdict on a
    candidate is the same on every rank (a ``MAX`` all-reduce of "unusable")."""

    def __init__(self, device: torch.device) -> None:
        ctx = ray.train.get_context()
        self.leader = ctx.get_local_rank() == 0
        self.device = device if device.type == "cuda" else torch.device("cpu")
        token = [uuid.uuid4().hex[:12]]
        dist.broadcast_object_list(token, src=0, device=self.device if device.type == "cuda" else None)
        self.name = f"{token[0]}-n{ctx.get_node_rank()}"

    @contextlib.contextmanager
    def shared_dir(self, index: int) -> Iterator[str]:
        name = f"{self.name}-{index}"
        # The leader makes and removes the copy (and holds its lock, so a killed run's copy is swept).
        with restore_scratch(name) if self.leader else contextlib.nullcontext(scratch_path(name)) as path:
            try:
                yield path
            finally:
                dist.barrier()  # every worker of the node has read the copy (or given up on it)

    def agree(self, check: Callable[[], str | None]) -> str | None:
        problem = check() if self.leader else None
        flag = torch.tensor([1 if problem else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # also the barrier before the others read the copy
        if flag.item() and problem is None:
            return "unusable on another node"
        return problem


def checkpoint_candidates(latest: str, fs: pafs.FileSystem) -> list[str]:
    """``latest`` then the older kept ``checkpoint_<step>`` directories beside it, newest first."""
    parent, name = posixpath.split(latest.rstrip("/"))
    try:
        infos = fs.get_file_info(pafs.FileSelector(parent))
    except OSError:
        return [latest]
    older = [
        i.path
        for i in infos
        if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_") and i.base_name < name
    ]
    return [latest, *sorted(older, key=posixpath.basename, reverse=True)]


class DroppedTextVariants:
    """``data.text_mask_mode="drop"``: the masked variants of ``masker`` with their text [MASK] tokens removed
    (``drop_masked_tokens``); the image variants and which samples are masked are unchanged."""

    def __init__(self, masker: MaskedVariants, mask_id: int, pad_id: int) -> None:
        self.masker, self.mask_id, self.pad_id = masker, mask_id, pad_id

    def __call__(self, batch: dict[str, np.ndarray], epoch: int) -> dict[str, np.ndarray]:
        out = self.masker(batch, epoch)
        dropped = drop_masked_tokens(np.asarray(out["masked_tokens"]), self.mask_id, self.pad_id)
        return {**out, "masked_tokens": dropped}


def _masker(state: TrainState, tokenizer: Any) -> MaskedVariants | DroppedTextVariants:
    data = state.cfg.data
    masker = MaskedVariants(
        state.mcfg.n_patches,
        tokenizer.pad_id,
        tokenizer.end_id,
        tokenizer.mask_id,
        data.mask_fraction,
        data.text_mask_ratio,
        data.patch_keep_ratio,
        seed=data.mask_seed,
        protected_ids=() if tokenizer.start_id is None else (tokenizer.start_id,),
    )
    if data.text_mask_mode in ("drop", "salient"):
        # "salient": the train step replaces these captions with the model's choice (training/train/salient_masking.py);
        # which samples are masked, and their image variants, still come from here.
        return DroppedTextVariants(masker, tokenizer.mask_id, tokenizer.pad_id)
    return masker


def _epoch_batches(
    state: TrainState,
    collate: tuple[Any, int | None],
    cache: DecodedCache | None,
    rank: int,
    local_batch: int,
    ingest: dict[str, Any],
) -> Iterator[dict[str, Any]]:
    """This worker's batches for ``state.epoch`` on its device: from the decoded cache once sealed, else its
    Ray shard (pinned host batches copied one step ahead, pipeline/ingest/prefetch.py).

    ``collate`` = (masked-variant maker or None, pad id to trim text padding with or None)."""
    data = state.cfg.data
    masker, pad_id = collate
    if data.exact_position:  # this rank's rows of the epoch's steps from the checkpoint's position on
        at = (state.epoch, state.step - state.epoch_start, state.step + 1)
        split = (state.cfg.global_batch_size, ray.train.get_context().get_world_size(), rank)
        host = exact_batches(data, ingest, state.mcfg, at, split, TrainCollate(masker, state.epoch, pad_id))
        return device_batches(host, state.device)
    if cache is not None and cache.sealed:
        seed = data.shuffle_seed
        rng = np.random.default_rng(None if seed is None else [seed, state.epoch, rank])
        return device_batches(
            cache.batches(local_batch, rng, TrainCollate(masker, state.epoch, pad_id)), state.device
        )
    shard = ray.train.get_dataset_shard("train")
    host = shard.iter_torch_batches(
        batch_size=local_batch,
        # The cache keeps the last partial batch too; the loop skips it below.
        drop_last=cache is None,
        collate_fn=RayTrainCollate(TrainCollate(masker, state.epoch, pad_id, cache=cache)),
        prefetch_batches=data.prefetch_batches,
        local_shuffle_buffer_size=data.local_shuffle_buffer or None,
        device="cpu",  # the copy to the GPU is ours, on a side stream
        pin_memory=data.pin_memory and state.device.type == "cuda",
    )
    return device_batches(host, state.device)


def _run_epochs(
    state: TrainState,
    config: dict[str, Any],
    tokenizer: Any,
    collate: tuple[Any, int | None],
    cache: DecodedCache | None,
    rank: int,
    writer: Any,
) -> None:
    cfg = state.cfg
    local_batch = local_batch_sizes(cfg.global_batch_size, ray.train.get_context().get_world_size())[rank]
    fail_armed = cfg.run.fail_at_step > 0 and not state.restored and rank == cfg.run.fail_rank
    window, epoch_end = Window(), EpochEnd()
    ingest = {"position": config.get("position"), "tokenizer": tokenizer, "counters": config.get("counters")}
    attempt = _attempt_id(state.device) if cfg.data.exact_position else 0
    while state.step < cfg.total_steps:
        batches, in_epoch = _epoch_batches(state, collate, cache, rank, local_batch, ingest), 0
        while state.step < cfg.total_steps:
            t0 = time.perf_counter()
            batch = next(batches, None)
            wait = time.perf_counter() - t0
            # Every rank steps only while every rank has a full batch (uneven local batches may run out at
            # different steps); a partial batch is the first epoch's remainder, kept by the cache.
            if not epoch_end.all_have(batch is not None and batch["images"].shape[0] == local_batch):
                if cache is not None and not cache.sealed:
                    for _ in batches:  # the rest of this worker's first epoch still belongs in its cache
                        pass
                    cache.seal()
                break
            keys = batch.pop("keys", None)
            terms, feats = train_step(state, batch)
            if keys is not None:
                faults.samples(attempt, rank, state.step, state.epoch, keys)
            in_epoch += 1
            faults.point("train.step")
            window.add(terms, feats, wait, time.perf_counter() - t0)
            if fail_armed and state.step == cfg.run.fail_at_step:
                raise RuntimeError(f"injected failure at step {state.step} on rank {rank} (run.fail_at_step)")
            if _report_due(state):
                _report(state, window, config, tokenizer, rank, writer)
                window = Window()
        if in_epoch == 0 and state.step == state.epoch_start:  # (not a resume at the epoch's very end)
            raise RuntimeError(
                f"epoch {state.epoch} gave no full batch of {local_batch} per worker: "
                f"the dataset is smaller than global_batch_size={cfg.global_batch_size}"
            )
        state.epoch, state.epoch_start = state.epoch + 1, state.step


def _attempt_id(device: torch.device) -> int:
    """One number per (re)start of the worker group, larger for a later one (rank 0's clock, shared)."""
    token = [time.time_ns()]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(token, src=0, device=device if device.type == "cuda" else None)
    return int(token[0])


def _report_due(state: TrainState) -> bool:
    run = state.cfg.run
    return state.step % run.log_every == 0 or _checkpoint_due(state)


def _checkpoint_due(state: TrainState) -> bool:
    return state.step % state.cfg.run.checkpoint_every == 0 or state.step == state.cfg.total_steps


def _report(
    state: TrainState, window: Window, config: dict[str, Any], tokenizer: Any, rank: int, writer: Any
) -> None:
    """Every rank reports the window's global metrics; rank 0 attaches a checkpoint when one is due."""
    metrics = window_metrics(window, state)
    counters = config.get("counters")
    if rank == 0 and counters:
        ingest = read_counters(counters)
        metrics.update({f"ingest/{k}": v for k, v in ingest.items() if isinstance(v, int)})
        publish_progress(counters, {**metrics, "total_steps": state.cfg.total_steps})
    state.logged.append(metrics)
    if writer is not None:
        for k, v in metrics.items():
            writer.add_scalar(k, v, state.step)
        writer.flush()
    if not _checkpoint_due(state):
        return  # metrics alone: logged above, no controller round trip (module docstring)
    if rank != 0:
        ray.train.report(metrics)
        return
    # Saved locally, then uploaded by Ray Train's upload thread while training goes on (ASYNC), through
    # our upload (checksums.json last) into a directory name no checkpoint used before; Ray deletes the
    # local copy once it is uploaded (training/train/run_checkpoints.py).
    d = local_save_dir()  # also removes what killed workers of this host left
    faults.point("checkpoint.before_save")
    save_state(d, state, tokenizer, metrics)
    faults.point("checkpoint.saved")
    storage = ray.train.get_context().get_storage()
    ray.train.report(
        metrics,
        checkpoint=ray.train.Checkpoint.from_directory(d),
        checkpoint_dir_name=fresh_name(storage.storage_filesystem, storage.experiment_fs_path, state.step),
        checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
        delete_local_checkpoint_after_upload=True,
        checkpoint_upload_fn=_upload,
    )


def _upload(checkpoint: Any, dir_name: str) -> Any:
    """Ray Train's ``checkpoint_upload_fn``: our upload into the run's ``dir_name``; the stored checkpoint."""
    storage = ray.train.get_context().get_storage()
    dest = posixpath.join(storage.experiment_fs_path, dir_name)
    upload_checkpoint(checkpoint.path, storage.storage_filesystem, dest)
    faults.point("checkpoint.uploaded")  # whole in storage, not yet registered by the controller
    return ray.train.Checkpoint(dest, filesystem=storage.storage_filesystem)


def _tensorboard(log_dir: str | None) -> Any:
    """A SummaryWriter (torch's, else tensorboardX's) or None when neither imports or no dir is given."""
    if not log_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return None
    return SummaryWriter(log_dir=log_dir)
