"""``python -m jobs.track --preset demo|tiny|datacomp-small [--config F] [--set k=v ...]``.

The DataComp-style filtering track in one job: build → scorer → CSD scores → filters → reshard → one
model per subset at equal samples seen → evaluation → ``report.md`` (jobs/track/run.py). ``make demo``
runs the demo preset on a generated pool served on 127.0.0.1. Re-running with the same ``output``
resumes: finished steps are skipped, an interrupted training resumes from its checkpoint.
"""

from __future__ import annotations

import sys

from jobs.common import init_ray, parse_job_config
from jobs.track.config import TRACK_PRESETS
from jobs.track.report import markdown_table
from jobs.track.run import ResumeMismatch, claim_output, run_track
from pipeline.common.config import ConfigError, to_dict
from pipeline.common.manifest import write_manifest
from pipeline.common.shared_storage import require_shared_storage
from pipeline.common.storage import Storage, redact_text


def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(argv, __doc__.splitlines()[0], TRACK_PRESETS, {"--output": "output"})
    try:  # before Ray starts: a resumed run's config must match the steps it recorded
        claim_output(cfg)
    except ResumeMismatch as exc:
        print(f"config error: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    init_ray(cfg.num_cpus)
    try:  # every step's tasks open the run directory; the evaluation reads the eval root
        require_shared_storage(
            {"output": cfg.output, "eval_root": cfg.eval_root, "build.metadata": cfg.build.metadata}
        )
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    result = run_track(cfg)
    write_manifest(
        cfg.output,
        job="track",
        config=to_dict(cfg),
        counts={"subsets": {r["subset"]: r["size"] for r in result.table}},
        timings=result.timings,
        store=Storage.from_env(cfg.s3_endpoint),
        extra={"report": result.report, "verdict": result.comparisons},
    )
    print(f"\nreport: {result.report}\n")
    for key, v in result.comparisons.items():
        cand, ctrl = key.split("_vs_")
        word = "beats" if v["beats"] else "does not beat"
        print(f"{cand} {word} {ctrl}: mean average difference {v['mean_diff']:+.4f} over seeds {v['seeds']}")
    print()
    print(markdown_table(result.table))
    return 0
