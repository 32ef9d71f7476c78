"""Re-run short-circuit for the build's filters: reuse ``filters.parquet`` and the subset ``.npy`` files of
an earlier run when nothing they are derived from has changed.

A filter's keep mask depends only on the pool's metadata, the filter specs with their parameters and input
files (fastText model, WordNet, synsets, centroids...), and the rows that went on to download; a subset
also on the status table. The *stamp* below fingerprints all of these: the metadata files and every input
file by name, size and modification time (a rewritten file counts as changed), the filter and caption
settings, and a digest of the status table's (uid, status) pairs. The build writes the stamp after the
results, and removes it before it starts writing new ones, so a stamp on disk always describes the files
beside it. The stamp carries ``VERSION``: bump it when a filter's rule changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from pipeline import schema as S
from pipeline.common import storage
from pipeline.common.config import to_dict
from pipeline.common.hashing import splitmix64
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig, FilterConfig
from pipeline.filters.datacomp import uid_hash
from pipeline.filters.language import default_model_path
from pipeline.filters.specs import FilterSpec, needs_language

VERSION = 1
_BATCH_ROWS = 1 << 20


def stamp_path(paths: dict[str, str]) -> str:
    return storage.join(paths["work"], "filters_stamp.json")


def file_stamps(names: list[str], store: Storage) -> list[list[Any]]:
    """``[name, size, mtime_ns]`` of each existing file (a directory: every file under it)."""
    out = []
    for name in sorted(set(names)):
        fs, p = store.resolve(name)
        info = fs.get_file_info(p)
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(p, recursive=True))
        elif info.type == pafs.FileType.File:
            infos = [info]
        else:
            continue
        for i in sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path):
            out.append([i.path, i.size, i.mtime_ns])
    return out


def status_words(table: pa.Table) -> tuple[int, int, int]:
    """(rows, wrapping sum, xor) of a 64-bit hash of each row's (uid, status): the pieces of
    ``status_digest``, which add up over the status table's files in any order."""
    n = table.num_rows
    if n == 0:
        return 0, 0, 0
    words = np.zeros(n, dtype=np.uint64)
    for start in range(0, n, _BATCH_ROWS):  # bounded memory: a million rows at a time
        part = table.slice(start, _BATCH_ROWS)
        uid = uid_hash(pc.fill_null(part.column(S.UID).combine_chunks().cast(pa.string()), ""), 1)
        status = pc.dictionary_encode(pc.fill_null(part.column(S.STATUS).combine_chunks(), ""))
        codes = uid_hash(status.dictionary, 2)[status.indices.to_numpy(zero_copy_only=False)]
        words[start : start + len(uid)] = splitmix64(uid ^ splitmix64(codes))
    with np.errstate(over="ignore"):
        total = int(words.sum(dtype=np.uint64))
    return n, total, int(np.bitwise_xor.reduce(words))


def combine_words(pieces: list[tuple[int, int, int]]) -> str:
    """``status_digest`` of a table from its files' ``status_words``."""
    n = sum(p[0] for p in pieces)
    if n == 0:
        return "0"
    total = sum(int(p[1]) for p in pieces) % (1 << 64)
    xor = 0
    for p in pieces:
        xor ^= int(p[2])
    return f"{n}:{total:016x}:{xor:016x}"


def status_digest(table: pa.Table) -> str:
    """A digest of the (uid, status) pairs as a multiset: rows of one uid may come in any order (the
    status table is sorted by uid only). Per row a 64-bit hash of uid and status, vectorised; the digest is
    their count, wrapping sum and xor."""
    return combine_words([status_words(table)])


def _is_path_key(key: str) -> bool:
    """Settings and spec parameters that name an input file or directory (and nothing else: a relative
    name such as ``metadata`` or ``cld3`` must never be read as a path)."""
    return key.endswith("_file") or key in ("wordnet", "language_model")


def _input_files(filters: FilterConfig, specs: list[FilterSpec]) -> list[str]:
    """The input files the filters read: the path settings and the specs' path parameters."""
    settings = to_dict(filters)
    names = [v for k, v in settings.items() if _is_path_key(k) and isinstance(v, str) and v]
    for spec in specs:
        for _, params in spec.parts:
            names += [v for k, v in params.items() if _is_path_key(k) and isinstance(v, str) and v]
    if needs_language(specs) and not filters.language_model:
        names.append(default_model_path())
    return [n for n in names if n not in ("cld3", "fasttext")]  # laion2b's language_model names a model


def filter_stamp(
    cfg: BuildConfig, specs: list[FilterSpec], status: str | pa.Table, store: Storage
) -> dict[str, Any]:
    """What the filters' results of this run depend on (see the module docstring); ``status``: the status
    table or its ``status_digest``."""
    metadata = store.list_files(cfg.metadata, suffix=".parquet")
    return {
        "version": VERSION,
        "filters": to_dict(cfg.filters),
        "specs": [spec.text or spec.label for spec in specs],
        "max_caption_bytes": cfg.max_caption_bytes,
        "metadata": file_stamps(metadata, store),
        "inputs": file_stamps([n for n in _input_files(cfg.filters, specs) if _exists(n, store)], store),
        "status": status if isinstance(status, str) else status_digest(status),
    }


def _exists(name: str, store: Storage) -> bool:
    try:
        return store.exists(name)
    except (OSError, ValueError):
        return False  # a parameter that is not a path at all


def reusable(stamp: dict[str, Any], paths: dict[str, str], store: Storage) -> dict[str, Any] | None:
    """The earlier run's record (``sizes``, ``subsets``) when its stamp equals ``stamp`` and its files are
    all there; else None."""
    where = stamp_path(paths)
    if not store.exists(where):
        return None
    record = store.read_json(where)
    if record.get("stamp") != stamp:
        return None
    subsets = {name: subset_path(paths, name) for name in record.get("subsets", [])}
    if not all(store.exists(f) for f in [paths["filters"], *subsets.values()]):
        return None
    return {"sizes": record["sizes"], "subsets": subsets}


def subset_path(paths: dict[str, str], name: str) -> str:
    return storage.join(paths["subsets"], f"{name}.npy")


def forget(paths: dict[str, str], store: Storage) -> None:
    """Remove the stamp before results are rewritten: a run stopped halfway leaves no stamp behind."""
    if store.exists(stamp_path(paths)):
        store.remove(stamp_path(paths))


def remember(
    stamp: dict[str, Any], sizes: dict, subsets: dict, paths: dict[str, str], store: Storage
) -> None:
    # Names, not paths: a run directory that was copied or moved must never reach back into the original.
    store.write_json({"stamp": stamp, "sizes": sizes, "subsets": sorted(subsets)}, stamp_path(paths))
