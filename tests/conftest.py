"""Shared fixtures (each lives in a ``tests/fixtures_*.py`` module) and marker handling."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from tests.fixtures.local_ray import ray_local  # noqa: E402,F401
from tests.fixtures.s3_server import s3_server  # noqa: E402,F401


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
