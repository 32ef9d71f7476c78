"""What a hub dataset repo holds at one commit: its files with the size and hash the hub lists for each.

``snapshot(api, repo, revision, patterns)`` asks the hub which commit ``revision`` (a branch, a tag, a
``refs/convert/parquet`` ref or a commit sha) names, then lists the repo's tree at that commit, so every
file of one copy comes from one commit. An LFS file is checked by its sha256 (the hub's LFS ``oid``); a file
stored in git by its git blob id (sha1 of ``"blob <size>\\0"`` + the bytes), which is what the hub lists and
sends as its ``ETag`` (``hf_hub_url``'s docstring). Failures are the project's job errors: a repo or
revision the hub does not have is ``HubMissing`` (an input error, exit 3), a hub that cannot be reached or
keeps failing is ``HubUnreachable`` (a storage error, exit 4).
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from pipeline.common.errors import InputError, StorageError

CHUNK = 8 * 1024 * 1024


class HubMissing(InputError, LookupError):
    """The hub has no such repo, revision or file (or none matching what was asked)."""


class HubRepoMissing(HubMissing):
    """The hub has no such repo (or it is private or gated and no token opens it)."""


class HubUnreachable(StorageError, ConnectionError):
    """The hub did not answer, or kept failing (5xx, timeouts), or sent bytes that never matched their hash."""


@dataclass(frozen=True)
class HubFile:
    path: str  # in the repo
    size: int
    sha256: str  # of an LFS file; "" for a file stored in git
    git_oid: str  # the git blob id (for an LFS file: of its pointer)

    @property
    def digest(self) -> str:
        """What the bytes must hash to: ``sha256:<hex>`` (LFS) or ``git-sha1:<hex>``."""
        return f"sha256:{self.sha256}" if self.sha256 else f"git-sha1:{self.git_oid}"


@dataclass(frozen=True)
class Snapshot:
    repo: str
    revision: str  # as asked
    commit: str  # the commit it named when listed
    files: tuple[HubFile, ...]


def hasher(digest: str) -> tuple[Any, str]:
    """(a hashlib object fed as the bytes arrive, the hex it must end at) for ``HubFile.digest``."""
    kind, _, want = digest.partition(":")
    return (hashlib.sha256() if kind == "sha256" else hashlib.sha1()), want


def digest_of(
    stream: BinaryIO, size: int, digest: str, progress: Callable[[int], None] | None = None
) -> bool:
    """Whether ``size`` bytes read from ``stream`` hash to ``digest``."""
    h, want = hasher(digest)
    if digest.startswith("git-sha1:"):
        h.update(b"blob %d\0" % size)
    while chunk := stream.read(CHUNK):
        h.update(chunk)
        if progress is not None:
            progress(len(chunk))
    return h.hexdigest() == want


def matches(path: str, patterns: Sequence[str]) -> bool:
    """``fnmatch`` on the repo path (``*`` also crosses ``/``, as the hub's allow_patterns do)."""
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def snapshot(api: Any, repo: str, revision: str, patterns: Sequence[str]) -> Snapshot:
    """``repo``'s files matching ``patterns`` at the commit ``revision`` names (``api``: an ``HfApi``)."""
    with hub_errors(api, repo, revision):
        commit = api.dataset_info(repo, revision=revision).sha or revision
        entries = api.list_repo_tree(repo, recursive=True, revision=commit, repo_type="dataset")
        files = tuple(
            HubFile(e.path, int(e.size), e.lfs.sha256 if e.lfs else "", e.blob_id)
            for e in sorted(entries, key=lambda e: e.path)
            if hasattr(e, "blob_id") and matches(e.path, patterns)
        )
    return Snapshot(repo, revision, commit, files)


class hub_errors:  # noqa: N801 (a context manager used like a function)
    """The hub client's exceptions inside the block raised as ``HubMissing``/``HubUnreachable`` naming
    ``repo`` at ``revision`` and the endpoint."""

    def __init__(self, api: Any, repo: str, revision: str = "", path: str = "") -> None:
        self.where = f"{repo}" + (f"/{path}" if path else "") + (f"@{revision}" if revision else "")
        self.endpoint = getattr(api, "endpoint", "")

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, (HubMissing, HubUnreachable)):
            return False
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        on = f"on {self.endpoint}" if self.endpoint else "on the hub"
        if isinstance(exc, RevisionNotFoundError):
            raise HubMissing(f"{self.where}: the revision does not exist {on}") from None
        if isinstance(exc, EntryNotFoundError):
            raise HubMissing(f"{self.where}: no such file {on}") from None
        if isinstance(exc, GatedRepoError):
            raise HubRepoMissing(f"{self.where}: a gated repo; accept its terms and set HF_TOKEN") from None
        if isinstance(exc, RepositoryNotFoundError):
            raise HubRepoMissing(
                f"{self.where}: no such dataset repo {on} (or it is private: set HF_TOKEN)"
            ) from None
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, HfHubHTTPError) and status is not None and status < 500 and status != 429:
            raise HubMissing(f"{self.where}: the hub answered {status} {on}") from None
        if isinstance(exc, (HfHubHTTPError, OSError)) or type(exc).__module__.startswith(
            ("httpx", "httpcore")
        ):
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise HubUnreachable(f"{self.where}: {on} did not answer ({first})") from None
        return False
