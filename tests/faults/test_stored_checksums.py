"""Failure 6, checks: a shard's stored bytes carry a checksum, and the reader and the resharder verify it.

The json's ``sha256`` is DataComp's hash of the *downloaded* file, so a shard JPEG whose entropy-coded
bytes were flipped (a bad disk, a torn copy) decoded as corrupted pixels in training and was copied by
``jobs.reshard`` without a word. Each sample the build writes now records ``stored_sha256`` of its
``jpg`` and ``txt`` bytes; ``verify_shard``, ``ShardReader(verify=True)`` and ``jobs.reshard --verify``
count and name a mismatch.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from jobs import reshard as reshard_job
from pipeline.build import build
from pipeline.common.config import merge
from pipeline.config import BUILD_PRESETS
from pipeline.ingest.transforms import decode_for_size
from pipeline.shards.checksums import CHECKSUM_FIELD
from pipeline.shards.reader import ShardReader, iter_shard, verify_shard
from tests.faults.tiny_pool import serve, write_files, write_metadata


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checksums")
    rows = write_files(root, n=40, seed=3)
    with serve(root) as base:
        cfg = merge(BUILD_PRESETS["demo"], {
            "metadata": write_metadata(root, rows, base), "output": str(root / "out"), "download_actors": 0,
            "part_size": 10, "samples_per_shard": 12, "filters": {"names": ["no_filter"]},
            "download": {"timeout_s": 10.0, "retries": 0, "threads_per_actor": 4},
        })  # fmt: skip
        build(cfg, log=lambda m: None)
    return root / "out"


def _flip_entropy_byte(tar_path: Path) -> str:
    """Flip one byte in the middle of the first JPEG's data, in place (same size); returns its key."""
    with tarfile.open(tar_path) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith(".jpg"))
    with open(tar_path, "r+b") as f:
        pos = member.offset_data + member.size * 2 // 3
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x5A]))
    return member.name.split(".")[0]


def test_every_sample_records_the_checksums_of_its_stored_bytes(built) -> None:
    shards = sorted((built / "shards").glob("*.tar"))
    checks = [verify_shard(str(p)) for p in shards]
    assert sum(c.samples for c in checks) == sum(c.checked for c in checks) > 30
    assert all(c.ok for c in checks)
    sample = next(iter_shard(str(shards[0])))
    assert set(sample["json"][CHECKSUM_FIELD]) == {"jpg", "txt"}
    assert sample["json"]["sha256"] != sample["json"][CHECKSUM_FIELD]["jpg"]  # DataComp's is the download's


def test_flipped_bytes_are_found_by_the_reader_and_the_resharder(built, tmp_path, capsys) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    for p in sorted((built / "shards").glob("*")):
        (shards / p.name).write_bytes(p.read_bytes())
    damaged = sorted(shards.glob("*.tar"))[1]
    key = _flip_entropy_byte(damaged)
    check = verify_shard(str(damaged))
    assert check.mismatched == {key: ["jpg"]} and not check.error

    # Unverified, the damaged JPEG still decodes: it would train as corrupted pixels.
    plain = ShardReader()
    rows = [t for t in plain(str(damaged))]
    keys = [k for t in rows for k in t.column("key").to_pylist()]
    image = rows[0].column("jpg")[keys.index(key)].as_py()
    assert decode_for_size(image, 32).shape[2] == 3
    named: list[tuple[str, str, list[str]]] = []
    verified = ShardReader(verify=True, on_mismatch=lambda *a: named.append(a))
    kept = [k for t in verified(str(damaged)) for k in t.column("key").to_pylist()]
    assert kept == [k for k in keys if k != key] and verified.mismatched == 1
    assert named == [(str(damaged), key, ["jpg"])]

    uid = json.loads(next(s for s in iter_shard(str(damaged), decode=False) if s["__key__"] == key)["json"])[
        "uid"
    ]
    subset = built / "subsets" / "no_filter.npy"
    for verify, out in ((False, tmp_path / "copied"), (True, tmp_path / "verified")):
        argv = ["--shards", str(shards), "--subset", str(subset), "--out", str(out)] + (
            ["--verify"] if verify else []
        )
        assert reshard_job.main(argv) == 0
        summary = json.loads((out / "reshard.json").read_text())
        written = {s["json"]["uid"] for p in sorted(out.glob("*.tar")) for s in iter_shard(str(p))}
        assert (uid in written) is (not verify)
        if verify:
            assert summary["checksum_mismatches"] == 1 and key in summary["mismatched_first"][0]
            err = capsys.readouterr().err
            assert f"checksum mismatch, not copied: {damaged} {key} (jpg)" in err
    assert np.load(subset).size > 30
