import numpy as np
import pyarrow as pa
import pytest

from pipeline import schema as S


def test_missing_and_mistyped_columns_are_named():
    sch = pa.schema([("uid", pa.string()), ("text", pa.string()), ("original_width", pa.string())])
    problems = {p.column: p.problem for p in S.check_metadata_schema(sch)}
    assert "url" in problems and "missing" in problems["url"]
    assert "original_width" in problems and "string" in problems["original_width"]
    with pytest.raises(S.SchemaError, match="url"):
        S.validate_metadata_schema(sch)


def test_compatible_types_pass():
    sch = pa.schema(
        [
            ("uid", pa.large_string()),
            ("url", pa.string()),
            ("text", pa.string()),
            ("original_width", pa.int32()),
            ("clip_b32_similarity_score", pa.float32()),
            ("clip_l14_similarity_score", pa.null()),
            ("face_bboxes", pa.list_(pa.list_(pa.float32()))),
            ("extra", pa.binary()),
        ]
    )
    assert S.check_metadata_schema(sch) == []


def test_uid_pairs_round_trip_and_order():
    uids = ["ffffffffffffffff0000000000000001", "00000000000000010000000000000002", "0" * 32]
    pairs = S.uids_to_u8pairs(uids)
    assert pairs.dtype == np.dtype("u8,u8")
    assert pairs[0]["f0"] == np.uint64(2**64 - 1) and pairs[0]["f1"] == 1
    assert S.u8pairs_to_uids(pairs) == uids
    assert S.u8pairs_to_uids(np.sort(pairs)) == sorted(uids)


def test_is_valid_uid():
    assert S.is_valid_uid("a" * 32)
    assert not S.is_valid_uid("g" * 32)
    assert not S.is_valid_uid("a" * 31)
    assert not S.is_valid_uid(None)
