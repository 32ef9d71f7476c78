"""``python -m jobs.evaluate --checkpoint C [--tasks demo|datacomp|FILE.yaml] [--eval-root R] --out DIR``.

Options: ``--num-actors N --num-gpus G --batch-size B --max-samples K --no-analyses --s3-endpoint URL``,
``--preset demo|datacomp-small|prolip-b16``, ``--config FILE``, ``--set key=value``. Without ``--num-actors``
and ``--num-gpus`` the encoding takes the cluster's GPUs: one actor per GPU, none on a CPU-only cluster
(``training.infer.batch_inference.gpu_pool``).

Zero-shot classification, retrieval and the uncertainty analyses of a ProLIP (or deterministic CLIP)
checkpoint on a task list in clip_benchmark layout (``training/eval/run.py``). Prints one row per task and
the DataComp aggregates; writes ``eval_results.jsonl`` (DataComp's schema: its ``aggregate_scores.py``
reads it), ``aggregates.json``, ``analyses.json``, ``plots/`` and ``manifest.json`` into ``--out``. Tasks
already in ``--out``'s ``eval_results.jsonl`` (ours or DataComp's) are kept, not run again
(``--set resume=false`` runs all). A bad checkpoint or eval set stops the job before Ray starts, in one
line naming the file (exit 3; docs/jobs.md, "Errors and exit codes").
"""

from __future__ import annotations

import dataclasses
import sys
import time

from jobs.common import init_ray, job_main, parse_job_config, print_table
from pipeline.common.config import to_dict
from pipeline.common.errors import naming
from pipeline.common.manifest import write_manifest
from pipeline.common.preflight import input_dir, output_location
from pipeline.common.shared_storage import require_shared_storage
from training.eval.config import EVAL_PRESETS

_KEYS = (
    "checkpoint",
    "tasks",
    "eval_root",
    "out",
    "storage.s3_endpoint",
    "num_actors",
    "num_gpus",
    "batch_size",
)
FLAGS: dict[str, str | tuple[str, bool]] = {
    "--" + k.rsplit(".", 1)[-1].replace("_", "-"): k for k in (*_KEYS, "max_samples")
}
FLAGS["--no-analyses"] = ("analyses", False)
SUMMARY = """\
Zero-shot classification and retrieval (by CSD for a probabilistic checkpoint, cosine otherwise) on a
task list in clip_benchmark layout; eval_results.jsonl in DataComp's schema, its aggregates, the
uncertainty analyses and plots. Tasks already in --out are kept, not run again."""
EXAMPLE = (
    "python -m jobs.evaluate --checkpoint runs/demo/train/scorer/checkpoint_00001500 --tasks demo "
    "--eval-root runs/demo/pool/eval --out runs/eval"
)


def _fmt(v: object) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))


@job_main
def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, EVAL_PRESETS, FLAGS, required=("checkpoint", "out"), prog="jobs.evaluate",
        example=EXAMPLE,
    )  # fmt: skip
    from training.eval.sets import load_tasks

    store = cfg.storage.store()
    input_dir(store, cfg.checkpoint, "checkpoint")  # before torch loads to read it
    with naming(f"tasks {cfg.tasks}"):
        tasks = load_tasks(cfg.tasks, root=cfg.eval_root or None)
    output_location(store, cfg.out, "out")
    from training.eval.results import AGGREGATES, datacomp_names, main_value
    from training.eval.run import evaluate

    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for key in ("checkpoint", "tasks", "eval_root", "out", "storage"):
        kwargs.pop(key)
    # The encoding actors open the checkpoint and every task's files on whichever host they run.
    shared = {"checkpoint": cfg.checkpoint, **{f"tasks[{t.name}].path": t.path for t in tasks}}

    def init() -> None:
        init_ray()
        require_shared_storage(shared)

    t0 = time.perf_counter()
    with naming(f"checkpoint {cfg.checkpoint} or eval sets under {cfg.eval_root or '.'}"):
        report = evaluate(cfg.checkpoint, tasks, cfg.out, store=store, init=init, **kwargs)
    wall = time.perf_counter() - t0
    write_manifest(
        cfg.out,
        job="evaluate",
        config=to_dict(cfg),
        counts={r["key"]: r["metrics"].get("n", r["metrics"].get("n_images")) for r in report.results},
        timings={"evaluate": wall},
        store=store,
        extra={
            "aggregates": report.aggregates,
            "datacomp_aggregates": datacomp_names(report.aggregates),
            "missing_aggregates": report.missing_aggregates,
            "skipped": report.skipped,
        },
    )
    rows = [
        (r.get("task", r["key"]), r.get("main_metric_name", "-"), _fmt(main_value(r))) for r in report.results
    ]
    print_table(f"evaluation of {cfg.checkpoint}", rows, ("task", "main metric", "value"))
    agg_rows = [(k, _fmt(v)) for k, v in datacomp_names(report.aggregates).items()]
    agg_rows += [(AGGREGATES[k][0], "missing: " + ", ".join(v)) for k, v in report.missing_aggregates.items()]
    print_table("aggregates", agg_rows, ("aggregate", "value"))
    if report.skipped:
        print(f"skipped (no eval set under the root): {', '.join(report.skipped)}")
    print(f"results in {cfg.out} ({wall:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
