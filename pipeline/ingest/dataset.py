"""The training ingest's Ray side: the training dataset built from our shards, and what its tasks share.

The stages are Ray-free callables elsewhere (pipeline/shards/reader.py reads a shard, pipeline/ingest/transforms.py
shuffles, decodes, augments, masks and collates); this module only wires them into Ray:

- ``build_train_dataset``: read (all of ``data.shards``, or the rows of ``data.subset``:
  pipeline/ingest/subset_reader.py) → windowed shuffle → decode/crop/tokenize, scoped to the data nodes
  (pipeline/common/placement.py); ``train_dataset_config`` carries the same selector into Ray Train's ingest.
- ``IngestCounters``: a small named actor shared by every ingest task (damaged shards, dropped images)
  and by the train loop's progress line (``ProgressPrinter`` on the driver).
- ``RayTrainCollate``: ``TrainCollate`` as the ``NumpyBatchCollateFn`` that ``iter_torch_batches`` expects.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import ray
from ray.data.collate_fn import NumpyBatchCollateFn
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.common.placement import scope_dataset
from pipeline.common.storage import Storage
from pipeline.ingest.subset_reader import SubsetShardReader, load_counts
from pipeline.ingest.transforms import (
    DecodeAugment,
    TrainCollate,
    decode_augment_batch,
    tokenizer_state,
    window_shuffle,
)
from pipeline.shards.ray_reader import ShardDatasource, read_shards
from pipeline.shards.reader import ShardReader, list_shards

# --- the counters actor -------------------------------------------------------------------------------


class IngestCounters:
    """Counts shared by every ingest task (run as a named Ray actor): damaged shards and dropped images;
    also the train loop's latest metrics, so the driver can print progress without worker log streaming."""

    def __init__(self) -> None:
        self.bad_shards: dict[str, str] = {}
        self.bad_image_keys: set[str] = set()  # distinct: a bad picture is met again every epoch
        self.bad_image_examples: list[str] = []
        self.mismatches: dict[str, str] = {}  # "shard key" → members whose stored checksum differs
        self.progress: dict[str, Any] = {}

    def set_progress(self, metrics: dict[str, Any]) -> None:
        """The train loop's latest logged metrics, for the driver's progress line."""
        self.progress = dict(metrics)

    def latest_progress(self) -> dict[str, Any]:
        return self.progress

    def bad_shard(self, path: str, error: str) -> int:
        self.bad_shards.setdefault(path, error)
        return len(self.bad_shards)

    def add_bad_images(self, keys: Sequence[str], examples: Sequence[str]) -> None:
        new = [k for k in keys if k not in self.bad_image_keys]
        self.bad_image_keys.update(keys)
        if new:
            self.bad_image_examples = (self.bad_image_examples + list(examples))[:20]

    def checksum_mismatch(self, path: str, key: str, members: Sequence[str]) -> None:
        self.mismatches.setdefault(f"{path} {key}", "+".join(members))

    def snapshot(self) -> dict[str, Any]:
        return {
            "bad_shards": len(self.bad_shards),
            "bad_shard_paths": sorted(self.bad_shards),
            "bad_images": len(self.bad_image_keys),
            "bad_image_examples": list(self.bad_image_examples),
            "checksum_mismatches": len(self.mismatches),
            "checksum_mismatch_examples": sorted(self.mismatches)[:20],
        }


_LIVE_COUNTERS: dict[str, Any] = {}


def counters_handle(name: str | None) -> Any:
    if not name:
        return None
    try:
        return ray.get_actor(name)
    except ValueError:
        return None


def start_counters(name: str | None = None) -> str:
    """Start the shared ``IngestCounters`` actor and return its name."""
    name = name or f"prolip-ingest-{uuid.uuid4().hex[:12]}"
    # A named actor is still garbage-collected once no handle exists: the driver keeps one. It lives on the
    # driver's node, so a lost worker host (a spot reclaim) does not take the run's counters with it. Hard
    # affinity: a soft one spills a zero-CPU actor off a head started with --num-cpus=0.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0)(IngestCounters).options(name=name, scheduling_strategy=here)
    _LIVE_COUNTERS[name] = actor.remote()
    return name


def stop_counters(name: str | None) -> None:
    """Let the counters actor go (its process would otherwise idle on, one per finished training)."""
    handle = _LIVE_COUNTERS.pop(name, None) if name else None
    if handle is not None:
        ray.kill(handle)


def read_counters(name: str) -> dict[str, Any]:
    handle = counters_handle(name)
    return ray.get(handle.snapshot.remote()) if handle is not None else {}


def publish_progress(name: str | None, metrics: dict[str, Any]) -> None:
    """Fire-and-forget: the loop never waits on the driver's progress line."""
    handle = counters_handle(name)
    if handle is not None:
        handle.set_progress.remote(metrics)


