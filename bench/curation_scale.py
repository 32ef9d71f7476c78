"""Cost of the curation stage against the pool's size: semantic dedup and eval-set decontamination on
synthetic 768-d embeddings, the curve, and its extrapolation to DataComp small's 12.8M rows.

Each size runs in its own subprocess (its own peak memory), on the stage's own pure functions in the order
the build's Ray stage runs them (pipeline/dedup/curation_stage.py) on one process:

- **data**: ``n`` float16 unit vectors written to a memory map on local disk, in blobs of 1,000 rows (a
  random centre each, cosine ≈ 0.7 within a blob, like pictures of one concept), with 2% planted
  near-copies (cosine ≈ 0.97) of other rows; 64-bit hashes per row; an eval reference of ``--eval`` vectors
  (blob-like too) of which 0.1% of the pool are lightly perturbed copies;
- **k-means**: faiss spherical k-means on a 256·k sample, k = ⌈n / cluster_rows⌉, then every row assigned in
  blocks read from the map;
- **dedup**: every cluster's rows gathered from the map and ``dedup_cluster``-ed (within the cluster only:
  single-assignment SemDeDup; the build's guests across borders are measured by bench/semdedup_exact.py);
- **decontam**: ``eval_leaks`` of every row against the reference, by embedding (exact or inverted-file
  index, ``pipeline/dedup/semantic.py``) and by pHash (multi-index hashing over pool + reference).

Per size: wall time of each step, planted-copy recall, leak recall, peak RSS (``ru_maxrss``, which counts the
map's resident file pages) and the peak of anonymous memory (RssAnon sampled every 0.2 s: what the process
itself holds). The extrapolation fits t(n) = a·n + b·n² per step by least squares over the sizes (the
assignment scans k ∝ n centroids per row; dedup and decontam are linear at fixed cluster size and reference)
and evaluates it at 12.8M. Writes ``--out`` in the recorded-figures format of bench/benchmarks_doc.py.

Usage: python -m bench.curation_scale [--sizes 100000,400000,1600000] [--eval 100000] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.memory import PeakAnon

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "curation_scale.json"
D = 768
BLOB = 1000
TARGET = 12_800_000


def synth(n: int, n_eval: int, folder: Path, seed: int = 0):
    """The memory map of pool vectors, planted copies, hashes and the eval reference (module docstring)."""
    from pipeline.dedup.semantic import normalize

    rng = np.random.default_rng(seed)
    vec = np.memmap(folder / "pool.f16", dtype=np.float16, mode="w+", shape=(n, D))
    for a in range(0, n, BLOB):
        m = min(BLOB, n - a)
        centre = rng.standard_normal(D)
        vec[a : a + m] = normalize(
            0.85 * centre / np.sqrt(D) + 0.55 * rng.standard_normal((m, D)) / np.sqrt(D)
        )
    n_copy = n // 50
    src = rng.choice(n, n_copy, replace=False)
    dst = rng.choice(np.setdiff1d(np.arange(n), src), n_copy, replace=False)
    for a in range(0, n_copy, 65536):
        s, d = src[a : a + 65536], dst[a : a + 65536]
        noisy = np.asarray(vec[s], np.float32)
        vec[d] = normalize(noisy + 0.25 * rng.standard_normal(noisy.shape) / np.sqrt(D)).astype(np.float16)
    vec.flush()
    hashes = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    ref_vec = np.empty((n_eval, D), np.float32)
    for a in range(0, n_eval, BLOB):
        m = min(BLOB, n_eval - a)
        centre = rng.standard_normal(D)
        ref_vec[a : a + m] = normalize(
            0.85 * centre / np.sqrt(D) + 0.55 * rng.standard_normal((m, D)) / np.sqrt(D)
        )
    ref_hash = rng.integers(-(2**63), 2**63 - 1, n_eval, dtype=np.int64)
    n_leak = max(1, n // 1000)
    leak_rows = np.sort(rng.choice(np.setdiff1d(np.arange(n), dst), n_leak, replace=False))
    leak_of = rng.choice(n_eval, n_leak, replace=False)
    vec[leak_rows] = normalize(ref_vec[leak_of] + 0.1 * rng.standard_normal((n_leak, D)) / np.sqrt(D)).astype(
        np.float16
    )
    half = n_leak // 2  # half the leaks are copies by pHash too (a re-encode), half by embedding only
    hashes[leak_rows[:half]] = ref_hash[leak_of[:half]] ^ np.int64(0b101)
    vec.flush()
    return vec, (src, dst), hashes, ref_vec, ref_hash, (leak_rows, leak_of)


def one_size(n: int, n_eval: int, cluster_rows: int, threshold: float) -> dict:
    from pipeline.dedup import eval_leaks as EL
    from pipeline.dedup import semantic as SD

    folder = Path(tempfile.mkdtemp(prefix="prolip-bench-curation-"))
    try:
        vec, (src, dst), hashes, ref_vec, ref_hash, (leak_rows, leak_of) = synth(n, n_eval, folder)
        out: dict = {"n": n, "eval": n_eval, "cluster_rows": cluster_rows, "load_start": os.getloadavg()[0]}
        with PeakAnon(every_s=0.2) as peak:
            t0 = time.perf_counter()
            k = -(-n // cluster_rows)
            sample = np.sort(np.random.default_rng(1).choice(n, min(n, 256 * k), replace=False))
            centroids = SD.kmeans_centroids(np.asarray(vec[sample], np.float32), k, 0)
            cluster = np.concatenate(
                [
                    SD.assign_clusters(np.asarray(vec[a : a + (1 << 17)], np.float32), centroids)
                    for a in range(0, n, 1 << 17)
                ]
            )
            t1 = time.perf_counter()
            uids = np.char.mod("%032x", np.arange(n))
            dup_of = np.full(n, -1, np.int64)
            sizes = []
            for rows in SD.cluster_members(cluster):
                sizes.append(len(rows))
                local = SD.dedup_cluster(np.asarray(vec[rows], np.float32), uids[rows], None, threshold)
                hit = local >= 0
                dup_of[rows[hit]] = rows[local[hit]]
            t2 = time.perf_counter()
            ref = EL.EvalReference(
                np.full(n_eval, "task", object),
                np.arange(n_eval).astype(str).astype(object),
                ref_hash,
                ref_vec,
            )
            task = np.full(n, "", object)
            key = np.full(n, "", object)
            task[:], key[:] = EL.eval_leaks(hashes, None, ref)
            for a in range(0, n, 1 << 17):
                rows = np.arange(a, min(n, a + (1 << 17)))
                rows = rows[task[rows] == ""]
                t, kk = EL.eval_leaks(None, np.asarray(vec[rows], np.float32), ref)
                task[rows], key[rows] = t, kk
            t3 = time.perf_counter()
        pairs = {(int(a), int(b)) for a, b in zip(src, dst, strict=True)}
        found = sum((int(dup_of[d]) == s) or (int(dup_of[s]) == d) for s, d in pairs)
        leak_found = np.mean(key[leak_rows] == leak_of.astype(str).astype(object))
        out.update(
            kmeans_s=t1 - t0, dedup_s=t2 - t1, decontam_s=t3 - t2, total_s=t3 - t0, clusters=len(centroids),
            largest_cluster=int(max(sizes)), copy_recall=found / len(pairs),
            dropped=int((dup_of >= 0).sum()), leak_recall=float(leak_found), flagged=int((task != "").sum()),
            peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, peak_anon_gb=peak.peak / 2**20,
            load_end=os.getloadavg()[0], map_gb=n * D * 2 / 2**30,
        )  # fmt: skip
        return out
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def fit(rows: list[dict], key: str) -> tuple[float, float]:
    """Least squares t = a·n + b·n² (through the origin) over the measured sizes."""
    n = np.array([r["n"] for r in rows], np.float64)
    t = np.array([r[key] for r in rows], np.float64)
    (a, b), *_ = np.linalg.lstsq(np.stack([n, n * n], axis=1), t, rcond=None)
    if b < 0 or len(n) < 3:  # no growth beyond linear seen (or too few sizes to tell): the linear fit
        return float((n @ t) / (n @ n)), 0.0
    return float(a), float(b)


def records(rows: list[dict], args) -> dict:
    date = datetime.date.today().isoformat()
    recs = []
    for r in rows:
        recs.append(
            {
                "what": f"semantic dedup + decontamination, {r['n']:,} rows (vs {r['eval']:,} eval pictures)",
                "command": f"python -m bench.curation_scale --sizes {r['n']}",
                "figure": f"{r['total_s']:.0f} s ({r['total_s'] / r['n'] * 1e6 / 60:.1f} min per million rows); "
                f"peak anonymous memory {r['peak_anon_gb']:.2f} GB, peak RSS {r['peak_rss_gb']:.2f} GB",
                "spread": f"k-means + assignment {r['kmeans_s']:.0f} s ({r['clusters']} clusters, largest "
                f"{r['largest_cluster']:,}), dedup {r['dedup_s']:.0f} s, decontam {r['decontam_s']:.0f} s; "
                f"planted copies found {100 * r['copy_recall']:.1f}%, leaks {100 * r['leak_recall']:.1f}%",
                "load": f"{r['load_start']:.1f} → {r['load_end']:.1f}",
                "date": date,
            }
        )
    total = 0.0
    parts = []
    quadratic = False
    for key in ("kmeans_s", "dedup_s", "decontam_s"):
        a, b = fit(rows, key)
        quadratic |= b > 0
        t = a * TARGET + b * TARGET**2
        total += t
        parts.append(f"{key[:-2]} {t / 60:.0f} min")
    n = np.array([r["n"] for r in rows], np.float64)
    mem = np.array([r["peak_anon_gb"] for r in rows], np.float64)
    slope, icpt = np.polyfit(n, mem, 1) if len(rows) > 1 else (mem[0] / n[0], 0.0)
    recs.append(
        {
            "what": f"extrapolated to {TARGET:,} rows (DataComp small), one process on this machine",
            "command": "python -m bench.curation_scale",
            "figure": f"{total / 60:.0f} min ({', '.join(parts)}); peak anonymous memory "
            f"{icpt + slope * TARGET:.1f} GB ({slope * 1e6 * 1024:.0f} MB per million rows: uids, cluster ids "
            f"and decisions per row; the vectors stay in the map), and {TARGET * D * 2 / 2**30:.1f} GB of "
            "local disk for the float16 map",
            # the fit says which form it used: with fewer than three sizes the quadratic one is not tried
            "spread": (
                "fit t = a·n + b·n²" if quadratic else "fit t = a·n (linear; the n² term needs three sizes)"
            )
            + " per step and memory = c + d·n by least squares over "
            + ", ".join(f"{r['n']:,}" for r in rows)
            + " rows; without three sizes the k² k-means and n·k assignment terms are left out, and"
            + " decontamination runs in the curation stage's one task, so more cores do not divide it",
            "load": "see the rows above",
            "date": date,
        }
    )
    return {
        "title": "Curation at scale: semantic dedup and eval-set decontamination (bench/curation_scale.py)",
        "about": "Synthetic 768-d float16 embeddings in blobs of 1,000 (cosine ≈ 0.7 within one), 2% planted "
        f"near-copies, cosine threshold {args.threshold}, ~{args.cluster_rows:,} rows per k-means cluster, "
        f"an eval reference of {args.eval:,} pictures (inverted-file index above 20,000) with 0.1% of the pool "
        "leaking it; each size in its own process on the 2-core machine, dedup and decontam on one core's "
        "worth of threads (faiss and numpy use both).",
        "records": recs,
        "raw": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100000,400000,1600000")
    p.add_argument("--eval", type=int, default=100_000)
    p.add_argument("--cluster-rows", type=int, default=10_000)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument(
        "--append", action="store_true", help="keep the sizes already in --out (one size per command)"
    )
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_size(args.one, args.eval, args.cluster_rows, args.threshold)))
        return 0
    rows = []
    if args.append and Path(args.out).exists():
        rows = [
            r
            for r in json.loads(Path(args.out).read_text())["raw"]
            if str(r["n"]) not in args.sizes.split(",")
        ]
    for n in (int(s) for s in args.sizes.split(",")):
        cmd = [sys.executable, "-m", __spec__.name, "--one", str(n), "--eval", str(args.eval),
               "--cluster-rows", str(args.cluster_rows), "--threshold", str(args.threshold)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    rows.sort(key=lambda r: r["n"])
    Path(args.out).write_text(json.dumps(records(rows, args), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
