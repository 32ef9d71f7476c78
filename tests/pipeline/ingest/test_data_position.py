"""The exact data position (pipeline/ingest/data_position.py) against brute force, on real shards read by
the one shard reader: every epoch a permutation of the rows, one step's rows the same at every world size,
and a rank resumed at step k reading exactly the rows still to come, shards wholly before k never opened."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from pipeline.ingest.data_position import (
    adjacent_same_shard,
    count_rows,
    epoch_plan,
    local_shares,
    locate,
    rank_steps,
    step_rows,
    stream_positions,
)
from pipeline.shards.reader import ShardReader
from tests.fixtures.train_shards import write_demo_shards
from training.train.distributed import local_batch_sizes

COUNTS = [7, 0, 13, 5, 11]  # uneven, one empty shard


def _brute_order(counts, seed, epoch, window):
    """The definition, written out: shards shuffled, rows concatenated, each window permuted."""
    order = np.random.default_rng([seed, epoch]).permutation(len(counts))
    stream = [(int(s), r) for s in order for r in range(counts[s])]
    out = []
    for w, lo in enumerate(range(0, len(stream), window)):
        chunk = stream[lo : lo + window]
        out += [chunk[i] for i in np.random.default_rng([seed, epoch, w]).permutation(len(chunk))]
    return out


@pytest.mark.parametrize("window", [1, 4, 9, 100])
def test_an_epochs_order_is_the_shard_shuffle_then_the_window_shuffle(window) -> None:
    for epoch in range(3):
        plan = epoch_plan(COUNTS, seed=3, epoch=epoch, window=window)
        shards, rows = locate(plan, stream_positions(plan, np.arange(plan.rows)))
        got = list(zip(shards.tolist(), rows.tolist(), strict=True))
        assert got == _brute_order(COUNTS, 3, epoch, window)
        assert sorted(got) == sorted((s, r) for s, n in enumerate(COUNTS) for r in range(n))


def test_a_steps_rows_are_the_same_at_every_world_size() -> None:
    plan = epoch_plan(COUNTS, seed=1, epoch=2, window=6)
    assert plan.steps(5) == sum(COUNTS) // 5
    for world in (1, 2, 3, 5):
        assert local_shares(5, world) == local_batch_sizes(5, world)
    for step in range(plan.steps(5)):
        want = sorted(stream_positions(plan, np.arange(step * 5, step * 5 + 5)).tolist())
        for world in (1, 2, 3, 5):
            got = [step_rows(plan, step, 5, world, r).tolist() for r in range(world)]
            assert [len(g) for g in got] == local_shares(5, world)
            assert sorted(sum(got, [])) == want


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("position_shards")
    return write_demo_shards(root, n_shards=4, per_shard=9, size=8)


class OpenedShards:
    """The real reader, noting which shards it was asked for."""

    def __init__(self) -> None:
        self.reader, self.opened = ShardReader(chunk_rows=4), []

    def __call__(self, path: str):
        self.opened.append(path)
        return self.reader(path)


def _keys(read, shards, plan, batch, world, start=0) -> list[list[str]]:
    per_rank = [list(rank_steps(read, shards, plan, batch, world, r, start)) for r in range(world)]
    return [sum((t[s].column("key").to_pylist() for t in per_rank), []) for s in range(len(per_rank[0]))]


def test_a_resumed_rank_reads_exactly_the_rows_still_to_come(shards) -> None:
    counts = [count_rows(ShardReader(), p) for p in shards]
    assert counts == [9, 9, 9, 9]
    plan = epoch_plan(counts, seed=5, epoch=1, window=5)
    whole = _keys(ShardReader(), shards, plan, 6, world=2)
    assert (
        len(whole) == 6 and Counter(sum(whole, [])).most_common(1)[0][1] == 1
    )  # 36 rows, 6 steps, each once
    for start in (1, 3, 4):
        read = OpenedShards()
        resumed = _keys(read, shards, plan, 6, world=3, start=start)
        assert [sorted(s) for s in resumed] == [sorted(s) for s in whole[start:]]
        # shards whose rows all come before the position are never opened; each opened shard once per rank
        first = int(
            np.searchsorted(plan.starts, stream_positions(plan, np.arange(start * 6, 36)).min(), "right")
        )
        skipped = {shards[s] for s in plan.order[: first - 1].tolist()}
        assert not skipped & set(read.opened) and max(Counter(read.opened).values()) <= 3


def test_shuffle_quality_is_the_file_shuffle_and_window() -> None:
    """Adjacent samples from one shard: ~1/S for a full shuffle, about (R - 1)/R without a window."""
    counts = [100] * 20
    plan = epoch_plan(counts, seed=0, epoch=0, window=1)
    same = adjacent_same_shard(locate(plan, stream_positions(plan, np.arange(plan.rows)))[0])
    assert same == pytest.approx(1980 / 1999, abs=1e-12)  # 1,999 neighbours; only the 19 shard borders differ
    windowed = epoch_plan(counts, seed=0, epoch=0, window=400)
    same = adjacent_same_shard(locate(windowed, stream_positions(windowed, np.arange(2000)))[0])
    assert 0.15 < same < 0.35  # a window spans ~4 shards: ~1/4
