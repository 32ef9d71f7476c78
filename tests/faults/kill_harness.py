"""The build kill suite, run in a fresh interpreter (``python -m tests.faults.kill_harness OUT.json DIR``).

Each case forks a child that builds with one kill point armed (pipeline/common/faults.py) and dies there
by SIGKILL, checks what the dead build left (every visible file whole, every committed part's files
present), forks another child that re-runs the build to the end, and compares the result with a clean
build of the same pool: every input row in exactly one status, each uid once per subset, the same
statuses, shard members and tar bytes, and no part file or temp file left that no marker names. Forking
from one process that imported everything once makes a case cost two builds of a tiny pool (~0.5 s),
not two interpreter starts; the interpreter is fresh so that no thread or Ray client of a test session
is forked. Three kinds of run are killed: a build from nothing, a ``retry_failed`` pass over a finished
build, and a ``refresh_changed`` pass after the pool's captions changed. The occurrence of each point is
drawn at random (seeded, recorded) among the times a clean run reaches it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import traceback
from collections import Counter
from pathlib import Path

from pipeline import schema as S
from pipeline.build import build
from pipeline.common import faults
from pipeline.common.config import merge
from pipeline.common.storage import LOCAL
from pipeline.config import BUILD_PRESETS
from pipeline.shards.reader import iter_shard
from pipeline.source import run_state as R
from tests.faults.tiny_pool import serve, write_files, write_metadata
from tests.fixtures.build_reference import build_outputs, reference_build, status_rows
from tests.fixtures.build_runs import check_invariants, snapshot

N_ROWS = 48
POINTS = (
    "storage.publish",
    "shard.sample",
    "part.fetched",
    "part.tar_written",
    "part.commit",
    "parts.remove",
    "stage.task",
)
# (kind of run, points killed, cases): 24 kill points in all.
PLAN = (("fresh", POINTS, 12), ("retry", POINTS, 6), ("refresh", POINTS, 6))


def config(meta: str, out: Path, **extra):
    return merge(BUILD_PRESETS["demo"], {
        "metadata": meta, "output": str(out), "download_actors": 0, "part_size": 8, "samples_per_shard": 16,
        "bucket_rows": 16,  # three uid buckets: a kill lands between the tasks of one stage too
        "filters": {"names": ["no_filter", "random", "clip_score"]}, "dedupe": {"near_duplicates": True},
        "download": {"timeout_s": 10.0, "retries": 0, "threads_per_actor": 4}, **extra,
    })  # fmt: skip


def in_child(cfg, env: dict[str, str], log: Path) -> str:
    """Build ``cfg`` in a forked child with ``env`` set: "killed", "finished" or "failed"."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's stack
        code = 1
        try:
            os.environ.update(env)
            with open(log, "a") as f:
                build(cfg, log=lambda m: print(m, file=f, flush=True))
            code = 0
        except BaseException:
            with open(log, "a") as f:
                traceback.print_exc(file=f)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    return "finished" if os.waitstatus_to_exitcode(status) == 0 else "failed"


def dead_state_problems(out: Path) -> list[str]:
    """What a killed build must never leave: a visible file cut short, a marker without its files."""
    bad = []
    for p in sorted(out.rglob("*")):
        if not p.is_file() or p.name.startswith((".", "_")):
            continue
        try:
            if p.suffix == ".tar":
                for _ in iter_shard(str(p), decode=False):
                    pass
            elif p.suffix == ".json":
                json.loads(p.read_text())
            elif p.suffix == ".parquet":
                import pyarrow.parquet as pq

                pq.read_table(p)
        except Exception as exc:  # any unreadable visible file is a torn write
            bad.append(f"{p.relative_to(out)}: {type(exc).__name__}: {exc}")
    parts = out / "work" / "parts"
    latest: dict[str, tuple[int, str, str]] = {}  # part → the marker that counts (the highest numbered)
    for m in sorted(parts.glob("*.done")) if parts.exists() else []:
        part, seq, token = m.name.split(".")[:3]
        if part not in latest or latest[part][0] < int(seq):
            latest[part] = (int(seq), token, m.name)
    for part, (_, token, name) in sorted(latest.items()):
        for ext in ("tar", "parquet"):
            if not (parts / f"{part}.{token}.{ext}").exists():
                bad.append(f"{name} names a missing .{ext}")
    return bad


