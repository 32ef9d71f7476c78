"""The semantic dedup's passes over every centroid: float32 products that screen (decision 0109) against
the float64 products before them.

Two of the curation stage's passes compare every row with all k centroids: each cluster's extent
(``semantic.cluster_cosines``) and the assignment with guests (``semantic.assign_with_guests``). This times
both on ``--rows`` rows of 768-d blobs (the curation benchmark's generator: a random centre each, cosine
≈ 0.84 to it; centroids the blobs' means over 40 rows each) at ``--clusters`` k, each size in a fresh
process, today's code and the code at ``--baseline`` (a worktree made for the run) in turn, round by round
(bench/alternate.py's method), and checks that both give the same homes, guests and extents.
Writes bench/results/assignment_precision.json.
Usage: python -m bench.assignment_precision [--rows 32768] [--clusters 4000,16000] [--baseline 884c38f]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import time
from pathlib import Path

from bench.alternate import against_baseline, baseline_flags, head_commit, results_path, spread
from bench.schema import write_records

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "assignment_precision.json"
DIM = 768


def worker(rows: int, k: int) -> dict:
    """In a fresh process: the rows and centroids made, then both passes timed."""
    import numpy as np

    from pipeline.dedup import semantic as SD

    rng = np.random.default_rng(0)
    centre = rng.standard_normal((k, DIM))

    def draw(m: int):
        b = rng.integers(0, k, m)
        return SD.normalize(0.85 * centre[b] + 0.55 * rng.standard_normal((m, DIM))), b

    s, b = draw(40 * k)
    c = np.zeros((k, DIM))
    np.add.at(c, b, s)
    centroids = SD.normalize(c)
    x, _ = draw(rows)
    del s
    t0 = time.perf_counter()
    extent = SD.cluster_cosines(x, centroids)
    t1 = time.perf_counter()
    primary, g_row, g_cl = SD.assign_with_guests(x, centroids, 0.9, member_cos=extent)
    t2 = time.perf_counter()
    digest = hashlib.sha256(primary.tobytes() + g_row.tobytes() + g_cl.tobytes()).hexdigest()[:16]
    return {"rows": rows, "clusters": k, "extents_s": t1 - t0, "assign_s": t2 - t1,
            "guests": len(g_row), "digest": digest, "extent_sum": float(extent.sum())}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--clusters", default="4000,16000")
    baseline_flags(ap, "884c38f", "assignment", RESULT)
    args = ap.parse_args()
    code = "import json; from bench.assignment_precision import worker; print(json.dumps(worker({}, {})))"
    calls = {k: code.format(args.rows, int(k)) for k in args.clusters.split(",")}
    results = against_baseline(args.baseline, __file__, calls, args.rounds)
    for r in (r for rounds in results.values() for r in rounds):  # the same decisions: equal work compared
        t, b = r["today"], r["baseline"]
        assert t["digest"] == b["digest"] and abs(t["extent_sum"] - b["extent_sum"]) < 1e-9, (t, b)
    date = datetime.date.today().isoformat()
    loads = [r[c]["load"] for rs in results.values() for r in rs for c in r]
    records = []
    for k, rounds in results.items():
        for key, name in (("extents_s", "each cluster's extent (cluster_cosines)"),
                          ("assign_s", "assignment with guests (assign_with_guests)")):  # fmt: skip
            t = spread([r["today"][key] for r in rounds])
            b = spread([r["baseline"][key] for r in rounds])
            ratio = spread([r["baseline"][key] / r["today"][key] for r in rounds])
            records.append({
                "what": f"{name}, {args.rows:,} rows of 768-d blobs against {int(k):,} centroids: seconds, today "
                        f"({head_commit()}) vs {args.baseline}, the same decisions",
                "command": f"python -m bench.assignment_precision --rows {args.rows} --clusters {args.clusters}",
                "figure": f"{t['median']:.2f} s vs {b['median']:.2f} s ({ratio['median']:.2f}× faster; "
                          f"{args.rows / t['median']:,.0f} rows/s)",
                "spread": f"today {t['min']:.2f}–{t['max']:.2f} s, baseline {b['min']:.2f}–{b['max']:.2f} s, ratio "
                          f"{ratio['min']:.2f}–{ratio['max']:.2f}; {args.rounds} rounds; "
                          f"{rounds[0]['today']['guests']:,} guest memberships",
                "load": f"{min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} cores", "date": date})  # fmt: skip
    out = results_path(args.out, RESULT, max(loads), os.cpu_count() or 1, args.allow_loaded)
    write_records(out, "Semantic dedup: the passes over every centroid, float32 screen vs float64", __doc__,
                  records, {"results": results})  # fmt: skip


if __name__ == "__main__":
    main()
