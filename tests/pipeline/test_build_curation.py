"""The build's curation stage end to end on the served demo pool: decontamination and semantic dedup found
against the planted truth, with every input row still holding exactly one status."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import schema as S
from pipeline.build import build
from pipeline.common.config import merge
from pipeline.config import BUILD_PRESETS
from pipeline.demo.planted import curation_figures
from tests.fixtures.build_runs import snapshot

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def curated(ray_local, demo_pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("curated")
    ref = str(Path(demo_pool.pool_dir) / "eval" / "reference.parquet")
    cfg = dataclasses.replace(BUILD_PRESETS["demo"], metadata=str(demo_pool.metadata_path), output=str(out))
    cfg = merge(
        cfg,
        {
            "samples_per_shard": 200,
            "part_size": 150,
            # clusters of ~100 rows, each group a task of its own
            "dedupe": {"semantic": True, "semantic_cluster_rows": 100},
            "decontam": {"reference": ref},
        },
    )
    return cfg, build(cfg, log=lambda m: None)


def test_planted_duplicates_and_leaks_are_found(curated, demo_pool):
    cfg, result = curated
    status = pq.read_table(os.path.join(cfg.output, "metadata", "status.parquet"))
    fig = curation_figures(demo_pool.truth, status)
    assert fig["semantic_planted_pairs"] == 12 and fig["leaks_planted"] == 6
    assert fig["semantic_recall"] >= 0.95 and fig["semantic_precision"] >= 0.95, fig
    assert fig["leak_recall"] >= 0.95 and fig["false_leaks"] == 0, fig
    assert result.curation["eval_leaks"] == {"colours": 2, "hierarchy": 1, "retrieval": 1, "shapes": 2}
    assert result.curation["clusters"] == 6  # ⌈504 rows left after the leaks / 100⌉


def test_every_row_keeps_one_status_and_leaks_are_in_no_subset(curated, demo_pool):
    cfg, result = curated
    snap = snapshot(cfg.output)
    assert len(snap["status"]) == demo_pool.truth.num_rows == result.n_input
    leaks = {u for u, s in snap["status"] if s.startswith(S.EVAL_LEAK + ":")}
    success = {u for u, s in snap["status"] if s == S.STATUS_SUCCESS}
    assert set(snap["members"]) == success  # the shards hold the successes, each once
    for name, uids in snap["subsets"].items():
        assert not set(uids) & leaks, name
    # the metadata scope lists every valid uid but the leaks (check_invariants' rule, less the leaks)
    valid = {u for u, _ in snap["status"] if S.is_valid_uid(u)}
    assert set(snap["subsets"]["no_filter"]) == valid - leaks
    # the statuses are the truth's with the curation stage on
    truth = dict(
        zip(
            demo_pool.truth.column("uid").to_pylist(),
            demo_pool.truth.column("expected_curated_status").to_pylist(),
            strict=True,
        )
    )
    assert Counter(dict(snap["status"]).values()) == Counter(truth.values())
    assert result.status_counts == dict(sorted(Counter(truth.values()).items()))


def test_a_semantic_duplicate_names_a_kept_row(curated, demo_pool):
    cfg, _ = curated
    st = pq.read_table(os.path.join(cfg.output, "metadata", "status.parquet")).to_pydict()
    status = dict(zip(st["uid"], st["status"], strict=True))
    meta = demo_pool.metadata
    score = dict(zip(meta["uid"].to_pylist(), meta[S.CLIP_L14].to_pylist(), strict=True))
    for u, s, d in zip(st["uid"], st["status"], st[S.DUPLICATE_OF], strict=True):
        assert (s == S.STATUS_SEMANTIC_DUPLICATE) == (d is not None)
        if d is not None:  # the copy with the better (stand-in) CLIP L/14 score stays, ties by uid
            assert status[d] == S.STATUS_SUCCESS and (-score[d], d) < (-score[u], u)


def test_missing_embeddings_stop_the_build_before_download(ray_local, demo_pool, tmp_path):
    cfg = dataclasses.replace(
        BUILD_PRESETS["demo"], metadata=str(demo_pool.metadata_path), output=str(tmp_path)
    )
    cfg = merge(cfg, {"dedupe": {"semantic": True, "embeddings": str(tmp_path / "none.npz")}})
    with pytest.raises(FileNotFoundError, match="dedupe.semantic: no image embeddings at .*none.npz"):
        build(cfg, log=lambda m: None)
    cfg = merge(cfg, {"dedupe": {"semantic": False}, "decontam": {"reference": str(tmp_path / "r.parquet")}})
    with pytest.raises(FileNotFoundError, match="decontam.reference: no such file"):
        build(cfg, log=lambda m: None)
    # a reference with embeddings needs the pool's: here dedupe.embeddings points nowhere
    cfg = merge(
        cfg, {"decontam": {"reference": str(Path(demo_pool.pool_dir) / "eval" / "reference.parquet")}}
    )
    with pytest.raises(FileNotFoundError, match="decontam.reference: no image embeddings at .*none.npz"):
        build(cfg, log=lambda m: None)
    assert not (tmp_path / "shards").exists()  # stopped at the start: nothing downloaded


def test_datacomp_pool_rules_leave_no_leak_and_no_hash_refusal(curated, demo_pool, tmp_path):
    """``pool=datacomp`` (jobs/track/datacomp/pool.py) on the same served demo pool: no row ends
    ``eval_leak`` or ``hash_mismatch`` — the planted leaks stay in the pool and in ``no_filter``, the rows
    whose body differs from the metadata's sha256 are downloaded — while our default build refuses both."""
    from jobs.track.datacomp.pool import datacomp_pool

    cfg, _ = curated
    ours = Counter(s.split(":")[0] for _, s in snapshot(cfg.output)["status"])
    assert ours[S.EVAL_LEAK] == 6 and ours[S.STATUS_HASH_MISMATCH] > 0, ours
    dc = datacomp_pool(dataclasses.replace(cfg, output=str(tmp_path / "datacomp")))
    assert (dc.download.verify_sha256, dc.download.retries, dc.decontam.reference) == (False, 0, "")
    build(dc, log=lambda m: None)
    snap = snapshot(dc.output)
    theirs = Counter(s.split(":")[0] for _, s in snap["status"])
    assert theirs[S.EVAL_LEAK] == 0 and theirs[S.STATUS_HASH_MISMATCH] == 0, theirs
    assert (
        theirs[S.STATUS_SUCCESS] >= ours[S.STATUS_SUCCESS] + ours[S.EVAL_LEAK] + ours[S.STATUS_HASH_MISMATCH]
    )
    assert set(snap["subsets"]["no_filter"]) == {u for u, _ in snap["status"] if S.is_valid_uid(u)}


