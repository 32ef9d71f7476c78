"""The exact data position (``data.exact_position``): an epoch's sample order as a pure function, and one
rank's share of each step read from the shard files by the rank itself. No Ray here.

The order of epoch ``e`` is a function of (seed, e, the shards' row counts) only: the shards in a seeded
order (what ``FileShuffleConfig`` does to files), their rows concatenated into one stream, and the stream
permuted inside consecutive windows of ``window`` rows (what the window shuffle does). Global position
``p`` of the epoch is one (shard, row); step ``k`` of the epoch trains positions ``[k·B, (k+1)·B)``
(``B`` the global batch), whatever the world size. Rank ``r`` takes its ``local_batch_sizes`` share of a
step's rows in stream order (the rows of a step sorted by where they sit in the files, then cut into
consecutive pieces), so a rank reads about its share of a window's shards rather than all of them.

A run resumed at step ``k`` of an epoch therefore trains exactly the rows an uninterrupted run would
have trained from there, at any world size: shards wholly before position ``k·B`` are never opened (their
rows are known by arithmetic on the counts), and a shard that the position cuts is read from its start,
keeping only the rows still to come. The last ``n mod B`` positions of an epoch are not trained (the
remainder, as ``drop_last`` does). Decision: docs/decisions/0094-exact-data-position.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

Read = Callable[[str], Iterable[pa.Table]]  # one shard path → its rows in file order (ShardReader)


def local_shares(global_batch: int, world: int) -> list[int]:
    """Rows each rank takes of a step (training/train/distributed.py ``local_batch_sizes``, the same rule)."""
    base, extra = divmod(global_batch, world)
    return [base + (r < extra) for r in range(world)]


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's order: shards in read order and where each starts in the stream of their rows."""

    seed: int
    epoch: int
    window: int  # rows per window permutation (1: none)
    order: np.ndarray  # shard indices in read order
    starts: np.ndarray  # (len(order) + 1,) stream offset of each shard of ``order``, then the total

    @property
    def rows(self) -> int:
        return int(self.starts[-1])

    def steps(self, global_batch: int) -> int:
        """Full steps in this epoch (the remainder is not trained)."""
        return self.rows // global_batch


def epoch_plan(counts: Sequence[int], seed: int, epoch: int, window: int) -> EpochPlan:
    """The order of epoch ``epoch`` over shards holding ``counts`` rows (module docstring)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(counts))
    sizes = np.asarray(counts, dtype=np.int64)[order]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return EpochPlan(seed, epoch, max(1, int(window)), order, starts)


def stream_positions(plan: EpochPlan, positions: np.ndarray) -> np.ndarray:
    """Stream offsets of global positions: each window of the stream permuted by (seed, epoch, window)."""
    positions = np.asarray(positions, dtype=np.int64)
    out = np.empty_like(positions)
    w = plan.window
    for win in np.unique(positions // w):
        lo = int(win) * w
        n = min(w, plan.rows - lo)
        perm = np.random.default_rng([plan.seed, plan.epoch, int(win)]).permutation(n)
        at = positions // w == win
        out[at] = lo + perm[positions[at] - lo]
    return out


def locate(plan: EpochPlan, stream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shard index, row within the shard) of stream offsets."""
    slot = np.searchsorted(plan.starts, stream, side="right") - 1
    return plan.order[slot], np.asarray(stream, dtype=np.int64) - plan.starts[slot]


def step_rows(plan: EpochPlan, step: int, global_batch: int, world: int, rank: int) -> np.ndarray:
    """Stream offsets that rank ``rank`` of ``world`` trains at step ``step`` of the epoch, in stream order."""
    stream = np.sort(stream_positions(plan, np.arange(step * global_batch, (step + 1) * global_batch)))
    shares = np.cumsum([0, *local_shares(global_batch, world)])
    return stream[shares[rank] : shares[rank + 1]]


