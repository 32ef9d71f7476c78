"""negCLIPLoss in the build's two steps (pipeline/stages/score_stages.py), without Ray: each embeddings
file's vectors grouped by uid range, each range scored alone, equal to the one-process rule over the pool."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import schema as S
from pipeline.common.storage import LOCAL
from pipeline.filters import embedding as E
from pipeline.stages import score_stages as SS
from pipeline.stages.buckets import read_bucket, uid_buckets

PARAMS = {"temperature": 0.01, "batch_size": 16, "batches": 2, "seed": 4}


def _unit(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_ranges_scored_alone_equal_the_pool_scored_at_once(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    uids = [f"{int(a):016x}{int(b):016x}" for a, b in rng.integers(0, 2**64, (320, 2), dtype=np.uint64)]
    image = _unit(rng.standard_normal((320, 8)))
    text = _unit(image + 0.7 * rng.standard_normal((320, 8)))
    pool = [*uids[:300], "not-a-uid"]  # the last 20 have embeddings but are not in the pool
    # file 0: rows 0-199; file 1: rows 150-319 with other vectors for 150-199 (the first file gives them)
    np.savez(tmp_path / "a.npz", uid=np.array(uids[:200]), img=image[:200], txt=text[:200])
    np.savez(tmp_path / "b.npz", uid=np.array([*uids[150:], "not-a-uid"]),
             img=np.vstack([image[150:200][::-1], image[200:], image[:1]]), txt=np.vstack([text[150:], text[:1]]))  # fmt: skip
    n_buckets, groups = 5, E.neg_clip_groups(len(pool), PARAMS["batch_size"])
    assert groups == 4  # ranges and buckets do not line up
    table = pa.table({"uid": pool})
    bucket = uid_buckets(table.column("uid"), n_buckets)
    rows = [str(tmp_path / f"pool{b}.parquet") for b in range(n_buckets)]
    for b in range(n_buckets):
        pq.write_table(table.filter(pa.array(bucket == b)), rows[b])
    monkeypatch.setattr(SS, "RANGES_PER_FILE", 3)  # two vectors files per embeddings file
    for s, f in enumerate(["a.npz", "b.npz"]):
        out = lambda blk, s=s: str(tmp_path / f"v{s}-{blk}.parquet")  # noqa: E731
        SS.group_vectors(str(tmp_path / f), s, ("img", "txt"), groups, out, LOCAL)
    assert sorted(p.name for p in tmp_path.glob("v*.parquet")) == [
        "v0-0.parquet",
        "v0-1.parquet",
        "v1-0.parquet",
        "v1-1.parquet",
    ]
    scored = [str(tmp_path / f"g{g}.parquet") for g in range(groups)]
    for g in range(groups):
        pool_files = [rows[b] for b in SS.overlapping(g, groups, n_buckets)]
        vectors = [str(tmp_path / f"v{s}-{g // 3}.parquet") for s in range(2)]
        SS.score_group(vectors, pool_files, g, groups, PARAMS, scored[g], LOCAL, n_buckets)
    got = {}
    for b in range(n_buckets):
        t = read_bucket([scored[g] for g in SS.overlapping(b, n_buckets, groups)], b, LOCAL)
        assert set(t.column("uid").to_pylist()) <= set(table.filter(pa.array(bucket == b))["uid"].to_pylist())
        got.update(zip(t.column("uid").to_pylist(), t.column("score").to_pylist(), strict=True))
    assert sorted(got) == sorted(uids[:300])  # each pool uid with an embedding once; none else

    want = E.neg_clip_loss_scores(
        image[:300], text[:300], S.uids_to_u8pairs(uids[:300]), tau=0.01, batch_size=16, batches=2,
        seed=4, groups=groups,
    )  # fmt: skip
    np.testing.assert_array_equal([got[u] for u in uids[:300]], want)
    # the filter over the whole table keeps the same rows (invalid uid: no embedding)
    one = E.neg_clip_loss(table, (E.Embeddings(uids, image), E.Embeddings(uids, text)), 0.3, **{
        "tau": 0.01, "batch_size": 16, "batches": 2, "seed": 4})  # fmt: skip
    order = np.lexsort((np.array(uids[:300]), -want))
    assert set(np.flatnonzero(one.keep)) == set(order[: round(0.3 * 300)].tolist())
    assert one.reason[-1] == "missing_embedding"
