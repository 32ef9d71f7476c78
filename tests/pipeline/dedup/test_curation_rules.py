"""pipeline.dedup.curation_rules without Ray: pieces of pairs merged over the uids they name, and the
decisions over them equal the greedy rule written out over uid pairs."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline import schema as S
from pipeline.dedup import curation_rules as CR
from pipeline.dedup import semantic as SD


def _pieces(rng, uids: np.ndarray, n_pieces: int) -> tuple[list[tuple], list[tuple[str, str, float]]]:
    """Pieces as the group tasks return them (their sorted uids, int32 positions, cosine), and every pair
    they hold as (uid, uid, cosine); pieces share uids and some pairs are in two pieces."""
    pieces, every = [], []
    for _ in range(n_pieces):
        mine = np.unique(rng.choice(uids, size=rng.integers(2, 40), replace=False))
        m = int(rng.integers(0, 60))
        i, j = rng.integers(0, len(mine), m), rng.integers(0, len(mine), m)
        s = np.round(rng.uniform(0.9, 1.0, m), 2)  # rounded: equal cosines, so ties are decided too
        used, at = np.unique(np.r_[i, j], return_inverse=True)  # a piece names only the uids its pairs use
        mine, i, j = mine[used], at[:m], at[m:]
        pieces.append((pa.array(mine.tolist()), i.astype(np.int32), j.astype(np.int32), s))
        every += list(zip(mine[i].tolist(), mine[j].tolist(), s.tolist(), strict=True))
    return pieces, every


def test_merged_pieces_name_every_pair_by_its_uids():
    rng = np.random.default_rng(3)
    uids = np.array([f"{v:032x}" for v in rng.integers(0, 2**62, 300)])
    pieces, every = _pieces(rng, uids, 25)
    pieces.insert(3, CR.merge_pairs([]))  # an empty piece is skipped
    names, i, j, s = CR.merge_pairs(pieces)
    got = names.to_pylist()
    assert got == sorted(set(got)) and set(got) == {u for p in every for u in p[:2]}
    assert i.dtype == np.int64 and j.dtype == np.int64
    assert list(zip(names.take(pa.array(i)).to_pylist(), names.take(pa.array(j)).to_pylist(), s.tolist(),
                    strict=True)) == every  # fmt: skip


def test_decisions_over_merged_pieces_equal_the_greedy_rule_over_uid_pairs():
    """Some named uids are not live rows (a pair with one is dropped), some leak (out before the rule),
    some have no score (last), a pair can join a uid to itself (ignored) and pairs repeat."""
    rng = np.random.default_rng(5)
    uids = np.array([f"{v:032x}" for v in rng.integers(0, 2**62, 200)])
    pieces, every = _pieces(rng, uids, 40)
    every.append((uids[0], uids[0], 0.95))
    pieces.append((pa.array([uids[0]]), np.zeros(1, np.int32), np.zeros(1, np.int32), np.array([0.95])))
    live = uids[rng.random(len(uids)) < 0.9]
    score = np.where(rng.random(len(live)) < 0.2, np.nan, np.round(rng.uniform(0, 1, len(live)), 1))
    leaks = live[:5]
    names, i, j, s = CR.merge_pairs(pieces)
    cand = CR.Candidates(names, i, j, s, leak_uid=pa.array(leaks.tolist()),
                         leak_task=np.array(["imagenet"] * 5, object), leak_key=np.arange(5).astype(str).astype(object))  # fmt: skip
    at = {u: k for k, u in enumerate(cand.named().to_pylist())}
    asked = np.array([u in at for u in live])  # a bucket answers for the named uids only
    facts = CR.BucketFacts(pa.array([], pa.string()), np.zeros(0, object), np.zeros(0, object),
                           np.array([at[u] for u in live[asked]], np.int64), score[asked])  # fmt: skip
    assert 0 < asked.sum() < len(live)
    out = CR.decide(cand, [facts], semantic=True)
    rel = out.relabels.to_pydict()
    got = {u: d for u, st, d in zip(rel[S.UID], rel[S.STATUS], rel[S.DUPLICATE_OF], strict=True)
           if st == S.STATUS_SEMANTIC_DUPLICATE}  # fmt: skip
    # the rule written out: the live rows without leaks, ranked; every uid pair between two of them
    alive = [k for k in range(len(live)) if live[k] not in set(leaks)]
    a_uid, a_score = live[alive], score[alive]
    rank = np.empty(len(a_uid), np.int64)
    rank[SD.rank_order(a_uid, a_score)] = np.arange(len(a_uid))
    at = {u: k for k, u in enumerate(a_uid.tolist())}
    keep = [(at[x], at[y], c) for x, y, c in every if x in at and y in at and x != y]
    pi, pj, ps = (np.array(v) for v in zip(*keep, strict=True))
    want = SD.greedy_duplicates(rank, pi, pj, ps.astype(np.float64))
    assert len(got) > 10 and out.n_semantic == len(got)
    assert got == {a_uid[k]: a_uid[want[k]] for k in np.flatnonzero(want >= 0)}
    assert sum(out.leaks_by_task.values()) == 5
