"""CPU per image inside one download actor, against img2dataset's per-image path, without Ray.

Each case runs in fresh processes (``--procs`` of them at once, 2 = our two actors or img2dataset's two
processes on 2 cores), each over its own ``--n`` rows of bench/build_throughput.py's corpus fetched from
127.0.0.1 (the same threaded server, in its own process, whose CPU is not counted). A process reports its
own user + system CPU seconds (``resource.getrusage``) for the timed call, so the figure is CPU per image,
which sharing the machine distorts much less than wall time. Cases:

``ceiling``   ``process_image`` + sha256 over the bodies in memory, one thread (no fetch).
``fetch``     ``fetch`` only (guard, pinned socket, HTTP, body) on ``--threads`` threads.
``worker``    ``DownloadWorker`` (fetch, sha256, process_image, result rows → Arrow) on ``--threads``.
``part``      ``DownloadPart.download``: the worker plus the part's tar and parquet.
``i2d``       img2dataset 1.47's ``download_image`` + ``Resizer`` (its per-image path) on ``--threads``.
``i2d_fetch`` img2dataset's ``download_image`` only.

Cases alternate A B C … per round (``--rounds``); per case the median over rounds of CPU ms per image and
the min–max, with the 1-min load beside each round. Writes ``--out`` (JSON).

Usage: python -m bench.actor_cpu [--cases ceiling,worker,i2d] [--n 1000] [--procs 2] [--threads 16]
       [--set jpeg_dct_margin=1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from bench.alternate import spread

ROOT = Path(__file__).resolve().parents[1]


def _cpu() -> tuple[float, float, int, int]:
    """(user s, system s, minor page faults, involuntary + voluntary context switches) of this process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt, r.ru_nvcsw + r.ru_nivcsw


def _threads_cpu(fn, items: list, threads: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, items))


def child(case: str, meta: str, lo: int, hi: int, threads: int, overrides: dict, tmp: str) -> dict:
    """One process of one case over rows [lo, hi) of ``meta``; its CPU and wall for the timed call."""
    import cv2
    import pyarrow.parquet as pq

    from pipeline.common.config import merge
    from pipeline.config import DownloadConfig

    cv2.setNumThreads(1)
    rows = pq.read_table(meta).slice(lo, hi - lo)
    urls = rows.column("url").to_pylist()
    cfg = merge(DownloadConfig(allow_hosts=["127.0.0.1"], verify_sha256=False, threads_per_actor=threads),
                overrides)  # fmt: skip
    run = _case(case, cfg, rows, urls, threads, tmp)
    if os.environ.get("ACTOR_CPU_MMAP_THRESHOLD"):  # after DownloadWorker's own setting: this one wins
        from pipeline.download.pixel_budget import return_large_buffers_to_os

        return_large_buffers_to_os(int(os.environ["ACTOR_CPU_MMAP_THRESHOLD"]))
    if os.environ.get("ACTOR_CPU_TRIM_THRESHOLD"):
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-1, int(os.environ["ACTOR_CPU_TRIM_THRESHOLD"]))
    run(warm=True)
    t0, c0 = time.perf_counter(), _cpu()
    run(warm=False)
    wall, (user, system, faults, switches) = (
        time.perf_counter() - t0,
        (b - a for a, b in zip(c0, _cpu(), strict=True)),
    )
    n = len(urls)
    return {
        "cpu_ms_per_image": 1e3 * (user + system) / n,
        "sys_ms_per_image": 1e3 * system / n,
        "page_faults_per_image": faults / n,
        "context_switches_per_image": switches / n,
        "wall_s": wall,
        "images": n,
        "threads": threading.active_count(),
    }


