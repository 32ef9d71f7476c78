"""Shared fixtures (each lives in a ``tests/fixtures/`` module) and marker handling."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Session fixtures are imported here only: one a test module imports itself is built again for that module.
from tests.fixtures.checkpoints import clip_checkpoint, tiny_checkpoint  # noqa: E402,F401
from tests.fixtures.demo_pool import demo_pool  # noqa: E402,F401
from tests.fixtures.local_ray import ray_local  # noqa: E402,F401
from tests.fixtures.s3_server import s3_server  # noqa: E402,F401
from tests.fixtures.tiny_track import tiny_track  # noqa: E402,F401

# Set by `make test` (and so by CI): a test skipped for a missing optional dependency or tool fails instead,
# so a broken install cannot pass as skips. Only the GPU tests may skip (no CUDA here).
STRICT_SKIPS = os.environ.get("PROLIP_STRICT_SKIPS") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT_SKIPS and report.skipped and "gpu" not in item.keywords and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under PROLIP_STRICT_SKIPS=1 (make test): {reason}"


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
