"""Builds and runs the Ray Train ``TorchTrainer`` for a ``TrainConfig``: ``train(cfg) -> TrainResult``.

- Scaling: ``ScalingConfig(num_workers, use_gpu, resources_per_worker)``, the worker's CPUs, GPUs and
  ``scaling.resources``; with ``scaling.min_workers > 0`` the range ``(min_workers, num_workers)`` (Ray
  Train elastic). The global batch is constant: rank r takes its share of ``global_batch_size``
  (training/train/distributed.py ``local_batch_sizes``; uneven when the world does not divide it), and
  the loop reads the world size at each (re)start. The process group's
  collective timeout is ``scaling.collective_timeout_s`` (``TorchConfig(timeout_s)``).
- Storage: ``RunConfig(storage_path, name)``, local or ``s3://`` (a ``pyarrow.fs.S3FileSystem`` from the run's
  ``Storage``: its endpoint and, when set in the environment, explicit credentials, so the controller and the
  workers — other processes, possibly other machines — can write checkpoints). Re-running with the same
  ``storage_path`` and ``name`` resumes from the latest checkpoint (Ray Train V2 has no
  ``resume_from_checkpoint``). ``FailureConfig(max_failures)`` restarts the worker group from it
  automatically; ``CheckpointConfig(num_to_keep)`` prunes old ones.
- Tokenizer: a given one (``cfg.tokenizer``), else the one saved in the run directory by an earlier
  attempt (so a resumed run tokenizes identically), else a BPE trained on the shards' captions and saved
  there (``<storage_path>/<name>/tokenizer/``); every checkpoint carries it too.
- TensorBoard event files go to ``<storage_path>/<name>/tensorboard`` for local storage (rank 0 writes
  them); for ``s3://`` storage to ``run.tensorboard`` off-cluster is not attempted — the same metrics are
  in every checkpoint's ``metrics.json`` and in ``Result.return_value``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import posixpath
import signal
import sys
import tempfile
import threading
import time
from itertools import islice
from typing import Any

from pipeline.common import faults, storage
from pipeline.common.placement import worker_label_selector
from pipeline.common.storage import Storage
from pipeline.ingest.dataset import (
    ProgressPrinter,
    build_train_dataset,
    count_shard_rows,
    read_counters,
    start_counters,
    stop_counters,
    train_dataset_config,
)
from pipeline.ingest.tokenizer import (
    SPECIAL_IDS_FILE,
    TOKENIZER_FILE,
    TextTokenizer,
    tokenizer_from_spec,
    train_tokenizer,
)
from pipeline.ingest.transforms import tokenizer_state
from pipeline.shards.reader import list_shards, stop_reason
from training.config import TrainConfig, to_plain
from training.train.loop import train_loop_per_worker
from training.train.run_checkpoints import preflight

TOKENIZER_CAPTIONS = 200_000  # captions read to train a BPE when none is given


@dataclasses.dataclass
class TrainResult:
    """What a finished run left: Ray's ``Result``, the loop's return value, the last checkpoint."""

    result: Any  # ray.train.Result
    return_value: dict[str, Any]
    checkpoint_path: str | None  # local path or s3://…
    run_dir: str
    tokenizer: TextTokenizer
    ingest: dict[str, Any]
    wall_s: float
    # checkpoints found corrupt and set aside or skipped (also in the manifest: they change what resumed)
    warnings: list[str] = dataclasses.field(default_factory=list)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        return list(self.return_value.get("metrics", []))


def run_dir(cfg: TrainConfig) -> str:
    return storage.join(cfg.run.storage_path, cfg.run.name)


def storage_target(path: str, store: Storage) -> tuple[str, Any]:
    """(storage_path for RunConfig, filesystem or None). S3 paths lose their scheme, as Ray expects; the
    S3 filesystem carries the store's explicit keys, so the controller and workers need no AWS env."""
    if not storage.is_s3(path):
        return os.path.abspath(path), None
    fs, key = store.resolve(path)
    return key, fs


def prepare_tokenizer(cfg: TrainConfig, run_store: Storage, data_store: Storage) -> TextTokenizer:
    """The run's tokenizer (see module docstring for the order of preference)."""
    if cfg.tokenizer:
        return tokenizer_from_spec(cfg.tokenizer, cfg.tokenizer_clean or None, data_store)
    saved = storage.join(run_dir(cfg), "tokenizer")
    if run_store.exists(storage.join(saved, SPECIAL_IDS_FILE)):
        with tempfile.TemporaryDirectory() as d:
            for name in (TOKENIZER_FILE, SPECIAL_IDS_FILE):
                with open(os.path.join(d, name), "wb") as f:
                    f.write(run_store.read_bytes(storage.join(saved, name)))
            return TextTokenizer.load(d)
    tokenizer = train_tokenizer(_captions(cfg, data_store), vocab_size=cfg.tokenizer_vocab)
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save(d)
        for name in (TOKENIZER_FILE, SPECIAL_IDS_FILE):
            with open(os.path.join(d, name), "rb") as f:
                run_store.write_bytes(f.read(), storage.join(saved, name))
    return tokenizer


