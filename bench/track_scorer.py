"""The demo track's scorer alone, trained and evaluated exactly as ``jobs.track`` does, for recipe trials.

A Ray-free replica of the train step (bench/scorer_replica.py, at commit f74a57f) draws its own
batches, so a seed's figures there differ from the same seed's track run by as much as seeds differ from each other (seed 2
ordered 83.8% of the hierarchy levels in the replica and 74.7% in the track). This script runs the track's
own code instead, which is how the scorer's budget was chosen (docs/decisions/0003-demo-pool-and-budgets.md):
``jobs.track.config.train_config`` on a finished track run's shards and tokenizer, Ray Train, then
``jobs.evaluate`` on the run's eval sets. With no ``--set`` it reproduces that run's scorer to the bit
(``weights.pt``), in a separate storage path, so the run itself is never touched. Prints and adds one
run with the σ² claims the acceptance reads.

Usage: python -m bench.track_scorer --run runs/demo-seed2 --seed 2 --out /tmp/trial [--set scorer.k=v ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.schema import append_run
from jobs import evaluate
from jobs.common import init_ray
from jobs.track.config import TRACK_PRESETS, paths, train_config
from pipeline.common.config import merge, parse_set

ROOT = Path(__file__).resolve().parents[1]


def claims(analyses: dict) -> dict:
    """The scorer's σ² figures that issue acceptance reads, from ``analyses.json``."""
    h, m = analyses["hierarchy_order"], analyses["sigma2_modality"]
    return {
        "levels_ordered": h["ordered_fraction"],
        "levels_ordered_per_pair": h["ordered_fraction_per_pair"],
        "spearman_words": analyses["sigma2_length"]["spearman_words_vs_trace"],
        "image_in_caption": analyses["inclusion"]["image_in_caption"]["rate"],
        "text_trace": m["text_mean_trace"],
        "image_trace": m["image_mean_trace"],
        "text_gt_image": m["text_gt_image"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--run", required=True, help="a finished demo track run (its shards, tokenizer, eval sets)"
    )
    ap.add_argument("--seed", type=int, required=True, help="the scorer's seed (the run's seeds[0])")
    ap.add_argument("--out", required=True, help="where this trial's checkpoints and evaluation go")
    ap.add_argument("--set", nargs="*", default=[], help="track overrides, e.g. scorer.samples_seen=96000")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "track_scorer.json"))
    args = ap.parse_args()
    cfg = merge(TRACK_PRESETS["demo"], {"output": args.run, "seeds": [args.seed]})
    cfg = merge(cfg, parse_set(args.set))
    tcfg = train_config(cfg, cfg.scorer, "scorer", paths(cfg)["shards"], args.seed)
    tcfg = merge(tcfg, {"run": {"storage_path": args.out, "name": "scorer"}})
    init_ray(cfg.num_cpus)
    from training.train.trainer import train

    res = train(tcfg)
    ev = f"{args.out}/eval"
    root = paths(cfg)["eval_root"]
    code = evaluate.main(["--checkpoint", res.checkpoint_path, "--tasks", cfg.eval_tasks, "--eval-root", root,
                          "--out", ev])  # fmt: skip
    if code:
        raise SystemExit(code)
    result = {"run": args.run, "seed": args.seed, "set": args.set, "train_s": round(res.wall_s, 1)}
    result |= claims(json.loads(Path(ev, "analyses.json").read_text()))
    print(json.dumps(result))
    append_run(args.results, result)


if __name__ == "__main__":
    main()
