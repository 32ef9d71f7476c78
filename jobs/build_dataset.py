"""``python -m jobs.build_dataset --preset demo|datacomp-small [--config F] [--set k=v ...]``.

Builds webdataset shards, a per-uid status table and one subset per filter. With the demo preset and no
``metadata`` it generates the demo pool and serves it on 127.0.0.1 for the duration of the build.
"""

from __future__ import annotations

import sys

from jobs.common import init_ray, parse_job_config, print_table
from pipeline.build import build
from pipeline.common.config import ConfigError, to_dict
from pipeline.common.manifest import write_manifest
from pipeline.common.storage import Storage
from pipeline.common.storage_errors import explain
from pipeline.config import BUILD_PRESETS
from pipeline.demo.source import demo_source
from pipeline.filters.specs import check_build_filters
from pipeline.schema import METADATA_SCHEMA, SchemaError
from pipeline.source.metadata import MetadataError
from pipeline.source.run_state import FingerprintMismatch

FLAGS = {"--metadata": "metadata", "--output": "output", "--s3-endpoint": "s3_endpoint"}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_job_config(argv, __doc__.splitlines()[0], BUILD_PRESETS, FLAGS)
    try:
        check_build_filters(cfg.filters, _ALL_COLUMNS, "filters")  # names and parameters, before Ray starts
    except ConfigError as exc:
        return _stop("config error", exc)
    except SchemaError:
        pass  # the columns are checked against the real metadata in build()
    init_ray(cfg.num_cpus)
    store = Storage.from_env(cfg.s3_endpoint)
    try:
        with demo_source(cfg) as run_cfg:
            result = build(run_cfg, store=store)
    except ConfigError as exc:
        return _stop("config error", exc)
    except (MetadataError, SchemaError) as exc:
        return _stop("metadata error", exc)
    except FingerprintMismatch as exc:
        return _stop("refused", exc)
    except (
        Exception
    ) as exc:  # a full disk or an unreachable store: one line; anything else keeps its traceback
        line = explain(exc, cfg.output)
        if line is None:
            raise
        return _stop("storage error", line)
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


_ALL_COLUMNS = [f.name for f in METADATA_SCHEMA]


def _stop(kind: str, exc: Exception | str) -> int:
    """One line on stderr naming the field or file, exit code 2 (no traceback: the message is the fix)."""
    print(f"{kind}: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