def _captions(cfg: TrainConfig, store: Storage):
    from pipeline.ingest.subset_reader import SubsetShardReader
    from pipeline.shards.reader import iter_shard
    from pipeline.shards.tar_format import ShardError

    def gen():
        if cfg.data.subset:  # the captions the run will train on
            reader = SubsetShardReader(cfg.data.subset, store)
            for path in list_shards(cfg.data.shards, store):
                for table in reader(path):
                    yield from table.column("txt").to_pylist()
            return
        for path in list_shards(cfg.data.shards, store):
            try:
                for sample in iter_shard(path, store, extensions={"txt"}):
                    yield sample.get("txt", "")
            except ShardError:
                continue  # the ingest counts damaged shards; a tokenizer needs only their intact part

    return islice(gen(), TOKENIZER_CAPTIONS)


POSITION_FILE = "data_position.json"  # the exact plan's shards and row counts, in the run directory


def position_plan(cfg: TrainConfig, run_store: Storage, data_store: Storage) -> dict[str, Any]:
    """``data.exact_position``: the shards and their row counts the run's order is made of, counted once
    (one Ray task per shard) and kept in the run directory, so a resumed run plans the same order."""
    saved = storage.join(run_dir(cfg), POSITION_FILE)
    if run_store.exists(saved):
        return json.loads(run_store.read_bytes(saved))
    paths = list_shards(cfg.data.shards, data_store)
    plan = {"shards": paths, "counts": count_shard_rows(cfg.data, data_store, paths)}
    run_store.write_bytes(json.dumps(plan).encode(), saved)
    return plan


