"""``python -m jobs.filter --preset NAME --checkpoint C --shards S --out O [--config F] [--set k=v ...]``.

Presets: demo, datacomp-small (``jobs/filter/run.py``). Scores every pool pair with a trained
checkpoint (CSD, cosine, per-tower uncertainty; Ray batch inference), runs the score filters, writes one
DataComp subset ``.npy`` per filter (and, with ``reshard``, its shards) and ``manifest.json`` into the
run directory. A missing or corrupt checkpoint, or a bad config, stops the job at start (exit code 2).
``--checkpoint`` also takes a model trained elsewhere — ``openclip:MODEL:LOCATION`` or ``prolip:LOCATION``
(training/imports/load.py) — imported first into ``OUT/checkpoint``.
"""

from __future__ import annotations

import sys

from jobs.common import init_ray, parse_job_config, print_table
from jobs.filter.run import FILTER_PRESETS, check_checkpoint, run_filter_job, validate
from pipeline.common import storage
from pipeline.common.config import ConfigError, merge, to_dict
from pipeline.common.manifest import write_manifest
from pipeline.common.shared_storage import require_shared_storage
from pipeline.common.storage import Storage
from training.imports.load import import_checkpoint, is_import_source
from training.model.checkpoint import CheckpointError

# a checkpoint directory or an openclip:/prolip: source; pool shards (directory, glob or list); run directory
FLAGS = {"--checkpoint": "checkpoint", "--shards": "shards", "--out": "out", "--s3-endpoint": "s3_endpoint"}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(argv, __doc__.splitlines()[0], FILTER_PRESETS, FLAGS)
    imported_from = None
    try:
        specs = validate(cfg)
        if is_import_source(cfg.checkpoint):
            imported_from, target = cfg.checkpoint, storage.join(cfg.out, "checkpoint")
            print(f"filter: importing {imported_from} → {target}", file=sys.stderr)
            store = Storage.from_env(cfg.s3_endpoint)
            cfg = merge(
                cfg,
                {"checkpoint": import_checkpoint(cfg.checkpoint, target, store, cfg.checkpoint_tokenizer)},
            )
        check_checkpoint(cfg, specs)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"filter: {exc}", file=sys.stderr)
        return 2
    init_ray()
    try:  # the scoring actors read the shards and the checkpoint and write the scores
        require_shared_storage({"shards": cfg.shards, "checkpoint": cfg.checkpoint, "out": cfg.out})
    except ConfigError as exc:
        print(f"filter: {exc}", file=sys.stderr)
        return 2
    res = run_filter_job(cfg)
    write_manifest(
        cfg.out,
        job="filter",
        config=to_dict(cfg),
        counts={
            "scored": res.n_scored,
            "image_failed": res.n_failed,
            **{f"subset.{k}": v.size for k, v in res.subsets.items()},
        },
        timings=res.timings,
        store=Storage.from_env(cfg.s3_endpoint),
        extra={
            "checkpoint": cfg.checkpoint,
            "imported_from": imported_from,
            "scores": res.scores_path,
            "subsets": {k: v.path for k, v in res.subsets.items()},
            "pairs_per_s": round(res.score.pairs_per_s, 1) if res.score else None,
        },
    )
    rows = [(k, v.size, f"{v.fraction:.3f}") for k, v in res.subsets.items()]
    print_table(
        f"filters · {res.n_scored} pairs scored ({res.n_failed} images failed) · {res.scores_path}",
        rows,
        ("filter", "kept", "fraction"),
    )
    return 0
