"""Which rows of the pool may enter a build subset, over Arrow columns (no Python object per row).

A row is identified by its uid and ``row_key`` (rows equal in both are interchangeable: same URL and
caption bytes) and looked up with Arrow hash kernels and sorts, so the tables compared here may come in
any row order (the language labels come back from a Ray actor block by block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.source.row_checks import ROW_KEY, one_array, valid_uids


@dataclass
class LiveRows:
    """The rows that went on to download, at most one per uid (a repeated uid's canonical row): their
    uids and row keys as Arrow arrays, and the uids whose status ended as success."""

    uids: pa.Array
    keys: pa.Array
    success: pa.Array

    @classmethod
    def of(cls, narrow: pa.Table, live: np.ndarray, status_table: pa.Table) -> LiveRows:
        """``narrow``: the pool's uid and row_key; ``live``: its rows that went on to download."""
        live = pa.array(live, pa.bool_())
        status = status_table.column(S.STATUS)
        success = pc.filter(status_table.column(S.UID), pc.equal(status, S.STATUS_SUCCESS))
        return cls(
            one_array(pc.filter(narrow.column(S.UID), live)),
            one_array(pc.filter(narrow.column(ROW_KEY), live)),
            one_array(success),
        )

    def rows(self, table: pa.Table) -> np.ndarray:
        """Mask of the rows of ``table`` (uid, row_key) that are a live row."""
        at = pc.index_in(table.column(S.UID), value_set=self.uids)
        same = pc.equal(self.keys.take(at), one_array(table.column(ROW_KEY)))
        return pc.fill_null(same, False).to_numpy(zero_copy_only=False)


def eligible(live: LiveRows, table: pa.Table, live_rows: np.ndarray | None = None) -> np.ndarray:
    """Rows that may enter a subset or the tokenizer: the canonical row of a uid whose status is success."""
    live_rows = live.rows(table) if live_rows is None else live_rows
    ok = pc.is_in(table.column(S.UID), value_set=live.success).to_numpy(zero_copy_only=False)
    return live_rows & ok


def uids_where(table: pa.Table, mask: np.ndarray) -> pa.Array:
    """The distinct uids of the rows in ``mask`` (unordered: a subset file sorts them)."""
    return pc.unique(pc.filter(one_array(table.column(S.UID)), pa.array(mask, pa.bool_())))


def listable(table: pa.Table, live_rows: np.ndarray) -> np.ndarray:
    """Rows a metadata-scope subset may list: one row per valid uid (DataComp lists each uid once; an invalid
    uid has no u8,u8 form) — the row that went on to download when there is one, else the uid's first row.
    Rows equal in uid and row key (interchangeable) are listable together."""
    uids = one_array(table.column(S.UID))
    idx = np.flatnonzero(valid_uids(uids))
    out = np.zeros(len(uids), dtype=bool)
    if not len(idx):
        return out
    rows = pa.array(idx, pa.int64())
    su = uids.take(rows)
    order = pc.sort_indices(su).to_numpy()  # stable: a uid's rows stay in table order
    su = su.take(pa.array(order))
    sk = one_array(table.column(ROW_KEY)).take(rows).take(pa.array(order))
    start = np.ones(len(order), dtype=bool)
    start[1:] = ~pc.equal(su.slice(1), su.slice(0, len(su) - 1)).to_numpy(zero_copy_only=False)
    run = np.cumsum(start) - 1
    pick = np.flatnonzero(start)  # the uid's first row, unless one of its rows is live
    live_at = np.flatnonzero(live_rows[idx[order]])
    pick[run[live_at]] = live_at
    chosen = pc.equal(sk, sk.take(pa.array(pick[run]))).to_numpy(zero_copy_only=False)
    out[idx[order]] = chosen
    return out


def align_labels(meta: pa.Table, tagged: pa.Table) -> pa.Array:
    """``tagged``'s language labels in ``meta``'s row order. Both hold the same rows (two executions of one
    dataset, in any order); rows equal in uid and row key have the same caption, hence the same label."""
    keys = [(S.UID, "ascending"), (ROW_KEY, "ascending")]
    by_meta = pc.sort_indices(meta.select([S.UID, ROW_KEY]), sort_keys=keys).to_numpy()
    by_tag = pc.sort_indices(tagged.select([S.UID, ROW_KEY]), sort_keys=keys)
    inverse = np.empty(len(by_meta), dtype=np.int64)
    inverse[by_meta] = np.arange(len(by_meta))
    return one_array(tagged.column("lang")).take(by_tag).take(pa.array(inverse))