def _case(case: str, cfg, rows, urls: list[str], threads: int, tmp: str):
    """A callable ``run(warm)``: the warm call does a few rows so lazy imports and first connections are paid."""
    from pipeline.download.fetch import fetch
    from pipeline.download.netguard import UrlGuard
    from pipeline.download.part import DownloadPart
    from pipeline.download.resize import process_image
    from pipeline.download.worker import DownloadWorker

    warm_n = 8
    if case == "ceiling":
        from urllib.request import urlopen

        bodies = [urlopen(u, timeout=10).read() for u in urls]  # noqa: S310 - 127.0.0.1 corpus

        def one(b: bytes):
            hashlib.sha256(b).hexdigest()
            return process_image(b, image_size=cfg.image_size, jpeg_quality=cfg.jpeg_quality,
                                 dct_margin=cfg.jpeg_dct_margin)  # fmt: skip

        return lambda warm: [one(b) for b in (bodies[:warm_n] if warm else bodies)]
    if case == "fetch":
        guard = UrlGuard(cfg.allow_hosts)

        def get(u: str):
            return fetch(u, timeout_s=cfg.timeout_s, retries=cfg.retries, max_bytes=cfg.max_bytes, guard=guard,
                         user_agent=cfg.user_agent, honor_robots=cfg.honor_robots)  # fmt: skip

        return lambda warm: _threads_cpu(get, urls[:warm_n] if warm else urls, threads)
    if case == "worker":
        worker = DownloadWorker(cfg)
        return lambda warm: worker(rows.slice(0, warm_n) if warm else rows)
    if case == "part":
        part = DownloadPart(cfg, tmp, "t0")
        return lambda warm: part.download(1 if warm else 0, rows.slice(0, warm_n) if warm else rows)
    if case in ("i2d", "i2d_fetch"):
        from img2dataset.downloader import download_image
        from img2dataset.resizer import Resizer

        resizer = Resizer(cfg.image_size, "keep_ratio_largest", True, encode_quality=cfg.jpeg_quality)
        directives = ["noai", "noimageai", "noindex", "noimageindex"]

        def i2d(u: str):
            _key, stream, err = download_image((0, u), cfg.timeout_s, None, directives)
            if case == "i2d" and stream is not None:
                hashlib.sha256(stream.read()).hexdigest()  # its default compute_hash reads the stream
                stream.seek(0)
                resizer(stream)

        return lambda warm: _threads_cpu(i2d, urls[:warm_n] if warm else urls, threads)
    raise SystemExit(f"unknown case {case!r}")


def run_case(case: str, meta: Path, args, tmp: Path) -> dict:
    """``--procs`` children at once, each on its own ``--n`` rows; summed CPU over summed images."""
    procs = []
    for k in range(args.procs):
        spec = json.dumps([case, str(meta), k * args.n, (k + 1) * args.n, args.threads, args.overrides,
                           str(tmp / f"{case}{k}")])  # fmt: skip
        (tmp / f"{case}{k}").mkdir(exist_ok=True)
        procs.append(subprocess.Popen([sys.executable, "-m", __spec__.name, "--child", spec]))
    outs = []
    for k, p in enumerate(procs):
        if p.wait(timeout=600):
            raise RuntimeError(f"{case} child failed ({p.returncode})")
        outs.append(json.loads((tmp / f"{case}{k}" / "result.json").read_text()))
    images = sum(o["images"] for o in outs)
    per_image = (
        "cpu_ms_per_image",
        "sys_ms_per_image",
        "page_faults_per_image",
        "context_switches_per_image",
    )
    return {
        **{k: sum(o[k] * o["images"] for o in outs) / images for k in per_image},
        "images_per_s": images / max(o["wall_s"] for o in outs),
        "children": outs,
    }


# --- a whole build's CPU by process --------------------------------------------------------------------


