"""Eval sets in the Hugging Face ``datasets`` cache, where DataComp's ``download_evalsets.py`` puts its
retrieval sets (Flickr30k 1k, MSCOCO 5k) and WinoGAViL.

DataComp loads them with ``datasets.load_dataset("nlphuji/<name>", split="test",
cache_dir=<eval root>/hf_cache)``, which prepares each set once as Arrow files inside the cache::

    <eval root>/hf_cache/nlphuji___<name>/<config>/<version>/<hash>/<name>-test.arrow
                                                                  (or <name>-test-00000-of-00002.arrow …)
    <eval root>/hf_cache/downloads/extracted/<hash>/…/*.jpg      (images of sets prepared from a script)

``jobs.fetch`` puts the hub's parquet files of a set's test split in the same layout (``<config>/0.0.0/hub/
<name>-test[-NNNNN-of-NNNNN].parquet``), read the same way. The Arrow files are IPC streams. An ``Image`` column is a struct ``{bytes, path}``: sets prepared by a
loading script (the ``datasets`` 2.x that DataComp pins) keep only ``path``, an absolute path into the
cache's ``downloads/extracted``; sets converted to parquet on the hub embed ``bytes``. A path that no longer
exists (a cache copied to another machine or bucket) is looked up again under this cache's ``downloads/``.
Columns read: retrieval sets ``image`` and ``caption`` (a list of captions per image); WinoGAViL
``candidate_images`` (a list of images), ``cue``, ``candidates`` and ``associations`` (the candidates that
go with the cue). When the cache holds several prepared copies of a set, the last in path order is read.

A task names its set with ``hf_dataset`` (``nlphuji/flickr_1k_test_image_text_retrieval``) and its ``path``
is the cache directory. Rows are served in chunks (``path#start:stop``), the unit of one Ray read task.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from training.eval.sets import EvalSetError, Task

CHUNK_ROWS = 256
COLUMNS = {
    "retrieval": ("image", "caption"),
    "association": ("candidate_images", "cue", "candidates", "associations"),
}


def dataset_dir(task: Task) -> str:
    """``<cache>/<namespace>___<name>``: where ``datasets`` prepares the set."""
    return storage.join(task.path, task.hf_dataset.replace("/", "___"))


def arrow_files(task: Task, store: Storage = LOCAL) -> list[str]:
    """The test split's Arrow files of one prepared copy (its shards in order); [] when absent."""
    name = re.escape(task.hf_dataset.rsplit("/", 1)[-1])
    split = re.compile(rf"^{name}-test(-\d+-of-\d+)?\.(arrow|parquet)$")
    found = store.list_files(storage.join(dataset_dir(task), "**", "*"))
    files = [f for f in found if split.match(_base(f))]
    if not files:
        return []
    last = max(f.rsplit("/", 1)[0] for f in files)
    return sorted(f for f in files if f.rsplit("/", 1)[0] == last)


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def read_table(path: str, store: Storage = LOCAL) -> pa.Table:
    """One ``datasets`` Arrow file (IPC stream; the IPC file format is read too), or a hub parquet file."""
    if path.endswith(".parquet"):
        try:
            with store.open_input(path) as fh:
                return pq.read_table(fh)
        except (pa.ArrowInvalid, OSError) as e:
            raise EvalSetError(f"{path}: not a parquet file: {e}") from e
    source = pa.memory_map(path) if not storage.is_s3(path) else pa.py_buffer(store.read_bytes(path))
    try:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise EvalSetError(f"{path}: not a datasets Arrow file: {e}") from e


def validate_task(task: Task, store: Storage = LOCAL) -> list[str]:
    """Check the set (files, columns, a first row) before any Ray work; returns its row chunks."""
    files = arrow_files(task, store)
    if not files:
        raise EvalSetError(
            f"eval set {task.name}: no {task.hf_dataset} test split under {dataset_dir(task)}/ "
            "(DataComp's download_evalsets.py puts it there)"
        )
    chunks = []
    for f in files:
        table = read_table(f, store)
        lacking = [c for c in COLUMNS[task.kind] if c not in table.column_names]
        if lacking:
            raise EvalSetError(f"{f}: no column {', '.join(lacking)} ({task.kind} set {task.hf_dataset})")
        chunks += [
            f"{f}#{a}:{min(a + CHUNK_ROWS, table.num_rows)}" for a in range(0, table.num_rows, CHUNK_ROWS)
        ]
    if not chunks:
        raise EvalSetError(f"eval set {task.name}: {files[0]} holds no row")
    return chunks


def cue_prompt(cue: str) -> str:
    """WinoGAViL's text for a cue, as DataComp builds it: lower case, "An " before a vowel, else "A "."""
    cue = cue.lower()
    return ("An " if cue[:1] in "aeiou" and cue else "A ") + cue


def _image(value: Any, cache: str, store: Storage) -> bytes:
    """Bytes of one ``Image`` cell: embedded bytes, else its file (re-rooted under ``cache`` if moved)."""
    if not isinstance(value, dict):
        return b""
    if value.get("bytes"):
        return bytes(value["bytes"])
    path = value.get("path") or ""
    if path and not store.exists(path) and "/downloads/" in path:
        path = storage.join(cache, path[path.index("/downloads/") + 1 :])
    try:
        return store.read_bytes(path) if path else b""
    except OSError:
        return b""  # counted as undecodable, like a bad image in a shard


def iter_rows(
    chunk: str, kind: str, store: Storage = LOCAL, limit: int | None = None
) -> Iterator[dict[str, Any]]:
    """Rows of one chunk ``file#start:stop`` in order, at most ``limit``; ``pos`` is the row's index in
    the chunk. Retrieval: ``image`` bytes and ``captions`` ("\\n"-joined). Association: ``images``
    (candidate bytes), ``truth`` (is each candidate an association) and ``cue`` (the prompt)."""
    path, rows = chunk.rsplit("#", 1)
    start, stop = (int(x) for x in rows.split(":"))
    cache = path[: path.index("___")].rsplit("/", 1)[0]
    table = read_table(path, store).slice(start, stop - start).select(list(COLUMNS[kind]))
    for pos, row in enumerate(table.to_pylist()):
        if limit is not None and pos >= limit:
            return
        if kind == "retrieval":
            caps = [" ".join(str(c).split()) for c in (row["caption"] or [])]
            yield {"pos": pos, "image": _image(row["image"], cache, store), "captions": "\n".join(caps)}
        else:
            truth = set(row["associations"] or [])
            yield {
                "pos": pos,
                "images": [_image(v, cache, store) for v in row["candidate_images"] or []],
                "truth": [c in truth for c in row["candidates"] or []],
                "cue": cue_prompt(str(row["cue"])),
            }
