"""What every filter returns and reads: ``FilterResult`` (a keep mask with a reason per row) and column access.

DataComp's contract: a filter decides, it never drops rows itself. ``from_drops`` and ``intersect`` build
results from rules; ``table_column`` reads one column of a ``pyarrow.Table`` or a dict of arrays and names
the filter when the column is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.common.errors import InputError

Table = pa.Table | Mapping[str, Any]
LANG = "lang"  # optional precomputed column of fastText labels


class FilterError(InputError, ValueError):
    """A filter cannot run: unknown name, missing column or missing input file; the message names it."""


class FilterResult(NamedTuple):
    """What every filter returns (DataComp's contract: a filter decides, it never drops rows itself)."""

    keep: np.ndarray  # (n,) bool
    reason: np.ndarray  # (n,) object: "" where kept, else why dropped

    def counts(self) -> dict[str, int]:
        """Rows per reason, "kept" for the kept ones: the one group-by the stats come from."""
        values, counts = np.unique(np.asarray(self.reason, dtype=str), return_counts=True)
        return {("kept" if v == "" else v): int(c) for v, c in zip(values, counts, strict=True)}


class WeightedResult(FilterResult):
    """A ``FilterResult`` whose kept rows are listed ``repeat`` times: a weighted subset repeats rows
    (DataComp's subset files up-sample a repeated uid). Still unpacks as ``keep, reason``."""

    def __new__(cls, keep: np.ndarray, reason: np.ndarray, repeat: np.ndarray) -> WeightedResult:
        self = super().__new__(cls, keep, reason)
        self.repeat = np.asarray(repeat, dtype=np.int64)  # (n,): 0 where dropped
        return self


def repeats(result: FilterResult) -> np.ndarray | None:
    """How often each row is listed (a ``WeightedResult``'s ``repeat``), or None: once per kept row."""
    return getattr(result, "repeat", None)


def from_drops(n: int, drops: list[tuple[np.ndarray, str]]) -> FilterResult:
    """Reason = the first failing rule, in the order given."""
    reason = np.full(n, "", dtype=object)
    dropped = np.zeros(n, dtype=bool)
    for mask, why in drops:
        take = np.asarray(mask, dtype=bool) & ~dropped
        reason[take] = why
        dropped |= take
    return FilterResult(keep=~dropped, reason=reason)


def intersect(*results: FilterResult) -> FilterResult:
    """Keep = AND of all; reason = the first failing result's reason, in argument order."""
    if not results:
        raise ValueError("intersect needs at least one FilterResult")
    n = len(results[0].keep)
    if any(len(r.keep) != n for r in results):
        raise ValueError("intersect: results cover different numbers of rows")
    reason = np.full(n, "", dtype=object)
    dropped = np.zeros(n, dtype=bool)
    for r in results:
        take = ~np.asarray(r.keep, dtype=bool) & ~dropped
        reason[take] = r.reason[take]
        dropped |= take
    counts = [repeats(r) for r in results if repeats(r) is not None]
    if counts:  # the weighted part's repeats, on the rows every part keeps
        return WeightedResult(~dropped, reason, np.where(dropped, 0, counts[0]))
    return FilterResult(keep=~dropped, reason=reason)


# --- column access ------------------------------------------------------------------------------------


def num_rows(table: Table) -> int:
    if isinstance(table, pa.Table):
        return table.num_rows
    return len(next(iter(table.values()))) if table else 0


def table_column(table: Table, name: str, filt: str) -> pa.Array:
    names = table.column_names if isinstance(table, pa.Table) else list(table)
    if name not in names:
        raise FilterError(f"filter {filt!r} needs column {name!r}; the table has {sorted(names)}")
    col = table.column(name) if isinstance(table, pa.Table) else table[name]
    if isinstance(col, pa.ChunkedArray):
        return col.combine_chunks()
    if isinstance(col, pa.Array):
        return col
    arr = np.asarray(col)
    return pa.array(arr.tolist() if arr.dtype.kind in "OUS" else arr, from_pandas=True)


def float_column(table: Table, name: str, filt: str) -> np.ndarray:
    """Float column with NaN for nulls (an all-null column arrives as Arrow type null)."""
    col = table_column(table, name, filt)
    return pc.fill_null(col.cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False)
