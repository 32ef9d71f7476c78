"""A subset model's data on the demo: resharded copy + its read, against the pool read through the subset .npy.

On a finished track run (``--run``, a ``make demo`` output: ``shards/`` and ``subsets/*.npy``), for each
subset alternated (bench/alternate.py) over ``--rounds``:

- ``reshard``: ``pipeline.subsets.reshard.reshard`` into a temp directory (what the track's reshard step
  did), then one pass of the strict shard reader over the copy (a training epoch's read);
- ``direct``: one pass of ``SubsetShardReader`` over the pool's shards (pipeline/ingest/subset_reader.py:
  what a subset model reads with ``data.subset``, and all it reads with ``data.cache_decoded``).

Both yield the same rows (tests/pipeline/ingest/test_subset_reader.py); here the figures are the bytes
written and the wall time. Later epochs without the decoded cache read the copy (reshard) or the pool
(direct) again: ``epoch_read_s`` gives one such read each. Writes bench/results/subset_read.json.
Usage: python -m bench.subset_read --run runs/demo [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.alternate import MIN_ROUNDS, alternate, loads_note, results_path, spread, times
from pipeline.ingest.subset_reader import SubsetShardReader
from pipeline.shards.reader import ShardReader, list_shards
from pipeline.subsets.reshard import reshard

ROOT = Path(__file__).resolve().parents[1]

RESULT = ROOT / "bench" / "results" / "subset_read.json"


def rows_of(reader, paths: list[str]) -> int:
    return sum(t.num_rows for p in paths for t in reader(p))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=ROOT / "runs" / "demo")
    ap.add_argument("--subsets", default="csd_best,random")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--allow-loaded", action="store_true")
    args = ap.parse_args()
    assert args.rounds >= MIN_ROUNDS
    pool = list_shards(str(args.run / "shards"))
    pool_bytes = sum(os.path.getsize(p) for p in pool)
    results, records, loads = {}, [], []
    date = datetime.datetime.now().isoformat(timespec="seconds")
    for name in args.subsets.split(","):
        subset = str(args.run / "subsets" / f"{name}.npy")
        tmp = Path(tempfile.mkdtemp(prefix="prolip-bench-reshard-"))
        written: dict = {}

        def resharded(subset=subset, tmp=tmp, written=written) -> None:
            shutil.rmtree(tmp / "out", ignore_errors=True)
            res = reshard(pool, subset, str(tmp / "out"), samples_per_shard=500)
            copy = list_shards(str(tmp / "out"))
            written.update(rows=rows_of(ShardReader(), copy), n=res.n_written,
                           bytes=sum(os.path.getsize(p) for p in (tmp / "out").iterdir()))  # fmt: skip

        def direct(subset=subset, written=written) -> None:
            written["direct_rows"] = rows_of(SubsetShardReader(subset), pool)

        log = alternate({"reshard": resharded, "direct": direct}, args.rounds)
        t0 = time.perf_counter()
        rows_of(ShardReader(), list_shards(str(tmp / "out")))
        copy_epoch = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows_of(SubsetShardReader(subset), pool)
        pool_epoch = time.perf_counter() - t0
        shutil.rmtree(tmp, ignore_errors=True)
        assert written["rows"] == written["direct_rows"] == written["n"], written
        saved = spread([r["reshard"]["wall_s"] - r["direct"]["wall_s"] for r in log])
        loads += [r[c]["load"] for r in log for c in r]
        results[name] = {"rows": written["n"], "bytes_written": written["bytes"], "pool_bytes": pool_bytes,
                         "reshard": times(log, "reshard"), "direct": times(log, "direct"), "saved_s": saved,
                         "epoch_read_s": {"copy": copy_epoch, "pool_through_subset": pool_epoch}, "rounds": log}  # fmt: skip
        r = results[name]
        print(f"{name}: {r['rows']} rows; reshard + read {r['reshard']['wall_s']['median']:.2f} s "
              f"({r['bytes_written'] / 1e6:.0f} MB written) vs direct {r['direct']['wall_s']['median']:.2f} s; "
              f"{loads_note([x['reshard']['load'] for x in log], os.cpu_count() or 1)}")  # fmt: skip
        records.append({
            "what": f"demo subset {name} ({r['rows']} of the pool's rows): resharded copy + its read vs the pool "
                    "read through the .npy (first epoch)",
            "command": f"python -m bench.subset_read --run RUN --rounds {args.rounds}  (RUN: a demo track's output)",
            "figure": f"{r['reshard']['wall_s']['median']:.2f} s and {r['bytes_written'] / 1e6:.0f} MB written "
                      f"vs {r['direct']['wall_s']['median']:.2f} s and 0 MB",
            "spread": f"reshard {r['reshard']['wall_s']['min']:.2f}–{r['reshard']['wall_s']['max']:.2f} s, direct "
                      f"{r['direct']['wall_s']['min']:.2f}–{r['direct']['wall_s']['max']:.2f} s over {args.rounds} "
                      f"rounds; a later epoch reads {copy_epoch:.2f} s (copy) vs {pool_epoch:.2f} s (pool, "
                      f"{pool_bytes / 1e6:.0f} MB)",
            "load": f"{min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} cores", "date": date})  # fmt: skip
    doc = {"title": "A subset's data on the demo: reshard vs the pool through the subset .npy",
           "about": "Alternated in one process, no Ray: the strict shard reader in both, the same rows.",
           "records": records, "results": results}  # fmt: skip
    out = results_path(args.out, RESULT, max(loads), os.cpu_count() or 1, args.allow_loaded)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
