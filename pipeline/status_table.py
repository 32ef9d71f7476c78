"""The status table: every input row's one status, from the decisions made before download
(pipeline/rows.py) and the download parts' rows, with exact and near-duplicate images re-labelled.

Pure functions over Arrow tables; ``pipeline/build.py`` writes the result to ``metadata/status.parquet``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.config import DedupeConfig
from pipeline.dedupe import exact_duplicates, near_duplicates


def decide_image_duplicates(parts: pa.Table, cfg: DedupeConfig) -> np.ndarray:
    """Per part row: its download status, with exact and near duplicates among successes re-labelled."""
    if parts.num_rows == 0:
        return np.zeros(0, dtype=object)
    status = np.array(parts.column(S.STATUS).to_pylist(), dtype=object)
    ok = np.flatnonzero(status == S.STATUS_SUCCESS)
    uids = np.array(parts.column(S.UID).to_pylist(), dtype=object)[ok]
    sha = np.array(parts.column(S.IMAGE_SHA256).to_pylist(), dtype=object)[ok]
    exact = np.asarray(exact_duplicates(uids, sha), dtype=bool)
    status[ok[exact]] = S.STATUS_DUPLICATE_IMAGE
    if cfg.near_duplicates:
        rest = ok[~exact]
        # take() keeps int64: to_numpy() on a column with nulls would turn the hashes into lossy floats.
        ph = parts.column(S.PHASH).take(pa.array(rest, pa.int64()))
        rest_uids = np.array(parts.column(S.UID).to_pylist(), dtype=object)[rest]
        near = np.asarray(near_duplicates(rest_uids, ph, cfg.phash_threshold), dtype=bool)
        status[rest[near]] = S.STATUS_NEAR_DUPLICATE
    return status


def status_table_of(narrow: pa.Table, pre: np.ndarray, parts: pa.Table, part_status: np.ndarray) -> pa.Table:
    """One row per input row: the rows decided before download (``pre`` != "") and every part row."""
    decided = np.flatnonzero(pre != "")
    pre_tab = pa.table(
        {
            S.UID: pc.take(narrow.column(S.UID), pa.array(decided, pa.int64())),
            S.STATUS: pa.array(pre[decided].tolist(), pa.string()),
            "error": pa.array([""] * len(decided), pa.string()),
        }
    )
    if parts.num_rows == 0:
        return pre_tab.sort_by(S.UID)
    errors = parts.column("error") if "error" in parts.column_names else pa.array([""] * parts.num_rows)
    part_tab = pa.table(
        {
            S.UID: parts.column(S.UID),
            S.STATUS: pa.array(part_status.tolist(), pa.string()),
            "error": pc.fill_null(errors.cast(pa.string()), ""),
        }
    )
    extra = [c for c in (S.WIDTH, S.HEIGHT, S.IMAGE_SHA256) if c in parts.column_names]
    for c in extra:
        part_tab = part_tab.append_column(c, parts.column(c))
    return pa.concat_tables([pre_tab, part_tab], promote_options="permissive").sort_by(S.UID)