def rank_steps(
    read: Read,
    paths: Sequence[str],
    plan: EpochPlan,
    global_batch: int,
    world: int,
    rank: int,
    start: int = 0,
) -> Iterator[pa.Table]:
    """This rank's rows for steps ``start, start + 1, …`` of the epoch, one table per step.

    Each shard is read once (by ``read``, the one shard reader), when the first of its rows is due; only
    this rank's rows of it are kept, until the last step that needs them."""
    steps = [step_rows(plan, k, global_batch, world, rank) for k in range(start, plan.steps(global_batch))]
    last_use: dict[int, int] = {}
    wanted: dict[int, set[int]] = {}
    for i, stream in enumerate(steps):
        shards, rows = locate(plan, stream)
        for s, r in zip(shards.tolist(), rows.tolist(), strict=True):
            last_use[s] = i
            wanted.setdefault(s, set()).add(r)
    loaded: dict[int, tuple[pa.Table, dict[int, int]]] = {}
    for i, stream in enumerate(steps):
        shards, rows = locate(plan, stream)
        parts = []
        for s in dict.fromkeys(shards.tolist()):  # in stream order
            if s not in loaded:
                loaded[s] = _kept_rows(read, paths[s], wanted.pop(s))
            table, where = loaded[s]
            take = [where[r] for r in rows[shards == s].tolist()]
            parts.append(table.take(pa.array(take, pa.int64())))
        for s in [s for s, last in last_use.items() if last == i]:
            loaded.pop(s, None)
        yield pa.concat_tables(parts) if len(parts) > 1 else parts[0]


def _kept_rows(read: Read, path: str, rows: set[int]) -> tuple[pa.Table, dict[int, int]]:
    """The ``rows`` of one shard (by position in ``read``'s output) and where each sits in the table."""
    kept, seen = [], 0
    for table in read(path):
        idx = [r - seen for r in sorted(rows) if seen <= r < seen + table.num_rows]
        if idx:
            kept.append(table.take(pa.array(idx, pa.int64())))
        seen += table.num_rows
    missing = [r for r in rows if r >= seen]
    if missing:
        raise RuntimeError(
            f"{path}: {seen} rows read, the plan counted more (row {min(missing)} wanted); "
            "the shard changed since the run counted it"
        )
    table = pa.concat_tables(kept) if kept else None
    return table, {r: i for i, r in enumerate(sorted(rows))}


def decoded_steps(
    tables: Iterable[pa.Table], decode: Callable, collate: Callable, first: tuple[int, int, int | None]
) -> Iterator[dict]:
    """Each step's rows decoded (``DecodeAugment``) and collated (``TrainCollate``), with their ``keys``;
    ``first`` = (the first table's step, rank, augment seed). A picture that does not decode is counted by
    ``decode`` and its place taken by a decodable row of the same step, so a rank keeps its planned rows."""
    step, rank, seed = first
    for k, table in enumerate(tables):
        if seed is not None:  # a step's crops do not depend on where the run resumed
            decode.rng = np.random.default_rng([seed, step + k, rank])
        rows = decode({c: table.column(c).to_numpy(zero_copy_only=False) for c in ("key", "jpg", "txt")})
        n = table.num_rows
        if not len(rows["key"]):
            raise RuntimeError(f"no picture of step {step + k}'s {n} rows on rank {rank} decodes")
        if len(rows["key"]) < n:
            fill = np.resize(np.arange(len(rows["key"])), n)
            rows = {c: v[fill] for c, v in rows.items()}
        yield {**collate(rows), "keys": [str(key) for key in rows["key"]]}


def count_rows(read: Read, path: str) -> int:
    """Rows ``read`` yields for one shard: what the plan is made of (a Ray task per shard in the trainer)."""
    return sum(t.num_rows for t in read(path))


def adjacent_same_shard(shards: np.ndarray) -> float:
    """Share of consecutive samples that come from one shard: the shuffle-quality figure of the decision
    record (a full shuffle over S equal shards gives ~1/S; no shuffle ~1)."""
    shards = np.asarray(shards)
    return float(np.mean(shards[1:] == shards[:-1])) if len(shards) > 1 else 0.0
