"""Semantic dedup against the exact all-pairs rule, and its cost against single-assignment SemDeDup.

Data: ``tests/fixtures/continuum.py`` (concept blobs of varied spread on the sphere whose neighbours
overlap, 5% planted near-copies at cosine 0.90-0.99), ``--n`` rows of ``--dim`` float32. The exact rule's
pairs come from brute force: every one of the n² products in float32 blocks, screened 1e-3 below the
threshold and recomputed in float64. Against it, per row decision:

- **exact** ``semantic_duplicates``: each row in its nearest cluster and a guest of the clusters whose
  border it is within √(2 − 2t) of, the guests screened against the members in a 64-d basis
  (docs/decisions/0096), the greedy over the union of the per-cluster pairs;
- **single** ``single_assignment_duplicates``: the paper's SemDeDup, each row in one cluster only.

Recall and precision are over the dropped rows (a row both drop, of the rows the exact rule drops / of the
rows the method drops); *same decision* also needs the same kept row named. The cost ratio exact/single
is measured in alternated rounds (bench/alternate.py), both on the same pure functions the Ray stage
runs per cluster, in one process. Writes ``--out`` in the recorded-figures format of
bench/benchmarks_doc.py.

Usage: python -m bench.semdedup_exact [--n 200000] [--dim 768] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from bench import alternate as A
from pipeline.dedup import semantic as SD
from tests.fixtures.continuum import brute_force_pairs, continuum

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OUT = ROOT / "bench" / "results" / "semdedup_exact.json"
THRESHOLD = 0.9


def _score(got: np.ndarray, want: np.ndarray) -> dict:
    g, w = got != "", want != ""
    both = int((g & w).sum())
    return {
        "recall": both / max(int(w.sum()), 1),
        "precision": both / max(int(g.sum()), 1),
        "same_decision": float((got == want).mean()),
        "dropped": int(g.sum()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--cluster-rows", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=A.MIN_ROUNDS)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--allow-loaded", action="store_true")
    args = ap.parse_args(argv)
    n, d, cr = args.n, args.dim, args.cluster_rows
    uids, vectors, copy_of = continuum(n, d, seed=0)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    i, j, s = brute_force_pairs(vectors, THRESHOLD)
    brute_s = time.perf_counter() - t0
    order = SD.rank_order(uids, None)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    dup = SD.greedy_duplicates(rank, i, j, s)
    want = np.where(dup >= 0, uids[np.maximum(dup, 0)], "")
    print(
        f"brute force: {len(i):,} pairs above {THRESHOLD}, {int((dup >= 0).sum()):,} rows dropped, {brute_s:.0f} s"
    )
    got: dict[str, SD.SemanticResult] = {}

    def run(name: str, fn):
        def case() -> None:
            got[name] = fn(uids, vectors, THRESHOLD, cluster_rows=cr, seed=0)

        return case

    cases = {
        "exact": run("exact", SD.semantic_duplicates),
        "single": run("single", SD.single_assignment_duplicates),
    }
    rounds = A.alternate(cases, args.rounds, warmup=0)
    ratio = A.ratios(rounds, "exact", "single")
    exact, single = _score(got["exact"].duplicate_of, want), _score(got["single"].duplicate_of, want)
    cl = got["single"].cluster
    split = float((cl[i] != cl[j]).mean()) if len(i) else 0.0
    planted = copy_of >= 0
    copies_found = float((got["exact"].dropped[planted] | got["exact"].dropped[copy_of[planted]]).mean())
    t_exact, t_single = A.times(rounds, "exact"), A.times(rounds, "single")
    loads = [r[c]["load"] for r in rounds for c in cases] + [load0]
    load = A.loads_note(loads, os.cpu_count() or 1)
    date = datetime.date.today().isoformat()
    size = f"{n:,} rows, {d}-d"
    cmd = f"python -m bench.semdedup_exact --n {n} --dim {d}"
    records = [
        {
            "what": f"exact (guests) vs the all-pairs rule, {size}",
            "command": cmd,
            "figure": f"recall {exact['recall']:.4f}, precision {exact['precision']:.4f}; same decision "
            f"{exact['same_decision']:.4f} of rows",
            "spread": f"{int((dup >= 0).sum()):,} rows dropped by the exact rule over {len(i):,} pairs "
            f"(brute force {brute_s:.0f} s); planted copies found {copies_found:.4f}; "
            f"{got['exact'].n_guests / n:.2f} guest memberships a row",
            "load": load,
            "date": date,
        },
        {
            "what": f"single-assignment SemDeDup vs the all-pairs rule, {size}",
            "command": cmd,
            "figure": f"recall {single['recall']:.4f}, precision {single['precision']:.4f}; same decision "
            f"{single['same_decision']:.4f} of rows",
            "spread": f"{split:.1%} of the pairs above {THRESHOLD} fall in two clusters "
            f"({got['single'].n_clusters} clusters of ~{cr:,} rows)",
            "load": load,
            "date": date,
        },
        {
            "what": f"cost, exact / single assignment, {size}",
            "command": cmd,
            "figure": f"{A.fmt_spread(ratio['wall'], 2)} wall, {A.fmt_spread(ratio['cpu'], 2)} CPU",
            "spread": f"{args.rounds} alternated rounds; exact {t_exact['wall_s']['median']:.1f} s, single "
            f"{t_single['wall_s']['median']:.1f} s (median wall, one process: k-means, assignment, pairs)",
            "load": load,
            "date": date,
        },
    ]
    for r in records:
        print(f"{r['what']}: {r['figure']} | {r['spread']} | {r['load']}")
    doc = {
        "title": "Semantic dedup against the exact all-pairs rule (bench/semdedup_exact.py)",
        "about": "Continuum embeddings (tests/fixtures/continuum.py: blobs of varied spread whose neighbours "
        "overlap, 5% planted copies at cosine 0.90-0.99), threshold 0.9, ~1,000 rows a cluster, uid order "
        "as priority; the exact rule's pairs by brute force over all n² products.",
        "records": records,
        "raw": {"n": n, "dim": d, "pairs": int(len(i)), "brute_s": brute_s, "exact": exact, "single": single,
                "split_pairs": split, "guests": got["exact"].n_guests, "rounds": rounds},
    }  # fmt: skip
    out = A.results_path(args.out, DEFAULT_OUT, max(loads), os.cpu_count() or 1, args.allow_loaded)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
