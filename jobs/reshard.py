"""``python -m jobs.reshard --shards PATH_OR_GLOB [...] --subset X.npy --out DIR``: materialise a subset.

Like every job it also takes ``--preset``, ``--config FILE.yaml`` and ``--set key=value``.

Thin entry point over ``pipeline.subsets.reshard.reshard`` (DataComp's resharder semantics: semi-join on uid,
repeated uids up-sampled, bytes copied as they are). No Ray: one streaming pass, optional read-ahead
threads. The summary (written, missing, shards) is printed and written to ``OUT/reshard.json``. The
shards, the subset and the output are checked before the first tar is read.
``--verify`` checks every selected sample against the checksums of its stored bytes that the build
recorded (pipeline/shards/checksums.py): a mismatch is not copied, counted and named.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import field

from jobs.common import job_main, parse_job_config, print_table
from pipeline.common.config import Names, Positive, config_class
from pipeline.common.errors import JobError, RefusedError, UsageError, naming
from pipeline.common.preflight import input_file, input_files, output_location
from pipeline.common.storage_config import StorageConfig


@config_class
class ReshardJobConfig:
    shards: Names = field(default_factory=list)  # input tars, directories or globs (local or s3://)
    subset: str = ""  # DataComp subset .npy (u8,u8 uids), local or s3://
    out: str = ""  # output directory (local or s3://)
    samples_per_shard: Positive = 10_000  # DataComp's default
    storage: StorageConfig = StorageConfig()  # storage.s3_endpoint; credentials from the environment
    workers: Positive = 1  # input tars read ahead in parallel
    overwrite: bool = False  # replace shards already in out
    skip_corrupt: bool = False  # keep going past a damaged input tar
    verify: bool = False  # copy only samples whose bytes match their stored checksums; name the others


PRESETS = {"demo": ReshardJobConfig()}
FLAGS = {
    "--shards": "shards",
    "--subset": "subset",
    "--out": "out",
    "--samples-per-shard": "samples_per_shard",
    "--s3-endpoint": "storage.s3_endpoint",
    "--workers": "workers",
    "--overwrite": "overwrite",
    "--skip-corrupt": "skip_corrupt",
    "--verify": "verify",
}
SUMMARY = """\
Materialise a DataComp subset (a sorted u8,u8 uid .npy) as new webdataset shards: DataComp's resharder
semantics (a semi-join on uid, repeated uids up-sampled, bytes copied as they are), no Ray."""
EXAMPLE = (
    "python -m jobs.reshard --shards runs/demo/shards --subset runs/demo/subsets/basic.npy --out runs/basic"
)


@job_main
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_job_config(
        argv, SUMMARY, PRESETS, FLAGS, required=("shards", "subset", "out"), prog="jobs.reshard",
        example=EXAMPLE,
    )  # fmt: skip
    from pipeline.subsets.reshard import load_subset, reshard

    store = args.storage.store()
    input_files(store, ",".join(args.shards), "shards", "tar", ".tar")
    input_file(store, args.subset, "subset", "npy")
    with naming(f"subset {args.subset}"):
        load_subset(args.subset, store)  # dtype and order, before any tar is read
    output_location(store, args.out, "out")
    try:
        res = reshard(
            args.shards,
            args.subset,
            args.out,
            samples_per_shard=args.samples_per_shard,
            store=store,
            workers=args.workers,
            overwrite=args.overwrite,
            skip_corrupt=args.skip_corrupt,
            verify=args.verify,
        )
    except JobError:
        raise
    except FileExistsError as exc:  # out holds another reshard's shards
        raise RefusedError(str(exc).removeprefix("reshard: ")) from None
    except ValueError as exc:  # out overlaps the inputs
        raise UsageError(str(exc).removeprefix("reshard: ")) from None
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
    if args.verify:
        rows.append(("checksum mismatches", len(res.mismatched)))
    print_table(f"reshard → {args.out}", rows, ("", "count"))
    for line in res.mismatched[:20]:
        print(f"reshard: checksum mismatch, not copied: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
