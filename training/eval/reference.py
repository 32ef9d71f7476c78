"""The eval reference a build is decontaminated against: every picture of a task list, read the way the
harness reads it (clip_benchmark webdataset shards, DataComp's Hugging Face caches), as one parquet of
``task``, ``key``, ``phash`` and, with a checkpoint, ``embedding``.

``decontam.reference`` of the build (pipeline/dedup/curation_stage.py) takes this file; the demo pool writes
its own (pipeline/demo/planted.py). The pHash is the build's (pipeline/dedup/phash.py) of the picture
downscaled to the build's longest side of 512; the embedding, when a checkpoint is given, is its image μ
from the one batch encoder, which must then be the model whose embeddings the pool's are (e.g. an
imported open_clip L/14 for DataComp's ``l14_img``). ``key`` is ``<shard>:<position>`` (or
``<chunk>:<position>:<candidate>`` for an association game's pictures), stable for a set on disk.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
from PIL import Image

from pipeline.common.storage import LOCAL, Storage
from pipeline.dedup.phash import phash64
from training.eval import hf_sets
from training.eval import sets as eval_sets
from training.eval.sets import Task

BUILD_MAX_SIDE = 512  # DownloadConfig.image_size: what the build hashes


def parts(tasks: Sequence[Task], store: Storage = LOCAL) -> list[tuple[Task, int, str]]:
    """(task, index, shard or row chunk) of every part of ``tasks``, in the harness's order: the unit one
    worker reads (each set checked first, on the caller)."""
    out = []
    for task in tasks:
        found = (
            hf_sets.validate_task(task, store) if task.hf_dataset else eval_sets.validate_task(task, store)
        )
        out += [(task, i, part) for i, part in enumerate(found)]
    return out


def part_pictures(task: Task, i: int, part: str, store: Storage = LOCAL) -> Iterator[tuple[str, bytes]]:
    """(key, encoded picture) of every picture of one part, in order."""
    if task.hf_dataset:
        for r in hf_sets.iter_rows(part, task.kind, store):
            if "images" in r:
                for j, image in enumerate(r["images"]):
                    yield f"{i}:{r['pos']}:{j}", image
            else:
                yield f"{i}:{r['pos']}", r["image"]
    else:
        for r in eval_sets.iter_rows(part, task.kind, store):
            yield f"{i}:{r['pos']}", r["image"]


def pictures(tasks: Sequence[Task], store: Storage = LOCAL) -> Iterator[tuple[str, str, bytes]]:
    """(task name, key, encoded picture) of every picture of ``tasks``, in the harness's order."""
    for task, i, part in parts(tasks, store):
        for key, image in part_pictures(task, i, part, store):
            yield task.name, key, image


def build_phash(data: bytes) -> int | None:
    """The build's pHash of an encoded picture (None when it does not decode)."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError):
        return None
    image = image.convert("RGB")
    w, h = image.size
    if max(w, h) > BUILD_MAX_SIDE:
        scale = BUILD_MAX_SIDE / max(w, h)
        image = image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BOX)
    return phash64(image)


def part_table(
    task: Task, i: int, part: str, store: Storage = LOCAL, encoder=None, batch: int = 256
) -> pa.Table:
    """One part's reference rows (``task``, ``key``, ``phash``; ``embedding`` with an ``encoder``): the
    pictures are hashed as they are read and encoded ``batch`` at a time, so at most a batch's bytes are
    held; pictures that do not decode are left out."""
    keys, hashes, mus, held = [], [], [], []
    for key, image in part_pictures(task, i, part, store):
        h = build_phash(image)
        if h is None:
            continue
        keys.append(key)
        hashes.append(h)
        if encoder is not None:
            held.append(image)
            if len(held) == batch:
                mus.append(encoder.images(held)[0])
                held = []
    cols: dict[str, pa.Array] = {
        "task": pa.array([task.name] * len(keys), pa.string()),
        "key": pa.array(keys, pa.string()),
        "phash": pa.array(hashes, pa.int64()),
    }
    if encoder is not None:
        if held:
            mus.append(encoder.images(held)[0])
        mu = np.concatenate(mus) if mus else np.zeros((0, encoder.embed_dim), np.float32)
        cols["embedding"] = pa.FixedSizeListArray.from_arrays(
            pa.array(mu.astype(np.float32).reshape(-1)), mu.shape[1]
        )
    return pa.table(cols)


def reference_table(
    tasks: Sequence[Task], store: Storage = LOCAL, checkpoint: str = "", batch: int = 256
) -> pa.Table:
    """The reference of ``tasks`` (module docstring), one part after the other in this process (the Ray
    Data pass over the parts is ``reference_dataset.build_reference``)."""
    encoder = None
    if checkpoint:
        from training.infer.encode import Encoder

        encoder = Encoder(checkpoint, store)
    tables = [part_table(t, i, part, store, encoder, batch) for t, i, part in parts(tasks, store)]
    return pa.concat_tables(tables) if tables else empty_reference(bool(checkpoint))


def empty_reference(embedding: bool, dim: int = 0) -> pa.Table:
    cols = {
        "task": pa.array([], pa.string()),
        "key": pa.array([], pa.string()),
        "phash": pa.array([], pa.int64()),
    }
    if embedding:
        cols["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array([], pa.float32()), max(dim, 1))
    return pa.table(cols)


def reference_counts(table: pa.Table) -> dict[str, int]:
    """Pictures per task of a reference table."""
    names, counts = np.unique(np.asarray(table.column("task").to_pylist(), dtype=str), return_counts=True)
    return {str(n): int(c) for n, c in zip(names, counts, strict=True)}


def save_reference(table: pa.Table, out: str, store: Storage = LOCAL) -> dict[str, int]:
    """Write a reference table (built serially or on the cluster) to ``out``; returns pictures per task."""
    store.write_parquet(table, out)
    return reference_counts(table)
