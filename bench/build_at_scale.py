"""The whole build at DataComp-like sizes: does the driver stay flat while Ray does the rows?

For each pool size (default 1M, 4M, 16M rows: bench/scale_pool.py's synthetic DataComp schema with real
string lengths, its URL column past 2 GiB at 16M) the whole build runs once — scan, uid and URL dedupe,
download, exact and pHash near-duplicate dedupe, status table, shards, the baseline filters ``basic``,
``english``, ``clip_score`` (by fraction: a whole-pool cut) and ``random``, subsets — on a local Ray of
this machine's cores, in a child process inside a cpuacct and a memory cgroup of its own (as root), with
the fetch stand-in of bench/scale_pool.py answering every URL at memory speed (the download itself is
tested against real servers elsewhere). Reported per size: the driver's peak RSS (``ru_maxrss`` of the
child, which is the job's driver), the largest Ray worker's peak RSS (sampled every 0.5 s), wall time,
CPU seconds of the whole process tree per row (cpuacct), and each stage's wall time.

Then ``--requests N``: the same build at ``N`` rows with its output on SeaweedFS S3 (the metadata too),
and the S3 requests the server counted (its Prometheus counter), per download part and per row.

The fits (least squares over the sizes): wall and CPU = a + b·N, driver peak = a + b·N; extrapolated to
DataComp small (12.8M), medium (128M) and large (1.28B) — marked as extrapolated in the output.
Writes ``--out`` (JSON). Each size's output is removed after it is measured (disk: a 16M-row build holds
~80 GB of part tars and shards).
Usage: python -m bench.build_at_scale [--sizes 1000000,4000000,16000000] [--requests 200000] [--quick]
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
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH / "results" / "build_at_scale.json"
CACHE = Path(
    os.environ.get("PROLIP_BENCH_CACHE", Path(tempfile.gettempdir()) / "prolip-bench-build-at-scale")
)
CGROUPS = Path("/sys/fs/cgroup")
FILTERS = ["no_filter", "basic", "english", "clip_score", "random"]
EXTRAPOLATE = {"small": 12_800_000, "medium": 128_000_000, "large": 1_280_000_000}
# 70% of the rows fail to download (a pool whose links rotted): a 16M-row build then holds ~35 GB of part
# tars and shards, which this machine's disk takes. A second 1M run at 3% separates the cost of a success.
FAIL = 0.70
DENSE_FAIL = 0.03

_CHILD = r"""
import json, os, resource, sys, time
import ray
from bench import scale_pool as P
cfg_json, out_json = sys.argv[1], sys.argv[2]
env = {"PYTHONPATH": sys.argv[3]}
ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": env, "worker_process_setup_hook": "bench.scale_pool.install_standin"})
P.install_standin()
from pipeline.build import build
from pipeline.common.config import load
from pipeline.common.storage import Storage
from pipeline.config import BuildConfig

cfg = load(BuildConfig, json.loads(cfg_json))
t = time.perf_counter()
res = build(cfg, log=lambda m: print(m, flush=True), store=cfg.storage.store())
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
json.dump({"wall_s": wall, "driver_peak_rss": peak, "timings": res.timings, "status": res.status_counts,
           "shards": len(res.shards), "filters": res.filter_counts}, open(out_json, "w"))
