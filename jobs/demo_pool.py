"""``python -m jobs.demo_pool --out DIR [--n N] [--seed S] [--serve]``: generate (and serve) the demo pool.

Without ``--serve`` it writes the pool (pictures, routes, truth, eval sets) and prints what was injected.
With ``--serve`` it also starts the pool's HTTP server on 127.0.0.1, writes ``DIR/metadata/`` with that
server's URLs, prints the base URL and the status each row must end in, and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import threading

from jobs.common import print_table
from pipeline.demo.pool import generate_pool, write_metadata
from pipeline.demo.server import serve_pool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="pool directory (reused when n and seed match)")
    parser.add_argument("--n", type=int, default=2000, help="metadata rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve", action="store_true", help="serve on 127.0.0.1 until Ctrl-C")
    parser.add_argument("--port", type=int, default=0, help="with --serve: port (0 = any free port)")
    parser.add_argument("--slow-s", type=float, default=3.0, help="with --serve: delay of the 'slow' routes")
    args = parser.parse_args(argv)

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
