"""The demo pool as a build source: generate it, serve it on 127.0.0.1 for the duration of a build."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from pipeline.common import storage
from pipeline.config import BuildConfig


class demo_source:
    """Context manager: with ``cfg.metadata`` empty, generate the demo pool, serve it on 127.0.0.1 and
    yield a config pointing at its metadata; the server is stopped on exit."""

    def __init__(self, cfg: BuildConfig, log: Callable[[str], None] = print):
        self.cfg, self.log, self.server = cfg, log, None

    def __enter__(self) -> BuildConfig:
        if self.cfg.metadata:
            return self.cfg
        from pipeline.demo.pool import generate_pool, write_metadata
        from pipeline.demo.server import serve_pool

        pool_dir = storage.join(self.cfg.output, "pool")
        t = time.perf_counter()
        generate_pool(pool_dir, n=self.cfg.demo_n, seed=self.cfg.demo_seed)
        self.server = serve_pool(pool_dir)
        meta = write_metadata(pool_dir, self.server.base_url)
        self.log(
            f"demo pool: {self.cfg.demo_n} rows served at {self.server.base_url} ({time.perf_counter() - t:.1f}s)"
        )
        return dataclasses.replace(self.cfg, metadata=str(meta))

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()