class Census:
    """Last-seen CPU seconds of every descendant of this process (Ray's gcs, raylet and workers included),
    polled so that workers which exit before the end still count; keyed by process title."""

    def __init__(self, every_s: float = 0.25) -> None:
        import psutil

        self.me = psutil.Process()
        self.seen: dict[int, tuple[str, float]] = {}
        self.base: dict[int, float] = {}
        self._stop = threading.Event()
        self._every = every_s
        self._poll(base=True)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _poll(self, base: bool = False) -> None:
        import psutil

        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu = t.user + t.system
                    title = " ".join(p.cmdline()[:1])[:60] if p.pid != self.me.pid else "driver"
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if p.pid != self.me.pid:
                title = title.split("/")[-1]
            if base:
                self.base[p.pid] = cpu
            self.seen[p.pid] = (title, cpu)

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            self._poll()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self._poll()
        out: dict[str, float] = {}
        for pid, (title, cpu) in self.seen.items():
            out[title] = out.get(title, 0.0) + cpu - self.base.get(pid, 0.0)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def census_build(meta: Path, tmp: Path, overrides: dict, cores: int) -> dict:
    """One ``build()`` (bench/build_throughput.py's config) in a fresh Ray; CPU seconds per process title."""
    import ray

    from bench import build_throughput as BT
    from jobs.common import init_ray

    init_ray(num_cpus=cores)
    try:
        census = Census()
        res = BT.run_ours(BT.bench_config(meta, tmp / f"build{time.monotonic_ns()}", overrides))
        by_process = census.stop()
    finally:
        ray.shutdown()
    ok = res["successes"]
    return {
        "images_per_s": res["images_per_s"],
        "download_images_per_s": res["download_images_per_s"],
        "cpu_ms_per_image": 1e3 * sum(by_process.values()) / ok,
        "by_process_s": by_process,
        "successes": ok,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="ceiling,worker,i2d")
    p.add_argument("--n", type=int, default=1000, help="rows per process")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="DownloadConfig override")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "actor_cpu.json"))
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        result = child(*spec)
        Path(spec[-1], "result.json").write_text(json.dumps(result))  # img2dataset's imports take over stdout
        return 0
    from bench import build_throughput as BT
    from pipeline.common.config import parse_set

    args.overrides = parse_set(args.set) if args.set else {}
    cores = os.cpu_count() or 1
    paths = BT.make_corpus(args.n * args.procs, 0, cores)
    tmp = Path(tempfile.mkdtemp(prefix="actor-cpu-"))
    server = BT.ImageServer(paths[0].parent)
    cases = args.cases.split(",")
    rounds: list[dict] = []
    try:
        meta = BT.write_metadata(paths, server.base_url, tmp / "meta", 0)
        for i in range(args.rounds):
            row = {}
            for case in cases:
                load = os.getloadavg()[0]
                if case == "build":
                    row[case] = census_build(meta, tmp, args.overrides, cores) | {"load_avg_1m": load}
                    print(
                        f"round {i + 1} build {row[case]['cpu_ms_per_image']:.2f} CPU ms/image, "
                        f"{row[case]['images_per_s']:.1f} images/s, load {load:.1f}: "
                        + ", ".join(f"{k} {v:.1f}s" for k, v in row[case]["by_process_s"].items() if v > 0.05)
                    )
                    continue
                row[case] = run_case(case, meta, args, tmp) | {"load_avg_1m": load}
                r = row[case]
                print(f"round {i + 1} {case:10s} {r['cpu_ms_per_image']:6.2f} CPU ms/image (sys "
                      f"{r['sys_ms_per_image']:.2f}, {r['page_faults_per_image']:.0f} faults, "
                      f"{r['context_switches_per_image']:.1f} switches) {r['images_per_s']:6.1f} images/s  "
                      f"load {load:.1f}", flush=True)  # fmt: skip
            rounds.append(row)
    finally:
        server.stop()
    summary = {
        c: {k: spread([r[c][k] for r in rounds]) for k in ("cpu_ms_per_image", "images_per_s")} for c in cases
    }
    for c, s in summary.items():
        m = s["cpu_ms_per_image"]
        print(f"{c:10s} CPU ms/image {m['median']:.2f} ({m['min']:.2f}–{m['max']:.2f}); "
              f"images/s {s['images_per_s']['median']:.1f}")  # fmt: skip
    report = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "cores": cores, "rounds": rounds,
              "summary": summary}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
