"""A training run's checkpoint directories in storage: their checksums, their upload, and the check a
re-run makes before Ray Train reads them.

- **Checksums**: ``save_state`` ends with ``checksums.json`` (size and sha256 of every other file);
  ``upload_checkpoint`` copies it last, so a checkpoint whose upload was cut (a killed worker, a partial
  S3 upload) lacks it or does not match it, and is never mistaken for a whole one.
- **Names never reused**: a checkpoint's directory is ``checkpoint_{step:08d}``, or with a suffix
  (``.1``, ``.2``, …) when that name already exists (a run that went back to an earlier checkpoint
  reaches the same step again; a cut upload left a directory behind): ``fresh_name``.
- **Local saves** (``local_save_dir``): a save goes to a temporary directory named by its process and
  host, which Ray Train deletes once uploaded; one a killed worker left (mid-save or mid-upload, up to a
  checkpoint's size) is removed at the next save on that host.
- **Pre-flight** (``preflight``, on the driver before ``fit()``): Ray Train's checkpoint manager keeps
  every checkpoint its snapshot lists and prunes them by name; a corrupt one left there was restored
  from again, and pruning deleted the directory a later checkpoint of the same step had reused (the run
  died two checkpoints later with "Path not found"). The newest registered checkpoints are checked
  against their checksums (sizes from the listing, no download); a corrupt one is deregistered from the
  snapshot and renamed to ``corrupt-<name>-<time>``, and the warning is returned for the console and the
  manifest. Workers still verify the content (sha256) when they restore (training/train/checkpointing.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs

from pipeline.common import faults
from training.model.checkpoint import CheckpointError

CHECKSUMS_FILE = "checksums.json"
CHECKSUMMED = "checksummed"  # the extra.json key of a checkpoint that ends with checksums.json
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train V2's record of registered checkpoints
_CHUNK = 8 << 20
LOCAL_SAVE_PREFIX = "prolip-ckpt-"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(directory: str) -> None:
    """``checksums.json``: ``{file: {"size", "sha256"}}`` of every other file, written last, atomically."""
    files = sorted(n for n in os.listdir(directory) if n != CHECKSUMS_FILE and not n.startswith("."))
    sums = {n: {"size": os.path.getsize(os.path.join(directory, n)), "sha256": _sha256(os.path.join(directory, n))}
            for n in files}  # fmt: skip
    tmp = os.path.join(directory, f".{CHECKSUMS_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(sums, f, indent=1)
    os.replace(tmp, os.path.join(directory, CHECKSUMS_FILE))


def verify_checkpoint(directory: str) -> str | None:
    """What is wrong with a local checkpoint copy (a file missing, cut short or changed), else None.

    A checkpoint written before checksums existed has none to check: None (its load decides)."""
    path = os.path.join(directory, CHECKSUMS_FILE)
    if not os.path.exists(path):
        extra = os.path.join(directory, "extra.json")
        return _unfinished(open(extra, "rb").read() if os.path.exists(extra) else None)
    try:
        sums = json.loads(open(path).read())
    except ValueError as exc:
        return f"{CHECKSUMS_FILE} unreadable ({exc})"
    for name, want in sorted(sums.items()):
        p = os.path.join(directory, name)
        if not os.path.exists(p):
            return f"{p} missing"
        if os.path.getsize(p) != want["size"]:
            return f"{p}: {os.path.getsize(p)} of {want['size']} bytes"
        if _sha256(p) != want["sha256"]:
            return f"{p}: sha256 differs from {CHECKSUMS_FILE}"
    return None


def _unfinished(extra: bytes | None) -> str | None:
    """No checksums.json: a save or upload that never finished, unless ``extra.json`` says the checkpoint
    predates checksums (it lacks ``CHECKSUMMED``; its load then decides)."""
    try:
        legacy = extra is not None and not json.loads(extra).get(CHECKSUMMED)
    except (ValueError, AttributeError):
        legacy = False
    return None if legacy else f"no {CHECKSUMS_FILE}: a save or upload that never finished"


def listing_problem(fs: pafs.FileSystem, path: str) -> str | None:
    """``verify_checkpoint`` from the storage listing alone (sizes, no download of the files)."""
    try:
        infos = {i.base_name: i.size for i in fs.get_file_info(pafs.FileSelector(path)) if i.is_file}
    except (OSError, FileNotFoundError) as exc:
        return f"cannot list it ({exc})"
    if CHECKSUMS_FILE not in infos:
        if "extra.json" not in infos:
            return _unfinished(None)
        with fs.open_input_stream(posixpath.join(path, "extra.json")) as f:
            return _unfinished(f.read())
    with fs.open_input_stream(posixpath.join(path, CHECKSUMS_FILE)) as f:
        try:
            sums = json.loads(f.read())
        except ValueError as exc:
            return f"{CHECKSUMS_FILE} unreadable ({exc})"
    for name, want in sorted(sums.items()):
        if name not in infos:
            return f"{name} missing"
        if infos[name] != want["size"]:
            return f"{name}: {infos[name]} of {want['size']} bytes"
    return None


def upload_checkpoint(local_dir: str, fs: pafs.FileSystem, dest: str) -> None:
    """Copy a saved checkpoint to ``dest`` on ``fs``, ``checksums.json`` last (module docstring)."""
    names = sorted(n for n in os.listdir(local_dir) if not n.startswith("."))
    names.sort(key=lambda n: n == CHECKSUMS_FILE)
    fs.create_dir(dest, recursive=True)
    local = pafs.LocalFileSystem()
    for name in names:
        faults.point("checkpoint.upload")
        pafs.copy_files(os.path.join(local_dir, name), posixpath.join(dest, name),
                        source_filesystem=local, destination_filesystem=fs)  # fmt: skip


def fresh_name(fs: pafs.FileSystem, run_path: str, step: int) -> str:
    """``checkpoint_{step:08d}``, or the first of ``….1``, ``….2``, … that does not exist in the run."""
    base = f"checkpoint_{step:08d}"
    name, k = base, 0
    while fs.get_file_info(posixpath.join(run_path, name)).type != pafs.FileType.NotFound:
        k += 1
        name = f"{base}.{k}"
    return name


# --- the re-run's check of the registered checkpoints ----------------------------------------------------


def preflight(fs: pafs.FileSystem, run_path: str, warn: Callable[[str], None]) -> list[str]:
    """Deregister and rename the corrupt newest registered checkpoints of a run; returns the warnings.

    Stops at the newest intact one. None intact: ``CheckpointError`` naming each (a run to start again
    under a new ``run.name``, or to delete)."""
    snap_path = posixpath.join(run_path, SNAPSHOT_FILE)
    if fs.get_file_info(snap_path).type == pafs.FileType.NotFound:
        return []
    with fs.open_input_stream(snap_path) as f:
        snap = json.loads(f.read())
    order = sorted(range(len(snap["checkpoint_results"])), key=lambda i: snap["checkpoint_report_indices"][i])
    corrupt: dict[str, str] = {}  # name → problem, newest first
    for i in reversed(order):
        name = snap["checkpoint_results"][i]["checkpoint_dir_name"]
        problem = listing_problem(fs, posixpath.join(run_path, name))
        if problem is None:
            break
        corrupt[name] = problem
    if not corrupt:
        return []
    if len(corrupt) == len(order):  # nothing to resume from: left as it is, for the user to decide
        raise CheckpointError(f"no usable checkpoint in {run_path}: "
                              + "; ".join(f"{n} ({p})" for n, p in corrupt.items()))  # fmt: skip
    # Deregistered first: a crash between the two steps leaves an unregistered directory, never a
    # snapshot naming a directory that is gone (which Ray Train refuses to start from).
    _write_snapshot(fs, snap_path, _without(snap, set(corrupt)))
    warnings = []
    for name, problem in corrupt.items():
        moved = _set_aside(fs, run_path, name)
        warnings.append(f"checkpoint {posixpath.join(run_path, name)} is corrupt ({problem}): deregistered "
                        f"and moved to {moved}")  # fmt: skip
        warn(warnings[-1])
    return warnings


def _set_aside(fs: pafs.FileSystem, run_path: str, name: str) -> str:
    """Rename ``name`` out of the checkpoint namespace (a copy and a delete where storage has no rename)."""
    dest = posixpath.join(run_path, f"corrupt-{name}-{time.strftime('%Y%m%dT%H%M%S')}")
    src = posixpath.join(run_path, name)
    if isinstance(fs, pafs.LocalFileSystem):
        fs.move(src, dest)
    else:
        pafs.copy_files(src, dest, source_filesystem=fs, destination_filesystem=fs)
        fs.delete_dir(src)
    return dest


def _without(snap: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Ray's snapshot with the checkpoints ``names`` removed everywhere it lists them."""
    keep = [i for i, r in enumerate(snap["checkpoint_results"]) if r["checkpoint_dir_name"] not in names]
    out = dict(snap)
    out["checkpoint_results"] = [snap["checkpoint_results"][i] for i in keep]
    out["checkpoint_report_indices"] = [snap["checkpoint_report_indices"][i] for i in keep]
    latest = max(keep, key=lambda i: snap["checkpoint_report_indices"][i]) if keep else None
    out["latest_checkpoint_result"] = snap["checkpoint_results"][latest] if latest is not None else None
    pending = [(r, v) for r, v in zip(snap.get("pending_training_results", []),
                                      snap.get("pending_validation_specs", []), strict=True)
               if r["checkpoint_dir_name"] not in names]  # fmt: skip
    out["pending_training_results"] = [r for r, _ in pending]
    out["pending_validation_specs"] = [v for _, v in pending]
    for key in ("validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
                "failed_validation_checkpoint_dir_names"):  # fmt: skip
        if key in out:
            out[key] = [n for n in out[key] if n not in names]
    return out


