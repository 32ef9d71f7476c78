"""Two of the demo track's subset models in turn (two threads each) against side by side (one thread each).

What ``train_parallel=2`` buys ``make demo``: the track's subset recipe (``TRACK_PRESETS["demo"].train``
through ``jobs.track.config.train_config``) on two of a finished run's subset shard sets, timed as the
track runs it. Contender ``in_turn``: one model after the other, one Train worker with every core as torch
threads (``train_parallel=1``). Contender ``side_by_side``: both at once through the track's
``in_parallel``, one thread and half a logical CPU each (the demo preset's setting,
docs/decisions/0007-subset-models-two-at-a-time.md). Rounds alternate the two
(bench/alternate.py); each training writes to a fresh temporary directory, so nothing resumes. Ray starts
once; its start-up is in neither figure. Adds one run to ``bench/results/train_parallel.json``.

Usage: python -m bench.train_parallel --run runs/demo [--subsets csd,random] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench.alternate import alternate, fmt_spread, loads_note, ratios, times
from bench.schema import append_run
from jobs.common import init_ray
from jobs.track.config import TRACK_PRESETS, train_config
from jobs.track.run import in_parallel
from pipeline.common.config import merge

ROOT = Path(__file__).resolve().parents[1]

IN_TURN = {"torch_threads": -1, "cpus_per_worker": 1.0}
SIDE_BY_SIDE = {"torch_threads": 1, "cpus_per_worker": 0.5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a finished demo track run (its subset_shards)")
    ap.add_argument("--subsets", default="csd,random", help="two of the run's subsets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "train_parallel.json"))
    args = ap.parse_args()
    cfg = merge(TRACK_PRESETS["demo"], {"output": args.run, "seeds": [args.seed]})
    subsets = args.subsets.split(",")
    init_ray(cfg.num_cpus)
    from training.train.trainer import train

    def one(subset: str, scaling: dict, root: str) -> None:
        shards = os.path.join(args.run, "subset_shards", subset)
        tcfg = train_config(cfg, cfg.train, f"{subset}-seed{args.seed}", shards, args.seed)
        train(merge(tcfg, {"run": {"storage_path": root}, "scaling": scaling}))

    def in_turn() -> None:
        with tempfile.TemporaryDirectory() as root:
            for s in subsets:
                one(s, IN_TURN, root)

    def side_by_side() -> None:
        with tempfile.TemporaryDirectory() as root:
            in_parallel(lambda s: one(s, SIDE_BY_SIDE, root), subsets, len(subsets), print)

    rounds = alternate({"in_turn": in_turn, "side_by_side": side_by_side}, args.rounds, warmup=0)
    r = ratios(rounds, "side_by_side", "in_turn")
    loads = [row[c]["load"] for row in rounds for c in row]
    result = {
        "run": args.run,
        "subsets": subsets,
        "rounds": rounds,
        "side_by_side_over_in_turn": r,
        "in_turn": times(rounds, "in_turn"),
        "side_by_side": times(rounds, "side_by_side"),
        "cores": os.cpu_count(),
    }
    print(
        f"side by side / in turn, wall: {fmt_spread(r['wall'])} over {args.rounds} rounds "
        f"({loads_note(loads, os.cpu_count() or 1)}); in turn {fmt_spread(result['in_turn']['wall_s'], 0)} s, "
        f"side by side {fmt_spread(result['side_by_side']['wall_s'], 0)} s"
    )
    append_run(args.results, result)


if __name__ == "__main__":
    main()
