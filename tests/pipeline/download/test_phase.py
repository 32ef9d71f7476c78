"""The driver's side of the download parts, without Ray: which committed parts a late retry pass owes, and
which failed part calls go to another actor."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline import schema as S
from pipeline.common.errors import InputError, StorageError
from pipeline.common.storage import LOCAL
from pipeline.config import BuildConfig, DownloadConfig
from pipeline.download.phase import LivePlan, PartSpec, _LatePasses, _storage_out_of_reach
from pipeline.source import run_state as R

TIMEOUT = S.failed_download("timeout")


def _part(parts: str, part: int, token: str, statuses: list[str]) -> dict[str, int]:
    """Part ``part``'s files under ``token``: rows u{part}{i} with ``statuses``; its counts back."""
    summary = pa.table({S.UID: [f"u{part}{i}" for i in range(len(statuses))], S.STATUS: statuses})
    LOCAL.write_parquet(summary, R.part_file(parts, part, token, "parquet"))
    LOCAL.write_bytes(b"", R.part_file(parts, part, token, "tar"))
    return {"rows": len(statuses), "success": statuses.count(S.STATUS_SUCCESS),
            "transient": sum(map(S.is_transient, statuses)), "fetched": len(statuses)}  # fmt: skip


def test_a_late_pass_is_owed_by_each_part_with_transient_rows_until_its_marker_counts_it(tmp_path):
    parts = str(tmp_path / "parts")
    LOCAL.makedirs(parts)
    cfg = BuildConfig(metadata="m", output=str(tmp_path), part_size=2)
    _part(parts, 0, "a0", [S.STATUS_SUCCESS, TIMEOUT])
    R.commit(parts, 0, "a0", LOCAL, transient=1, late=1)  # its pass is done
    _part(parts, 1, "a1", [S.STATUS_SUCCESS, S.STATUS_SUCCESS])
    R.commit(parts, 1, "a1", LOCAL, transient=0)  # nothing to fetch again: its parquet is not read
    _part(parts, 2, "a2", [S.failed_download("http_503"), S.failed_download("http_404")])
    LOCAL.write_bytes(b"{}", f"{parts}/{R.Marker('a2', None, 0).name(2)}")  # a marker with no counts
    markers = R.committed_markers(parts, LOCAL)
    assert markers == {0: R.Marker("a0", 1, 1), 1: R.Marker("a1", 0, 0), 2: R.Marker("a2", None, 0)}

    plan = LivePlan(pool=None, live=(6,))
    late = _LatePasses(plan, cfg, LOCAL, {"parts": parts}, markers, lambda m: None)
    assert late.due() == [2]  # a marker that does not count its transient rows owes its pass
    summary = _part(parts, 3, "b3", [S.STATUS_SUCCESS, TIMEOUT])  # a part this run downloads
    late.commit(PartSpec(3, ()), "b3", summary)
    assert late.due() == [2, 3]
    assert R.committed_markers(parts, LOCAL)[3] == R.Marker("b3", 1, 0)

    late.passes = 1  # in a late pass, a committed part counts one pass more
    late.commit(PartSpec(3, (), "b3", "transient"), "c3", _part(parts, 3, "c3", [S.STATUS_SUCCESS, TIMEOUT]))
    assert R.committed_markers(parts, LOCAL)[3] == R.Marker("c3", 1, 1, seq=1)
    assert late.due() == [2]  # still transient, but its one pass is spent
    assert [s.part for s in late.next_pass()] == [2]
    off = _LatePasses(plan, BuildConfig(metadata="m", output="o", download=DownloadConfig(late_retries=0)), LOCAL,
                      {"parts": parts}, markers, lambda m: None)  # fmt: skip
    assert off.due() == []


@pytest.mark.parametrize(
    ("exc", "elsewhere"),
    [
        (OSError("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7"), True),
        (ConnectionRefusedError(111, "Connection refused"), True),
        (StorageError("s3://b/x: Could not connect"), True),
        (FileNotFoundError(2, "No such file", "meta/part-0.parquet"), False),
        (InputError("meta/part-0.parquet: not found"), False),
        (ValueError("a bug"), False),
        (None, False),
    ],
)
def test_a_part_that_could_not_reach_storage_goes_to_another_actor(exc, elsewhere):
    assert _storage_out_of_reach(exc) is elsewhere
