"""The run manifest: resolved config, versions, git SHA, counts and timings at the top of a run directory."""

from __future__ import annotations

import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline import storage

_PACKAGES = ("ray", "torch", "pyarrow", "webdataset", "img2dataset", "numpy")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_manifest(
    run_dir: str,
    *,
    job: str,
    config: dict[str, Any],
    counts: dict[str, Any],
    timings: dict[str, float],
    s3_endpoint: str = "",
    extra: dict[str, Any] | None = None,
) -> str:
    """Write ``manifest.json``; an existing manifest's other jobs are kept so one run dir tells the story."""
    path = storage.join(run_dir, "manifest.json")
    manifest: dict[str, Any] = {}
    if storage.exists(path, s3_endpoint):
        manifest = storage.read_json(path, s3_endpoint)
    manifest.update({"versions": versions(), "git_sha": git_sha()})
    manifest.setdefault("jobs", {})[job] = {
        "config": config,
        "counts": counts,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **(extra or {}),
    }
    storage.write_json(manifest, path, s3_endpoint)
    return path
