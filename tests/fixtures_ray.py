"""A private local Ray shared by every ``ray``-marked test, stopped by the fixture that started it."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from jobs.common import loopback_only

    loopback_only(ray)  # the suite's Ray listens on 127.0.0.1 only, like a job's local Ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    # address="local" always starts a new instance: never attach to a cluster someone else runs here.
    ctx = ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=400 * 1024**2,
        log_to_driver=False,
        configure_logging=False,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ctx
    ray.shutdown()  # stops the raylet/GCS processes this init started (its own children, by PID)
