"""``python -m jobs.reshard --shards PATH_OR_GLOB [...] --subset X.npy --out DIR``: materialise a subset.

Thin entry point over ``pipeline.reshard.reshard`` (DataComp's resharder semantics: semi-join on uid,
repeated uids up-sampled, bytes copied as they are). No Ray: one streaming pass, optional read-ahead
threads. The summary (written, missing, shards) is printed and written to ``OUT/reshard.json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jobs.common import print_table
from pipeline.reshard import ReshardError, reshard
from pipeline.shards import ShardError
from pipeline.subset import SubsetError


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Write the samples of a DataComp subset (.npy) into new shards.")
    p.add_argument(
        "--shards", nargs="+", required=True, help="input tars, directories or globs (local or s3://)"
    )
    p.add_argument("--subset", required=True, help="DataComp subset .npy (u8,u8 uids), local or s3://")
    p.add_argument("--out", required=True, help="output directory (local or s3://)")
    p.add_argument("--samples-per-shard", type=int, default=10_000, help="DataComp's default: 10000")
    p.add_argument(
        "--s3-endpoint", default="", help="e.g. http://127.0.0.1:8333 (else AWS_ENDPOINT_URL / AWS)"
    )
    p.add_argument("--workers", type=int, default=1, help="input tars read ahead in parallel")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    p.add_argument("--skip-corrupt", action="store_true", help="keep going past a damaged input tar")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        res = reshard(
            args.shards,
            args.subset,
            args.out,
            samples_per_shard=args.samples_per_shard,
            s3_endpoint=args.s3_endpoint,
            workers=args.workers,
            overwrite=args.overwrite,
            skip_corrupt=args.skip_corrupt,
        )
    except (FileExistsError, FileNotFoundError, ShardError, SubsetError, ReshardError, ValueError) as exc:
        print(f"reshard: {exc}", file=sys.stderr)
        return 1
    rows = [
        ("subset rows", int(res.expected.sum())),
        ("distinct uids", len(res.uids)),
        ("written", res.n_written),
        ("missing uids", res.n_missing),
        ("missing rows", res.n_missing_rows),
        ("input samples read", res.n_input_samples),
        ("shards", len(res.shards)),
    ]
    if res.corrupt_inputs:
        rows.append(("corrupt inputs", len(res.corrupt_inputs)))
    print_table(f"reshard → {args.out}", rows, ("", "count"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
