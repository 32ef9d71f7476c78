"""DataComp subset files: the decision of a filter, separate from materialising it (resharding).

Format (DataComp's submission format, read by its ``resharder.py``): a NumPy ``.npy`` holding a 1-D
structured array of dtype ``u8,u8`` — high and low 64 bits of each 128-bit uid — sorted, because the
resharder binary-searches it (``np.searchsorted`` left/right: the count of equal entries is how many
copies of a sample it writes, so repeated uids mean up-sampling). Subsets written from a filter decision
(the build, ``write_subsets``) hold each uid once; ``write_subset`` keeps repeats a caller passes on purpose. ``np.sort`` on this dtype
orders by ``f0`` then ``f1``, i.e. by the 128-bit uid. Like the resharder, ``read_subset`` also accepts a
raw headerless ``u8,u8`` memmap.

Paths are local; for ``s3://`` the caller passes a binary file object (e.g. from ``pipeline.common.storage``).
``write_subsets`` writes filter results (``pipeline.filters.datacomp.FilterResult``) through a ``Storage``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from pipeline.common.errors import InputError
from pipeline.common.storage import Storage
from pipeline.filters.base import FilterResult, repeats
from pipeline.schema import UID, UID_DTYPE, u8pairs_to_uids, uids_to_u8pairs
from pipeline.source.row_checks import valid_uids

_NPY_MAGIC = b"\x93NUMPY"


class SubsetError(InputError, ValueError):
    """A subset file is not DataComp's sorted ``u8,u8`` array; the message names the file."""


def to_subset_array(uids: Sequence[str] | np.ndarray | pa.Array | pa.ChunkedArray) -> np.ndarray:
    """32-hex uids (or an existing ``u8,u8`` array) → the sorted ``u8,u8`` array; repeats kept (DataComp's
    up-sampling: only a caller that means it passes repeats; filter decisions go through ``kept_uids``)."""
    if isinstance(uids, np.ndarray) and uids.dtype == UID_DTYPE:
        pairs = uids.copy()
    else:
        if isinstance(uids, (pa.Array, pa.ChunkedArray)):
            pairs = arrow_u8pairs(uids)
        else:
            pairs = uids_to_u8pairs(list(uids))  # strict: a uid spelled any other way raises, naming it
    return np.sort(pairs.reshape(-1))