ray.shutdown()
"""


class _Group:
    """A cpuacct + memory cgroup for the child's process tree (v1, as root)."""

    def __init__(self, name: str) -> None:
        self.dirs = [CGROUPS / c / name for c in ("cpuacct", "memory")]
        for d in self.dirs:
            d.mkdir(exist_ok=True)

    def enter(self) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def cpu_s(self) -> float:
        return int((self.dirs[0] / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass


class _WorkerPeak:
    """The largest RSS any Ray worker process (a descendant of ``pid``) reached, sampled every 0.5 s."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.psutil, self.pid, self.peak = psutil, pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                kids = self.psutil.Process(self.pid).children(recursive=True)
            except self.psutil.NoSuchProcess:
                return
            for k in kids:
                try:
                    if "ray::" in k.name() or "default_worker" in " ".join(k.cmdline()):
                        self.peak = max(self.peak, k.memory_info().rss)
                except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                    pass

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _config(n: int, out: str, metadata: str, s3: str = "") -> dict:
    return {
        "metadata": metadata, "output": out, "storage": {"s3_endpoint": s3}, "part_size": 2_000, "samples_per_shard": 10_000,
        "download_actors": os.cpu_count() or 2, "download_cpus": 0.5,
        "download": {"verify_sha256": False, "late_retries": 0, "threads_per_actor": 16},
        "dedupe": {"near_duplicates": True}, "filters": {"names": FILTERS},
    }  # fmt: skip


def run_size(n: int, label: str, s3=None, fail: float = 0.0) -> dict:
    """One whole build of ``n`` rows (a ``fail`` share of them 404s) in a child process; its figures."""
    from bench import scale_pool as P

    fail = fail or FAIL
    pool = P.write_pool(CACHE / f"pool-{n}-{fail}", n, file_rows=min(n, P.FILE_ROWS), fail=fail)
    out = CACHE / f"out-{n}"
    shutil.rmtree(out, ignore_errors=True)
    metadata, output, endpoint = str(pool), str(out), ""
    if s3 is not None:
        metadata, output, endpoint = _upload(s3, pool, label), s3.url(f"{label}-out"), s3.endpoint
    cfg = _config(n, output, metadata, endpoint)
    group = _Group(f"prolip-bench-{os.getpid()}-{label}")
    result = CACHE / f"result-{label}.json"
    load = os.getloadavg()[0]
    try:
        cpu0 = group.cpu_s()
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(cfg), str(result), str(ROOT)],
            cwd=ROOT, preexec_fn=group.enter, env={**os.environ, **(s3.env if s3 else {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        workers = _WorkerPeak(proc.pid)
        for line in proc.stdout:
            if not line.startswith("  part(s) done"):
                print(f"  [{label}] {line.rstrip()}", flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"the build of {n} rows failed")
        fig = json.loads(result.read_text())
        fig.update(rows=n, cpu_s=group.cpu_s() - cpu0, largest_worker_rss=workers.stop(), load_avg_1m=load,
                   fail=fail, successes=fig["status"].get("success", 0))  # fmt: skip
        fig["cpu_us_per_row"] = 1e6 * fig["cpu_s"] / n
    finally:
        group.close()
        shutil.rmtree(out, ignore_errors=True)
    return fig


def _upload(s3, pool: Path, label: str) -> str:
    from pipeline.common.storage import Storage

    store = Storage(endpoint=s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key)
    for f in sorted(pool.glob("*.parquet")):
        store.write_bytes(f.read_bytes(), s3.url(f"{label}-meta", f.name))
    return s3.url(f"{label}-meta")


def _per_row_rest(sparse: dict, dense: dict) -> float:
    """CPU seconds a row costs besides its success (two runs of the same size, other success counts)."""
    per_success = (dense["cpu_s"] - sparse["cpu_s"]) / (dense["successes"] - sparse["successes"])
    return (sparse["cpu_s"] - per_success * sparse["successes"]) / sparse["rows"]


def fit(xs: list[float], ys: list[float]) -> dict:
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return {"fixed": float(a), "per_row": float(b), **{k: float(a + b * v) for k, v in EXTRAPOLATE.items()}}


def requests(n: int) -> dict:
    """The build of ``n`` rows on SeaweedFS: the S3 requests its server counted, per part and per row."""
    from tests.fixtures.s3_server import start_seaweedfs, stop_seaweedfs

    data = CACHE / "s3"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    proc, s3 = start_seaweedfs(data, metrics=True)
    try:
        before = s3.request_counts()
        fig = run_size(n, f"s3-{n}", s3)
        counts = {k: v - before.get(k, 0) for k, v in s3.request_counts().items()}
    finally:
        stop_seaweedfs(proc)
        shutil.rmtree(data, ignore_errors=True)
    parts = -(-n // 2_000)
    total = sum(counts.values())
    return {**fig, "requests": counts, "requests_total": total, "parts": parts,
            "requests_per_part": total / parts, "requests_per_row": total / n}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000000,4000000,16000000")
    ap.add_argument("--requests", type=int, default=200_000, help="rows of the S3 run (0: none)")
    ap.add_argument("--quick", action="store_true", help="20k and 60k rows, 20k on S3: a check, not a figure")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("the benchmark measures its process tree with cgroups: run it as root")
    sizes = [20_000, 60_000] if args.quick else [int(s) for s in args.sizes.split(",")]
    CACHE.mkdir(parents=True, exist_ok=True)
    runs = [run_size(n, f"n{n}") for n in sizes]
    dense = run_size(sizes[0], f"n{sizes[0]}-dense", fail=DENSE_FAIL)
    for r in runs:
        print(f"{r['rows']:>11,} rows: wall {r['wall_s']:.0f} s, {r['cpu_us_per_row']:.0f} CPU-µs/row, driver "
              f"{r['driver_peak_rss'] / 2**20:.0f} MiB, largest worker {r['largest_worker_rss'] / 2**20:.0f} MiB, "
              f"load {r['load_avg_1m']:.1f}", flush=True)  # fmt: skip
    n = [r["rows"] for r in runs]
    out = {
        "date": datetime.date.today().isoformat(), "cores": os.cpu_count(), "runs": runs,
        "fit_wall_s": fit(n, [r["wall_s"] for r in runs]), "fit_cpu_s": fit(n, [r["cpu_s"] for r in runs]),
        "fit_driver_peak_rss": fit(n, [r["driver_peak_rss"] for r in runs]),
        "driver_growth_rss": runs[-1]["driver_peak_rss"] - runs[0]["driver_peak_rss"],
        "dense": dense,
        "cpu_s_per_success": (dense["cpu_s"] - runs[0]["cpu_s"]) / (dense["successes"] - runs[0]["successes"]),
        "cpu_s_per_row_without_download": _per_row_rest(runs[0], dense),
        "extrapolated": sorted(EXTRAPOLATE),
    }  # fmt: skip
    if args.requests or args.quick:
        out["s3"] = requests(20_000 if args.quick else args.requests)
        print(f"S3: {out['s3']['requests_per_part']:.1f} requests a part ({out['s3']['requests']})")
    if not args.quick:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k.startswith(("fit", "driver"))}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
