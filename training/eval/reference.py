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


def pictures(tasks: Sequence[Task], store: Storage = LOCAL) -> Iterator[tuple[str, str, bytes]]:
    """(task name, key, encoded picture) of every picture of ``tasks``, in the harness's order."""
    for task in tasks:
        if task.hf_dataset:
            for c, chunk in enumerate(hf_sets.validate_task(task, store)):
                for r in hf_sets.iter_rows(chunk, task.kind, store):
                    if "images" in r:
                        for j, image in enumerate(r["images"]):
                            yield task.name, f"{c}:{r['pos']}:{j}", image
                    else:
                        yield task.name, f"{c}:{r['pos']}", r["image"]
        else:
            for s, shard in enumerate(eval_sets.validate_task(task, store)):
                for r in eval_sets.iter_rows(shard, task.kind, store):
                    yield task.name, f"{s}:{r['pos']}", r["image"]


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


def reference_table(
    tasks: Sequence[Task], store: Storage = LOCAL, checkpoint: str = "", batch: int = 256
) -> pa.Table:
    """The reference of ``tasks`` (module docstring); pictures that do not decode are left out."""
    names, keys, hashes, data = [], [], [], []
    for name, key, image in pictures(tasks, store):
        h = build_phash(image)
        if h is None:
            continue
        names.append(name)
        keys.append(key)
        hashes.append(h)
        data.append(image)
    cols: dict[str, pa.Array] = {
        "task": pa.array(names, pa.string()),
        "key": pa.array(keys, pa.string()),
        "phash": pa.array(hashes, pa.int64()),
    }
    if checkpoint:
        from training.infer.encode import Encoder

        enc = Encoder(checkpoint, store)
        mus = [enc.images(data[a : a + batch])[0] for a in range(0, len(data), batch)]
        mu = np.concatenate(mus) if mus else np.zeros((0, enc.embed_dim), np.float32)
        cols["embedding"] = pa.FixedSizeListArray.from_arrays(
            pa.array(mu.astype(np.float32).reshape(-1)), mu.shape[1]
        )
    return pa.table(cols)


def write_reference(
    tasks: Sequence[Task], out: str, store: Storage = LOCAL, checkpoint: str = ""
) -> dict[str, int]:
    """Write the reference parquet to ``out``; returns pictures per task."""
    table = reference_table(tasks, store, checkpoint)
    store.write_parquet(table, out)
    names, counts = np.unique(np.asarray(table.column("task").to_pylist(), dtype=str), return_counts=True)
    return {str(n): int(c) for n, c in zip(names, counts, strict=True)}
