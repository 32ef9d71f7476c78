"""pipeline.shards.writer: webdataset tar round trip, member contiguity/order, damage detection, stats."""

from __future__ import annotations

import os
import tarfile

import pytest

from pipeline.shards import tar_format
from pipeline.shards import writer as shards
from pipeline.shards.reader import iter_shard
from pipeline.shards.tar_format import ShardError
from pipeline.shards.writer import PartWriter, shard_stats, write_shard


def _samples(n: int = 4) -> list[tuple]:
    # jpg payloads of awkward sizes (not multiples of 512) and with NULs, to catch padding/offset bugs
    return [
        (
            f"{i:032x}",
            bytes([i, 0, 255]) * (100 + 211 * i),
            f"caption {i} é",
            {"uid": f"{i:032x}", "width": i},
        )
        for i in range(n)
    ]


def test_round_trip_order_and_bytes(tmp_path):
    path = str(tmp_path / tar_format.shard_name(3))
    assert path.endswith("00000003.tar") and tar_format.stats_name(3) == "00000003_stats.json"
    samples = _samples()
    assert write_shard(path, samples) == 4
    names = tarfile.open(path).getnames()
    assert names == [f"{s[0]}.{ext}" for s in samples for ext in ("jpg", "txt", "json")]  # contiguous
    got = list(iter_shard(path))
    assert [g["__key__"] for g in got] == [s[0] for s in samples]
    for g, (_key, jpg, txt, meta) in zip(got, samples, strict=True):
        assert g["jpg"] == jpg and g["txt"] == txt and g["json"] == meta and g["__url__"] == path
    raw = next(iter_shard(path, decode=False))
    assert isinstance(raw["txt"], bytes) and isinstance(raw["json"], bytes)


def test_dict_samples_extra_members_and_extensions_filter(tmp_path):
    path = str(tmp_path / "x.tar")
    write_shard(path, [{"key": "k1", "cls": 3, "json": {"a": 1}, "txt": None, "jpg": b"J"}])
    assert tarfile.open(path).getnames() == ["k1.jpg", "k1.txt", "k1.json", "k1.cls"]
    (s,) = iter_shard(path)
    assert s["txt"] == "" and s["cls"] == b"3"
    (only,) = iter_shard(path, extensions={"json"})
    assert set(only) == {"__key__", "__url__", "json"}
    with pytest.raises(ValueError, match="key"):
        write_shard(str(tmp_path / "bad.tar"), [{"__key__": "a.b", "jpg": b"x"}])


def test_shards_are_reproducible_and_webdataset_readable(tmp_path):
    import webdataset as wds

    a, b = str(tmp_path / "a.tar"), str(tmp_path / "b.tar")
    write_shard(a, _samples())
    write_shard(b, _samples())
    assert open(a, "rb").read() == open(b, "rb").read()
    assert {m.mtime for m in tarfile.open(a).getmembers()} == {tar_format.MTIME}
    assert os.path.getsize(a) % tar_format.RECORD == 0
    got = list(wds.WebDataset(a, shardshuffle=False))
    assert [g["jpg"] for g in got] == [s[1] for s in _samples()]


def test_long_and_unicode_names_round_trip(tmp_path):
    path = str(tmp_path / "x.tar")
    write_shard(path, [{"__key__": "k" * 150, "jpg": b"1"}, {"__key__": "ключ", "txt": "t"}])
    assert [s["__key__"] for s in iter_shard(path)] == ["k" * 150, "ключ"]


def _cut(src: str, dst: str, n: int) -> str:
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data[:n])
    return dst


