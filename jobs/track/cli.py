"""``python -m jobs.track --preset demo|tiny|datacomp-small [--config F] [--set k=v ...]``.

The DataComp-style filtering track in one job: build → scorer → CSD scores → filters → reshard → one
model per subset at equal samples seen → evaluation → ``report.md`` and ``report.html``
(jobs/track/run.py). ``make demo`` runs the demo preset on a generated pool served on 127.0.0.1.
Re-running with the same ``output`` resumes: finished steps are skipped, an interrupted training resumes
from its checkpoint. The output, the metadata and the eval root are checked before Ray starts.
"""

from __future__ import annotations

import sys

from jobs.common import init_ray, job_main, parse_job_config
from jobs.track.config import TRACK_PRESETS, TrackConfig
from pipeline.common.config import to_dict
from pipeline.common.manifest import write_manifest
from pipeline.common.preflight import input_dir, input_files, output_location
from pipeline.common.shared_storage import require_shared_storage
from pipeline.common.storage import Storage

# A preset for real data names no bucket: a forgotten flag must not write to one nobody chose.
REQUIRED = {"*": ("output",), "datacomp-small": ("output", "build.metadata", "eval_root")}
SUMMARY = """\
DataComp's filtering track in one run directory: build → a ProLIP scorer on the unfiltered pool → CSD
scores → filters → reshard → one model per subset at equal samples seen → evaluation → report.md and
report.html. Re-running the same command resumes; python -m jobs.status OUTPUT shows how far it got."""
EXAMPLE = "python -m jobs.track --preset demo --set output=runs/demo"


def check_inputs(cfg: TrackConfig, store: Storage) -> None:
    """Before Ray starts: where the run writes, the metadata and the eval sets' root when given, and that
    a resumed run's config matches the steps it recorded (``claim_output``)."""
    from jobs.track.run import claim_output

    output_location(store, cfg.output, "output")
    if cfg.build.metadata:
        input_files(store, cfg.build.metadata, "build.metadata", "parquet", ".parquet")
    if cfg.eval_root:
        input_dir(store, cfg.eval_root, "eval_root")
    claim_output(cfg, store)


@job_main
def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, TRACK_PRESETS, {"--output": "output"}, required=REQUIRED, prog="jobs.track",
        example=EXAMPLE,
    )  # fmt: skip
    store = cfg.storage.store()
    check_inputs(cfg, store)
    from jobs.track.report import markdown_table
    from jobs.track.run import run_track

    init_ray(cfg.num_cpus)
    # every step's tasks open the run directory; the evaluation reads the eval root
    require_shared_storage(
        {"output": cfg.output, "eval_root": cfg.eval_root, "build.metadata": cfg.build.metadata}
    )
    result = run_track(cfg)
    write_manifest(
        cfg.output,
        job="track",
        config=to_dict(cfg),
        counts={"subsets": {r["subset"]: r["size"] for r in result.table}},
        timings=result.timings,
        store=store,
        extra={"report": result.report, "verdict": result.comparisons},
    )
    print(f"\nreport: {result.report}\n")
    if cfg.unofficial:
        print(
            "UNOFFICIAL RUN (unofficial=true): a changed recipe; its numbers do not stand beside DataComp's"
        )
    for key, v in result.comparisons.items():
        cand, ctrl = key.split("_vs_")
        word = "beats" if v["beats"] else "does not beat"
        same = " (same fraction)" if ctrl == "clip_score_l14" else ""
        print(
            f"{cand} vs {ctrl}{same}: {word}, mean average difference {v['mean_diff']:+.4f} over seeds {v['seeds']}"
        )
    print()
    print(markdown_table(result.table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