@dataclasses.dataclass(frozen=True)
class BadShardCounter:
    """``ShardReader``'s ``report``: counts a damaged shard in the named actor (1 when it is gone)."""

    counters: str

    def __call__(self, path: str, error: str) -> int:
        handle = counters_handle(self.counters)
        return 1 if handle is None else int(ray.get(handle.bad_shard.remote(path, error)))


@dataclasses.dataclass(frozen=True)
class MismatchCounter:
    """``ShardReader``'s ``on_mismatch`` (``data.verify_checksums``): fire-and-forget, like bad images."""

    counters: str

    def __call__(self, path: str, key: str, members: list[str]) -> None:
        handle = counters_handle(self.counters)
        if handle is not None:
            handle.checksum_mismatch.remote(path, key, members)


@dataclasses.dataclass(frozen=True)
class BadImageCounter:
    """``DecodeAugment``'s ``on_bad_images``: fire-and-forget, decoding never waits on the actor."""

    counters: str

    def __call__(self, keys: list[str], examples: list[str]) -> None:
        handle = counters_handle(self.counters)
        if handle is not None:
            handle.add_bad_images.remote(keys, examples)


class ProgressPrinter:
    """A driver-side thread printing the train loop's latest metrics every ``every_s`` seconds:
    step/total, loss, samples/s and an ETA, so a long run is never silent."""

    def __init__(self, name: str, label: str, every_s: float = 15.0, log: Any = print) -> None:
        self.name, self.label, self.every_s, self.log = name, label, every_s, log
        self._stop = threading.Event()
        self._last_step = -1
        self._thread = threading.Thread(target=self._run, name="train-progress", daemon=True)

    def __enter__(self) -> ProgressPrinter:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            handle = counters_handle(self.name)
            try:
                m = ray.get(handle.latest_progress.remote(), timeout=5) if handle is not None else {}
            except Exception:  # a progress line is best effort; training is unaffected
                continue
            step, total = int(m.get("step", 0)), int(m.get("total_steps", 0))
            if not m or step == self._last_step:
                continue
            self._last_step = step
            rate = float(m.get("samples_per_s", 0.0))
            left = (total - step) * (m.get("samples_seen", 0) / max(step, 1)) / rate if rate > 0 else 0.0
            self.log(
                f"[train {self.label}] step {step}/{total} loss {m.get('loss/total', float('nan')):.4f} "
                f"{rate:.0f} samples/s, data wait {100 * float(m.get('data_wait_fraction', 0.0)):.0f}%, "
                f"~{left:.0f}s left"
            )


# --- training ingest ----------------------------------------------------------------------------------


class SharedSubset:
    """A subset's (sorted distinct uids, counts), loaded by one task into the object store: each node holds
    one copy that its read workers map zero-copy; the driver holds only the reference."""

    def __init__(self, path: str, store: Storage, label_selector: dict[str, str] | None = None) -> None:
        options: dict = {"num_cpus": 0}
        if label_selector:
            options["label_selector"] = {str(k): str(v) for k, v in label_selector.items()}
        self.ref = ray.remote(load_counts).options(**options).remote(path, store)

    def __call__(self) -> tuple[Any, Any]:
        return ray.get(self.ref)


def build_train_dataset(
    data: Any,
    store: Storage,
    tokenizer: Any,
    image_size: int,
    context_length: int,
    counters: str | None = None,
) -> Any:
    """The training ``ray.data.Dataset`` (ingest stages 1–3); stage 4 is ``RayTrainCollate`` in the loop.

    ``data`` is a ``training.config.DataConfig``; ``counters`` the name of a running ``IngestCounters``
    actor (``start_counters()``), else damaged shards and undecodable images are only logged.
    """
    shuffle: Any = (
        "files"
        if data.shuffle_seed is None
        else ray.data.FileShuffleConfig(seed=data.shuffle_seed, reseed_after_execution=True)
    )
    read_cpus = data.read_cpus or data.decode_cpus  # no worker churn: decision 0085
    resample = None  # open_clip's --dataset-resampled: shards drawn with replacement every epoch
    if data.sampling == "resampled":
        resample = (
            data.shuffle_seed
            if data.shuffle_seed is not None
            else int(np.random.SeedSequence().entropy % 2**63)
        )
    report = BadShardCounter(counters) if counters else None
    mismatch = MismatchCounter(counters) if counters else None
    if data.subset:  # the build's shards, filtered to the subset's rows inside each read task
        counts = SharedSubset(data.subset, store, data.label_selector)
        reader = SubsetShardReader(data.subset, store, counts, max_bad_shards=data.max_bad_shards, report=report,
                                   verify=data.verify_checksums, on_mismatch=mismatch)  # fmt: skip
        source = ShardDatasource(list_shards(data.shards, store), reader, resample=resample, shuffle=shuffle)
        ds = ray.data.read_datasource(source, num_cpus=read_cpus)
    else:
        ds = read_shards(
            data.shards, store, report=report, max_bad_shards=data.max_bad_shards, shuffle=shuffle,
            num_cpus=read_cpus, verify=data.verify_checksums, on_mismatch=mismatch, resample=resample,
        )  # fmt: skip
    ds = scope_dataset(ds, data.label_selector)
    if data.shuffle_window > 1:
        ds = ds.map_batches(
            window_shuffle,
            fn_kwargs={"seed": data.shuffle_seed},
            batch_size=data.shuffle_window,
            batch_format="pyarrow",
            num_cpus=read_cpus,
        )
    return ds.map_batches(
        decode_augment_batch,
        fn_kwargs={
            "image_size": image_size,
            "context_length": context_length,
            "tokenizer": tokenizer_state(tokenizer),
            "data": data,
            "on_bad_images": BadImageCounter(counters) if counters else None,
            "seed": data.augment_seed,
        },
        batch_size=data.decode_batch_size,
        batch_format="numpy",
        # decode_tasks=0: no cap, as many tasks as the ingest nodes' free CPUs take (docs/gpu.md sizes them)
        **({"compute": ray.data.TaskPoolStrategy(size=data.decode_tasks)} if data.decode_tasks else {}),
        num_cpus=data.decode_cpus,
    )


