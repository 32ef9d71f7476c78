"""Shared method of the benchmarks: contenders alternated A B A B, ratios per round, load beside each figure.

A shared machine's load moves within seconds, so a contender timed after another is not comparable to it;
timing them in turn, one round each, and taking the ratio within a round lets both see the same load. The
summary of a ratio is its median over the rounds with the min–max spread. Every round records the 1-minute
load average; a run whose load exceeded the core count is flagged and does not overwrite the checked-in
results unless asked (`--allow-loaded`). Wall time and process CPU time are both kept: on a loaded machine
the CPU time of a single-threaded case is the steadier of the two (it leaves out the time it waited for a
core, not the slowdown of sharing caches and memory bandwidth).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

MIN_ROUNDS = 3


def load_note(load: float, cores: int) -> str:
    """The 1-min load average as printed beside every figure; flagged when the machine is oversubscribed."""
    return f"load {load:.1f}" + (" (> cores!)" if load > cores else "")


def spread(values: list[float]) -> dict:
    v = sorted(values)
    return {"median": float(statistics.median(v)), "min": v[0], "max": v[-1], "n": len(v), "values": values}


def fmt_spread(s: dict, digits: int = 3) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def alternate(cases: dict[str, Callable[[], object]], rounds: int, warmup: int = 1) -> list[dict]:
    """Run every case once per round, in turn; per round and case: wall s, CPU s and the load average."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    out = []
    for _ in range(rounds):
        row: dict = {}
        for name, fn in cases.items():
            load = os.getloadavg()[0]
            before = resource.getrusage(resource.RUSAGE_SELF)
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            row[name] = {
                "wall_s": time.perf_counter() - wall,
                "cpu_s": time.process_time() - cpu,
                "load": load,
                **_rusage_delta(before, resource.getrusage(resource.RUSAGE_SELF)),
            }
        out.append(row)
    return out


def _rusage_delta(a: resource.struct_rusage, b: resource.struct_rusage) -> dict:
    # CPU time split into user and kernel time, and the page faults behind most of the kernel time: a
    # CPU allocator that hands memory back to the OS pays to fault it in again, a GPU's caching one does not.
    return {
        "user_s": b.ru_utime - a.ru_utime,
        "sys_s": b.ru_stime - a.ru_stime,
        "minflt": b.ru_minflt - a.ru_minflt,
    }


def ratios(rounds: list[dict], num: str, den: str) -> dict:
    """Per-round num/den of wall and CPU time, summarised; the loads seen over those rounds."""
    loads = [r[c]["load"] for r in rounds for c in (num, den)]
    kinds = {"wall": "wall_s", "cpu": "cpu_s", "user": "user_s"}
    return {
        # getrusage's user time moves in scheduler ticks: a case shorter than one can read 0.
        **{
            k: spread([r[num][t] / r[den][t] for r in rounds])
            for k, t in kinds.items()
            if all(r[den][t] > 0 for r in rounds)
        },
        "load_min": min(loads),
        "load_max": max(loads),
    }


def times(rounds: list[dict], case: str) -> dict:
    return {k: spread([r[case][k] for r in rounds]) for k in ("wall_s", "cpu_s", "user_s", "sys_s", "minflt")}


def loads_note(loads: list[float], cores: int) -> str:
    return f"load {min(loads):.1f}–{max(loads):.1f}" + (" (> cores!)" if max(loads) > cores else "")


def results_path(out: Path, default: Path, max_load: float, cores: int, allow_loaded: bool) -> Path:
    """Where to write: `out`, unless it is the checked-in file and the machine was loaded (then a temp file)."""
    if max_load > cores:
        print(
            f"WARNING: load exceeded the core count ({max_load:.1f} > {cores}): these ratios are not evidence"
        )
        if out.resolve() == default.resolve() and not allow_loaded:
            print(f"loaded machine: not overwriting {default} (pass --allow-loaded to force)")
            return Path(tempfile.gettempdir()) / default.name
    return out


def baseline_flags(ap, ref: str, what: str, result: Path) -> None:
    """The flags of a benchmark run against the code at a commit: ``--baseline``, ``--rounds``, ``--out``,
    ``--allow-loaded``."""
    ap.add_argument("--baseline", default=ref, help=f"a commit whose {what} is the baseline")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--out", type=Path, default=result)
    ap.add_argument("--allow-loaded", action="store_true")


def head_commit() -> str:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()


def against_baseline(ref: str, bench_file: str, calls: dict[str, str], rounds: int) -> dict[str, list[dict]]:
    """Each of ``calls`` (a key → code for ``run_fresh``) run on today's code and on the code at ``ref``
    in turn, ``rounds`` times → per key its rounds as {"today": …, "baseline": …}."""
    assert rounds >= MIN_ROUNDS
    root = Path(__file__).resolve().parents[1]
    out: dict[str, list[dict]] = {}
    with baseline_tree(ref, bench_file) as tree:
        for key, code in calls.items():
            out[key] = [
                {"today": run_fresh(root, code), "baseline": run_fresh(tree, code)} for _ in range(rounds)
            ]
            t, b = out[key][-1]["today"], out[key][-1]["baseline"]
            print(f"{key}: today {json.dumps(t)}\n{key}: baseline {json.dumps(b)}", flush=True)
    return out


@contextlib.contextmanager
def baseline_tree(ref: str, bench_file: str) -> Iterator[Path]:
    """A git worktree of the code at ``ref`` with today's ``bench_file`` copied in, so the same measurement
    runs on the old code; removed afterwards."""
    root = Path(__file__).resolve().parents[1]
    tree = Path(tempfile.mkdtemp(prefix="prolip-bench-baseline-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=root, check=True)
    for harness in (bench_file, __file__, Path(__file__).with_name("schema.py")):  # today's harness there
        shutil.copy(harness, tree / "bench" / Path(harness).name)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root, check=False)


def run_fresh(root: Path, code: str) -> dict:
    """``code`` (which prints one JSON object last) in a fresh Python process on the code under ``root`` →
    that object, with the 1-minute load average when it ended."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    res = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "load": os.getloadavg()[0]}
