"""Each of the build's map-reduce stages equals its whole-pool rule, without Ray: bucketed files read back
what was written, the pHash near-duplicate bands and greedy equal ``decisions.near_duplicates``, and the
whole-pool cuts of ``clip_score`` and ``random`` (radix selection over buckets) equal DataComp's rules over
the concatenated pool, ties, missing scores and empty selections included."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from pipeline import schema as S
from pipeline.common.storage import LOCAL
from pipeline.config import FilterConfig
from pipeline.dedup.decisions import bands, near_duplicates
from pipeline.filters import datacomp as F
from pipeline.stages import filter_stages as FS
from pipeline.stages import score_stages as SS
from pipeline.stages.buckets import BucketWriter, read_bucket, uid_buckets, write_buckets
from pipeline.stages.image_stages import _first_shared_band, greedy_drops
from pipeline.subsets.uid_files import arrow_u8pairs


def test_bucketed_files_give_back_each_buckets_rows_in_order(tmp_path):
    rng = np.random.default_rng(0)
    paths = []
    for f in range(3):
        w = BucketWriter(str(tmp_path / f"{f}.bkt"), LOCAL, flush_rows=7)  # several flushes a file
        for start in range(0, 40, 10):
            rows = np.arange(start, start + 10)
            w.add(pa.table({"f": np.full(10, f), "row": rows}), rng.integers(0, 5, 10))
        w.close()
        paths.append(str(tmp_path / f"{f}.bkt"))
    write_buckets(pa.table({"f": pa.array([], pa.int64()), "row": pa.array([], pa.int64())}), np.zeros(0),
                  str(tmp_path / "empty.bkt"), LOCAL)  # fmt: skip
    seen = []
    for b in range(5):
        t = read_bucket([*paths, str(tmp_path / "empty.bkt")], b, LOCAL)
        pairs = list(zip(t.column("f").to_pylist(), t.column("row").to_pylist(), strict=True))
        assert pairs == sorted(pairs)  # file order, then the order added
        seen += pairs
    assert sorted(seen) == [(f, r) for f in range(3) for r in range(40)]


def test_a_bucket_file_of_many_buckets_gives_one_back_and_refuses_what_is_not_one(tmp_path):
    """2,000 buckets over three flushes: a bucket's rows, the columns asked for, nothing of the others; a
    truncated or garbled file and a parquet file are refused in one line that names them."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng(2)
    path = str(tmp_path / "many.bkt")
    w = BucketWriter(path, LOCAL, flush_rows=10_000)
    n = 30_000
    buckets = rng.integers(0, 2000, n)
    vec = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(n * 4, dtype=np.float32)), 4)
    w.add(pa.table({"row": np.arange(n), "vec": vec}), buckets)
    w.close()
    for b in (0, 777, 1999):
        t = read_bucket([path], b, LOCAL)
        assert t.column_names == ["row", "vec"]
        assert t.column("row").to_pylist() == np.flatnonzero(buckets == b).tolist()
        assert read_bucket([path], b, LOCAL, ["row"]).column_names == ["row"]
    assert read_bucket([path], 2000, LOCAL).num_rows == 0
    data = open(path, "rb").read()
    garbled = data[:100] + bytes(len(data) - 130) + data[-30:]  # its tail intact, all else zeroed
    for name, body in (("cut.bkt", data[:-5]), ("short.bkt", b"x"), ("garbled.bkt", garbled)):
        (tmp_path / name).write_bytes(body)
        with pytest.raises(ValueError, match=f"{name}: not a bucket file"):
            read_bucket([str(tmp_path / name)], 0, LOCAL)
    pq.write_table(pa.table({"row": [1, 2]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="other.parquet: not a bucket file"):
        read_bucket([str(tmp_path / "other.parquet")], 0, LOCAL)


def test_uid_buckets_are_ranges_in_uid_order():
    words = np.random.default_rng(1).integers(0, 2**64 - 1, (1000, 2), np.uint64)
    uids = pa.array(sorted(f"{hi:016x}{lo:016x}" for hi, lo in words.tolist()))
    b = uid_buckets(uids, 7)
    assert (np.diff(b) >= 0).all() and set(b.tolist()) == set(range(7))
    step = -(-(1 << 64) // 7)  # the leading 64 bits, as Python integers: the range each uid falls in
    assert b.tolist() == [int(u[:16], 16) // step for u in uids.to_pylist()]
    assert (uid_buckets(pa.array(["not a uid", "x"]), 7) < 7).all()


def _hashes(n: int, rng) -> np.ndarray:
    """Random 64-bit hashes with planted near copies (1-5 bits away) and exact repeats."""
    h = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    src = rng.integers(0, n, n // 5)
    for i, s in zip(range(0, n, 5), src.tolist(), strict=False):
        flips = rng.choice(64, rng.integers(0, 6), replace=False)
        h[i] = h[s] ^ np.int64(sum(1 << int(b) for b in flips) - (1 << 64 if 63 in flips else 0))
    return h


@pytest.mark.parametrize("threshold", [0, 2, 4, 9])
def test_band_pairs_and_the_greedy_equal_the_whole_pool_near_duplicates(threshold):
    rng = np.random.default_rng(threshold)
    n = 3000
    h = _hashes(n, rng)
    uids = pa.array([f"{v:032x}" for v in rng.permutation(n) * 7919 + 13])
    want = near_duplicates(uids, pa.array(h), threshold)
    # the stages' way: reps = smallest uid per hash; pairs of reps within the threshold, each from the
    # first band they share; the greedy over the pairs; every other holder of a hash goes
    order = np.lexsort((np.asarray(uids.to_pylist()), h))
    hs, us = h[order], np.asarray(uids.to_pylist(), dtype=object)[order]
    rep = np.concatenate([[True], hs[1:] != hs[:-1]])
    hr, ur = hs[rep].view(np.uint64), us[rep]
    a, b = [], []
    for k, (shift, width) in enumerate(bands(threshold + 1)):
        value = (hr >> np.uint64(shift)) & np.uint64((1 << width) - 1)
        for v in np.unique(value):
            idx = np.flatnonzero(value == v)
            i, j = np.triu_indices(len(idx), 1)
            i, j = idx[i], idx[j]
            close = np.array([bin(int(x ^ y)).count("1") <= threshold for x, y in zip(hr[i], hr[j], strict=True)],
                             bool)  # fmt: skip
            own = _first_shared_band(hr[i], hr[j], threshold) == k
            i, j = i[close & own], j[close & own]
            a += np.minimum(ur[i], ur[j]).tolist()
            b += np.maximum(ur[i], ur[j]).tolist()
    assert len(set(zip(a, b, strict=True))) == len(a)  # every pair once
    dropped = set(S.u8pairs_to_uids(greedy_drops(arrow_u8pairs(pa.array(a, pa.string())),
                                                 arrow_u8pairs(pa.array(b, pa.string())))))  # fmt: skip
    dropped |= set(us[~rep].tolist())
    assert dropped == set(np.asarray(uids.to_pylist())[want].tolist())
    assert 0 < len(dropped) < n


def _job(names: list[str], n_rows: int, **filters) -> FS.FilterJob:
    return FS.FilterJob(None, tuple(names), FilterConfig(names=names, **filters), (), n_rows, "")


def _cuts(job: FS.FilterJob, buckets: list[pa.Table]) -> FS.FilterJob:
    """The selection passes as the build runs them, each bucket's summary from its own rows."""
    job = replace(job, cuts=FS.first_cuts(job))
    for _ in range(20):
        if all(c.done for c in job.cuts.values()):
            return job
        summaries = [FS.cut_summary(job, t) for t in buckets]
        job = replace(
            job, cuts={k: c if c.done else FS.advance(job, k, summaries) for k, c in job.cuts.items()}
        )
    raise AssertionError("the cuts did not converge")


def _pool(n: int, rng, scores: np.ndarray) -> pa.Table:
    uids = [f"{v:032x}" for v in rng.integers(0, 2**63, n)]
    uids[:3] = ["bad uid", "", "BAD"]  # invalid uids are rows of the pool too
    return pa.table({S.UID: uids, S.CLIP_L14: pa.array(scores, pa.float32())})


@pytest.mark.parametrize(
    ("case", "fraction", "nan_cut"),
    [("spread", 0.3, "datacomp"), ("ties", 0.3, "datacomp"), ("mostly_missing", 0.3, "datacomp"),
     ("mostly_missing", 0.3, "all_scored"), ("spread", 0.0001, "datacomp")],
)  # fmt: skip
def test_the_clip_score_cut_equals_datacomps_threshold(case, fraction, nan_cut):
    rng = np.random.default_rng(3)
    n = 20_000
    scores = {"spread": rng.normal(0.25, 0.05, n), "ties": np.round(rng.normal(0.25, 0.05, n), 2),
              "mostly_missing": np.where(rng.random(n) < 0.8, np.nan, rng.normal(0.25, 0.05, n))}[case]  # fmt: skip
    pool = _pool(n, rng, scores)
    want = F.clip_score_fraction(pool, S.CLIP_L14, fraction, nan_cut=nan_cut)
    spec = f"clip_score:fraction={fraction},nan_cut={nan_cut}"
    buckets = [pool.slice(a, 2500) for a in range(0, n, 2500)]
    job = _cuts(_job([spec], n), buckets)
    got = np.concatenate([_one(job, t) for t in buckets])
    assert (got == want.keep).all()


def _one(job: FS.FilterJob, t: pa.Table) -> np.ndarray:
    ((name, params),) = FS.cut_keys(job).values()
    (key,) = FS.cut_keys(job)
    cut = job.cuts[key]
    return (FS._random_cut(t, params, cut) if name == "random" else FS._clip_cut(t, params, cut)).keep


@pytest.mark.parametrize("fraction", [0.00001, 0.3, 0.5, 1.0])  # 0.00001 of 30,000 rows: none
def test_the_random_cut_equals_the_random_baseline(fraction):
    rng = np.random.default_rng(4)
    n = 30_000
    pool = _pool(n, rng, rng.random(n))
    want = F.random_subset(pool, fraction, seed=5)
    buckets = [pool.slice(a, 3000) for a in range(0, n, 3000)]
    job = _cuts(_job([f"random:fraction={fraction},seed=5"], n), buckets)
    got = np.concatenate([_one(job, t) for t in buckets])
    assert (got == want.keep).all() and got.sum() == F.random_count(fraction, n)


@pytest.mark.parametrize(
    ("case", "fraction"), [("spread", 0.3), ("ties", 0.3), ("ties", 0.5), ("spread", 0.00001)]
)
def test_the_norm_sim_cut_equals_the_whole_pool_top_fraction(case, fraction):
    """NormSim scored per file and cut over the buckets keeps the rows ``top_fraction`` keeps over the
    whole pool: ties by uid, rows without an embedding ``missing_embedding``, the rank among the scored."""
    from pipeline.filters import embedding as E

    rng = np.random.default_rng(6)
    n = 20_000
    score = {"spread": rng.random(n), "ties": np.round(rng.random(n), 2)}[case]
    score[rng.random(n) < 0.1] = np.nan  # no embedding
    pool = _pool(n, rng, np.zeros(n))
    spec = f"norm_sim:fraction={fraction},target_file=t.npy"
    job = _job([spec], n)
    ((key, _, params),) = SS.streamed(job)
    pool = pool.append_column(SS.score_column(key), pa.array(score, pa.float64()))
    want = E.top_fraction(pool, score, ~np.isnan(score), fraction, f"norm_sim_not_in_top_{100 * fraction:g}%")
    buckets = [pool.slice(a, 2500) for a in range(0, n, 2500)]
    job = _cuts(job, buckets)
    got = [SS.score_cut(t, "norm_sim", params, job.cuts[key]) for t in buckets]
    assert np.concatenate([g.reason for g in got]).tolist() == want.reason.tolist()
    assert 0 < (want.reason == "missing_embedding").sum() < n