def train_dataset_config(selector: Mapping[str, str] | None, preserve_order: bool = False) -> Any:
    """A ``ray.train.DataConfig`` whose ingest keeps ``selector`` (and Ray Data's output order when
    ``preserve_order``), or None (Train's default) when neither is asked for. Ray Train *replaces* the
    dataset's execution options with these, so the selector of ``scope_dataset`` has to travel here too."""
    if not selector and not preserve_order:
        return None
    from ray.train import DataConfig

    options = DataConfig.default_ingest_options()
    if selector:
        options.label_selector = {str(k): str(v) for k, v in selector.items()}
    options.preserve_order = preserve_order
    return DataConfig(execution_options=options)


class RayTrainCollate(NumpyBatchCollateFn):
    """``iter_torch_batches``' ``collate_fn``: Ray Data takes a ``NumpyBatchCollateFn`` to hand it numpy
    batches; the work is ``TrainCollate``'s (pipeline/ingest/transforms.py), which needs no Ray."""

    def __init__(self, collate: TrainCollate) -> None:
        self.collate = collate

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return self.collate(batch)


# --- the exact data position (pipeline/ingest/data_position.py) -------------------------------------------


def position_reader(data: Any, store: Storage) -> ShardReader:
    """The reader whose rows the exact plan counts and each rank reads: every row of a shard, or the
    subset's rows as often as listed. Plain (no counters): a shard counted damaged reads alike each time."""
    if data.subset:
        return SubsetShardReader(data.subset, store, verify=data.verify_checksums)
    return ShardReader(store, verify=data.verify_checksums)


def count_shard_rows(data: Any, store: Storage, paths: Sequence[str]) -> list[int]:
    """Rows of each shard as ``position_reader`` yields them: one Ray task per shard (the driver holds
    one integer per file)."""
    options: dict = {"num_cpus": data.read_cpus or data.decode_cpus}
    if data.label_selector:
        options["label_selector"] = {str(k): str(v) for k, v in data.label_selector.items()}
    task = ray.remote(_count).options(**options)
    return [int(n) for n in ray.get([task.remote(data, store, p) for p in paths])]


def exact_batches(
    data: Any,
    ingest: dict[str, Any],
    mcfg: Any,
    at: tuple[int, int, int],
    split: tuple[int, int, int],
    collate: TrainCollate,
) -> Iterator[dict[str, Any]]:
    """``data.exact_position``: one rank's collated batches of an epoch, read and decoded here (no Ray Data).

    ``ingest``: ``position`` (the plan's shards and counts), ``tokenizer``, ``counters`` (actor name or
    None); ``mcfg`` the model config (image size, context length); ``at`` = (epoch, first step in the
    epoch, its global step); ``split`` = (global batch, world size, rank)."""
    from pipeline.ingest.data_position import decoded_steps, epoch_plan, rank_steps

    (epoch, start, step), (batch, world, rank) = at, split
    plan = epoch_plan(ingest["position"]["counts"], data.shuffle_seed, epoch, data.shuffle_window)
    read = position_reader(data, data.storage.store())
    tables = rank_steps(read, ingest["position"]["shards"], plan, batch, world, rank, start)
    counters = ingest.get("counters")
    decode = DecodeAugment(mcfg.image_size, mcfg.context_length, ingest["tokenizer"], data,
                           on_bad_images=BadImageCounter(counters) if counters else None)  # fmt: skip
    return decoded_steps(tables, decode, collate, (step, rank, data.augment_seed))


def _count(data: Any, store: Storage, path: str) -> int:
    from pipeline.ingest.data_position import count_rows

    return count_rows(position_reader(data, store), path)
