"""The status table: every input row's one status, from the decisions made before download
(pipeline/source/row_checks.py) and the download parts' rows, with exact and near-duplicate images re-labelled.

Pure functions over Arrow tables, columnar throughout (no Python object per row: at DataComp scale the
parts hold ~10⁷ rows); ``pipeline/build.py`` writes the result to ``metadata/status.parquet``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.config import DedupeConfig
from pipeline.dedup.decisions import exact_duplicates, near_duplicates


def _relabel(status: pa.Array, rows: np.ndarray, label: str) -> pa.Array:
    """``status`` with the positions ``rows`` set to ``label``."""
    if not len(rows):
        return status
    mask = np.zeros(len(status), dtype=bool)
    mask[rows] = True
    return pc.if_else(pa.array(mask), pa.scalar(label, pa.string()), status)


def decide_image_duplicates(parts: pa.Table, cfg: DedupeConfig) -> pa.Array:
    """Per part row: its download status, with exact and near duplicates among successes re-labelled."""
    if parts.num_rows == 0:
        return pa.array([], pa.string())
    status = parts.column(S.STATUS).combine_chunks().cast(pa.string())
    ok = np.flatnonzero(
        pc.fill_null(pc.equal(status, S.STATUS_SUCCESS), False).to_numpy(zero_copy_only=False)
    )
    uids = parts.column(S.UID).combine_chunks()
    ok_idx = pa.array(ok, pa.int64())
    exact = np.asarray(
        exact_duplicates(uids.take(ok_idx), parts.column(S.IMAGE_SHA256).take(ok_idx)), dtype=bool
    )
    status = _relabel(status, ok[exact], S.STATUS_DUPLICATE_IMAGE)
    if cfg.near_duplicates:
        rest = pa.array(ok[~exact], pa.int64())
        # take() keeps int64: to_numpy() on a column with nulls would turn the hashes into lossy floats.
        near = np.asarray(
            near_duplicates(uids.take(rest), parts.column(S.PHASH).take(rest), cfg.phash_threshold),
            dtype=bool,
        )
        status = _relabel(status, ok[~exact][near], S.STATUS_NEAR_DUPLICATE)
    return status


def status_table_of(narrow: pa.Table, pre: np.ndarray, parts: pa.Table, part_status: pa.Array) -> pa.Table:
    """One row per input row: the rows decided before download (``pre`` != "") and every part row."""
    rows = np.flatnonzero(pre != "")
    decided = pa.array(rows, pa.int64())
    pre_tab = pa.table(
        {
            S.UID: pc.take(narrow.column(S.UID), decided),
            S.STATUS: pa.array(pre[rows], pa.string()),
            "error": pa.nulls(len(decided), pa.string()).fill_null(""),
        }
    )
    if parts.num_rows == 0:
        return pre_tab.sort_by(S.UID)
    errors = parts.column("error") if "error" in parts.column_names else pa.nulls(parts.num_rows, pa.string())
    part_tab = pa.table(
        {
            S.UID: parts.column(S.UID),
            S.STATUS: part_status,
            "error": pc.fill_null(errors.cast(pa.string()), ""),
        }
    )
    extra = [
        c for c in (S.WIDTH, S.HEIGHT, S.IMAGE_SHA256, S.DUPLICATE_OF, S.LEAK_OF) if c in parts.column_names
    ]
    for c in extra:
        part_tab = part_tab.append_column(c, parts.column(c))
    return pa.concat_tables([pre_tab, part_tab], promote_options="permissive").sort_by(S.UID)
