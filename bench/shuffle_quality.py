"""Shuffle quality of the exact data position's order against today's streaming order and a full shuffle.

Three orders of one epoch over ``--shards`` shards of ``--rows`` rows, the same shard shuffle seed:

- **exact**: pipeline/ingest/data_position.py (shards in a seeded order, windows of ``--window`` permuted);
- **today**: the streaming ingest with a seed (ordered output): the shards in a seeded order, their rows
  concatenated, and ``window_shuffle`` (pipeline/ingest/transforms.py, the real stage) applied to each
  consecutive window of ``--window`` rows, as Ray Data's ``map_batches(batch_size=window)`` calls it;
- **full**: one permutation of every row (the ideal).

Figures per order: the share of adjacent samples from one shard (1/S for a full shuffle) and the mean
number of distinct shards in a global batch of ``--batch``, each the median over ``--rounds`` seeds, and
the exact order's ratio to today's. Writes bench/results/shuffle_quality.json.

Usage: python -m bench.shuffle_quality [--shards 200 --rows 2000 --window 1024 --batch 512 --rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import numpy as np
import pyarrow as pa

from bench.schema import RESULTS, RecordsFile, Row
from pipeline.ingest.data_position import adjacent_same_shard, epoch_plan, locate, stream_positions
from pipeline.ingest.transforms import window_shuffle


def exact(counts: list[int], seed: int, window: int) -> np.ndarray:
    plan = epoch_plan(counts, seed, 0, window)
    return locate(plan, stream_positions(plan, np.arange(plan.rows)))[0]


def today(counts: list[int], seed: int, window: int) -> np.ndarray:
    order = np.random.default_rng([seed, 0]).permutation(len(counts))
    shard = np.concatenate([np.full(counts[s], s) for s in order])
    keys = np.concatenate([[f"{s:05d}{r:07d}" for r in range(counts[s])] for s in order])
    out = []
    for lo in range(0, len(shard), window):
        table = pa.table({"key": keys[lo : lo + window], "shard": shard[lo : lo + window]})
        out.append(window_shuffle(table, seed).column("shard").to_numpy())
    return np.concatenate(out)


def full(counts: list[int], seed: int, window: int) -> np.ndarray:
    shard = np.concatenate([np.full(n, s) for s, n in enumerate(counts)])
    return shard[np.random.default_rng(seed).permutation(len(shard))]


def distinct_per_batch(shards: np.ndarray, batch: int) -> float:
    n = len(shards) // batch
    return float(np.mean([len(np.unique(shards[i * batch : (i + 1) * batch])) for i in range(n)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=200)
    ap.add_argument("--rows", type=int, default=2000, help="rows per shard")
    ap.add_argument("--window", type=int, default=1024, help="data.shuffle_window (the default)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", default=str(RESULTS / "shuffle_quality.json"))
    args = ap.parse_args()
    counts = [args.rows] * args.shards
    figures: dict[str, dict[str, list[float]]] = {}
    for seed in range(args.rounds):  # alternated: each round measures every order on the same seed
        for name, make in (("exact", exact), ("today", today), ("full", full)):
            shards = make(counts, seed, args.window)
            assert len(shards) == sum(counts)
            f = figures.setdefault(name, {"adjacent": [], "distinct": []})
            f["adjacent"].append(adjacent_same_shard(shards))
            f["distinct"].append(distinct_per_batch(shards, args.batch))
    load = f"{os.getloadavg()[0]:.1f}"
    date = datetime.date.today().isoformat()
    cmd = (f"python -m bench.shuffle_quality --shards {args.shards} --rows {args.rows} --window {args.window} "
           f"--batch {args.batch} --rounds {args.rounds}")  # fmt: skip
    rows = []
    for stat, label in (
        ("adjacent", "adjacent samples from one shard"),
        ("distinct", "distinct shards a batch"),
    ):
        med = {k: float(np.median(v[stat])) for k, v in figures.items()}
        spread = "; ".join(f"{k} {min(v[stat]):.4f}–{max(v[stat]):.4f}" for k, v in figures.items())
        print(f"{label}: exact {med['exact']:.4f}, today {med['today']:.4f}, full shuffle {med['full']:.4f}; "
              f"exact/today {med['exact'] / med['today']:.3f}")  # fmt: skip
        rows.append(Row(what=f"{label} (window {args.window}, batch {args.batch}, {args.shards}×{args.rows} rows)",
                        command=cmd, figure=f"exact/today {med['exact'] / med['today']:.3f} (exact {med['exact']:.4f}, "
                        f"today {med['today']:.4f}, full shuffle {med['full']:.4f})", spread=spread, load=load,
                        date=date))  # fmt: skip
    out = RecordsFile(
        title="Shuffle quality of the exact data position",
        about="The exact plan's order against the seeded streaming ingest's (file shuffle + window) and a "
        "full shuffle: the share of adjacent samples from one shard and the distinct shards in a batch.",
        records=rows,
        figures=figures,
    )
    Path(args.results).write_text(out.model_dump_json(indent=1) + "\n")


if __name__ == "__main__":
    main()