def leftover_problems(out: Path) -> list[str]:
    parts = out / "work" / "parts"
    done = R.committed(str(parts), LOCAL) if parts.exists() else {}
    named = {
        R.part_file(str(parts), p, t, e).rsplit("/", 1)[-1]
        for p, t in done.items()
        for e in ("tar", "parquet")
    }
    stray = [p.name for p in parts.iterdir() if p.suffix in (".tar", ".parquet") and p.name not in named]
    temps = [str(p.relative_to(out)) for p in out.rglob(".*.tmp-*")]
    return [f"part files no marker names: {stray}"] * bool(stray) + [f"temp files left: {temps}"] * bool(
        temps
    )


def trace_counts(cfg, start: Path | None, work: Path) -> Counter:
    """How often a clean run of ``cfg`` (from a copy of ``start``, or from nothing) reaches each point."""
    trace = work / "trace.txt"
    _reset(Path(cfg.output), start)
    assert in_child(cfg, {faults.TRACE: str(trace)}, work / "trace.log") == "finished"
    counts = Counter(trace.read_text().split())
    trace.unlink()
    return counts


def _reset(out: Path, start: Path | None) -> None:
    shutil.rmtree(out, ignore_errors=True)
    if start is not None:
        shutil.copytree(start, out)


def run_case(kind: str, point: str, nth: int, cfgs: dict, refs: dict, work: Path) -> dict:
    cfg, start = cfgs[kind]
    out = Path(cfg.output)
    _reset(out, start)
    log = work / f"{kind}-{point}-{nth}.log"
    result = {"kind": kind, "point": point, "nth": nth}
    result["first"] = in_child(cfg, {faults.ARM: f"{point}@{nth}"}, log)
    result["dead_state"] = dead_state_problems(out)
    result["second"] = in_child(cfg, {}, log)
    problems = list(result["dead_state"])
    if result["first"] != "killed":
        problems.append(f"first run {result['first']}, not killed at {point}@{nth}")
    if result["second"] != "finished":
        problems.append(f"resumed run {result['second']}: {log.read_text()[-1500:]}")
    else:
        snap = snapshot(out)
        try:
            check_invariants(snap, N_ROWS)
        except AssertionError as exc:
            problems.append(f"invariants: {exc}")
        ref = refs[kind]
        for key in ("status", "members", "tars", "subsets"):
            if snap[key] != ref[key]:
                problems.append(f"{key} differ from a clean build")
        problems += leftover_problems(out)
    result["problems"] = problems
    return result


def main(report: str, work_dir: str, seed: int = 0) -> int:
    work = Path(work_dir)
    rows = write_files(work / "pool", n=N_ROWS, seed=5)
    changed = [dict(r, **{S.TEXT: r[S.TEXT] + " again"}) if i % 4 == 1 else r for i, r in enumerate(rows)]
    with serve(work / "pool") as base:
        v1, v2 = write_metadata(work, rows, base, "v1"), write_metadata(work, changed, base, "v2")
        done_v1 = work / "done-v1"
        assert in_child(config(v1, done_v1), {}, work / "clean.log") == "finished"
        assert in_child(config(v2, work / "clean-v2"), {}, work / "clean.log") == "finished"
        cfgs = {"fresh": (config(v1, work / "out"), None),
                "retry": (config(v1, work / "out", retry_failed=True), done_v1),
                "refresh": (config(v2, work / "out", refresh_changed=True), done_v1)}  # fmt: skip
        refs = {
            "fresh": snapshot(done_v1),
            "retry": snapshot(done_v1),
            "refresh": snapshot(work / "clean-v2"),
        }
        reference = _reference_problems(config(v1, done_v1), work / "ref-v1")
        reference += _reference_problems(config(v2, work / "clean-v2"), work / "ref-v2")
        rng = random.Random(seed)
        results = []
        for kind, points, n_cases in PLAN:
            counts = trace_counts(cfgs[kind][0], cfgs[kind][1], work)
            reachable = [p for p in points if counts[p]]
            for i in range(n_cases):
                point = reachable[i % len(reachable)]
                results.append(run_case(kind, point, rng.randint(1, counts[point]), cfgs, refs, work))
    Path(report).write_text(json.dumps({"seed": seed, "cases": results, "reference": reference}, indent=1))
    return 0


def _reference_problems(cfg, work: Path) -> list[str]:
    """How a clean build differs from the whole-pool rules run in one process (tests/fixtures/build_reference.py)."""
    got, want = build_outputs(cfg), reference_build(cfg, work)
    problems = (
        [] if status_rows(got["status"]) == status_rows(want["status"]) else [f"{cfg.output}: statuses"]
    )
    problems += [f"{cfg.output}: {k}" for k in ("subsets", "tars", "sizes") if got[k] != want[k]]
    return problems


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0))