@pytest.mark.parametrize(
    "where",
    ["inside_first_jpg", "inside_a_header", "member_boundary", "before_end_marker", "empty"],
)
def test_truncated_tar_raises_naming_the_file(tmp_path, where):
    src = str(tmp_path / "full.tar")
    write_shard(src, _samples())
    members = tarfile.open(src).getmembers()
    last = members[-1]
    end_of_data = last.offset_data + last.size + (-last.size % 512)
    cut = {
        "inside_first_jpg": members[0].offset_data + 10,
        "inside_a_header": members[6].offset + 100,
        "member_boundary": members[6].offset,  # tarfile itself would stop here silently
        "before_end_marker": end_of_data,
        "empty": 0,
    }[where]
    bad = _cut(src, str(tmp_path / "bad.tar"), cut)
    got = []
    with pytest.raises(ShardError, match="bad.tar"):
        for s in iter_shard(bad):
            got.append(s)
    # what was yielded is intact: whole samples only, identical to what was written
    want = {k: jpg for k, jpg, _, _ in _samples()}
    assert all(s["jpg"] == want[s["__key__"]] and "json" in s for s in got)
    assert len(got) < 4


def test_corrupt_header_raises(tmp_path):
    path = str(tmp_path / "c.tar")
    write_shard(path, _samples())
    second = tarfile.open(path).getmembers()[1].offset
    data = bytearray(open(path, "rb").read())
    data[second + 10] ^= 0xFF  # breaks the header checksum
    open(path, "wb").write(bytes(data))
    with pytest.raises(ShardError, match="c.tar.*corrupt tar header"):
        list(iter_shard(path))


def test_non_contiguous_sample_raises(tmp_path):
    path = str(tmp_path / "nc.tar")
    w = shards.ShardWriter(path)
    w.write_members("a", [("jpg", b"1")])
    w.write_members("b", [("jpg", b"2")])
    w.write_members("a", [("txt", b"3")])
    w.close()
    with pytest.raises(ShardError, match="not contiguous"):
        list(iter_shard(path))


def test_part_writer_keys_are_uids(tmp_path):
    path = str(tmp_path / tar_format.part_name(7))
    assert path.endswith("part-000007.tar")
    uid = "0123456789abcdef" * 2
    with PartWriter(path) as w:
        w.add(uid, b"jpg", "cap", {"url": "http://x"})
        with pytest.raises(ValueError, match="uid"):
            w.add("not-a-uid", b"jpg", "cap", {})
    (s,) = iter_shard(path)
    assert s["__key__"] == uid and s["json"] == {"uid": uid, "url": "http://x"}


def test_writer_aborts_on_error(tmp_path):
    path = str(tmp_path / "x.tar")
    with pytest.raises(RuntimeError):
        with shards.ShardWriter(path) as w:
            w.write(_samples(1)[0])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_stats_like_img2dataset():
    counts = {
        "success": 5,
        "failed_to_download:http_404": 2,
        "failed_to_download:timeout": 1,
        "failed_to_resize:corrupt": 1,
        "duplicate_url": 3,
    }
    st = shard_stats(counts, start_time=10.0, end_time=12.5)
    assert st["count"] == 12 and st["successes"] == 5
    assert st["failed_to_download"] == 3 and st["failed_to_resize"] == 1
    assert st["duration"] == 2.5 and st["status_dict"] == dict(sorted(counts.items()))


def test_shard_on_s3(s3_server, tmp_path):
    from pipeline.common.storage import LOCAL, Storage

    store = Storage.from_env(s3_server.endpoint)
    path = s3_server.url("shards", tar_format.shard_name(0))
    write_shard(path, _samples(), store)
    got = list(iter_shard(path, store))
    assert [g["jpg"] for g in got] == [s[1] for s in _samples()]
    local = str(tmp_path / "same.tar")
    write_shard(local, _samples())
    assert store.read_bytes(path) == LOCAL.read_bytes(local)


def test_fast_header_matches_tarfile():
    for name, size in [
        ("a.jpg", 0),
        ("0" * 32 + ".json", 12345),
        ("k" * 99, 8**11 - 1),
        ("é.txt", 3),
        ("k" * 120, 1),
    ]:
        assert tar_format.member_header(name, size) == tar_format._header_slow(name, size)
