"""``python -m jobs.build_dataset --preset demo|datacomp-small [--config F] [--set k=v ...]``.

Builds webdataset shards, a per-uid status table and one subset per filter. With the demo preset and no
``metadata`` it generates the demo pool and serves it on 127.0.0.1 for the duration of the build. The
metadata's files and schemas, the filters and the output are checked before Ray starts.
"""

from __future__ import annotations

import sys

from jobs.common import init_ray, job_main, parse_job_config, print_table
from pipeline.common.config import to_dict
from pipeline.common.errors import StorageError, explain
from pipeline.common.manifest import write_manifest
from pipeline.common.preflight import input_files, output_location
from pipeline.common.shared_storage import require_shared_storage
from pipeline.common.storage import Storage
from pipeline.config import BUILD_PRESETS, BuildConfig

FLAGS = {"--metadata": "metadata", "--output": "output", "--s3-endpoint": "storage.s3_endpoint"}
# A preset for real data has no default output or metadata: a forgotten flag must not write to a bucket.
REQUIRED = {"*": ("output",), "datacomp-small": ("metadata", "output")}
SUMMARY = """\
Metadata parquet → row checks and URL dedupe → download and resize → image dedupe → webdataset shards,
metadata/status.parquet (one status per input row) and one DataComp subset .npy per filter.
Re-running into the same output resumes from the committed download parts."""
EXAMPLE = (
    "python -m jobs.build_dataset --preset datacomp-small --metadata s3://bucket/metadata/ "
    "--output s3://bucket/run --s3-endpoint http://127.0.0.1:8333"
)


def check_inputs(cfg: BuildConfig, store: Storage) -> None:
    """Everything that can fail before Ray starts: filter names and parameters, the metadata's files and
    their schemas (footers only), and the output location."""
    from pipeline.filters.specs import check_build_filters
    from pipeline.schema import METADATA_SCHEMA, SchemaError
    from pipeline.source.metadata import open_metadata

    try:
        check_build_filters(cfg.filters, [f.name for f in METADATA_SCHEMA], "filters")
    except SchemaError:
        pass  # the columns a filter needs are checked against the real metadata below
    output_location(store, cfg.output, "output")
    if cfg.metadata:
        input_files(store, cfg.metadata, "metadata", kind="parquet", suffix=".parquet")
        meta = open_metadata(cfg.metadata, store)
        for name, columns in zip(meta.files, meta.names, strict=True):
            check_build_filters(cfg.filters, columns, name)


@job_main
def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(
        argv, SUMMARY, BUILD_PRESETS, FLAGS, required=REQUIRED, prog="jobs.build_dataset", example=EXAMPLE
    )
    store = cfg.storage.store()
    check_inputs(cfg, store)
    import ray

    from pipeline.build import build
    from pipeline.demo.source import demo_source

    init_ray(cfg.num_cpus)
    require_shared_storage({"output": cfg.output, "metadata": cfg.metadata})
    # The demo pool is served on the driver's address: 127.0.0.1 locally, the head's on a cluster.
    source = demo_source(cfg, host=ray.util.get_node_ip_address(), store=store)
    try:
        with source as run_cfg:
            result = build(run_cfg, store=store, allow_hosts=source.allow_hosts)
    except Exception as exc:  # a full disk or an unreachable store: one line naming what to fix
        line = explain(exc, cfg.output)
        if line is None:
            raise
        raise StorageError(line) from None
    write_manifest(
        run_cfg.output,
        job="build_dataset",
        config=to_dict(run_cfg),
        counts={
            "input_rows": result.n_input,
            "status": result.status_counts,
            "subsets": result.filter_counts,
            "subset_sizes": result.subset_sizes,
        },
        timings=result.timings,
        store=store,
    )
    total = result.n_input
    rows = [(k, v, f"{100 * v / max(total, 1):.1f}%") for k, v in result.status_counts.items()]
    rows.append(("total", total, "100.0%"))
    print_table(f"status of {total} input rows → {run_cfg.output}", rows, ("status", "rows", "share"))
    scope = run_cfg.filters.subset_scope
    subset_rows = [(k, v["metadata"], v["downloaded"]) for k, v in sorted(result.subset_sizes.items())]
    print_table(
        f"subsets (the .npy lists the {scope} scope; training sees the downloaded ones)",
        subset_rows,
        ("filter", "passing uids (DataComp)", "downloaded"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
