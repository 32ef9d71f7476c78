"""The served demo pool as a session fixture: n = 600, seed 0, served on 127.0.0.1, stopped at teardown.

Rendering 600 rows takes a few seconds, so the generated pool is kept in pytest's cache
(``.pytest_cache/d/demo_pool/<n>_<seed>_<code fingerprint>``, generated under a file lock so concurrent
sessions in one checkout never write it twice) and each session gets its own hard-linked copy in a tmp
dir: its metadata (which carries the session's port) and its server never meet another session's.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.demo.eval_sets import EvalSizes
from pipeline.demo.pool import PoolInfo, code_fingerprint, generate_pool, write_metadata
from pipeline.demo.server import DemoServer, serve_pool

DEMO_N = 600
DEMO_SEED = 0
DEMO_EVAL = EvalSizes(per_class=4, retrieval=16, hierarchy=16)


@dataclass
class DemoPool:
    pool_dir: str
    metadata_path: str
    base_url: str
    truth: pa.Table
    info: PoolInfo
    server: DemoServer

    @property
    def metadata(self) -> pa.Table:
        return pq.read_table(self.metadata_path)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def _cached_pool(request) -> Path | None:
    cache = getattr(request.config, "cache", None)
    if cache is None:  # -p no:cacheprovider
        return None
    root = Path(cache.mkdir("demo_pool"))
    name = f"n{DEMO_N}_s{DEMO_SEED}_{code_fingerprint()}"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for old in root.iterdir():  # pools of older generator code; sessions using them hold links
            if old.is_dir() and old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        generate_pool(root / name, n=DEMO_N, seed=DEMO_SEED, eval_sizes=DEMO_EVAL)
    return root / name


@pytest.fixture(scope="session")
def demo_pool(request, tmp_path_factory):
    pool_dir = tmp_path_factory.mktemp("demo_pool")
    cached = _cached_pool(request)
    if cached is not None:
        ignore = shutil.ignore_patterns("metadata")
        shutil.copytree(cached, pool_dir, copy_function=_link_or_copy, dirs_exist_ok=True, ignore=ignore)
    info = generate_pool(pool_dir, n=DEMO_N, seed=DEMO_SEED, eval_sizes=DEMO_EVAL)  # reuses the copy
    with serve_pool(pool_dir) as server:
        meta = write_metadata(pool_dir, server.base_url)
        truth = pq.read_table(Path(pool_dir) / "truth.parquet")
        yield DemoPool(str(pool_dir), meta, server.base_url, truth, info, server)
