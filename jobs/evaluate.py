"""``python -m jobs.evaluate --checkpoint C [--tasks demo|datacomp|FILE.yaml] [--eval-root R] --out DIR``.

Options: ``--num-actors N --num-gpus G --batch-size B --max-samples K --no-analyses --s3-endpoint URL``,
``--preset demo|datacomp-small|prolip-b16``, ``--config FILE``, ``--set key=value``.

Zero-shot classification, retrieval and the uncertainty analyses of a ProLIP (or deterministic CLIP)
checkpoint on a task list in clip_benchmark layout (``training/eval/run.py``). Prints one row per task and
the DataComp aggregates; writes ``eval_results.jsonl`` (DataComp's schema: its ``aggregate_scores.py``
reads it), ``aggregates.json``, ``analyses.json``, ``plots/`` and ``manifest.json`` into ``--out``. Tasks
already in ``--out``'s ``eval_results.jsonl`` (ours or DataComp's) are kept, not run again
(``--set resume=false`` runs all). A bad checkpoint or eval set exits 2 naming the file.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from jobs.common import init_ray, parse_job_config, print_table
from pipeline.common.config import ConfigError, to_dict
from pipeline.common.manifest import write_manifest
from pipeline.common.shared_storage import require_shared_storage
from pipeline.common.storage import Storage
from training.eval.config import EVAL_PRESETS
from training.eval.results import AGGREGATES, datacomp_names, main_value
from training.eval.run import evaluate
from training.eval.sets import EvalSetError, load_tasks
from training.model.checkpoint import CheckpointError

_KEYS = ("checkpoint", "tasks", "eval_root", "out", "s3_endpoint", "num_actors", "num_gpus", "batch_size")
FLAGS: dict[str, str | tuple[str, bool]] = {"--" + k.replace("_", "-"): k for k in (*_KEYS, "max_samples")}
FLAGS["--no-analyses"] = ("analyses", False)


def _fmt(v: object) -> str:
    return f"{v:.4f}" if isinstance(v, float) else ("-" if v is None else str(v))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(argv, __doc__.splitlines()[0], EVAL_PRESETS, FLAGS, required=("checkpoint", "out"))
    try:
        tasks = load_tasks(cfg.tasks, root=cfg.eval_root or None)
    except (ConfigError, EvalSetError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for key in ("checkpoint", "tasks", "eval_root", "out", "s3_endpoint"):
        kwargs.pop(key)
    # The encoding actors open the checkpoint and every task's files on whichever host they run.
    shared = {"checkpoint": cfg.checkpoint, **{f"tasks[{t.name}].path": t.path for t in tasks}}

    def init() -> None:
        init_ray()
        require_shared_storage(shared)

    t0 = time.perf_counter()
    try:
        store = Storage.from_env(cfg.s3_endpoint)
        report = evaluate(cfg.checkpoint, tasks, cfg.out, store=store, init=init, **kwargs)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, EvalSetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
