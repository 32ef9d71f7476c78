"""Memory of the streamed embedding filters against the pool's size: negCLIPLoss and NormSim as the build
runs them (pipeline/stages/score_stages.py), each task in its own process, at several pool sizes.

- **data**: ``n`` rows in DataComp-like ``.npz`` embeddings files of ``--file-rows`` rows (``u8,u8``
  uids from a hash of the row number, ``l14_img``/``l14_txt`` float32 of ``--dim`` dimensions, the text a
  noisy copy of the image), the pool's per-bucket uid files (``--bucket-rows`` a bucket), NormSim targets;
- **NormSim**: one ``embedding_scores`` task per file (scores written by uid bucket), then the exact
  top-fraction cut: every pass one ``count_digits``-like task per bucket (``with_scores`` +
  ``cut_summary``), the planning process gathering the summaries (``advance``) as the build's driver does;
- **negCLIPLoss**: one ``embedding_scores`` task per file (vectors written by uid range), then
  ``score_group`` for three of the ranges (first, middle, last): a range holds 4–8 batches' rows whatever
  the pool's size, so three stand for all; the cut is NormSim's code over the ranges' scores.

Per size: each kind of task's largest peak (``ru_maxrss`` of its process, and the peak of anonymous
memory, RssAnon sampled every 0.1 s), the planning process's peak of anonymous memory (it holds the
file, bucket and range lists and the summaries), and wall times. Flat in ``n`` is the claim; the ratio is
each figure at the largest size over the smallest. Writes ``--out`` (bench/schema.py's records).

Usage: python -m bench.embedding_filters_scale [--sizes 1000000,4000000,16000000] [--dim 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench.memory import PeakAnon
from bench.schema import write_records

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "embedding_filters_scale.json"


# --- the tasks, each run in a child process ----------------------------------------------------------


def _uid_pairs(start: int, stop: int) -> np.ndarray:
    from pipeline.common.hashing import splitmix64
    from pipeline.schema import UID_DTYPE

    i = np.arange(start, stop, dtype=np.uint64)
    out = np.empty(len(i), UID_DTYPE)
    out["f0"], out["f1"] = splitmix64(2 * i + np.uint64(1)), splitmix64(2 * i + np.uint64(2))
    return out


def _job(a: dict, spec: str):
    from pipeline.common.storage import LOCAL
    from pipeline.config import FilterConfig
    from pipeline.stages import filter_stages as FS

    root = a["root"]
    parts = SimpleNamespace(store=LOCAL, pool=SimpleNamespace(n_buckets=a["n_buckets"]),
                            at=lambda *p: os.path.join(root, spec.split(":")[0], *p))  # fmt: skip
    finish = SimpleNamespace(parts=parts, pool_rows=lambda b: os.path.join(root, "pool", f"{b:05d}.parquet"))
    return FS.FilterJob(finish, (spec,), FilterConfig(names=[spec]), tuple(a["files"]), a["n"], "")


def _specs(a: dict) -> dict[str, str]:
    return {
        "norm_sim": f"norm_sim:fraction=0.3,target_file={a['root']}/targets.npy",
        "neg_clip_loss": f"neg_clip_loss:fraction=0.3,batch_size={a['batch_size']},batches={a['batches']}",
    }


def task_gen(a: dict) -> dict:
    rng = np.random.default_rng(a["f"])
    start, stop = a["f"] * a["file_rows"], min(a["n"], (a["f"] + 1) * a["file_rows"])
    img = rng.standard_normal((stop - start, a["dim"]), dtype=np.float32)
    txt = img + 1.5 * rng.standard_normal(img.shape, dtype=np.float32)
    np.savez(a["path"], uid=_uid_pairs(start, stop), l14_img=img, l14_txt=txt)
    return {}


def task_pool(a: dict) -> dict:
    """The pool's per-bucket uid files (the build's pool rows, uid column only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.schema import u8pairs_to_uids
    from pipeline.stages.buckets import range_bucket

    os.makedirs(os.path.join(a["root"], "pool"), exist_ok=True)
    schema = pa.schema([("uid", pa.string())])
    writers = [pq.ParquetWriter(os.path.join(a["root"], "pool", f"{b:05d}.parquet"), schema)
               for b in range(a["n_buckets"])]  # fmt: skip
    for start in range(0, a["n"], 1 << 20):
        pairs = _uid_pairs(start, min(a["n"], start + (1 << 20)))
        bucket = (
            range_bucket(pairs["f0"], a["n_buckets"]) if a["n_buckets"] > 1 else np.zeros(len(pairs), int)
        )
        uids = np.asarray(u8pairs_to_uids(pairs), dtype=object)
        for b in range(a["n_buckets"]):
            writers[b].write_table(pa.table({"uid": pa.array(uids[bucket == b].tolist(), pa.string())}))
    for w in writers:
        w.close()
    np.save(os.path.join(a["root"], "targets.npy"), np.random.default_rng(9).standard_normal((64, a["dim"])))
    return {}


def task_file(a: dict) -> dict:
    from pipeline.stages import score_stages as SS

    return SS.embedding_scores(_job(a, _specs(a)[a["filter"]]), a["s"])


def task_range(a: dict) -> dict:
    from pipeline.stages import score_stages as SS

    return SS.group_scores(_job(a, _specs(a)["neg_clip_loss"]), a["g"])


def task_cut(a: dict) -> dict:
    from pipeline.stages import filter_stages as FS

    job = _job(a, _specs(a)["norm_sim"])
    job = replace(job, cuts={k: FS.Cut(**{**c, "ties": None if c["ties"] is None else tuple(c["ties"])})
                             for k, c in a["cuts"].items()})  # fmt: skip
    return {"summary": FS.count_digits(job, a["b"])}


