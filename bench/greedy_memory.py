"""The curation stage's planning task at its peak: the group tasks' pairs merged, then the greedy rule.

The semantic dedup's candidate pairs meet in one planning task (docs/decisions/0107): the greedy rule is
sequential in keep-first order. This measures that task's work on synthetic group results at ``--pairs``
sizes: each size in a fresh process, its peak RSS over what it held with the group tasks' results in
hand (VmHWM reset there; bytes a pair) and its seconds. ``--baseline REF`` runs the same measurement on the code at a git commit (a
worktree made for the run) in turn with today's, round by round (bench/alternate.py's method), so the
ratio compares the two on the same load. Pairs are drawn as cluster groups yield them: groups of ~1,500
uids with ~4,000 pairs each, a tenth of a group's uids shared with the next group; cosines in [0.9, 1).
Writes bench/results/greedy_memory.json.
Usage: python -m bench.greedy_memory [--pairs 1000000,4000000] [--baseline e31f6ab] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

from bench.alternate import against_baseline, baseline_flags, head_commit, results_path, spread
from bench.schema import write_records

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "greedy_memory.json"
GROUP_UIDS, GROUP_PAIRS = 1500, 4000


def _pieces(n_pairs: int, seed: int = 0):
    """Group results as ``group_pairs`` returns them: (sorted uids, int32 positions i, j, cosine)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    n_groups = max(1, n_pairs // GROUP_PAIRS)
    step = GROUP_UIDS - GROUP_UIDS // 10
    uid = np.char.mod("%032x", rng.permutation(n_groups * step + GROUP_UIDS).astype(np.uint64) * 7919)
    out = []
    for g in range(n_groups):
        names = np.sort(uid[g * step : g * step + GROUP_UIDS])
        i = rng.integers(0, GROUP_UIDS, GROUP_PAIRS)
        j = (i + 1 + rng.integers(0, GROUP_UIDS - 1, GROUP_PAIRS)) % GROUP_UIDS
        used, at = np.unique(np.r_[i, j], return_inverse=True)
        at = at.astype(np.int32)
        s = rng.uniform(0.9, 1.0, GROUP_PAIRS)
        out.append((pa.array(names[used].tolist()), at[:GROUP_PAIRS], at[GROUP_PAIRS:], s))
    return out


def _status_kib(field: str) -> int:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """The process's peak RSS (VmHWM) set back to what it holds now: what came before is not measured."""
    Path(f"/proc/{os.getpid()}/clear_refs").write_text("5")


def worker(n_pairs: int) -> dict:
    """In a fresh process: the pieces made, then the planning task's part timed and its peak measured."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from pipeline.dedup import curation_rules as CR

    pieces = _pieces(n_pairs)
    n = sum(len(p[1]) for p in pieces)
    names = pc.unique(pa.concat_arrays([p[0] for p in pieces]))
    if "live_at" in CR.BucketFacts.__dataclass_fields__:  # every named uid live, as positions among them
        names = np.arange(len(names))
    live = CR.BucketFacts(pa.array([], pa.string()), np.zeros(0, object), np.zeros(0, object), names,
                          np.random.default_rng(1).uniform(0, 1, len(names)))  # fmt: skip
    positions = "pair_names" in CR.Candidates.__dataclass_fields__
    if not positions:  # the code before: the group tasks' pairs arrived as two uid strings each
        pieces = [(p[0].take(pa.array(p[1])), p[0].take(pa.array(p[2])), p[3]) for p in pieces]
    _reset_peak()
    start = _status_kib("VmRSS")  # the group results held, as the planning task holds them
    t0 = time.perf_counter()
    if positions:
        cand = CR.Candidates(*CR.merge_pairs(pieces))
    else:
        cand = CR.Candidates(*(pa.concat_arrays([p[k] for p in pieces]) for k in (0, 1)),
                             np.concatenate([p[2] for p in pieces]))  # fmt: skip
    del pieces
    named = cand.named()  # what the stage sends the uid buckets
    out = CR.decide(cand, [live], True)
    wall = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"pairs": n, "named": len(named), "dropped": out.n_semantic, "wall_s": wall,
            "peak_over_start_b_per_pair": (peak - start) * 1024 / n}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="1000000,4000000")
    baseline_flags(ap, "e31f6ab", "planning task", RESULT)
    args = ap.parse_args()
    code = "import json; from bench.greedy_memory import worker; print(json.dumps(worker({})))"
    calls = {x: code.format(int(x)) for x in args.pairs.split(",")}
    results = against_baseline(args.baseline, __file__, calls, args.rounds)
    date = datetime.date.today().isoformat()
    loads = [r[c]["load"] for rs in results.values() for r in rs for c in r]
    records = []
    for rounds in results.values():

        def s(case, key, rounds=rounds):
            return spread([r[case][key] for r in rounds])

        mem = spread([r["baseline"]["peak_over_start_b_per_pair"] / r["today"]["peak_over_start_b_per_pair"]
                      for r in rounds])  # fmt: skip
        wall = spread([r["baseline"]["wall_s"] / r["today"]["wall_s"] for r in rounds])
        t, b = s("today", "peak_over_start_b_per_pair"), s("baseline", "peak_over_start_b_per_pair")
        tw, bw = s("today", "wall_s"), s("baseline", "wall_s")
        pairs = rounds[0]["today"]["pairs"]
        records.append({
            "what": f"curation planning task, {pairs:,} candidate pairs ({rounds[0]['today']['named']:,} uids): "
                    f"peak bytes a pair and seconds, today ({head_commit()}) vs {args.baseline}",
            "command": f"python -m bench.greedy_memory --pairs {args.pairs} --baseline {args.baseline}",
            "figure": f"{t['median']:.0f} B a pair, {tw['median']:.1f} s vs {b['median']:.0f} B, {bw['median']:.1f} s "
                      f"({mem['median']:.1f}× less memory, {wall['median']:.1f}× faster)",
            "spread": f"today {t['min']:.0f}–{t['max']:.0f} B, {tw['min']:.1f}–{tw['max']:.1f} s; baseline "
                      f"{b['min']:.0f}–{b['max']:.0f} B, {bw['min']:.1f}–{bw['max']:.1f} s; {args.rounds} rounds",
            "load": f"{min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} cores", "date": date})  # fmt: skip
    out = results_path(args.out, RESULT, max(loads), os.cpu_count() or 1, args.allow_loaded)
    write_records(out, "Curation: the planning task's candidate pairs and greedy rule", __doc__, records,
                  {"results": results})  # fmt: skip


if __name__ == "__main__":
    main()