def build_trainer(
    cfg: TrainConfig,
    tokenizer: TextTokenizer,
    dataset: Any,
    counters: str | None,
    run_store: Storage,
    position: dict[str, Any] | None = None,
) -> Any:
    """The ``TorchTrainer`` (not yet fitted); ``dataset`` None with ``position`` (the exact plan)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    s = cfg.scaling
    resources = {"CPU": s.cpus_per_worker, **s.resources}
    if s.use_gpu:
        resources["GPU"] = s.gpus_per_worker
    num_workers: int | tuple[int, int] = (s.min_workers, s.num_workers) if s.min_workers else s.num_workers
    storage_path, filesystem = storage_target(cfg.run.storage_path, run_store)
    tensorboard = None
    if cfg.run.tensorboard and filesystem is None:
        tensorboard = os.path.join(storage_path, cfg.run.name, "tensorboard")
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "train": to_plain(cfg),
            "tokenizer": tokenizer_state(tokenizer),
            "counters": counters,
            "tensorboard_dir": tensorboard,
            "position": position,
            "faults": {
                k: os.environ[k]
                for k in (faults.ARM, faults.STATE, faults.TRACE, faults.ORDERED, faults.SAMPLES)
                if k in os.environ
            },
        },
        scaling_config=ScalingConfig(
            num_workers=num_workers,
            use_gpu=s.use_gpu,
            resources_per_worker=resources,
            label_selector=worker_label_selector(s.label_selector),
        ),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
        ),
        # NCCL's watchdog fails a collective stuck past this (Ray's default is 30 minutes).
        torch_config=TorchConfig(timeout_s=s.collective_timeout_s),
        datasets=None if dataset is None else {"train": dataset},
        # A seeded shuffle promises a repeatable run: without preserve_order the first epoch's batches
        # follow whichever decode task finishes first, and two runs of one seed differ within the first steps.
        dataset_config=None
        if dataset is None
        else train_dataset_config(cfg.data.label_selector, cfg.data.shuffle_seed is not None),
    )


@contextlib.contextmanager
def interrupt_reported(name: str):
    """Ctrl-C during ``fit()``: one line and exit status 130 instead of Ray Train's silent exit.

    Ray Train's ``fit()`` installs its own SIGINT handler, which aborts the run's workers and then leaves
    the driver through a bare ``SystemExit(1)``; it also leaves that handler installed after ``fit()``
    returns, where a later Ctrl-C (say, in the track's next step) would try to abort a finished run. The
    caller's handler comes back here either way. A resumed run starts from the last checkpoint, so the
    steps since it are trained again."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    try:
        yield
    except SystemExit:
        print(
            f"[train {name}] interrupted: run aborted; the same command resumes from its last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(130) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def h100_rate(cfg: TrainConfig, mcfg: Any, mfu: float = 0.30) -> tuple[float, float]:
    """(training FLOPs a sample, counted on the meta device; the samples/s an H100 trains at ``mfu``)."""
    from training.model.flops import samples_per_s, train_flops_per_sample

    masked = cfg.loss.uses_masked
    flops = train_flops_per_sample(mcfg, masked, cfg.data.mask_fraction, cfg.data.patch_keep_ratio)["total"]
    return flops, samples_per_s(flops, mfu=mfu)


def micro_batch_plan(cfg: TrainConfig) -> str:
    """One line: the micro-batches a step runs in at each world size the run may take (exact accumulation)."""
    parts = []
    for world in cfg.world_sizes():
        local = -(-cfg.global_batch_size // world)
        k = cfg.micro_batches(world)
        parts.append(
            f"world {world}: {local} a worker in {k} micro-batch{'es' if k > 1 else ''} of ≤ {-(-local // k)}"
        )
    return f"scaling.max_local_batch={cfg.scaling.max_local_batch}: " + "; ".join(parts)


def decode_sizing(cfg: TrainConfig, mcfg: Any, mfu: float = 0.30) -> str:
    """One line: the decode cores the run's GPUs need at ``mfu`` of an H100 from the measured per-core rate
    (the FLOPs counted on the meta device, training/model/flops.py; docs/gpu.md)."""
    from pipeline.ingest.transforms import DECODE_SAMPLES_PER_CORE_224
    from training.model.flops import cores_needed

    flops, rate = h100_rate(cfg, mcfg, mfu)
    per_gpu = cores_needed(rate, DECODE_SAMPLES_PER_CORE_224 * (mcfg.image_size / 224) ** -2)
    return (
        f"[train {cfg.run.name}] {flops / 1e9:.1f} GFLOP a sample: an H100 at {100 * mfu:.0f}% MFU trains "
        f"{rate:.0f} samples/s and needs ≈{per_gpu:.1f} decode cores at {DECODE_SAMPLES_PER_CORE_224:.0f} "
        f"samples/s per core; {cfg.scaling.num_workers} workers need ≈{per_gpu * cfg.scaling.num_workers:.0f}"
    )


def train(cfg: TrainConfig) -> TrainResult:
    """Run (or resume) training to ``cfg.total_steps``; needs Ray initialised (jobs.common.init_ray)."""
    from training.model.config import model_config, objective_model_config

    t0 = time.perf_counter()
    # Run directory and shards may sit behind different endpoints: each is resolved once, here.
    run_store = cfg.run.storage.store()
    data_store = cfg.data.storage.store()
    tokenizer = prepare_tokenizer(cfg, run_store, data_store)
    mcfg = model_config(cfg.model)
    warnings = check_checkpoints(cfg, run_store)
    if cfg.scaling.use_gpu:
        probabilistic = cfg.loss.probabilistic
        sized = objective_model_config(cfg.model, probabilistic, vocab_size=tokenizer.vocab_size)
        print(decode_sizing(cfg, sized), flush=True)
    if cfg.scaling.max_local_batch:
        print(micro_batch_plan(cfg), flush=True)
    counters = start_counters()
    try:
        size, context = mcfg.image_size, mcfg.context_length
        position, dataset = None, None
        if cfg.data.exact_position:  # each rank reads its own rows (pipeline/ingest/data_position.py)
            position = position_plan(cfg, run_store, data_store)
        else:
            dataset = build_train_dataset(cfg.data, data_store, tokenizer, size, context, counters)
        with ProgressPrinter(counters, cfg.run.name), interrupt_reported(cfg.run.name):
            try:
                result = build_trainer(cfg, tokenizer, dataset, counters, run_store, position).fit()
            except Exception:  # Ray's WorkerGroupError cuts the worker's own message short
                reason = stop_reason(read_counters(counters), cfg.data.max_bad_shards)
                if reason is None:
                    raise
                raise reason from None
        ingest = read_counters(counters)
    finally:
        stop_counters(counters)
    for line in (result.return_value or {}).get("restore_warnings", []):
        print(f"[train {cfg.run.name}] {line}", file=sys.stderr, flush=True)
        warnings.append(line)
    ckpt = result.checkpoint
    ckpt_path = None
    if ckpt is not None:
        ckpt_path = ckpt.path if not storage.is_s3(cfg.run.storage_path) else storage.S3_PREFIX + ckpt.path
    return TrainResult(
        result=result,
        return_value=dict(result.return_value or {}),
        checkpoint_path=ckpt_path,
        run_dir=run_dir(cfg),
        tokenizer=tokenizer,
        ingest=ingest,
        wall_s=time.perf_counter() - t0,
        warnings=warnings,
    )


def check_checkpoints(cfg: TrainConfig, run_store: Storage) -> list[str]:
    """Before Ray Train reads the run: its corrupt newest checkpoints deregistered and set aside, each
    with one line on the console (training/train/run_checkpoints.py ``preflight``)."""
    import pyarrow.fs as pafs

    path, fs = storage_target(cfg.run.storage_path, run_store)
    say = lambda line: print(f"[train {cfg.run.name}] {line}", file=sys.stderr, flush=True)  # noqa: E731
    return preflight(fs or pafs.LocalFileSystem(), posixpath.join(path, cfg.run.name), say)