@pytest.mark.parametrize(("group_memberships", "d"), [(400, 32), (1 << 18, 160)])
def test_semantic_stage_on_tasks_equals_the_all_pairs_rule(
    ray_local, monkeypatch, tmp_path, group_memberships, d
):
    """The Ray stage on a continuum k-means splits, its vectors read in place from two embeddings files by
    the tasks: the exact rule's decisions, however many tasks, with the guests compared in full (32-d) and
    screened in a basis (160-d), fitted on a third of the rows, in groups of 400 memberships (wide
    clusters' guests over several) and in one; a row no file holds stays and is not counted; rows the
    build no longer holds as successes (every seventh) are found in pairs but take no part in the rule."""
    import numpy as np

    from pipeline.common.storage import Storage
    from pipeline.config import DedupeConfig
    from pipeline.dedup import curation_rules as CR
    from pipeline.dedup import semantic as SD
    from pipeline.dedup import semantic_stage as SS
    from tests.fixtures.continuum import brute_force_pairs, continuum

    uids, vectors, _ = continuum(3000, d, seed=9)
    priority = np.random.default_rng(9).random(len(uids))
    monkeypatch.setattr(SS, "_GROUP_BYTES", group_memberships * (2 * d + SS._MEMBERSHIP_BYTES))
    monkeypatch.setattr(SS, "_FIT_BYTES", 1000 * 4 * d)  # a fit on 1,000 of the 3,000 rows
    rows = np.arange(len(uids))[::-1]  # the stage sees rows in any order
    files = [str(tmp_path / f"{f}.npz") for f in range(2)]
    for f, path in enumerate(files):  # every other row in each file, so both files feed every cluster
        np.savez(path, uid=uids[f::2], emb=vectors[f::2])
    gone = np.zeros(len(uids), bool)
    gone[::7] = True
    named = np.append(uids[rows][~gone[rows]], "f" * 32)  # and a row without a vector
    cfg = DedupeConfig(semantic=True, semantic_cluster_rows=100)
    store = Storage()
    said = []
    pairs, n_clusters, n = SS.semantic_pairs(files, "emb", cfg, store, log=said.append)
    assert n == len(uids)
    split = [int(m.split("(")[1].split()[0]) for m in said if "clusters over several" in m]
    assert any("30 clusters fitted on 1000 (" in m for m in said), said
    assert any("a Lloyd step over ~3000 rows" in m for m in said), said  # the fit saw 33 rows a centroid
    assert (split[0] > 0) == (group_memberships < 1000), said
    cand = CR.Candidates(*pairs)
    at = {u: k for k, u in enumerate(cand.named().to_pylist())}
    asked = np.array([u in at for u in named])  # a bucket answers for the named uids only
    live_at = np.array([at[u] for u in named[asked]], np.int64)
    live = CR.BucketFacts(*_no_leaks(), live_at, np.append(priority[rows][~gone[rows]], 9.0)[asked])
    out = CR.decide(cand, [live], semantic=True)
    rel = out.relabels.to_pydict()
    assert "f" * 32 not in rel[S.UID] and set(rel[S.STATUS]) == {S.STATUS_SEMANTIC_DUPLICATE}
    i, j, s = brute_force_pairs(vectors, 0.9)
    stay = ~gone[i] & ~gone[j]
    assert (~stay).sum() > 50
    i, j, s = i[stay], j[stay], s[stay]
    rank = np.empty(len(uids), dtype=np.int64)
    rank[SD.rank_order(uids, priority)] = np.arange(len(uids))
    want = SD.greedy_duplicates(rank, i, j, s)
    where = {u: k for k, u in enumerate(uids.tolist())}
    got = np.full(len(uids), -1)
    got[[where[u] for u in rel[S.UID]]] = [where[u] for u in rel[S.DUPLICATE_OF]]
    assert n_clusters == 30 and (want >= 0).sum() > 100
    np.testing.assert_array_equal(got, want)


def _no_leaks():
    import numpy as np
    import pyarrow as pa

    return pa.array([], pa.string()), np.zeros(0, object), np.zeros(0, object)
