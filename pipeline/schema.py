"""Column names, Arrow schemas and status vocabulary shared by every pipeline stage.

The metadata columns are DataComp's (``uid`` … ``face_bboxes``); extra columns pass through untouched.
Every input uid ends in exactly one status; ``STATUS_*`` constants and the ``failed_to_download:<reason>``
/ ``failed_to_resize:<reason>`` families are the whole vocabulary, so reports can group on them.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.common.errors import InputError

UID = "uid"
URL = "url"
TEXT = "text"
ORIGINAL_WIDTH = "original_width"
ORIGINAL_HEIGHT = "original_height"
SHA256 = "sha256"
CLIP_B32 = "clip_b32_similarity_score"
CLIP_L14 = "clip_l14_similarity_score"
FACE_BBOXES = "face_bboxes"

# Required columns and the Arrow types they must be castable to. ``None`` means "any list of 4 floats".
METADATA_SCHEMA = pa.schema(
    [
        pa.field(UID, pa.string()),
        pa.field(URL, pa.string()),
        pa.field(TEXT, pa.string()),  # or binary: see check_metadata_schema
        pa.field(ORIGINAL_WIDTH, pa.int64()),
        pa.field(ORIGINAL_HEIGHT, pa.int64()),
        pa.field(SHA256, pa.string()),
        pa.field(CLIP_B32, pa.float64()),
        pa.field(CLIP_L14, pa.float64()),
        pa.field(FACE_BBOXES, pa.list_(pa.list_(pa.float64()))),
    ]
)
REQUIRED_COLUMNS = (UID, URL, TEXT)

# Columns added by the build.
STATUS = "status"
KEEP = "keep"
DROP_REASON = "drop_reason"
SHARD = "shard"
KEY = "key"
WIDTH = "width"
HEIGHT = "height"
IMAGE = "jpg"
IMAGE_SHA256 = "image_sha256"
PHASH = "phash"

STATUS_SUCCESS = "success"
STATUS_INVALID_UID = "invalid_uid"  # decided before download: not 32 hex characters
STATUS_DUPLICATE_UID = "duplicate_uid"  # a uid seen on an earlier row
STATUS_DUPLICATE_URL = "duplicate_url"
STATUS_DUPLICATE_IMAGE = "duplicate_image"
STATUS_NEAR_DUPLICATE = "near_duplicate"
# Curation (pipeline/dedup/semantic.py): ``semantic_duplicate`` names the uid it duplicates in the status
# table's ``duplicate_of`` column; ``eval_leak:<task>`` is a near-copy of a picture of that eval task,
# named ``<task>/<key>`` in ``leak_of``.
STATUS_SEMANTIC_DUPLICATE = "semantic_duplicate"
EVAL_LEAK = "eval_leak"
DUPLICATE_OF = "duplicate_of"
LEAK_OF = "leak_of"
STATUS_HASH_MISMATCH = "hash_mismatch"
STATUS_BLOCKED_ADDRESS = "blocked_address"
STATUS_INVALID_URL = "invalid_url"
STATUS_OPTED_OUT = "opted_out"
DOWNLOAD_FAILED = "failed_to_download"
RESIZE_FAILED = "failed_to_resize"
# Decided before download from the caption alone (pipeline/source/row_checks.py): ``invalid_caption:<reason>``.
INVALID_CAPTION = "invalid_caption"
CAPTION_NULL, CAPTION_UTF8, CAPTION_TOO_LONG = "null", "invalid_utf8", "too_long"

# The failures worth another attempt later (an outage, a rate limit, an overloaded host): the statuses a
# ``retry_failed`` build downloads again. Everything else (4xx, opt-out, blocked, bad bytes) is final.
TRANSIENT_REASONS = frozenset({"timeout", "connection_error", "truncated", "deadline", "http_429"})


def is_transient(status: str | None) -> bool:
    """``failed_to_download:{timeout, connection_error, truncated, deadline, http_429, http_5xx}``."""
    if not status or not status.startswith(DOWNLOAD_FAILED + ":"):
        return False
    reason = status[len(DOWNLOAD_FAILED) + 1 :]
    return reason in TRANSIENT_REASONS or bool(re.fullmatch(r"http_5\d\d", reason))


def failed_download(reason: str) -> str:
    return f"{DOWNLOAD_FAILED}:{reason}"


def failed_resize(reason: str) -> str:
    return f"{RESIZE_FAILED}:{reason}"


def eval_leak(task: str) -> str:
    return f"{EVAL_LEAK}:{task}"


def invalid_caption(reason: str) -> str:
    return f"{INVALID_CAPTION}:{reason}"


class SchemaError(InputError, ValueError):
    """Metadata does not have the columns or types the build needs; the message names them."""


@dataclass(frozen=True)
class SchemaProblem:
    column: str
    problem: str

    def __str__(self) -> str:
        return f"{self.column}: {self.problem}"


def check_metadata_schema(schema: pa.Schema) -> list[SchemaProblem]:
    """Problems with ``schema`` as DataComp metadata: missing required columns and uncastable types.

    Optional DataComp columns may be absent (our demo pool has them; user pools may not), but when
    present they must have a compatible type, so a mistyped column stops the job before any download.
    A column name that appears twice is a problem of its own (reported alone: no column is unambiguous).
    """
    problems: list[SchemaProblem] = []
    names = set(schema.names)
    # A repeated name makes every read of that column ambiguous (pyarrow's field() refuses it): say which.
    for col, n in sorted(Counter(schema.names).items()):
        if n > 1:
            problems.append(SchemaProblem(col, f"column name appears {n} times"))
    if problems:
        return problems
    for col in REQUIRED_COLUMNS:
        if col not in names:
            problems.append(SchemaProblem(col, "missing required column"))
    for field in METADATA_SCHEMA:
        if field.name not in names:
            continue
        actual = schema.field(field.name).type
        # Captions may come as bytes (some writers store alt text undecoded): each row is then checked
        # for UTF-8 before download (pipeline/source/row_checks.py) instead of failing the whole file.
        binary_text = field.name == TEXT and (pa.types.is_binary(actual) or pa.types.is_large_binary(actual))
        if not (binary_text or _compatible(actual, field.type)):
            problems.append(SchemaProblem(field.name, f"has type {actual}, expected {field.type}"))
    return problems


def validate_metadata_schema(schema: pa.Schema) -> None:
    problems = check_metadata_schema(schema)
    if problems:
        raise SchemaError("metadata schema invalid: " + "; ".join(str(p) for p in problems))


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _compatible(actual: pa.DataType, expected: pa.DataType) -> bool:
    if pa.types.is_null(actual):
        return True  # an all-null column (e.g. clip scores in a pool that has none)
    if pa.types.is_string(expected):
        return _is_text(actual)
    if pa.types.is_integer(expected):
        return pa.types.is_integer(actual)
    if pa.types.is_floating(expected):
        return pa.types.is_floating(actual) or pa.types.is_integer(actual)
    if pa.types.is_list(expected) or pa.types.is_large_list(expected):
        if not (pa.types.is_list(actual) or pa.types.is_large_list(actual)):
            return False
        return _compatible(actual.value_type, expected.value_type)
    return actual.equals(expected)


# --- uids ---------------------------------------------------------------------------------------------

UID_DTYPE = np.dtype("u8,u8")
# DataComp's uids are 128-bit values written as exactly 32 lowercase hex digits. One spelling per value:
# ``int(x, 16)`` would also take a sign, ``0x``, spaces, ``_``, non-ASCII digits and upper case, so two
# spellings of one value would collide in the ``u8,u8`` pairs (and a ``-`` would overflow them).
_UID_RE = re.compile(r"[0-9a-f]{32}")


def is_valid_uid(uid: object) -> bool:
    """Exactly 32 characters from ``0-9a-f`` (ASCII; nothing else, upper case included)."""
    return isinstance(uid, str) and _UID_RE.fullmatch(uid) is not None


def uids_to_u8pairs(uids: list[str] | np.ndarray) -> np.ndarray:
    """32-hex-char uids → DataComp's structured ``u8,u8`` array (high 64 bits, low 64 bits), unsorted.

    Raises ``ValueError`` naming the first uid that is not exactly 32 lowercase hex digits."""
    items = uids.tolist() if isinstance(uids, np.ndarray) else list(uids)
    out = np.empty(len(items), dtype=UID_DTYPE)
    if not items:
        return out
    bad = [u for u in items if not is_valid_uid(u)]
    if bad:
        raise ValueError(f"not a uid (32 lowercase hex digits): {bad[0]!r}")
    raw = np.frombuffer(bytes.fromhex("".join(items)), dtype=">u8").reshape(-1, 2)
    out["f0"], out["f1"] = raw[:, 0], raw[:, 1]
    return out


def u8pairs_to_uids(pairs: np.ndarray) -> list[str]:
    return [f"{int(hi):016x}{int(lo):016x}" for hi, lo in zip(pairs["f0"], pairs["f1"], strict=True)]
