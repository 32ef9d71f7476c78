"""The demo pool as a build source: served on the address it is given, its inputs on S3 for an S3 run."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.common.config import merge
from pipeline.common.storage import Storage
from pipeline.config import BUILD_PRESETS
from pipeline.demo.source import demo_source


@pytest.mark.slow  # renders a 100-row pool (≈6 s)
def test_an_s3_run_gets_its_pool_inputs_on_s3_and_a_one_run_allow_entry(s3_server) -> None:
    store = Storage.from_env(s3_server.endpoint)
    out = s3_server.url("demo-source")
    cfg = merge(BUILD_PRESETS["demo"], {"output": out, "demo_n": 100})
    source = demo_source(cfg, log=lambda m: None, host="127.0.0.1", store=store)
    with source as run_cfg:
        private = source.private_dir
        assert run_cfg.metadata == out + "/pool/metadata/part-00000.parquet"
        assert run_cfg.download.allow_hosts == cfg.download.allow_hosts  # the config stays the user's
        (entry,) = source.allow_hosts
        assert entry == f"127.0.0.1:{source.server.port}"
        with store.open_input(run_cfg.metadata) as fh:
            meta = pq.read_table(fh)
        assert meta.num_rows == 100
        truth = pq.read_table(store.open_input(f"{out}/pool/truth.parquet")).to_pydict()
        ok_row = truth["noise"].index("clean")
        served = meta.column("url")[ok_row].as_py()
        assert served.startswith(f"http://{entry}/")
        with urllib.request.urlopen(served, timeout=10) as resp:  # served from the driver's private copy
            assert resp.status == 200 and resp.read()[:2] == b"\xff\xd8"
        for name in ("truth.parquet", "pool.json"):
            assert store.exists(f"{out}/pool/{name}")
        assert store.list_files(f"{out}/pool/eval/**/*.tar")  # the track's eval root on S3
    assert source.server._thread is None and not Path(private).exists()
