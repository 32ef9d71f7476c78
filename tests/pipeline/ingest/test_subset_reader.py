"""Training from the build's shards through a subset ``.npy`` sees exactly the samples resharding writes.

The pool: demo shards keyed by uid (the build's layout) plus one shard whose keys are not uids and whose
``.json`` carries them (the layout resharding also reads). The subset lists some uids twice (up-sampling),
some not at all, and some that no shard holds. The reference is ``pipeline.subsets.reshard.reshard`` on
the same pool and subset: the multiset of uids it writes.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import ray

from pipeline.ingest.subset_reader import SubsetShardReader, row_uid
from pipeline.shards.reader import iter_shard
from pipeline.shards.writer import write_shard
from pipeline.subsets.reshard import reshard
from pipeline.subsets.uid_files import write_subset
from tests.fixtures.train_shards import demo_samples, write_demo_shards


def pool(tmp: Path) -> tuple[list[str], list[str]]:
    """(shard paths, every uid in the pool)."""
    paths = write_demo_shards(tmp / "pool", n_shards=3, per_shard=20, size=16)
    renamed = demo_samples(10, size=16, seed=9)
    for i, s in enumerate(renamed):
        s["__key__"] = f"sample{i:04d}"  # not a uid: the json's uid counts
    paths.append(str(tmp / "pool" / "00000003.tar"))
    write_shard(paths[-1], renamed)
    uids = [json.loads(s["json"])["uid"] for p in paths for s in iter_shard(p, decode=False)]
    return paths, uids


def subset_file(tmp: Path, uids: list[str]) -> tuple[str, list[str]]:
    rng = np.random.default_rng(0)
    chosen = list(rng.choice(uids, size=len(uids) // 2, replace=False))
    listed = chosen + chosen[:7] + chosen[-3:]  # ten listed twice: up-sampled
    listed += [f"{'f' * 28}{i:04x}" for i in range(5)]  # uids no shard holds
    path = str(tmp / "subset.npy")
    write_subset(listed, path)
    return path, listed


def resharded_uids(paths: list[str], subset: str, out: Path) -> Counter:
    res = reshard(paths, subset, str(out), samples_per_shard=16)
    assert res.n_missing == 5
    return Counter(s["json"]["uid"] for p in sorted(out.glob("*.tar")) for s in iter_shard(str(p)))


def test_subset_reader_yields_what_reshard_writes(tmp_path) -> None:
    paths, uids = pool(tmp_path)
    subset, listed = subset_file(tmp_path, uids)
    reader = SubsetShardReader(subset, chunk_rows=8)
    tables = [t for p in paths for t in reader(p)]
    assert all(t.column_names == ["key", "jpg", "txt"] for t in tables)
    keys = [k for t in tables for k in t.column("key").to_pylist()]
    by_key = {s["__key__"]: json.loads(s["json"])["uid"] for p in paths for s in iter_shard(p, decode=False)}
    seen = Counter(by_key[k] for k in keys)
    want = Counter(u for u in listed if u in set(uids))
    assert seen == want and sum(seen.values()) == len(uids) // 2 + 10
    assert seen == resharded_uids(paths, subset, tmp_path / "resharded")
    # The copies of an up-sampled uid carry the same picture and caption.
    rows = {}
    for t in tables:
        for k, jpg, txt in zip(*(t.column(c).to_pylist() for c in ("key", "jpg", "txt")), strict=True):
            assert rows.setdefault(k, (jpg, txt)) == (jpg, txt)


def test_row_uid_reads_the_key_then_the_json() -> None:
    uid = "0123456789abcdef" * 2
    assert row_uid(uid, None) == uid and row_uid(uid.upper(), None) is None  # as resharding reads keys
    assert row_uid("k1", json.dumps({"uid": uid}).encode()) == uid
    assert row_uid("k1", b"not json") is None and row_uid("k1", json.dumps({"uid": "x"}).encode()) is None


@pytest.mark.ray
def test_training_dataset_of_a_subset_holds_exactly_its_samples(ray_local, tmp_path) -> None:
    """The training dataset the trainer builds (read → shuffle → decode) from the pool and the subset."""
    from pipeline.common.storage import LOCAL
    from pipeline.ingest.dataset import build_train_dataset
    from pipeline.ingest.tokenizer import train_tokenizer
    from training.config import DataConfig

    paths = write_demo_shards(tmp_path / "pool", n_shards=4, per_shard=24, size=32)
    uids = [s["__key__"] for p in paths for s in iter_shard(p, decode=False)]
    subset, listed = subset_file(tmp_path, uids)
    tok = train_tokenizer([f"a photo of a shape {i}" for i in range(50)], vocab_size=300)
    cfg = DataConfig(shards=str(tmp_path / "pool"), subset=subset, shuffle_window=16, decode_batch_size=8,
                     decode_cpus=0.5, shuffle_seed=3)  # fmt: skip
    ds = build_train_dataset(cfg, LOCAL, tok, 32, 16)
    # one task loaded the subset into the object store: the read tasks never open the file
    ray.get(ds_subset_ref(ds))
    Path(subset).rename(tmp_path / "moved.npy")
    keys = [k for b in ds.iter_batches(batch_size=None, batch_format="numpy") for k in b["key"]]
    assert Counter(keys) == Counter(u for u in listed if u in set(uids))
    Path(tmp_path / "moved.npy").rename(subset)
    assert Counter(keys) == resharded_uids(paths, subset, tmp_path / "resharded")


def ds_subset_ref(ds):
    """The object reference of the subset the dataset's read tasks take (its datasource's reader)."""
    import gc

    from pipeline.ingest.dataset import SharedSubset

    shared = [o for o in gc.get_objects() if isinstance(o, SharedSubset)]
    assert shared, "the read tasks take no shared subset"
    return shared[-1].ref


@pytest.mark.ray
def test_resampled_reads_draw_shards_with_replacement_every_execution(ray_local, tmp_path) -> None:
    """``sampling="resampled"`` (open_clip's --dataset-resampled): each execution (an epoch) reads as many
    shards as there are, drawn with replacement — some twice, some not at all — from a draw seeded by the
    seed and the execution; the same seed repeats the draws."""
    from pipeline.shards.ray_reader import read_shards

    paths = write_demo_shards(tmp_path / "pool", n_shards=6, per_shard=5, size=8)
    shard_of = {s["__key__"]: i for i, p in enumerate(paths) for s in iter_shard(p, decode=False)}

    def epochs(seed: int, n: int) -> list[Counter]:
        """Per execution: how many times each shard was read (its 5 rows each time)."""
        ds = read_shards(paths, resample=seed)
        out = []
        for _ in range(n):
            rows = Counter(shard_of[k] for k in ds.to_pandas()["key"])
            out.append(Counter({shard: count // 5 for shard, count in rows.items()}))
        return out

    draws = epochs(7, 3)
    for draw in draws:
        assert sum(draw.values()) == 6  # as many shard reads as shards
    assert any(max(d.values()) > 1 for d in draws)  # with replacement
    assert len({tuple(sorted(d.items())) for d in draws}) > 1  # a fresh draw every execution
    assert epochs(7, 3) == draws  # seeded
