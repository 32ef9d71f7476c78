"""The curation stage's decisions from its candidates, without Ray: what one uid bucket knows, and the rule.

The Ray stage (``curation_stage``) finds candidates over every row the embeddings files hold: the uid
pairs above the semantic threshold and the uids that copy an eval picture by embedding. Which of those
rows count — rows the build still holds as ``success`` — and which copy of a group stays is known per uid
bucket, so each bucket gives its ``BucketFacts`` and ``decide`` applies, over the union:

1. a ``success`` row whose pHash is within the threshold of an eval picture's leaks it; else one the
   embedding candidates name (a uid two files name takes the later file's answer);
2. the greedy rule (``semantic.greedy_duplicates``) over the pairs whose two ends are ``success`` rows
   that do not leak, in keep-first order: score descending (NaN last), ties by uid.

Restricting the pairs after they are found gives the rule on the remaining rows exactly: a row's
decision depends only on its pairs with the other remaining rows (docs/decisions/0087, 0102).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import schema as S
from pipeline.config import DecontamConfig
from pipeline.dedup import eval_leaks as EL
from pipeline.dedup import semantic as SD

_PHASH_BLOCK = 1 << 16  # rows matched against the eval reference's pHashes at once
PRIORITY = "priority"  # the keep-first score column of a bucket's rows (the metadata's CLIP L/14 score)
RELABELS = pa.schema([pa.field(S.UID, pa.string()), pa.field(S.STATUS, pa.string()),
                      pa.field(S.DUPLICATE_OF, pa.string()), pa.field(S.LEAK_OF, pa.string())])  # fmt: skip


def _strings(values) -> pa.Array:
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        return values.cast(pa.string())
    return pa.array([str(v) for v in values], pa.string())


@dataclass
class Candidates:
    """What the embeddings files say, over all their rows: the pairs above the semantic threshold as
    positions in the sorted uids they name (24 B a pair and each uid once, not two uid strings a pair:
    docs/decisions/0107), and the leaks by embedding."""

    pair_names: pa.Array = field(default_factory=lambda: pa.array([], pa.string()))
    pair_i: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pair_j: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pair_s: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    leak_uid: pa.Array = field(default_factory=lambda: pa.array([], pa.string()))  # by embedding
    leak_task: np.ndarray = field(default_factory=lambda: np.zeros(0, object))
    leak_key: np.ndarray = field(default_factory=lambda: np.zeros(0, object))
    n_clusters: int = 0
    n_rows: int = 0  # rows the files hold

    def named(self) -> pa.Array:
        """Every uid a candidate names, once, sorted: what the uid buckets are asked about."""
        return self.index()[0]

    def index(self) -> tuple[pa.Array, np.ndarray]:
        """``named()``, and the position in it of each of ``pair_names``."""
        names = _strings(self.pair_names)
        if not len(self.leak_uid):
            return names, np.arange(len(names))  # sorted and once each already
        named, where = sorted_unique(pa.concat_arrays([names, _strings(self.leak_uid)]))
        return named, where[: len(names)]


def sorted_unique(values: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """``values`` → (its distinct strings sorted, each value's position among them), by one sort: a hash
    table of the strings (``pc.unique``, ``pc.index_in``) peaks at ~300 B a string, the sort at ~60
    (docs/decisions/0112)."""
    values = _strings(values)
    if not len(values):
        return values, np.zeros(0, np.int64)
    order = pc.sort_indices(values).to_numpy()
    ordered = values.take(pa.array(order))
    new = np.ones(len(ordered), bool)
    new[1:] = pc.not_equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1)).to_numpy(
        zero_copy_only=False
    )
    where = np.empty(len(values), np.int64)
    where[order] = np.cumsum(new) - 1
    del order
    return ordered.filter(pa.array(new)), where


def merge_pairs(found: Sequence[tuple]) -> tuple[pa.Array, np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of pairs, each (its sorted uids, positions i and j in them, cosine) → one piece over the
    sorted union of their uids (positions int64)."""
    found = [f for f in found if len(f[1])]
    if not found:
        return pa.array([], pa.string()), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    names, where = sorted_unique(pa.concat_arrays([_strings(f[0]) for f in found]))
    starts = np.cumsum([0] + [len(f[0]) for f in found[:-1]])
    pieces = list(zip(found, starts.tolist(), strict=True))
    i = np.concatenate([where[lo + np.asarray(f[1], np.int64)] for f, lo in pieces])
    j = np.concatenate([where[lo + np.asarray(f[2], np.int64)] for f, lo in pieces])
    s = np.concatenate([np.asarray(f[3], np.float64) for f in found])
    return names, i, j, s


@dataclass
class BucketFacts:
    """One uid bucket's answer: its rows' pHash leaks, and which named uids are its ``success`` rows."""

    phash_uid: pa.Array  # success rows leaking an eval picture by pHash
    phash_task: np.ndarray
    phash_key: np.ndarray
    live_at: np.ndarray  # positions of the named uids that are success rows of the bucket (in those it was
    # asked about; the stage maps them to positions in ``Candidates.named()``)
    live_priority: np.ndarray  # their keep-first score (NaN: none)


def bucket_facts(
    rows: pa.Table, named: pa.Array, ref: EL.EvalReference | None, decontam: DecontamConfig
) -> BucketFacts:
    """``rows`` (``uid``, ``status``, ``phash``, ``priority``: one bucket's part rows after the image dedupe)
    against the candidates' ``named`` uids and the eval reference (None: no decontamination)."""
    ok = pc.fill_null(pc.equal(rows.column(S.STATUS), S.STATUS_SUCCESS), False)
    live = rows.filter(ok)
    uid = live.column(S.UID).combine_chunks().cast(pa.string())
    p_uid, p_task, p_key = pa.array([], pa.string()), np.zeros(0, object), np.zeros(0, object)
    if ref is not None and live.num_rows and len(ref.task):
        phash = live.column(S.PHASH).combine_chunks()
        hashed = phash.is_valid().to_numpy(zero_copy_only=False)
        if hashed.any():
            h = pc.fill_null(phash.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)[hashed]
            task, key = np.full(len(h), "", dtype=object), np.full(len(h), "", dtype=object)
            for a in range(0, len(h), _PHASH_BLOCK):  # a row's match is its own: blocks bound the candidates
                sl = slice(a, a + _PHASH_BLOCK)
                task[sl], key[sl] = EL.eval_leaks(
                    h[sl], None, ref, decontam.phash_threshold, decontam.embedding_threshold
                )
            hit = np.flatnonzero(hashed)[task != ""]
            p_uid, p_task, p_key = uid.take(pa.array(hit)), task[task != ""], key[task != ""]
    at = pc.index_in(_strings(named), value_set=uid) if len(named) and len(uid) else None
    if at is None:
        return BucketFacts(p_uid, p_task, p_key, np.zeros(0, np.int64), np.zeros(0, np.float64))
    picked = pc.drop_null(at)
    score = (
        live.column(PRIORITY).combine_chunks().cast(pa.float64()) if PRIORITY in live.column_names else None
    )
    priority = (
        pc.fill_null(score.take(picked), np.nan).to_numpy(zero_copy_only=False)
        if score is not None
        else np.full(len(picked), np.nan)
    )
    live_at = np.flatnonzero(at.is_valid().to_numpy(zero_copy_only=False))
    return BucketFacts(p_uid, p_task, p_key, live_at, priority.astype(np.float64))


@dataclass
class Decisions:
    relabels: pa.Table  # uid, status, duplicate_of, leak_of: only the rows the stage relabels
    leaks_by_task: dict[str, int]
    n_semantic: int


def decide(
    cand: Candidates,
    facts: list[BucketFacts],
    semantic: bool,
    index: tuple[pa.Array, np.ndarray] | None = None,
) -> Decisions:
    """The leaks, then the greedy rule over the pairs of remaining rows (module docstring). ``facts``'
    ``live_at`` are positions in ``cand.named()`` (``index``: ``cand.index()`` when the caller holds it).
    Every step is a mask over the named uids or a hash of the leaks' few: no hash table of the named
    uids (docs/decisions/0112)."""
    named, pair_at = cand.index() if index is None else index
    live, score = np.zeros(len(named), bool), np.full(len(named), np.nan)
    for f in facts:
        live[f.live_at] = True
        score[f.live_at] = f.live_priority
    # leaks: pHash first (each bucket's), then the embedding candidates that are live rows without one
    p_uid = pa.concat_arrays([_strings(f.phash_uid) for f in facts]) if facts else pa.array([], pa.string())
    p_task = np.concatenate([f.phash_task for f in facts]) if facts else np.zeros(0, object)
    p_key = np.concatenate([f.phash_key for f in facts]) if facts else np.zeros(0, object)
    e_uid = _strings(cand.leak_uid)
    last = _last_of_each(e_uid)
    e_uid, e_task, e_key = e_uid.take(pa.array(last)), cand.leak_task[last], cand.leak_key[last]
    keep = np.zeros(len(e_uid), bool)
    if len(e_uid):
        at = np.flatnonzero(pc.is_in(named, value_set=e_uid).to_numpy(zero_copy_only=False))
        mine = pc.index_in(named.take(pa.array(at)), value_set=e_uid).to_numpy().astype(np.int64)
        keep[mine] = live[at]
        keep &= ~pc.is_in(e_uid, value_set=p_uid).to_numpy(zero_copy_only=False)
    leak_uid = pa.concat_arrays([p_uid, e_uid.filter(pa.array(keep))])
    leak_task = np.concatenate([p_task, e_task[keep]]).astype(str)
    leak_key = np.concatenate([p_key, e_key[keep]]).astype(str)
    tasks, counts = np.unique(leak_task, return_counts=True)
    leaks_by_task = {str(t): int(c) for t, c in zip(tasks, counts, strict=True)}
    relabel = [
        pa.table(
            {
                S.UID: leak_uid,
                S.STATUS: pa.array([S.eval_leak(t) for t in leak_task], pa.string()),
                S.DUPLICATE_OF: pa.nulls(len(leak_uid), pa.string()),
                S.LEAK_OF: pa.array(
                    [f"{t}/{k}" for t, k in zip(leak_task, leak_key, strict=True)], pa.string()
                ),
            },
            schema=RELABELS,
        )
    ]
    n_semantic = 0
    if semantic and len(cand.pair_i):
        if len(leak_uid):
            live &= ~pc.is_in(named, value_set=leak_uid).to_numpy(zero_copy_only=False)
        dup, of = _greedy(cand, live[pair_at], score[pair_at])
        n_semantic = len(dup)
        relabel.append(
            pa.table(
                {
                    S.UID: dup,
                    S.STATUS: pa.array([S.STATUS_SEMANTIC_DUPLICATE] * len(dup), pa.string()),
                    S.DUPLICATE_OF: of,
                    S.LEAK_OF: pa.nulls(len(dup), pa.string()),
                },
                schema=RELABELS,
            )
        )
    return Decisions(pa.concat_tables(relabel), leaks_by_task, n_semantic)


def _last_of_each(uids: pa.Array) -> np.ndarray:
    """Positions of the last occurrence of each uid, in first-seen order of those positions."""
    if not len(uids):
        return np.zeros(0, np.int64)
    names = np.asarray(uids.to_pylist(), dtype=object)
    _, first_rev = np.unique(names[::-1], return_index=True)
    return np.sort(len(names) - 1 - first_rev)


def _greedy(cand: Candidates, ok: np.ndarray, score: np.ndarray) -> tuple[pa.Array, pa.Array]:
    """The greedy rule over the candidate pairs between the ``pair_names`` that are ``ok`` (live rows that
    do not leak; ``score``: the keep-first score of each) → (duplicates, the uid each copies)."""
    names = _strings(cand.pair_names)
    i, j, s = cand.pair_i, cand.pair_j, cand.pair_s
    both = ok[i] & ok[j] & (i != j)
    if not both.all():
        i, j, s = i[both], j[both], s[both]
    del both
    if not len(i):
        return pa.array([], pa.string()), pa.array([], pa.string())
    named_score = np.where(ok, np.asarray(score, np.float64), np.nan)  # a uid no pair left decides nothing
    key = np.where(np.isfinite(named_score), -named_score, np.inf)  # score descending, NaN last, then uid
    order = np.argsort(key, kind="stable")  # the names are in uid order: a stable sort breaks ties by uid
    rank = np.empty(len(names), dtype=np.int64)
    rank[order] = np.arange(len(names))
    del order, key, named_score
    target = SD.greedy_duplicates(rank, i, j, np.asarray(s, np.float64))
    hit = np.flatnonzero(target >= 0)
    return names.take(pa.array(hit)), names.take(pa.array(target[hit]))
