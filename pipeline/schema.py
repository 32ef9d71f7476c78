"""Column names, Arrow schemas and status vocabulary shared by every pipeline stage.

The metadata columns are DataComp's (``uid`` … ``face_bboxes``); extra columns pass through untouched.
Every input uid ends in exactly one status; ``STATUS_*`` constants and the ``failed_to_download:<reason>``
/ ``failed_to_resize:<reason>`` families are the whole vocabulary, so reports can group on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

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
        pa.field(TEXT, pa.string()),
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
STATUS_HASH_MISMATCH = "hash_mismatch"
STATUS_BLOCKED_ADDRESS = "blocked_address"
STATUS_INVALID_URL = "invalid_url"
STATUS_OPTED_OUT = "opted_out"
DOWNLOAD_FAILED = "failed_to_download"
RESIZE_FAILED = "failed_to_resize"


def failed_download(reason: str) -> str:
    return f"{DOWNLOAD_FAILED}:{reason}"


def failed_resize(reason: str) -> str:
    return f"{RESIZE_FAILED}:{reason}"


class SchemaError(ValueError):
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
    """
    problems: list[SchemaProblem] = []
    names = set(schema.names)
    for col in REQUIRED_COLUMNS:
        if col not in names:
            problems.append(SchemaProblem(col, "missing required column"))
    for field in METADATA_SCHEMA:
        if field.name not in names:
            continue
        actual = schema.field(field.name).type
        if not _compatible(actual, field.type):
            problems.append(SchemaProblem(field.name, f"has type {actual}, expected {field.type}"))
    return problems


def validate_metadata_schema(schema: pa.Schema) -> None:
    problems = check_metadata_schema(schema)
    if problems:
        raise SchemaError("metadata schema invalid: " + "; ".join(str(p) for p in problems))


def _compatible(actual: pa.DataType, expected: pa.DataType) -> bool:
    if pa.types.is_null(actual):
        return True  # an all-null column (e.g. clip scores in a pool that has none)
    if pa.types.is_string(expected):
        return pa.types.is_string(actual) or pa.types.is_large_string(actual)
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


def uids_to_u8pairs(uids: list[str] | np.ndarray) -> np.ndarray:
    """32-hex-char uids → DataComp's structured ``u8,u8`` array (high 64 bits, low 64 bits), unsorted."""
    arr = np.asarray(uids, dtype="U32")
    out = np.empty(len(arr), dtype=UID_DTYPE)
    if len(arr) == 0:
        return out
    out["f0"] = np.array([int(u[:16], 16) for u in arr], dtype=np.uint64)
    out["f1"] = np.array([int(u[16:], 16) for u in arr], dtype=np.uint64)
    return out


def u8pairs_to_uids(pairs: np.ndarray) -> list[str]:
    return [f"{int(hi):016x}{int(lo):016x}" for hi, lo in zip(pairs["f0"], pairs["f1"], strict=True)]


def is_valid_uid(uid: object) -> bool:
    if not isinstance(uid, str) or len(uid) != 32:
        return False
    try:
        int(uid, 16)
    except ValueError:
        return False
    return True
