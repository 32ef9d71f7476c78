"""The run manifest: resolved config, versions, git SHA, counts and timings at the top of a run directory.

The manifest is a file users share and commit, so nothing secret goes in: the storage is recorded as
``Storage.describe()`` (endpoint without userinfo, region; never a key), and every URL in the config or the
extras loses its userinfo (``scheme://user:secret@host`` → ``scheme://host``).
"""

from __future__ import annotations

import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.common import storage
from pipeline.common.storage import LOCAL, Storage, redact_url

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


def redacted(value: Any) -> Any:
    """``value`` with the userinfo of every URL string inside it (dicts, lists, tuples) removed."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redacted(v) for v in value]
    return value


def write_manifest(
    run_dir: str,
    *,
    job: str,
    config: dict[str, Any],
    counts: dict[str, Any],
    timings: dict[str, float],
    store: Storage = LOCAL,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write ``manifest.json``; an existing manifest's other jobs are kept so one run dir tells the story."""
    path = storage.join(run_dir, "manifest.json")
    manifest: dict[str, Any] = {}
    if store.exists(path):
        manifest = store.read_json(path)
    manifest.update({"versions": versions(), "git_sha": git_sha()})
    manifest.setdefault("jobs", {})[job] = {
        "config": redacted(config),
        "storage": store.describe(),
        "counts": counts,
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **redacted(extra or {}),
    }
    store.write_json(manifest, path)
    return path
