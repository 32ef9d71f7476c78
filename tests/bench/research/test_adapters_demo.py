"""bench/research/adapters_demo.py's eval-set expansion: one sample per (image, caption), uid shared per image."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.research import adapters_demo
from pipeline.schema import is_valid_uid
from pipeline.shards.reader import iter_shard
from pipeline.shards.writer import write_shard
from training.infer.scoring import sample_uid


def _set(tmp_path: Path) -> Path:
    samples = [
        {"__key__": "000000", "jpg": b"img0", "txt": "a red circle\na small red circle\n\nthe red one"},
        {"__key__": "000001", "jpg": b"img1", "txt": "a blue star\n"},
        {"__key__": "000002", "jpg": b"img2", "txt": ""},
    ]
    (tmp_path / "ret" / "test").mkdir(parents=True)
    write_shard(str(tmp_path / "ret" / "test" / "0.tar"), samples)
    return tmp_path / "ret"


def test_pairs_share_a_scorer_uid_per_image(tmp_path):
    paths, n_img, n_pairs = adapters_demo.write_retrieval_pairs(_set(tmp_path), tmp_path / "pairs")
    assert (n_img, n_pairs) == (3, 4)  # blank lines and caption-less images give no pair
    rows = [s for p in paths for s in iter_shard(p)]
    assert [r["__key__"] for r in rows] == ["000000_0", "000000_1", "000000_2", "000001_0"]
    assert [r["txt"] for r in rows] == ["a red circle", "a small red circle", "the red one", "a blue star"]
    assert [r["jpg"] for r in rows] == [b"img0"] * 3 + [b"img1"]
    uids = [sample_uid(r["__key__"], r["json"]) for r in rows]  # what the embedding job will write
    assert all(is_valid_uid(u) for u in uids)
    assert len(set(uids[:3])) == 1 and uids[3] != uids[0]


def test_newest_checkpoint(tmp_path):
    for step in ("00000050", "00000250", "00000100"):
        (tmp_path / f"checkpoint_{step}").mkdir()
        (tmp_path / f"checkpoint_{step}" / "weights.pt").write_bytes(b"")
    (tmp_path / "checkpoint_00000300").mkdir()  # incomplete: no weights
    assert adapters_demo.newest_checkpoint(str(tmp_path)).endswith("checkpoint_00000250")
    assert adapters_demo.newest_checkpoint(str(tmp_path / "checkpoint_00000050")).endswith("_00000050")
    with pytest.raises(FileNotFoundError, match="weights.pt"):
        adapters_demo.newest_checkpoint(str(tmp_path / "checkpoint_00000300"))