_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def arrow_u8pairs(uids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``schema.uids_to_u8pairs`` over an Arrow column, columnar: the hex digits decoded with a lookup
    table, no Python object per uid. As strict: the first uid that is not 32 lowercase hex digits raises."""
    if isinstance(uids, pa.ChunkedArray):
        uids = uids.combine_chunks()
    uids = uids.cast(pa.string())
    ok = valid_uids(uids)
    if not ok.all():
        raise ValueError(
            f"not a uid (32 lowercase hex digits): {uids[int(np.flatnonzero(~ok)[0])].as_py()!r}"
        )
    out = np.empty(len(uids), dtype=UID_DTYPE)
    if not len(uids):
        return out
    fixed = uids.cast(pa.binary(32))
    digits = np.frombuffer(fixed.buffers()[1], np.uint8)[fixed.offset * 32 : (fixed.offset + len(uids)) * 32]
    nibbles = _HEX[digits].reshape(-1, 32)
    raw = ((nibbles[:, 0::2] << 4) | nibbles[:, 1::2]).view(">u8")  # (n, 2): big-endian halves
    out["f0"], out["f1"] = raw[:, 0], raw[:, 1]
    return out


def _is_remote(path: object) -> bool:
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def write_subset(
    uids: Sequence[str] | np.ndarray | pa.Array | pa.ChunkedArray, dest: str | os.PathLike | BinaryIO
) -> int:
    """Write the sorted subset to ``dest`` (a local path, written as named, or a binary file object).
    Returns the number of entries."""
    arr = to_subset_array(uids)
    if hasattr(dest, "write"):
        np.save(dest, arr, allow_pickle=False)
        return len(arr)
    if _is_remote(dest):
        raise SubsetError(
            f"{dest}: pass a binary file object for remote paths (pipeline.common.storage opens one)"
        )
    path = os.fspath(dest)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:  # np.save(path) would append ".npy" to a name without it
        np.save(fh, arr, allow_pickle=False)
    os.replace(tmp, path)  # a reader never sees a half-written subset
    return len(arr)


def read_subset(src: str | os.PathLike | BinaryIO, name: str | None = None) -> np.ndarray:
    """Load and validate a subset: 1-D, dtype ``u8,u8``, sorted. ``name`` labels errors for file objects."""
    label = name or (os.fspath(src) if not hasattr(src, "read") else getattr(src, "name", "<subset stream>"))
    if hasattr(src, "read"):
        data = src.read()
    else:
        if _is_remote(src):
            raise SubsetError(f"{label}: pass a binary file object for remote paths")
        with open(src, "rb") as fh:
            data = fh.read()
    if data[:6] == _NPY_MAGIC:
        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as exc:
            raise SubsetError(f"{label}: not a plain numpy array ({exc})") from exc
    elif len(data) % UID_DTYPE.itemsize == 0:
        arr = np.frombuffer(data, dtype=UID_DTYPE).copy()  # DataComp's raw memmap variant
    else:
        raise SubsetError(f"{label}: neither a .npy file nor a raw u8,u8 array ({len(data)} bytes)")
    validate_subset(arr, label)
    return arr


def validate_subset(arr: np.ndarray, label: str = "subset") -> None:
    if arr.dtype != UID_DTYPE:
        raise SubsetError(f"{label}: dtype {arr.dtype}, expected DataComp's u8,u8 ({UID_DTYPE})")
    if arr.ndim != 1:
        raise SubsetError(f"{label}: expected a 1-D array, got shape {arr.shape}")
    hi, lo = arr["f0"], arr["f1"]
    ordered = (hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] >= lo[:-1]))
    if not ordered.all():
        first = int(np.flatnonzero(~ordered)[0])
        raise SubsetError(f"{label}: not sorted at entry {first + 1} (the resharder binary-searches it)")


def subset_uids(src: str | os.PathLike | BinaryIO) -> list[str]:
    """The 32-hex uids of a subset file, in file (sorted) order, repeats included."""
    return u8pairs_to_uids(read_subset(src))


def kept_uids(
    table: pa.Table | Mapping[str, Any], result: FilterResult, eligible: np.ndarray | None = None
) -> np.ndarray:
    """The sorted distinct uid strings ``result`` keeps (and ``eligible`` allows, e.g. rows that
    downloaded): a uid on two kept rows is listed once, never read as up-sampling. A weighted result
    (``result.count``) lists each kept row ``count`` times: that is up-sampling, by design."""
    col = table.column(UID) if isinstance(table, pa.Table) else table[UID]
    uids = np.asarray(col.to_pylist() if isinstance(col, (pa.Array, pa.ChunkedArray)) else col, dtype=str)
    keep = np.asarray(result.keep, bool) & (True if eligible is None else np.asarray(eligible, bool))
    count = repeats(result)
    if count is not None:
        return np.sort(np.repeat(uids[keep], count[keep]))
    return np.unique(uids[keep])


def write_subsets(
    store: Storage,
    table: pa.Table | Mapping[str, Any],
    results: Mapping[str, FilterResult],
    paths: Mapping[str, str],
    eligible: np.ndarray | None = None,
) -> dict[str, int]:
    """Each result's kept uids as DataComp's sorted ``u8,u8`` ``.npy`` at ``paths[label]``; → sizes."""
    sizes = {}
    for label, result in results.items():
        with store.open_output(paths[label]) as fh:
            sizes[label] = write_subset(kept_uids(table, result, eligible), fh)
    return sizes
