"""A demo track's subset model without Ray: train it on one of a run's shard sets, then score zero-shot shapes.

Trains the track's ``demo`` subset recipe (``TRACK_PRESETS["demo"].train`` plus any ``--set key=value``)
with ``training.train.step`` on ``<run>/<shards>`` (decoded once and reshuffled every epoch, as
``data.cache_decoded`` does), then measures on the run's eval sets what the report's table shows for
shapes and colours (prompt-ensemble zero-shot through ``training.infer.encode.Encoder``) and a nearest-class-mean
probe of the image embeddings on the shapes set (half the images to fit the class means, half to test):
the probe says whether the image tower separates shapes at all, zero-shot whether the captions taught it
their names. ``--recaption P0,P1,P2,P3`` replaces every caption by a clean English one of the picture's
true attributes at caption level k with probability Pk (``pipeline/demo/captions.py``): the ceiling a
perfect filter with that level mix would give. One JSON line per run to ``--out``. Not a timing benchmark.

Usage: python bench/subset_replica.py --run runs/demo --shards subset_shards/csd --seed 1 [--set optim.lr=1e-3]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.scorer_replica import (  # noqa: E402
    append_result,
    cpu_as_train_loop,
    read_tars,
    replica_parser,
    save_replica,
    seeded_config,
    train,
    zero_shot,
)
from jobs.track.config import TRACK_PRESETS  # noqa: E402
from pipeline.demo import render  # noqa: E402
from pipeline.demo.captions import caption, n_variants  # noqa: E402
from pipeline.ingest.tokenizer import TextTokenizer  # noqa: E402
from training.infer.encode import Encoder  # noqa: E402


def recaption(pool: list[dict], truth_path: str, probs: np.ndarray, rng: np.random.Generator) -> None:
    """Every sample's caption → a clean English caption of its picture at a level drawn from ``probs``."""
    import pyarrow.parquet as pq

    truth = pq.read_table(truth_path).to_pandas().set_index("uid")
    for row in pool:
        t = truth.loc[json.loads(row["json"])["uid"]]
        level = int(rng.choice(4, p=probs))
        texture, background = t["background"].split()
        attrs = (
            render.SHAPES.index(t["shape"]),
            render.COLOURS.index(t["colour"]),
            render.SIZES.index(t["size"]),
            render.POSITIONS.index(t["position"]),
            render.TEXTURES.index(texture),
            render.BACKGROUNDS.index(background),
        )
        variant = int(rng.integers(n_variants("en", level)))
        row["txt"] = caption("en", level, variant, *attrs).encode()


def main() -> None:
    ap = replica_parser(
        __doc__.splitlines()[0], "subset-recipe overrides, e.g. optim.lr=1e-3", 2, "subset_replica.jsonl"
    )
    ap.add_argument("--shards", default="subset_shards/csd", help="shard directory under --run")
    ap.add_argument("--recaption", default="", help="P0,P1,P2,P3: clean captions at these level rates")
    ap.add_argument("--eval", default="", help="eval-set root (default: <run>/pool/eval)")
    args = ap.parse_args()
    cpu_as_train_loop(args.threads)
    cfg = seeded_config(TRACK_PRESETS["demo"].train, args.seed, args.set)
    tok = TextTokenizer.load(f"{args.run}/tokenizer")
    pool = read_tars(f"{args.run}/{args.shards}/*.tar")
    if args.recaption:
        probs = np.array([float(x) for x in args.recaption.split(",")])
        recaption(
            pool, f"{args.run}/pool/truth.parquet", probs / probs.sum(), np.random.default_rng(args.seed)
        )
    t0 = time.time()
    state, _ = train(cfg, tok, pool)
    # One directory per process: replicas of one run and seed side by side must not read each other's model.
    ckpt = save_replica(
        state, cfg, tok, f"{args.run}/replica/subset-seed{args.seed}-{os.getpid()}", cfg.loss.name
    )
    enc, ev = Encoder(ckpt), args.eval or f"{args.run}/pool/eval"
    (shapes, probe), (colours, _) = zero_shot(enc, f"{ev}/shapes"), zero_shot(enc, f"{ev}/colours")
    result = {"run": args.run, "shards": args.shards, "seed": args.seed, "set": args.set}
    result |= {"recaption": args.recaption, "rows": len(pool), "steps": state.step}
    result |= {
        "train_s": round(time.time() - t0, 1),
        "shapes": shapes,
        "shape_probe": probe,
        "colours": colours,
    }
    append_result(result, args.out)


if __name__ == "__main__":
    main()
