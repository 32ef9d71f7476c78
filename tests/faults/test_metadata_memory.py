"""Failure 3: the metadata's layout multiplied a download actor's memory.

4,000 rows with an extra 150 kB column (a column no stage reads): the actor's peak resident memory was
557 MiB with 250-row groups and 2,369 MiB with one row group, because a part read every column of each
row group covering its rows. A part now reads only the columns it needs, in batches of
``READ_BATCH_ROWS`` rows whatever the row groups, and the peak stays under the documented bound
(``part_memory_bound``: the actor's images in flight plus its rows) in both layouts.

The actor class (``DownloadPart``, what each Ray download actor runs) works in a fresh subprocess, as in
bench/decode_memory.py: its peak is the kernel's high-water mark ``VmHWM``, reset just before the first
part, above its resident size at that moment. One row in 40 downloads a picture from a real HTTP server;
the others point at a private address and are refused without a connection.
"""
# ruff: noqa: F811

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline import schema as S
from pipeline.common.config import to_dict
from pipeline.config import BuildConfig, DownloadConfig
from pipeline.download.part import part_memory_bound
from tests.fixtures.http_server import Route, http_server  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ROWS, EXTRA_BYTES, PART = 4000, 150_000, 1000
MIB = 1 << 20
CFG = BuildConfig(
    part_size=PART,
    max_caption_bytes=256,
    download=DownloadConfig(threads_per_actor=2, max_bytes=256 << 10, max_pixels=1 << 20,
                            decode_pixel_budget=1 << 20, allow_hosts=["127.0.0.1"], timeout_s=10),
)  # fmt: skip


def _child_script(cfg_json: str, meta: str, parts: str) -> str:
    """The actor in its own process: its parts one after another, then its resident sizes."""
    return f"""
import json, re
import numpy as np, pyarrow as pa
from pipeline.common.config import load
from pipeline.config import BuildConfig
from pipeline.common.storage import LOCAL
from pipeline.download.part import DownloadPart
from pipeline.download.phase import PartSpec
from pipeline.stages.layout import Pool

def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024

cfg = load(BuildConfig, json.loads({cfg_json!r}))
pool = Pool({parts!r} + "/stages", ({meta!r},), ({ROWS},), 1, 1, cfg.max_caption_bytes, (), (), LOCAL)
LOCAL.write_bytes(np.arange({ROWS}, dtype="<i8").tobytes(), pool.live(0))  # every row is live
actor = DownloadPart(cfg.download, {parts!r}, "t0", LOCAL, pool)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM restarts from the resident size now
before, statuses = status("VmRSS"), []
for k in range(0, {ROWS}, {PART}):
    statuses += actor.rows(PartSpec(k // {PART}, ((0, k, k + {PART}),))).column("status").to_pylist()
print(json.dumps({{"before": before, "peak": status("VmHWM"), "statuses": statuses}}))
"""


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((48, 64, 3), (200, 60, 40), np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _metadata(path: Path, base_url: str, row_group_size: int) -> str:
    urls = [f"{base_url}/a.jpg" if i % 40 == 0 else f"http://10.0.0.1/{i}.jpg" for i in range(ROWS)]
    extra = [b"%08d" % i + bytes(EXTRA_BYTES - 8) for i in range(ROWS)]  # distinct, compresses well
    table = pa.table(
        {
            S.UID: [f"{i:032x}" for i in range(ROWS)],
            S.URL: urls,
            S.TEXT: [f"caption {i}" for i in range(ROWS)],
            "extra": pa.array(extra, pa.binary()),
        }
    )
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("row_group_size", [ROWS, 250], ids=["one_row_group", "250_row_groups"])
def test_a_part_reads_its_rows_in_bounded_memory_whatever_the_row_groups(
    http_server, tmp_path, row_group_size
) -> None:
    http_server.route("/a.jpg", Route(body=_jpeg()))
    meta = _metadata(tmp_path / "meta.parquet", http_server.url("").rstrip("/"), row_group_size)
    assert pq.ParquetFile(meta).num_row_groups == ROWS // row_group_size
    script = _child_script(json.dumps(to_dict(CFG)), meta, str(tmp_path / "parts"))
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    statuses = got["statuses"]
    assert len(statuses) == ROWS and statuses.count("success") == ROWS // 40
    assert statuses.count(S.STATUS_BLOCKED_ADDRESS) == ROWS - ROWS // 40
    peak, bound = got["peak"] - got["before"], part_memory_bound(CFG)
    print(f"{row_group_size}-row groups: peak {peak / MIB:.0f} MiB above idle, bound {bound / MIB:.0f} MiB")
    assert peak <= bound
