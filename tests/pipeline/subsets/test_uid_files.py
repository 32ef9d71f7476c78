"""DataComp subset files: sorted u8,u8 .npy, duplicates preserved, what DataComp's resharder loads."""

from __future__ import annotations

import io

import numpy as np
import pytest

from pipeline.schema import UID_DTYPE, uids_to_u8pairs
from pipeline.subsets.uid_files import SubsetError, read_subset, subset_uids, to_subset_array, write_subset

UIDS = [
    "ffffffffffffffff0000000000000001",
    "00000000000000010000000000000002",
    "0000000000000001ffffffffffffffff",
    "00000000000000000000000000000005",
    "00000000000000010000000000000002",  # repeated: up-sampling, must survive
    "8000000000000000000000000000000a",
]


def test_np_sort_orders_structured_pairs_by_high_then_low():
    arr = np.array([(2, 1), (1, 5), (1, 2), (2, 0), (0, 2**64 - 1)], dtype=UID_DTYPE)
    assert np.sort(arr).tolist() == [(0, 2**64 - 1), (1, 2), (1, 5), (2, 0), (2, 1)]


def test_round_trip_sorted_with_duplicates(tmp_path):
    path = tmp_path / "sub" / "basic.npy"
    assert write_subset(UIDS, path) == len(UIDS)
    arr = read_subset(path)
    assert arr.dtype == UID_DTYPE and arr.ndim == 1
    assert subset_uids(path) == sorted(UIDS)  # 128-bit order == order of the 32-hex strings
    assert subset_uids(path).count("00000000000000010000000000000002") == 2


def test_file_object_round_trip_and_u8_input():
    buf = io.BytesIO()
    write_subset(uids_to_u8pairs(UIDS), buf)
    buf.seek(0)
    assert subset_uids(buf) == sorted(UIDS)


def test_loads_as_datacomp_resharder_expects(tmp_path):
    path = tmp_path / "s.npy"
    write_subset(UIDS, path)
    subset = np.load(path, mmap_mode="r")  # what resharder.load_subset does
    assert subset.dtype == np.dtype("u8,u8")
    uid = "00000000000000010000000000000002"
    key = np.array([divmod(int(uid, 16), 2**64)], np.dtype("u8,u8"))[0]
    count = np.searchsorted(subset, key, "right") - np.searchsorted(subset, key, "left")
    assert count == 2
    missing = np.array([divmod(int("1" * 32, 16), 2**64)], np.dtype("u8,u8"))[0]
    assert np.searchsorted(subset, missing, "right") == np.searchsorted(subset, missing, "left")


def test_path_is_written_exactly_as_named(tmp_path):
    path = tmp_path / "subset.bin"
    write_subset(UIDS[:2], path)
    assert path.exists() and not (tmp_path / "subset.bin.npy").exists()


def test_raw_memmap_is_read_like_the_resharder(tmp_path):
    path = tmp_path / "raw.u16"
    to_subset_array(UIDS).tofile(path)
    assert subset_uids(path) == sorted(UIDS)


def test_empty_subset(tmp_path):
    path = tmp_path / "empty.npy"
    assert write_subset([], path) == 0
    assert read_subset(path).dtype == UID_DTYPE and subset_uids(path) == []


def test_wrong_dtype_names_the_file(tmp_path):
    path = tmp_path / "bad.npy"
    np.save(path, np.arange(4, dtype=np.uint64))
    with pytest.raises(SubsetError, match="bad.npy.*dtype"):
        read_subset(path)


def test_unsorted_is_rejected(tmp_path):
    path = tmp_path / "unsorted.npy"
    np.save(path, uids_to_u8pairs(sorted(UIDS, reverse=True)))
    with pytest.raises(SubsetError, match="unsorted.npy.*not sorted"):
        read_subset(path)


def test_two_dimensional_is_rejected(tmp_path):
    path = tmp_path / "2d.npy"
    np.save(path, to_subset_array(UIDS[:4]).reshape(2, 2))
    with pytest.raises(SubsetError, match="1-D"):
        read_subset(path)


def test_remote_path_needs_a_file_object():
    with pytest.raises(SubsetError, match="file object"):
        write_subset(UIDS, "s3://bucket/subsets/x.npy")