TASKS = {"gen": task_gen, "pool": task_pool, "file": task_file, "range": task_range, "cut": task_cut}


def _child(name: str, args: dict) -> dict:
    """Run one task in a fresh process; its result with its peaks (MiB)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "bench.embedding_filters_scale", "--task", name, "--args", json.dumps(args)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if run.returncode:
        raise RuntimeError(f"task {name} failed:\n{run.stderr[-3000:]}")
    out = run.stdout
    res = json.loads(out.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    return res


# --- one pool size -----------------------------------------------------------------------------------


def one_size(n: int, a: dict, folder: Path) -> dict:
    from pipeline.filters import embedding as E
    from pipeline.stages import filter_stages as FS
    from pipeline.stages.layout import bucket_count

    with PeakAnon() as driver:
        n_files = -(-n // a["file_rows"])
        files = [str(folder / f"{f:05d}.npz") for f in range(n_files)]
        base = {
            **a,
            "n": n,
            "root": str(folder),
            "files": files,
            "n_buckets": bucket_count(n, a["bucket_rows"]),
        }
        for f, path in enumerate(files):
            _child("gen", {**base, "f": f, "path": path})
        _child("pool", base)
        peaks: dict[str, list[dict]] = {
            "norm_sim file": [],
            "neg_clip file": [],
            "neg_clip range": [],
            "cut": [],
        }
        for s in range(n_files):
            peaks["norm_sim file"].append(_child("file", {**base, "filter": "norm_sim", "s": s}))
            peaks["neg_clip file"].append(_child("file", {**base, "filter": "neg_clip_loss", "s": s}))
        groups = E.neg_clip_groups(n, a["batch_size"])
        for g in sorted({0, groups // 2, groups - 1}):
            peaks["neg_clip range"].append(_child("range", {**base, "g": g}))
        job = _job(base, _specs(base)["norm_sim"])
        job = replace(job, cuts=FS.first_cuts(job))
        passes = 0
        while not all(c.done for c in job.cuts.values()):
            cuts = {k: asdict(c) for k, c in job.cuts.items()}
            done = [_child("cut", {**base, "b": b, "cuts": cuts}) for b in range(base["n_buckets"])]
            peaks["cut"].extend(done)
            summaries = [d["summary"] for d in done]
            job = replace(
                job, cuts={k: c if c.done else FS.advance(job, k, summaries) for k, c in job.cuts.items()}
            )
            passes += 1
    out = {"n": n, "files": n_files, "buckets": base["n_buckets"], "ranges": groups, "cut_passes": passes,
           "driver_anon_mib": driver.peak / 1024}  # fmt: skip
    for kind, runs in peaks.items():
        out[kind] = {"count": len(runs), "max_rss_mib": max(r["max_rss_mib"] for r in runs),
                     "max_anon_mib": max(r["anon_mib"] for r in runs),
                     "wall_s": sum(r["wall_s"] for r in runs)}  # fmt: skip
    return out


def _records(d: dict) -> list[dict]:
    sizes = d["sizes"]
    lo, hi = sizes[0], sizes[-1]
    cmd = "python -m bench.embedding_filters_scale"
    when, load = d["date"], f"{d['load']:.2f}"
    rows = []
    for kind, label in [("norm_sim file", "NormSim: one task per embeddings file"),
                        ("neg_clip file", "negCLIPLoss: one task per embeddings file (vectors by uid range)"),
                        ("neg_clip range", "negCLIPLoss: one task per uid range (3 sampled)"),
                        ("cut", "exact top-30% cut: one task per bucket and pass")]:  # fmt: skip
        figs = ", ".join(f"{s['n'] / 1e6:g}M: {s[kind]['max_anon_mib']:.0f}" for s in sizes)
        rows.append({"what": f"{label}, peak anonymous memory (MiB) at {d['dim']}-d", "command": cmd,
                     "figure": f"{figs}; {hi['n'] / lo['n']:g}× rows → "
                               f"{hi[kind]['max_anon_mib'] / lo[kind]['max_anon_mib']:.2f}×",
                     "spread": "largest task of its kind at each size", "load": load, "date": when})  # fmt: skip
    figs = ", ".join(f"{s['n'] / 1e6:g}M: {s['driver_anon_mib']:.0f}" for s in sizes)
    rows.append({"what": "planning process (file, bucket, range lists; cut summaries), peak anonymous MiB",
                 "command": cmd, "figure": f"{figs}; {hi['driver_anon_mib'] / lo['driver_anon_mib']:.2f}×",
                 "spread": "one run a size", "load": load, "date": when})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=sorted(TASKS))
    ap.add_argument("--args", default="{}")
    ap.add_argument("--sizes", default="1000000,4000000,16000000")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--file-rows", type=int, default=1_000_000)
    ap.add_argument("--bucket-rows", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    if args.task:
        with PeakAnon() as peak:
            res = TASKS[args.task](json.loads(args.args))
        res.update(
            max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, anon_mib=peak.peak / 1024
        )
        print(json.dumps(res))
        return 0
    a = {"dim": args.dim, "file_rows": args.file_rows, "bucket_rows": args.bucket_rows,
         "batch_size": args.batch_size, "batches": args.batches}  # fmt: skip
    sizes = []
    for n in [int(x) for x in args.sizes.split(",")]:
        folder = Path(tempfile.mkdtemp(prefix="emb-scale-"))
        try:
            sizes.append(one_size(n, a, folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(json.dumps(sizes[-1]), flush=True)
    d = {**a, "sizes": sizes, "load": os.getloadavg()[0], "date": datetime.date.today().isoformat()}
    write_records(
        args.out,
        "Streamed embedding filters against the pool's size (negCLIPLoss, NormSim)",
        __doc__,
        _records(d),
        d,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
