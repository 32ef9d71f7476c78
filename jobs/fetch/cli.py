"""``python -m jobs.fetch --preset datacomp-small|datacomp-medium|datacomp-large|datacomp-xlarge|eval --out DIR``.

DataComp's inputs straight from the Hugging Face hub to a local folder or S3, with ``huggingface_hub``
(jobs/fetch/plan.py says what lands where): the pool's metadata parquet files (``--set npz=true``: and the
``.npz`` embeddings) flat in ``<out>/metadata``, the build's ``--metadata``; the task list's evaluation sets
under ``<out>/eval``, the ``--eval-root`` of ``jobs.evaluate`` and ``jobs.track``. Each repo is copied at
one commit; every file is checked against the size and hash the hub lists; a cut transfer resumes where it
stopped, at once or at the next run, and a file already copied and checked is skipped, so the same command
finishes what an earlier one started. Progress: a line every ``progress_s`` seconds and one per set.

A set that cannot be fetched (not on the hub, no file to take, bytes that never match their hash) does not
stop the others, and ends the job with one line naming every such set and the exit status of the first
one's kind: 3 (input error) for a set the hub does not have, 4 (storage error) for a hub that does not
answer or keeps sending other bytes (docs/jobs.md, "Errors and exit codes"). No Ray: the job is one process
of threads, on a laptop or as a cluster's entrypoint (``ray job submit``).
"""

from __future__ import annotations

import sys

from jobs.common import job_main, parse_job_config, print_table
from jobs.fetch.config import FETCH_PRESETS
from pipeline.common.config import ConfigError, to_dict
from pipeline.common.manifest import write_manifest
from pipeline.common.preflight import output_location

FLAGS = {"--out": "out", "--metadata-out": "metadata_out", "--eval-out": "eval_out", "--npz": ("npz", True)}
SUMMARY = """\
DataComp's pool metadata (parquet, --npz for the embeddings) and evaluation sets from the Hugging Face hub
to a local folder or s3://, checked against the hub's hashes; a re-run resumes and skips what is done."""
EXAMPLE = "python -m jobs.fetch --preset datacomp-small --out s3://my-bucket/datacomp-small"


@job_main
def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, FETCH_PRESETS, FLAGS, default="datacomp-small", prog="jobs.fetch", example=EXAMPLE
    )
    from huggingface_hub import HfApi
    from huggingface_hub.utils import disable_progress_bars

    from jobs.fetch.plan import sources
    from pipeline.hub.mirror import default_staging, mirror

    roots = {"metadata_out": cfg.metadata_root() if cfg.metadata_repo else None}
    roots["eval_out"] = cfg.eval_root() if cfg.eval_tasks else None
    missing = [k for k, v in roots.items() if v == ""]
    if missing:
        raise ConfigError(f"{', '.join(missing)} required (give --out DIR)")
    store = cfg.storage.store()
    for key, root in roots.items():
        if root:
            output_location(store, root, key)
    todo = sources(cfg)
    disable_progress_bars()  # one progress line for every file, not one bar each
    api = HfApi(endpoint=cfg.hub_endpoint or None)
    print(f"[fetch] {len(todo)} repos from {api.endpoint}")
    report = mirror(
        todo, store, api=api, staging=lambda root: default_staging(root, cfg.staging), workers=cfg.workers,
        attempts=cfg.attempts, verify=cfg.verify, progress_s=cfg.progress_s,
        log=lambda line: print(line, flush=True),
    )  # fmt: skip
    rows = [
        (r.source.name, r.source.repo, r.commit[:12] or "-", r.files, f"{r.bytes / 1e6:.1f}",
         "FAILED" if r.error else ", ".join(f"{n} {k}" for k, n in sorted(r.how.items())) or "nothing to do")
        for r in report.results
    ]  # fmt: skip
    print_table(f"fetched from {api.endpoint}", rows, ("set", "repo", "commit", "files", "MB", "done"))
    manifest_dir = cfg.out or roots["metadata_out"] or roots["eval_out"]
    write_manifest(
        manifest_dir, job="fetch", config=to_dict(cfg), store=store,
        counts={r.source.name: {"files": r.files, "bytes": r.bytes, **r.how} for r in report.results},
        timings={"fetch": report.wall_s},
        extra={"commits": {r.source.name: f"{r.source.repo}@{r.commit}" for r in report.results if r.commit},
               "failed": {r.source.name: str(r.error) for r in report.failed}},
    )  # fmt: skip
    if report.failed:
        first = report.failed[0].error
        names = "; ".join(str(r.error) for r in report.failed)
        raise type(first)(f"{len(report.failed)} of {len(report.results)} sets failed: {names}") from None
    print(
        f"done in {report.wall_s:.1f} s; metadata: {roots['metadata_out'] or '-'}, eval sets: {roots['eval_out'] or '-'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
