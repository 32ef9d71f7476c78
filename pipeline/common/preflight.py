"""Checks a job runs on its inputs and outputs before it starts Ray or loads a model.

Each check costs one listing or one small read (the first bytes of a file, which tell its kind), so a
missing path, a text file given as a shard or a store that does not answer stops the job in about a
second with one line naming the path, instead of after Ray's start-up or inside a Ray task. Failures are
``InputError`` / ``StorageError`` (pipeline/common/errors.py); the library's own checks (schemas, the
checkpoint's config) still run where the data is read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pyarrow.fs as pafs

from pipeline.common.errors import InputError, JobError, os_error
from pipeline.common.storage import Storage, is_s3

# The first bytes that tell a file's kind (offset, magic).
_MAGIC = {
    "parquet": (0, b"PAR1"),
    "tar": (257, b"ustar"),
    "npy": (0, b"\x93NUMPY"),
    "zip": (0, b"PK\x03\x04"),  # torch.save's format
}
_HEAD = 512 + 8


def sniff(store: Storage, path: str) -> str:
    """What the file at ``path`` looks like from its first bytes: ``parquet``, ``tar``, ``npy``, ``zip``,
    ``json``, ``text``, ``empty`` or ``binary``."""
    with store.open_input(path) as f:
        head = f.read(_HEAD)
    for kind, (offset, magic) in _MAGIC.items():
        if head[offset : offset + len(magic)] == magic:
            return kind
    if not head:
        return "empty"
    if head.lstrip()[:1] in (b"{", b"["):
        return "json"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return "binary"
    return "text"


def _described(kind: str) -> str:
    return {"empty": "an empty file", "text": "a text file", "json": "a JSON file"}.get(
        kind, f"a {kind} file"
    )


def input_files(
    store: Storage, path: str, what: str, kind: str | None = None, suffix: str | None = None
) -> list[str]:
    """The files at ``path`` (a file, a directory, a glob or a comma list; local or ``s3://``) that input
    ``what`` names, checked: at least one, and the first of the kind ``kind`` (see ``sniff``)."""
    if not path:
        raise InputError(f"{what}: no path given")
    try:
        files: list[str] = []
        for part in [p.strip() for p in path.split(",") if p.strip()]:
            fs, resolved = store.resolve(part)
            if not _is_glob(part) and fs.get_file_info(resolved).type == pafs.FileType.File:
                files.append(part)  # a file named directly: its kind is checked, whatever its name
            else:
                files += store.list_files(part, suffix=suffix)
        if not files:
            raise _nothing_at(store, path, what, suffix)
        if kind is not None:
            got = sniff(store, files[0])
            if got != kind:
                raise InputError(f"{what} {files[0]}: not a {kind} file (it is {_described(got)})")
        return files
    except OSError as exc:
        raise os_error(exc, f"{what} {path}") from None


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _nothing_at(store: Storage, path: str, what: str, suffix: str | None) -> JobError:
    first = path.split(",")[0].strip()
    if _is_glob(first) or store.isdir(first):
        return InputError(f"{what} {path}: no {suffix or ''} files there".replace("  ", " "))
    return InputError(f"{what} {path}: not found")


def input_file(store: Storage, path: str, what: str, kind: str | None = None) -> str:
    """One input file, checked as ``input_files`` does; a directory is refused."""
    try:
        if path and store.isdir(path):
            raise InputError(f"{what} {path}: a directory, not a file")
    except OSError as exc:
        raise os_error(exc, f"{what} {path}") from None
    return input_files(store, path, what, kind)[0]


def input_dir(store: Storage, path: str, what: str, needs: Sequence[str] = ()) -> str:
    """An input directory holding the files ``needs`` names (relative paths)."""
    if not path:
        raise InputError(f"{what}: no path given")
    try:
        if not store.isdir(path):
            if store.exists(path):
                raise InputError(f"{what} {path}: a file, not a directory")
            if not is_s3(path) or not store.list_files(path):
                raise InputError(f"{what} {path}: not found")
        for name in needs:
            full = path.rstrip("/") + "/" + name
            if not store.exists(full):
                raise InputError(f"{what} {path}: has no {name}")
        return path
    except OSError as exc:
        raise os_error(exc, f"{what} {path}") from None


def output_location(store: Storage, path: str, what: str = "output") -> None:
    """``path`` can take a job's output: on S3 the store answers and the bucket exists; locally the path
    is not a file and its nearest existing parent is a directory this process may write to."""
    if not path:
        raise InputError(f"{what}: no path given")
    try:
        if is_s3(path):
            fs, key = store.resolve(path)
            bucket = key.split("/", 1)[0]
            if fs.get_file_info(bucket).type == pafs.FileType.NotFound:
                raise InputError(f"{what} {path}: bucket {bucket!r} does not exist")
            return
        full = os.path.abspath(os.path.expanduser(path))
        if os.path.isfile(full):
            raise InputError(f"{what} {path}: a file, not a directory")
        parent = full
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise InputError(f"{what} {path}: {parent} is a file, not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise InputError(f"{what} {path}: {parent} is not writable")
    except OSError as exc:
        raise os_error(exc, f"{what} {path}") from None
