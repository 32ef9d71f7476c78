"""Ray batch inference with the one encoder (``training.infer.encode.Encoder``): scoring, embedding extraction
and the evaluation's encoding pass. The model plane's only Ray builder; the stages it maps are Ray-free.

Every pipeline is ``map_batches(Encoder, compute=ActorPoolStrategy(size=num_actors), num_gpus=...)``
(one model per actor, loaded from the checkpoint through the ``Storage`` each actor receives) with a
per-use ``output`` function:

- ``score_shards``: the shards (``pipeline.shards.ray_reader.read_shards``, the one shard reader; damaged shards
  keep their intact samples and are logged) → ``training.infer.scoring.score_columns`` → one parquet part
  per batch, written by the encoding actor that scored it (``ScorePartWriter``), and an index of the parts
  written last by the driver, which receives one summary row per batch and no score row
  (``read_scores`` reads them back sorted by uid).
- ``embed_shards``: the same read → ``embedding_columns`` → ONE parquet written batch by batch in
  arrival order (memory: one batch); its schema is in jobs/embed.py.
- ``encode_items``: items (eval shards and prompt lists) → rows by a Ray-free ``reader`` → encoded
  columns gathered on the driver (eval sets are small; training/eval/run.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, Unpack

import numpy as np
import pyarrow.parquet as pq
import ray

from pipeline.common.storage import LOCAL, Storage
from pipeline.shards.ray_reader import read_shards
from training.infer.encode import BatchOutput, Encoder
from training.infer.scoring import (
    ScorePartWriter,
    ScoreResult,
    clear_scores,
    embedding_columns,
    embedding_table,
    write_score_index,
)

READ_CPUS = 0.25  # logical CPUs per read task of encode_items (reads bytes only)
# Decode threads (and CPUs) of an actor holding a whole GPU, unless cpus_per_actor says: one thread decodes
# ~400 images a second at 224 px (docs/gpu.md), a GPU encodes ViT-B/32 pairs by the thousand; 8 of a p5
# node's 24 vCPUs per GPU feed it ~3,200 a second (docs/cluster.md, "The bill").
GPU_ACTOR_CPUS = 8.0


def cluster_gpus() -> tuple[float, float]:
    """(GPUs the cluster has now, GPUs of its smallest GPU node type the autoscaler may add; 0 for none).

    The second comes from the autoscaler's config as Ray Train and Ray Data 2.60 read it
    (``ray._private.state``; no config, as on a laptop: 0)."""
    now = float(ray.cluster_resources().get("GPU", 0))
    try:
        from ray._private import state

        config = state.state.get_cluster_config()
        groups = config.node_group_configs if config is not None else []
        per_node = [float(g.resources.get("GPU", 0)) for g in groups if g.resources.get("GPU", 0) > 0]
    except Exception:  # noqa: BLE001 (a private API: when it moves, fall back to what is up now)
        per_node = []
    return now, min(per_node, default=0.0)


def gpu_pool(num_actors: int | None, num_gpus: float | None) -> tuple[int, float]:
    """An encoding pool's (actors, GPUs per actor) with the unset ones (None) taken from the cluster: one
    GPU per actor where the cluster has GPUs or its autoscaler can add a GPU node, else none; one actor per
    GPU up now, or per GPU of the node an autoscaler adds first, else one. Needs Ray initialised when a
    value is unset."""
    if num_actors is not None and num_gpus is not None:
        return num_actors, num_gpus
    now, node = cluster_gpus()
    if num_gpus is None:
        num_gpus = 1.0 if now or node else 0.0
    if num_actors is None:
        num_actors = max(1, int((now or node) // num_gpus)) if num_gpus else 1
    return num_actors, num_gpus


class PoolOptions(TypedDict, total=False):
    """The encoding actor pool: ``num_actors`` models, ``num_gpus`` and ``cpus_per_actor`` each (one
    decode thread per CPU; unset: 1, or ``GPU_ACTOR_CPUS`` a whole GPU), ``batch_size`` rows per call (0
    GPUs on CPU-only clusters: a GPU request there waits forever)."""

    num_actors: int
    num_gpus: float
    batch_size: int
    cpus_per_actor: float


def encode_dataset(
    ds: Any,
    checkpoint: str,
    store: Storage = LOCAL,
    *,
    output: BatchOutput | None = None,
    amp: bool | None = None,
    **pool: Unpack[PoolOptions],
) -> Any:
    """``ds.map_batches(Encoder)`` on an actor pool, one model per actor; rows go through ``output``."""
    num_gpus = float(pool.get("num_gpus", 0.0))
    cpus = float(pool.get("cpus_per_actor") or (max(1.0, GPU_ACTOR_CPUS * num_gpus) if num_gpus else 1.0))
    batch_size = int(pool.get("batch_size", 256))
    threads = max(1, int(cpus))
    return ds.map_batches(
        Encoder,
        fn_constructor_kwargs={
            "checkpoint": checkpoint,
            "store": store,
            "device": "cuda" if num_gpus > 0 else "cpu",
            "batch_size": batch_size,
            "threads": threads,
            "decode_threads": threads,
            "amp": amp,
            "output": output,
        },
        compute=ray.data.ActorPoolStrategy(size=max(1, int(pool.get("num_actors", 1)))),
        num_gpus=num_gpus,
        num_cpus=cpus,
        batch_size=batch_size,
        batch_format="numpy",
    )


def _encoded_shards(
    shards: str | Sequence[str], checkpoint: str, store: Storage, output: BatchOutput, pool: PoolOptions
) -> Any:
    return encode_dataset(
        read_shards(shards, store, with_json=True), checkpoint, store, output=output, **pool
    )


def score_shards(
    shards: str | Sequence[str],
    checkpoint: str,
    out: str,
    *,
    store: Storage = LOCAL,
    **pool: Unpack[PoolOptions],
) -> ScoreResult:
    """Score every pair of ``shards`` into the directory ``out``: SCORE_COLUMNS parts written by the actors
    and their index (``training.infer.scoring.read_scores`` reads them, sorted by uid)."""
    t0 = time.perf_counter()
    clear_scores(out, store)
    writer = ScorePartWriter(out, store, uuid.uuid4().hex[:8])
    ds = _encoded_shards(shards, checkpoint, store, writer, pool)
    files, rows, failed = [], 0, 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        files += [str(f) for f in batch["file"]]
        rows += int(np.asarray(batch["rows"]).sum())
        failed += int(np.asarray(batch["failed"]).sum())
    write_score_index(out, files, rows, failed, store)
    wall = time.perf_counter() - t0
    return ScoreResult(out, rows, failed, wall, rows / max(wall, 1e-9))


def embed_shards(
    shards: str | Sequence[str],
    checkpoint: str,
    out: str,
    *,
    store: Storage = LOCAL,
    **pool: Unpack[PoolOptions],
) -> ScoreResult:
    """Write the embeddings parquet (see ``jobs.embed`` for its schema) of every pair of ``shards``."""
    t0 = time.perf_counter()
    ds = _encoded_shards(shards, checkpoint, store, embedding_columns, pool)
    n_rows = n_failed = 0
    writer = None
    with store.open_output(out) as fh:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            table = embedding_table(batch)
            if writer is None:
                meta = {"checkpoint": checkpoint, "columns": ",".join(table.column_names)}
                writer = pq.ParquetWriter(fh, table.schema.with_metadata(meta))
            writer.write_table(table)
            n_rows += table.num_rows
            n_failed += int((~np.asarray(batch["ok"], bool)).sum())
        if writer is None:
            raise FileNotFoundError(f"embed: no samples in {shards!r}")
        writer.close()
    wall = time.perf_counter() - t0
    return ScoreResult(out, n_rows, n_failed, wall, n_rows / max(wall, 1e-9))


def encode_items(
    items: list[dict[str, Any]],
    reader: Callable[[dict[str, Any]], list[dict[str, Any]]],
    checkpoint: str,
    store: Storage = LOCAL,
    *,
    output: BatchOutput | None = None,
    amp: bool | None = None,
    **pool: Unpack[PoolOptions],
) -> list[dict[str, np.ndarray]]:
    """One read task per item (``reader``: item → rows for ``Encoder``), encoded on one actor pool;
    the encoded batches, gathered on the driver in arrival order."""
    # The read tasks only read bytes (the Encoder decodes), so they reserve a quarter CPU (the training
    # ingest's reads take the decode's, decision 0085): at Ray's default of one, an eval beside a half-CPU
    # training on 2 CPUs would hold its encoder actor with no CPU left for a read task until the training
    # ended (docs/decisions/0007-subset-models-two-at-a-time.md).
    ds = ray.data.from_items(items, override_num_blocks=len(items)).flat_map(reader, num_cpus=READ_CPUS)
    encoded = encode_dataset(ds, checkpoint, store, output=output, amp=amp, **pool)
    return list(encoded.iter_batches(batch_size=None, batch_format="numpy"))
