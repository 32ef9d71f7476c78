"""``python -m jobs.build_dataset --preset demo|datacomp-small [--config F] [--set k=v ...]``.

Builds webdataset shards, a per-uid status table and one subset per filter. With the demo preset and no
``metadata`` it generates the demo pool and serves it on 127.0.0.1 for the duration of the build.
"""

from __future__ import annotations

import sys

from jobs.common import config_parser, init_ray, print_table, resolve_config
from pipeline.build import build, demo_source
from pipeline.config import BUILD_PRESETS, to_dict
from pipeline.manifest import write_manifest
from pipeline.storage import Storage


def main(argv: list[str] | None = None) -> int:
    parser = config_parser(__doc__.splitlines()[0], BUILD_PRESETS)
    args = parser.parse_args(argv)
    cfg = resolve_config(args, BUILD_PRESETS)
    init_ray(cfg.num_cpus)
    store = Storage.from_env(cfg.s3_endpoint)
    with demo_source(cfg) as run_cfg:
        result = build(run_cfg, store=store)
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
