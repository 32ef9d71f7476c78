"""``python -m jobs.filter --preset NAME --checkpoint C --shards S --out O [--config F] [--set k=v ...]``.

Presets: demo, datacomp-small (``jobs/filter/run.py``). Scores every pool pair with a trained
checkpoint (CSD, cosine, per-tower uncertainty; Ray batch inference), runs the score filters, writes one
DataComp subset ``.npy`` per filter (and, with ``reshard``, its shards) and ``manifest.json`` into the
run directory. A bad config stops the job at start (exit 2); missing or corrupt shards or checkpoint stop
it before Ray starts (exit 3; docs/jobs.md, "Errors and exit codes").
``--checkpoint`` also takes a model trained elsewhere — ``openclip:MODEL:LOCATION`` or ``prolip:LOCATION``
(training/imports/load.py) — imported first into ``OUT/checkpoint``.
"""

from __future__ import annotations

import sys

from jobs.common import init_ray, job_main, parse_job_config, print_table
from jobs.filter.run import FILTER_PRESETS, check_checkpoint, run_filter_job, validate
from pipeline.common import storage
from pipeline.common.config import merge, to_dict
from pipeline.common.errors import InputError, JobError, naming
from pipeline.common.manifest import write_manifest
from pipeline.common.preflight import input_dir, input_files, output_location
from pipeline.common.shared_storage import require_shared_storage

FLAGS = {
    "--checkpoint": "checkpoint",
    "--shards": "shards",
    "--out": "out",
    "--s3-endpoint": "storage.s3_endpoint",
}
SUMMARY = """\
Score every pool pair with a checkpoint (CSD, cosine, Σσ² per tower; Ray batch inference) and write one
DataComp subset .npy per filter spec (CSD best k%, the uncertainty-aware variant, CLIP score, random),
optionally resharded. --checkpoint also takes openclip:MODEL:LOCATION or prolip:LOCATION."""
EXAMPLE = (
    "python -m jobs.filter --checkpoint runs/demo/train/scorer/checkpoint_00001500 --shards runs/demo/shards "
    "--out runs/filter --set 'filters=[csd_best:fraction=0.2]'"
)


@job_main
def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, FILTER_PRESETS, FLAGS, required=("checkpoint", "shards", "out"), prog="jobs.filter",
        example=EXAMPLE,
    )  # fmt: skip
    specs = validate(cfg)
    store = cfg.storage.store()
    input_files(store, cfg.shards, "shards", "tar", ".tar")
    output_location(store, cfg.out, "out")
    imported = cfg.checkpoint.split(":", 1)[0] in ("openclip", "prolip") and ":" in cfg.checkpoint
    if not imported:
        input_dir(store, cfg.checkpoint, "checkpoint")  # before torch loads to read it
    imported_from = None
    if imported:
        from training.imports.load import import_checkpoint

        imported_from, target = cfg.checkpoint, storage.join(cfg.out, "checkpoint")
        print(f"filter: importing {imported_from} → {target}", file=sys.stderr)
        try:
            checkpoint = import_checkpoint(cfg.checkpoint, target, store, cfg.checkpoint_tokenizer)
        except JobError:
            raise
        except (FileNotFoundError, ValueError) as exc:  # a malformed source spec or a missing location
            raise InputError(f"checkpoint {cfg.checkpoint}: {exc}") from None
        cfg = merge(cfg, {"checkpoint": checkpoint})
    with naming(f"checkpoint {cfg.checkpoint}"):
        check_checkpoint(cfg, specs)
    init_ray()
    # the scoring actors read the shards and the checkpoint and write the scores
    require_shared_storage({"shards": cfg.shards, "checkpoint": cfg.checkpoint, "out": cfg.out})
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
        store=cfg.storage.store(),
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
