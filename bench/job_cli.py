"""How fast every job answers ``--help``, ``--help-config`` and a bad input, each in a fresh process.

A user's first contact with a job is its help and its first mistake; both must answer in well under a
second (docs/jobs.md), which means neither torch nor Ray may load before the arguments are parsed.
Per job, alternated rounds time ``python -m jobs.<job> --help`` and ``--help-config`` beside the bare
interpreter (``python -c pass``, the floor of any command), and one run of each bad-input case of
tests/jobs/test_bad_inputs.py (missing file, wrong kind of file, unreachable S3, bad key, out-of-range
value) times the whole process until its one-line error. Writes bench/results/job_cli.json.

Usage: python -m bench.job_cli [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.alternate import MIN_ROUNDS, spread
from tests.jobs.test_bad_inputs import JOBS, KINDS, bad_input_files, cases

ROOT = Path(__file__).resolve().parents[1]

RESULT = ROOT / "bench" / "results" / "job_cli.json"


def _timed(argv: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, timeout=120)
    return time.perf_counter() - t0, proc.returncode


def help_times(rounds: int) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for job in JOBS:
        runs: dict[str, list[float]] = {"python -c pass": [], "--help": [], "--help-config": []}
        loads = []
        for _ in range(rounds):
            loads.append(os.getloadavg()[0])
            runs["python -c pass"].append(_timed(["-c", "pass"])[0])
            for flag in ("--help", "--help-config"):
                wall, rc = _timed(["-m", f"jobs.{job}", flag])
                assert rc == 0, (job, flag, rc)
                runs[flag].append(wall)
        out[job] = {name: spread(v) for name, v in runs.items()} | {"load": loads}
    return out


def error_times() -> dict[str, dict]:
    out: dict[str, dict] = {}
    held = socket.socket()  # bound, not listening: connections to it are refused
    held.bind(("127.0.0.1", 0))
    with tempfile.TemporaryDirectory() as tmp, held:
        files = bad_input_files(Path(tmp), f"http://127.0.0.1:{held.getsockname()[1]}")
        for (job, kind), (argv, code, _) in cases(files).items():
            load = os.getloadavg()[0]
            wall, rc = _timed(["-m", f"jobs.{job}", *argv])
            assert rc == code, (job, kind, rc, code)
            out[f"{job} {kind}"] = {"wall_s": wall, "exit": rc, "load": load}
    return out


def records(helps: dict[str, dict], errors: dict[str, dict], rounds: int) -> list[dict]:
    date = datetime.date.today().isoformat()
    rows = []
    for job, r in helps.items():
        for flag in ("--help", "--help-config"):
            s = r[flag]
            rows.append({
                "what": f"`jobs.{job} {flag}`, fresh process (the bare interpreter: {r['python -c pass']['median']:.2f} s)",
                "command": "python -m bench.job_cli",
                "figure": f"{s['median']:.2f} s",
                "spread": f"{s['min']:.2f}–{s['max']:.2f} s over {rounds} rounds",
                "load": f"{min(r['load']):.1f}–{max(r['load']):.1f} on 2 cores",
                "date": date,
            })  # fmt: skip
    for kind in KINDS:
        walls = [errors[f"{job} {kind}"]["wall_s"] for job in JOBS]
        loads = [errors[f"{job} {kind}"]["load"] for job in JOBS]
        worst = max(JOBS, key=lambda j: errors[f"{j} {kind}"]["wall_s"])
        rows.append({
            "what": f"time to the one-line error, {kind.replace('_', ' ')}: median over the {len(JOBS)} jobs",
            "command": "python -m bench.job_cli",
            "figure": f"{statistics.median(walls):.2f} s",
            "spread": f"{min(walls):.2f}–{max(walls):.2f} s (slowest: jobs.{worst})",
            "load": f"{min(loads):.1f}–{max(loads):.1f} on 2 cores",
            "date": date,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds = max(args.rounds, MIN_ROUNDS)
    helps, errors = help_times(rounds), error_times()
    for job, r in helps.items():
        print(
            f"{job:18s} --help {r['--help']['median']:.2f} s  --help-config {r['--help-config']['median']:.2f} s"
        )
    result = {
        "title": "Jobs: --help, --help-config and the first bad input, each in a fresh process",
        "about": "Wall time of `python -m jobs.<job> ...` from start to exit; the target is well under 1 s.",
        "records": records(helps, errors, rounds),
        "raw": {"help": helps, "errors": errors},
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
