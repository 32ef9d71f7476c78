"""One hub file to its place in a local folder or on S3: resumed where a cut transfer stopped, checked against
the hub's hash, skipped when a checked copy is already there.

The bytes come through ``huggingface_hub``'s own client: ``get_hf_file_metadata`` (the resolve URL's
headers: where the bytes are — the hub's CDN for an LFS file — and their size) and its HTTP session with
backoff (``http_stream_backoff``), reading from an offset and writing every byte as it arrives, so a
connection that drops mid-body resumes at the byte it stopped at (a ``Range`` request).
``hf_hub_download`` would not do: its in-call resume restarts at the last whole 10 MB chunk and its partial
files carry a random name per process, so a killed run starts over. Ours is named by the file's hash in the
staging folder: the next run resumes it.

A finished file is published only once its bytes hash to the listing's hash: moved into place (a local
destination; staging sits beside it, so the move is a rename) or uploaded (``s3://``, then the staged copy
is removed). A record beside the copies, ``<root>/_hub/<path>.json`` (hidden from ``Storage.list_files``),
says which repo, commit and hash the copy holds; the next run skips a file whose record and size match the
listing (``verify=True`` hashes the copy again). A copy without a record (put there by other tools) is
hashed once and kept when it matches. Bytes that do not match are fetched again up to ``attempts`` times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.common import storage
from pipeline.common.storage import Storage
from pipeline.hub.listing import CHUNK, HubFile, HubUnreachable, Snapshot, digest_of, hub_errors

Count = Callable[[int], None]


@dataclass(frozen=True)
class Placement:
    """Where one hub file goes: ``root`` (local or ``s3://``) and its path under it."""

    root: str
    rel: str

    @property
    def target(self) -> str:
        return storage.join(self.root, self.rel)

    @property
    def record(self) -> str:
        return storage.join(self.root, "_hub", self.rel + ".json")


def staged_path(staging: str, f: HubFile) -> str:
    return os.path.join(staging, f.digest.replace(":", "-") + ".part")


def fetch_file(api: Any, snap: Snapshot, f: HubFile, place: Placement, store: Storage, staging: str,
               *, attempts: int = 3, verify: bool = False, count: Count = lambda n: None) -> str:  # fmt: skip
    """Put ``f`` of ``snap`` at ``place``; returns what it took: ``"skipped"`` (a checked copy was there),
    ``"kept"`` (a copy without a record matched), ``"fetched"`` or ``"resumed"`` (a partial file grew)."""
    record = {"repo": snap.repo, "commit": snap.commit, "path": f.path, "size": f.size, "digest": f.digest}
    if _has_copy(place, f, store, verify, count):
        return "skipped"
    if store.exists(place.target) and _hashes_to(place.target, f, store, count):
        store.write_json(record, place.record)
        return "kept"
    os.makedirs(staging, exist_ok=True)
    part = staged_path(staging, f)
    how = "resumed" if os.path.exists(part) else "fetched"
    for attempt in range(1, attempts + 1):
        _download(api, snap, f, part, count)
        with open(part, "rb") as fh:
            if digest_of(fh, f.size, f.digest):
                break
        os.remove(part)  # the bytes do not hash to the listing's: all of them again
        if attempt == attempts:
            raise HubUnreachable(
                f"{snap.repo}/{f.path}@{snap.commit[:12]}: {attempts} downloads did not match the hub's "
                f"{f.digest[:24]}…; the hub or a proxy on the way serves other bytes"
            )
        how = "fetched again"
    _publish(part, place, store)
    store.write_json(record, place.record)
    return how


def _has_copy(place: Placement, f: HubFile, store: Storage, verify: bool, count: Count) -> bool:
    """Whether a copy recorded as ``f`` (same repo path, size and hash) is at the target."""
    if not store.exists(place.record) or not store.exists(place.target):
        return False
    try:
        old = store.read_json(place.record)
    except (OSError, ValueError):
        return False
    if old.get("digest") != f.digest or old.get("size") != f.size:
        return False
    fs, p = store.resolve(place.target)
    if fs.get_file_info(p).size != f.size:
        return False
    return not verify or _hashes_to(place.target, f, store, count)


def _hashes_to(path: str, f: HubFile, store: Storage, count: Count) -> bool:
    fs, p = store.resolve(path)
    if fs.get_file_info(p).size != f.size:
        return False
    with store.open_input(path, seekable=False) as fh:
        return digest_of(fh, f.size, f.digest)


def _download(api: Any, snap: Snapshot, f: HubFile, part: str, count: Count) -> None:
    """The rest of ``f`` appended to ``part`` (from its current size), through the hub client."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    have = os.path.getsize(part) if os.path.exists(part) else 0
    if have > f.size:  # longer than the file: not a prefix of it
        os.remove(part)
        have = 0
    with hub_errors(api, snap.repo, snap.commit, f.path):
        url = hf_hub_url(snap.repo, f.path, repo_type="dataset", revision=snap.commit, endpoint=api.endpoint)
        meta = get_hf_file_metadata(url, endpoint=api.endpoint, token=api.token)
        if meta.size is not None and meta.size != f.size:
            raise HubUnreachable(
                f"{snap.repo}/{f.path}@{snap.commit[:12]}: the hub lists {f.size} bytes but serves {meta.size}"
            )
        _stream(meta.location, part, have, f.size, _auth(api, meta.location), count)


def _stream(url: str, part: str, have: int, size: int, headers: dict[str, str], count: Count) -> None:
    """GET ``url`` into ``part`` from byte ``have`` until ``size`` bytes are there. Bytes are written as
    they arrive, so a connection that drops mid-body is resumed from the last byte received (a ``Range``
    request); ``TRIES`` drops in a row without a new byte give up."""
    from huggingface_hub import constants
    from huggingface_hub.utils import hf_raise_for_status, http_stream_backoff

    failures = 0
    while have < size:
        ask = {"Accept-Encoding": "identity", **headers} | ({"Range": f"bytes={have}-"} if have else {})
        before = have
        try:
            # retries on 429/5xx answers there; a dropped connection is ours to resume, from the right byte
            with http_stream_backoff("GET", url, headers=ask, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
                                     retry_on_exceptions=()) as r:  # fmt: skip
                hf_raise_for_status(r)
                if have and r.status_code != 206:  # the server ignored the range: from the start
                    have = 0
                with open(part, "ab" if have else "wb") as fh:
                    for chunk in r.iter_bytes():
                        fh.write(chunk)
                        have += len(chunk)
                        count(len(chunk))
        except _TRANSIENT as exc:
            failures = 0 if have > before else failures + 1
            if failures >= TRIES:
                raise HubUnreachable(f"{url}: {TRIES} tries without a byte ({exc})") from None
            time.sleep(0 if have > before else min(8.0, 0.5 * 2**failures))
            continue
        if have < size:  # the body ended short without an error: ask for the rest
            failures = 0 if have > before else failures + 1
            if failures >= TRIES:
                raise HubUnreachable(f"{url}: the body ends at {have} of {size} bytes")
    if have > size:
        raise HubUnreachable(f"{url}: {have} bytes served, {size} listed")


TRIES = 5


def _transient() -> tuple[type[BaseException], ...]:
    """The hub client's transport errors (connection refused or dropped, timeouts) and the OS's."""
    try:
        import httpx2 as http
    except ImportError:  # the hub client before its own fork of httpx
        import httpx as http
    return (http.TransportError, ConnectionError, TimeoutError)


_TRANSIENT = _transient()


def _auth(api: Any, location: str) -> dict[str, str]:
    """The hub's credentials for the hub's own host only: a CDN URL carries its own signature."""
    from urllib.parse import urlsplit

    from huggingface_hub.utils import build_hf_headers

    if urlsplit(location).netloc != urlsplit(api.endpoint).netloc:
        return {}
    return {k: v for k, v in build_hf_headers(token=api.token).items() if k.lower() == "authorization"}


def _publish(part: str, place: Placement, store: Storage) -> None:
    """The checked partial file at its target: renamed (local) or uploaded, then removed (``s3://``)."""
    if not storage.is_s3(place.target):
        _, target = store.resolve(place.target)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(part, target)
        return
    with open(part, "rb") as src, store.open_output(place.target) as out:
        while chunk := src.read(CHUNK):
            out.write(chunk)
    os.remove(part)
