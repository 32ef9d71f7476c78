"""Checksums of the bytes a shard stores, and their verification.

Each sample a build writes records, in its ``.json`` member, the sha256 of the bytes of its other members
as stored (``stored_sha256``: ``{"jpg": hex, "txt": hex}``). The json's ``sha256`` is DataComp's: the
hash of the *downloaded* file, which the resize changes, so it cannot tell a shard's JPEG from a damaged
copy of it; these can. Resharding copies member bytes as they are, so the checksums stay true in every
shard derived from the build's; an extra json field is what DataComp's resharder and open_clip's readers
ignore. Samples without the field (shards of other tools, older builds) are *unchecked*, never failed.
The one shard reader (pipeline/shards/reader.py) verifies on request: ``ShardReader(verify=True)`` and
``verify_shard``; ``jobs.reshard --verify`` copies only samples that match.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

CHECKSUM_FIELD = "stored_sha256"
# Members covered: the image and the caption (the json itself is rewritten by every reshard: new key).
CHECKED = ("jpg", "jpeg", "png", "webp", "txt")


def stored_checksums(members: Mapping[str, bytes]) -> dict[str, str]:
    """``{ext: sha256 hex}`` of the checked members among ``members`` (ext → the bytes written)."""
    return {ext: hashlib.sha256(data).hexdigest() for ext, data in members.items() if ext in CHECKED}


def sample_meta(sample: Mapping[str, Any]) -> dict[str, Any] | None:
    """The sample's json member as a dict (None when absent or unreadable)."""
    raw = sample.get("json")
    if isinstance(raw, dict):
        return raw
    if raw is None:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def mismatched_members(sample: Mapping[str, Any], meta: Mapping[str, Any] | None) -> list[str] | None:
    """Members whose bytes differ from the recorded checksum (a recorded member that is missing counts);
    None when the sample records no checksums (unchecked)."""
    recorded = (meta or {}).get(CHECKSUM_FIELD)
    if not isinstance(recorded, dict):
        return None
    bad = []
    for ext, want in sorted(recorded.items()):
        data = sample.get(ext)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            bad.append(ext)
        elif hashlib.sha256(data).hexdigest() != want:
            bad.append(ext)
    return bad