def _write_snapshot(fs: pafs.FileSystem, path: str, snap: dict[str, Any]) -> None:
    data = json.dumps(snap).encode()
    if isinstance(fs, pafs.LocalFileSystem):  # a rename: a crash here leaves the old snapshot or the new
        tmp = path + ".tmp"
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        fs.move(tmp, path)
        return
    with fs.open_output_stream(path) as f:  # an S3 object appears whole or not at all
        f.write(data)


def local_save_dir(root: str | None = None) -> str:
    """A fresh directory for one local save, ``prolip-ckpt-<pid>@<host>-<random>`` under ``root`` (the
    temp directory); first removes those of this host whose process is gone."""
    root = root or tempfile.gettempdir()
    for name in stale_local_saves(root):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{LOCAL_SAVE_PREFIX}{os.getpid()}@{socket.gethostname()}-", dir=root)


def stale_local_saves(root: str | None = None) -> list[str]:
    """The names of this host's local save directories under ``root`` whose process is gone."""
    root, host, out = root or tempfile.gettempdir(), socket.gethostname(), []
    for name in os.listdir(root):
        pid, at, rest = name.removeprefix(LOCAL_SAVE_PREFIX).partition("@")
        if name.startswith(LOCAL_SAVE_PREFIX) and at and pid.isdigit() and rest.startswith(host + "-"):
            if not _alive(int(pid)):
                out.append(name)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: another user's process, so alive
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
