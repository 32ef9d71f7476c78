"""Cost of the curation stage against the pool's size, through its Ray stages as the build runs them
(``pipeline.dedup.curation_stage.curate_buckets``): per-file tasks over embeddings files read in place,
the k-means fit task, bucket files by cluster group and one task per group, one task per uid bucket for
its facts, then the rule; the curve, and its extrapolation to DataComp small (12.8M) and medium (128M).

Each size runs in two processes: one writes the pool to local disk, then a fresh one (the "driver":
the process that calls the stage, as the build's curation task does) starts a local Ray on this
machine's cores and runs the stage on it.

- **pool**: ``n`` unit vectors of ``--dim`` dimensions in ``.npz`` files of ``FILE_ROWS`` rows (uid array
  plus float16 embeddings, DataComp's layout), in blobs of 1,000 rows (a random centre each, cosine ≈ 0.7
  within a blob, like pictures of one concept: the same density at every size), 2% planted near-copies
  (cosine ≈ 0.97) of other rows of the same file (the exactness on a continuum that k-means splits is
  bench/semdedup_exact.py's); the part rows of ``BUCKET_ROWS`` rows a uid bucket (``uid``, ``status`` with 5% failed
  downloads, ``phash``, the keep-first score); an eval reference of ``--eval`` pictures of which 0.1% of
  the pool are perturbed copies (half of them by pHash too).
- **measured**: wall time; the driver's peak anonymous memory (RssAnon, sampled every 0.2 s) above what
  it held before the stage, and at each of the stage's progress lines its growth then and its peak so
  far (so the phase that reached the peak is named); the largest RssAnon any one Ray worker process
  reached (the object store's shared pages are not anonymous); the planted pairs of which a row was
  dropped, and the leaks found.

The time is fitted as t = a·n + b·n² by least squares over the sizes (k = n / cluster_rows clusters: the
assignment scans k centroids per row, as n²; k-means fits min(256·k, 512 MiB of float32) rows against k,
as n² until the sample reaches its cap, linearly after), and evaluated at 12.8M and 128M. Writes ``--out`` in
the recorded-figures format of bench/benchmarks_doc.py.

Usage: python -m bench.curation_scale [--sizes 1000000,4000000,8000000] [--dim 256] [--eval 5000] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.memory import PeakAnon, PeakAnonWorkers, anon_kb
from bench.schema import write_records

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FILE_ROWS = 250_000
BUCKET_ROWS = 500_000
BLOB = 1000
TARGETS = (12_800_000, 128_000_000)
WIDTH = (
    "DataComp's L/14 embeddings are 768-d; 16M rows of 768-d would need ~24 GiB of input and 30-36 GB of buckets, most of this disk's ~68 GB free; "
    "at 256-d, with the guests held to sub-cones (decision 0111), 16M rows' buckets (~13 GB) fit this disk, but "
    "the run takes ~2 h of its 2 cores, so the default sweep stops at 8M and 16M is run on its own "
    "(--sizes 16000000 --append)"
)


def _blobs(rng: np.random.Generator, m: int, d: int) -> np.ndarray:
    from pipeline.dedup.semantic import normalize

    out = np.empty((m, d), np.float32)
    for a in range(0, m, BLOB):
        k = min(BLOB, m - a)
        centre = rng.standard_normal(d)
        out[a : a + k] = normalize(
            0.85 * centre / np.sqrt(d) + 0.55 * rng.standard_normal((k, d)) / np.sqrt(d)
        )
    return out


def synth(n: int, d: int, n_eval: int, folder: Path, seed: int = 0) -> dict:
    """Write the pool under ``folder`` (module docstring) → the planted truth's file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline import schema as S
    from pipeline.dedup.curation_rules import PRIORITY
    from pipeline.dedup.semantic import normalize
    from pipeline.stages.buckets import uid_buckets

    rng = np.random.default_rng(seed)
    ref_vec = _blobs(rng, n_eval, d)
    ref_hash = rng.integers(-(2**63), 2**63 - 1, n_eval, dtype=np.int64)
    pq.write_table(
        pa.table({"task": ["task"] * n_eval, "key": np.arange(n_eval).astype(str), "phash": ref_hash,
                  "embedding": pa.FixedSizeListArray.from_arrays(pa.array(ref_vec.ravel()), d)}),
        folder / "reference.parquet",
    )  # fmt: skip
    n_buckets = max(1, -(-n // BUCKET_ROWS))
    (folder / "emb").mkdir()
    pairs, leaks = [], []
    for f, a in enumerate(range(0, n, FILE_ROWS)):
        m = min(FILE_ROWS, n - a)
        hi = rng.integers(0, 2**63, m, dtype=np.int64).astype(np.uint64) * np.uint64(2)
        uids = np.array([f"{int(h):016x}{a + i:016x}" for i, h in enumerate(hi)])
        vec = _blobs(rng, m, d)
        src = rng.choice(m, m // 50, replace=False)
        dst = rng.choice(np.setdiff1d(np.arange(m), src), m // 50, replace=False)
        vec[dst] = normalize(vec[src] + 0.25 * rng.standard_normal((len(src), d)) / np.sqrt(d))
        pairs.append(np.stack([uids[src], uids[dst]], 1))
        leak = rng.choice(np.setdiff1d(np.arange(m), np.r_[src, dst]), max(1, m // 1000), replace=False)
        of = rng.choice(n_eval, len(leak), replace=False)
        vec[leak] = normalize(ref_vec[of] + 0.1 * rng.standard_normal((len(leak), d)) / np.sqrt(d))
        leaks.append(np.stack([uids[leak], of.astype(str)], 1))
        np.savez(folder / "emb" / f"{f:05d}.npz", uid=uids, emb=vec.astype(np.float16))
        phash = rng.integers(-(2**63), 2**63 - 1, m, dtype=np.int64)
        half = leak[: len(leak) // 2]  # a re-encode: the pHash within a few bits of the eval picture's
        phash[half] = ref_hash[of[: len(half)]] ^ np.int64(0b101)
        status = np.where(rng.random(m) < 0.05, "failed_to_download", S.STATUS_SUCCESS)
        status[np.r_[src, dst, leak]] = S.STATUS_SUCCESS  # the truth is about rows that downloaded
        t = pa.table({S.UID: uids, S.STATUS: status, S.PHASH: phash, PRIORITY: rng.random(m)})
        b = uid_buckets(t.column(S.UID), n_buckets)
        for k in np.unique(b):
            (folder / "rows" / f"{k:05d}").mkdir(parents=True, exist_ok=True)
            pq.write_table(t.filter(pa.array(b == k)), folder / "rows" / f"{k:05d}" / f"{f:05d}.parquet")
    np.save(folder / "pairs.npy", np.concatenate(pairs))
    np.save(folder / "leaks.npy", np.concatenate(leaks))
    return {"n_buckets": n_buckets, "files": -(-n // FILE_ROWS)}


class BucketFiles:
    """``bucket_rows`` of the synthetic pool: bucket ``b``'s part rows from its folder."""

    def __init__(self, folder: str):
        self.folder = folder

    def __call__(self, b: int):
        import pyarrow.parquet as pq

        path = Path(self.folder) / "rows" / f"{b:05d}"
        return (
            pq.read_table(path)
            if path.exists()
            else pq.read_table(next(Path(self.folder).glob("rows/*"))).slice(0, 0)
        )


_SAID: list[str] = []
_DRIVER: list = []  # (the driver's PeakAnon, its RssAnon before the stage) while the stage runs
_AT: list[tuple[float, float]] = []  # per progress line: the driver's growth then, and its peak so far (MiB)


def _progress(message: str) -> None:
    _SAID.append(message)
    if _DRIVER:
        drv, base = _DRIVER[0]
        now = anon_kb()
        drv.peak = max(drv.peak, now)  # a reading the sampler may have missed
        _AT.append(((now - base) / 1024, (drv.peak - base) / 1024))
    print(message, file=sys.stderr, flush=True)  # stdout carries the figures


def _driver_growth(r: dict) -> float:
    """The driver's peak growth: the sampler's, or a progress line's reading when higher."""
    return max([r["driver_growth_mb"]] + [peak for _, peak in r.get("driver_at", [])])


def _phase(line: str) -> str:
    """A progress line without its figures in parentheses, for the record."""
    return line.split(" (")[0].split(" {")[0]


def _peak_phase(said: list[str], at: list[tuple[float, float]], peak_mb: float) -> str:
    """The progress line that ends the phase in which the driver's peak was reached (or "after the last")."""
    for message, (_, peak) in zip(said, at, strict=False):
        if peak >= peak_mb - 1.0:
            return message
    return "after the last progress line"


def _memberships() -> int:
    """The cluster memberships (homes and guests) the stage reported writing."""
    said = [m for m in _SAID if "cluster memberships" in m]
    return int(said[-1].split(":")[1].split()[0]) if said else 0


def run_stage(folder: Path, n: int, cluster_rows: int, threshold: float) -> dict:
    """The stage on the pool under ``folder``, in this process as its driver, on a local Ray."""
    import ray

    from pipeline.common.storage import Storage
    from pipeline.config import BuildConfig, DecontamConfig, DedupeConfig
    from pipeline.dedup import curation_stage as CS

    meta = json.loads((folder / "meta.json").read_text())
    cfg = BuildConfig(
        metadata=str(folder), output=str(folder / "out"),
        dedupe=DedupeConfig(semantic=True, semantic_cluster_rows=cluster_rows, semantic_threshold=threshold,
                            embedding_key="emb"),
        decontam=DecontamConfig(reference=str(folder / "reference.parquet")),
    )  # fmt: skip
    files = sorted(str(p) for p in (folder / "emb").glob("*.npz"))
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        base = anon_kb()
        with PeakAnon(every_s=0.2) as drv, PeakAnonWorkers() as wk:
            _DRIVER.append((drv, base))
            t0 = time.perf_counter()
            out, cand = CS.curate_buckets(
                cfg,
                files,
                meta["n_buckets"],
                BucketFiles(str(folder)),
                Storage(),
                _progress,
                str(folder / "scratch"),
            )
            wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
    rel = out.relabels.to_pydict()
    of = dict(zip(rel["uid"], rel["duplicate_of"], strict=True))
    leak_of = dict(zip(rel["uid"], rel["leak_of"], strict=True))
    pairs, leaks = np.load(folder / "pairs.npy"), np.load(folder / "leaks.npy")
    found = sum(a in of or b in of for a, b in pairs.tolist())  # the pair does not survive whole
    leak_found = sum(leak_of.get(u) == f"task/{k}" for u, k in leaks.tolist())
    return {
        "n": n, "files": meta["files"], "buckets": meta["n_buckets"], "wall_s": wall,
        "driver_growth_mb": (drv.peak - base) / 1024, "worker_peak_mb": wk.peak / 1024, "worker_peak_task": wk.title,
        "clusters": cand.n_clusters, "pairs": len(cand.pair_i), "dropped": out.n_semantic,
        "copy_recall": found / len(pairs), "leak_recall": leak_found / len(leaks),
        "flagged": sum(out.leaks_by_task.values()), "memberships_per_row": _memberships() / n,
        "said": list(_SAID),  # the stage's progress lines, each phase's time in it
        "driver_at": list(_AT),  # per line: the driver's growth then and its peak so far, MiB
    }  # fmt: skip


def one_size(n: int, args) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="prolip-bench-curation-"))
    try:
        cmd = [sys.executable, "-m", __spec__.name, "--synth", str(folder), "--one", str(n), "--dim",
               str(args.dim), "--eval", str(args.eval)]  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        synth_s = time.perf_counter() - t0
        load = os.getloadavg()[0]
        cmd = [sys.executable, "-m", __spec__.name, "--stage", str(folder), "--one", str(n),
               "--cluster-rows", str(args.cluster_rows), "--threshold", str(args.threshold)]  # fmt: skip
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True, cwd=ROOT)
        row = json.loads(res.stdout.strip().splitlines()[-1])
        row.update(
            synth_s=synth_s, load_start=load, load_end=os.getloadavg()[0], dim=args.dim, eval=args.eval
        )
        return row
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares t = a·n + b·n² (through the origin) over the measured sizes; linear when b < 0."""
    n = np.array([r["n"] for r in rows], np.float64)
    t = np.array([r["wall_s"] for r in rows], np.float64)
    (a, b), *_ = np.linalg.lstsq(np.stack([n, n * n], axis=1), t, rcond=None)
    if b < 0 or len(n) < 3:
        return float((n @ t) / (n @ n)), 0.0
    return float(a), float(b)


def _flags(args) -> str:
    return "".join(
        f" --{name} {value}"
        for name, value, default in (("dim", args.dim, 256), ("eval", args.eval, 5_000))
        if value != default
    )


def records(rows: list[dict], args) -> dict:
    date = datetime.date.today().isoformat()
    recs = []
    for r in rows:
        recs.append(
            {
                "what": f"curation stage on Ray, {r['n']:,} rows ({r['files']} files, {r['buckets']} uid buckets)",
                "command": f"python -m bench.curation_scale --sizes {r['n']}" + _flags(args),
                "figure": f"{r['wall_s']:.0f} s ({r['wall_s'] / r['n'] * 1e6:.0f} µs a row); driver +"
                f"{_driver_growth(r):.0f} MiB, largest worker {r['worker_peak_mb']:.0f} MiB"
                + (f" ({r['worker_peak_task'].removeprefix('ray::')})" if r.get("worker_peak_task") else ""),
                "spread": f"{r['clusters']} clusters, {r['memberships_per_row']:.1f} memberships a row (home and "
                f"guests), {r['pairs']:,} pairs, {r['dropped']:,} dropped; planted "
                f"copies found {100 * r['copy_recall']:.1f}%, leaks {100 * r['leak_recall']:.1f}%"
                + (
                    "; the driver's peak reached by: "
                    + _phase(_peak_phase(r["said"], r["driver_at"], _driver_growth(r)))
                    if r.get("driver_at")
                    else ""
                ),
                "load": f"{r['load_start']:.1f} → {r['load_end']:.1f}",
                "date": date,
            }
        )
    a, b = fit(rows)
    at = [a * n + b * n * n for n in TARGETS]
    sizes = ", ".join(f"{r['n']:,}" for r in rows)
    recs.append(
        {
            "what": "extrapolated to 12.8M (small) and 128M (medium) rows on this machine's cores",
            "command": f"python -m bench.curation_scale --sizes {','.join(str(r['n']) for r in rows)}"
            + _flags(args),
            "figure": f"{at[0] / 3600:.1f} h and {at[1] / 3600:.0f} h (t = {a * 1e6:.1f} µs·n"
            + (f" + {b * 1e12:.3f} ps·n²)" if b else ")")
            + "; the driver's growth is in the rows above. The largest worker is named at each size: the k-means "
            "fit holds its sample (256·k rows, at most 512 MiB of float32, decision 0106); a cluster group's "
            "task ~44 MiB of bucket (decision 0104) and each file's index (decision 0105); a uid bucket's task "
            "its ≤ 500,000 part rows",
            "spread": f"least squares over {sizes} rows; the n² term is the assignment's k centroids a row (three "
            "passes; the memberships a row 1.1-1.5 with the guests held to sub-cones, decision 0111) "
            "and k-means' 256·k-row sample, which stops growing at 512 MiB "
            f"({(512 << 20) // (4 * args.dim) // 256 * args.cluster_rows / 1e6:.2f}M rows at this width and "
            "cluster size), past which the fit grows as n; the work divides over a cluster's cores (tasks per "
            "file, group and bucket)",
            "load": "see the rows above",
            "date": date,
        }
    )
    return {
        "title": f"Curation at scale through the Ray stages, {args.dim}-d (bench/curation_scale.py)",
        "doc": f"Synthetic {args.dim}-d float16 embeddings in .npz files of {FILE_ROWS:,} rows ({WIDTH}), "
        "blobs of 1,000 "
        f"(cosine ≈ 0.7 within one), 2% planted near-copies, cosine threshold {args.threshold}, "
        f"~{args.cluster_rows:,} rows per k-means cluster, an eval reference of {args.eval:,} pictures with "
        "0.1% of the pool leaking it, part rows in uid buckets of 500,000; each size's stage in a fresh "
        "process on a local Ray over this machine's 2 cores.",
        "records": recs,
        "raw": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000000,4000000,8000000")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--eval", type=int, default=5_000)
    p.add_argument("--cluster-rows", type=int, default=1000)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--out", default="", help="default: bench/results/curation_scale_<dim>d.json")
    p.add_argument("--append", action="store_true", help="keep the sizes already in --out")
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--synth", default="", help=argparse.SUPPRESS)
    p.add_argument("--stage", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out = args.out or str(RESULTS / f"curation_scale_{args.dim}d.json")
    if args.synth:
        meta = synth(args.one, args.dim, args.eval, Path(args.synth))
        (Path(args.synth) / "meta.json").write_text(json.dumps(meta))
        return 0
    if args.stage:
        print(json.dumps(run_stage(Path(args.stage), args.one, args.cluster_rows, args.threshold)))
        return 0
    rows = []
    if args.append and Path(args.out).exists():
        keep = {int(s) for s in args.sizes.split(",")}
        rows = [r for r in json.loads(Path(args.out).read_text())["raw"] if r["n"] not in keep]
    for n in (int(s) for s in args.sizes.split(",")):
        rows.append(one_size(n, args))
        print(json.dumps(rows[-1]), flush=True)
    rows.sort(key=lambda r: r["n"])
    doc = records(rows, args)
    write_records(args.out, doc["title"], doc["doc"], doc["records"], {"raw": doc["raw"]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
