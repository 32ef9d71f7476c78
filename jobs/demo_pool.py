"""``python -m jobs.demo_pool --out DIR [--n N] [--seed S] [--serve]``: generate (and serve) the demo pool.

Without ``--serve`` it writes the pool (pictures, routes, truth, eval sets) and prints what was injected.
With ``--serve`` it also starts the pool's HTTP server on 127.0.0.1, writes ``DIR/metadata/`` with that
server's URLs, prints the base URL and the status each row must end in, and serves until Ctrl-C.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import fields
from typing import Annotated

from pydantic import Field

from jobs.common import job_main, parse_job_config, print_table
from pipeline.common.config import Positive, PositiveFloat, Seed, config_class
from pipeline.common.errors import UsageError
from pipeline.common.preflight import output_location
from pipeline.common.storage import Storage, is_s3


@config_class
class DemoPoolConfig:
    out: str = ""  # pool directory (reused when n and seed match)
    n: Positive = 2000  # metadata rows
    seed: Seed = 0  # of everything the pool holds: pictures, captions, faults, eval sets
    serve: bool = False  # serve on 127.0.0.1 until Ctrl-C
    port: Annotated[int, Field(ge=0, le=65535)] = 0  # with serve: port (0 = any free port)
    slow_s: PositiveFloat = 3.0  # with serve: delay of the 'slow' routes


PRESETS = {"demo": DemoPoolConfig()}
FLAGS = {f"--{f.name.replace('_', '-')}": f.name for f in fields(DemoPoolConfig)}
SUMMARY = """\
Generate the demo pool (pictures, captions with web-like noise, download faults, eval sets) and,
with --serve, serve it on 127.0.0.1 with DIR/metadata/ pointing at that server, until Ctrl-C."""
EXAMPLE = "python -m jobs.demo_pool --out runs/pool --n 2000 --serve"


@job_main
def main(argv: list[str] | None = None) -> int:
    args = parse_job_config(
        argv, SUMMARY, PRESETS, FLAGS, required=("out",), prog="jobs.demo_pool", example=EXAMPLE
    )
    if is_s3(args.out):  # the pool's server and its renderers read the pictures from local disk
        raise UsageError(f"out: the demo pool is written to a local directory, got {args.out}")
    output_location(Storage(), args.out, "out")
    from pipeline.demo.pool import generate_pool, write_metadata
    from pipeline.demo.server import serve_pool

    info = generate_pool(args.out, n=args.n, seed=args.seed)
    how = "reused" if info.reused else f"generated in {info.seconds:.1f}s"
    print_table(f"demo pool: {info.n} rows, seed {info.seed}, {how} → {info.pool_dir}",
                sorted(info.noise_counts.items()), ("noise", "rows"))  # fmt: skip
    print_table("caption noise", sorted(info.caption_noise_counts.items()), ("caption_noise", "rows"))
    print_table("expected build status", sorted(info.expected_status_counts.items()), ("status", "rows"))
    if not args.serve:
        return 0
    with serve_pool(args.out, port=args.port, slow_s=args.slow_s) as server:
        meta = write_metadata(args.out, server.base_url)
        print(f"\nserving {server.base_url}  (metadata: {meta}); Ctrl-C to stop", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
