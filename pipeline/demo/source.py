"""The demo pool as a build source: generate it and serve it on the driver's address for one build.

With ``cfg.metadata`` empty, ``demo_source`` generates the pool, serves it on ``host`` — the address the
download actors reach the driver at: 127.0.0.1 for a job's private local Ray, the head's address on a
cluster — and yields a config pointing at the pool's metadata. ``allow_hosts`` is the one ``host:port``
the build's address guard lets the downloads connect to, for this run only (``pipeline.build.build``
takes it; the run's config and fingerprint stay the user's).

Where the pool lives follows the output. A local output keeps it in ``<output>/pool`` (a re-run reuses
it). An ``s3://`` output means other hosts read the build's inputs: the pool is generated in a private
directory of the driver, served from there, and what tasks and later steps read — the metadata, the eval
sets, ``truth.parquet`` and ``pool.json`` — is uploaded to ``<output>/pool/``; nothing on another host
opens a file of the driver's machine.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Callable

from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage
from pipeline.config import BuildConfig

UPLOADED = ("metadata", "eval", "truth.parquet", "pool.json")  # what a remote output's pool/ holds


class demo_source:
    """Context manager (see the module docstring); the server stops and a private pool directory is
    removed on exit."""

    def __init__(
        self,
        cfg: BuildConfig,
        log: Callable[[str], None] = print,
        host: str = "127.0.0.1",
        store: Storage = LOCAL,
    ):
        self.cfg, self.log, self.host, self.store = cfg, log, host, store
        self.server, self.private_dir = None, None
        self.allow_hosts: list[str] = []

    def __enter__(self) -> BuildConfig:
        if self.cfg.metadata:
            return self.cfg
        from pipeline.demo.pool import generate_pool, write_metadata
        from pipeline.demo.server import serve_pool

        pool_dir = storage.join(self.cfg.output, "pool")
        remote = storage.is_s3(pool_dir)
        local_dir = pool_dir
        if remote:
            self.private_dir = tempfile.mkdtemp(prefix="prolip-demo-pool-")
            local_dir = self.private_dir
        t = time.perf_counter()
        generate_pool(local_dir, n=self.cfg.demo_n, seed=self.cfg.demo_seed)
        self.server = serve_pool(local_dir, host=self.host)
        meta = write_metadata(local_dir, self.server.base_url)
        if remote:
            upload_tree(local_dir, pool_dir, UPLOADED, self.store)
            meta = storage.join(pool_dir, "metadata", os.path.basename(meta))
        self.allow_hosts = [f"{self.server.host}:{self.server.port}"]
        self.log(
            f"demo pool: {self.cfg.demo_n} rows served at {self.server.base_url} "
            f"({time.perf_counter() - t:.1f}s){f'; metadata and eval sets in {pool_dir}' if remote else ''}"
        )
        return dataclasses.replace(self.cfg, metadata=str(meta))

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()
        if self.private_dir is not None:
            shutil.rmtree(self.private_dir, ignore_errors=True)


def upload_tree(local_dir: str, dest: str, names: tuple[str, ...], store: Storage) -> int:
    """Copy the files and directory trees ``names`` of ``local_dir`` to ``dest``; returns the file count."""
    n = 0
    for name in names:
        top = os.path.join(local_dir, name)
        files = (
            [top]
            if os.path.isfile(top)
            else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in sorted(fs)]
        )
        for path in files:
            with open(path, "rb") as fh:
                store.write_bytes(fh.read(), storage.join(dest, os.path.relpath(path, local_dir)))
            n += 1
    return n
