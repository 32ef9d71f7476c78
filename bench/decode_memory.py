"""Peak resident memory of one download actor over large-canvas images, against the documented bound.

A pool of small files with huge canvases (the hostile case: a few hundred kB that decode to 8000-9000 px
on a side) is served from memory by a threaded HTTP server on 127.0.0.1 in its own process. One
``DownloadWorker`` (the worker each download actor of the build runs, here without Ray) runs in a fresh
subprocess and
downloads the whole pool in one call; the subprocess reports its resident size before the call
(imports done, worker built) and its peak during the call: the kernel's high-water mark ``VmHWM`` of
/proc/self/status, reset just before the call (``clear_refs``). Not ``getrusage().ru_maxrss``: Linux carries
that over from the forked parent's resident size across ``exec``, so it would report the image generator.

Kinds: RGBA PNG (alpha composited on white), palette PNG with a transparent entry, 16-bit greyscale PNG,
RGB PNG, and JPEG (decoded at 1/8 in the DCT domain). The bound is
``pipeline.download.fetch.memory_bound(cfg)`` (docs/download.md): the peak over the resident size before the
call must stay below it whatever the input. Each configuration runs ``--repeats`` times alternated with
the others; we report the median, min and max, and the load average beside each figure.

``--threads`` and ``--budget-mpx`` choose the configurations (default: the defaults, 16 threads, and a
small budget). Writes bench/results/decode_memory.json.
Usage: python -m bench.decode_memory [--side 9000] [--per-kind 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import platform
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]

KINDS = ("rgba_png", "palette_png", "gray16_png", "rgb_png", "jpeg")
# The same bench (--per-kind 2 --repeats 1 --side 9000) on the decode code before the memory bound (commit
# 02beaf1: float32 alpha blend and int64 16-bit path over the full canvas, no pixel budget), measured once
# on this 2-core machine at load 1.0-1.5; kept here because that code path is gone.
BEFORE_CHANGE_MIB = {"threads=1": {"peak_over_before_call": 4308, "seconds": 26.4},
                     "threads=2": {"peak_over_before_call": 8021, "seconds": 27.4}}  # fmt: skip
MIB = 1024 * 1024


def make_image(kind: str, side: int) -> bytes:
    """A canvas of ``side`` x ``side`` px whose file stays small (flat areas and a few stripes)."""
    h = w = side
    buf = io.BytesIO()
    if kind == "gray16_png":
        arr = np.zeros((h, w), np.uint16)
        arr[:, : w // 2] = 40000
        arr[::97] = 65535
        Image.fromarray(arr).save(buf, "PNG")
        return buf.getvalue()
    rgb = np.full((h, w, 3), (200, 120, 40), np.uint8)
    rgb[::101] = (10, 250, 10)
    im = Image.fromarray(rgb, "RGB")
    if kind == "rgba_png":
        alpha = np.full((h, w), 255, np.uint8)
        alpha[: h // 3] = 90
        alpha[:, ::89] = 0
        im = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
        im.save(buf, "PNG")
    elif kind == "palette_png":
        im = im.quantize(4)
        im.info["transparency"] = 0
        im.save(buf, "PNG", transparency=0)
    elif kind == "rgb_png":
        im.save(buf, "PNG")
    else:
        im.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _serve(files: dict[str, bytes], ready: mp.Queue, stop: mp.Event) -> None:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body or b"")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ready.put(srv.server_address[1])
    stop.wait()
    srv.shutdown()


def _hwm() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _worker(port: int, paths: list[str], threads: int, budget: int, out: mp.Queue) -> None:
    import pyarrow as pa

    from pipeline.config import DownloadConfig
    from pipeline.download.worker import DownloadWorker

    kw = {"allow_hosts": ["127.0.0.1"], "threads_per_actor": threads, "verify_sha256": False}
    if budget and "decode_pixel_budget" in DownloadConfig.__dataclass_fields__:
        kw["decode_pixel_budget"] = budget
    cfg = DownloadConfig(**kw)
    worker = DownloadWorker(cfg)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size to the current one
    rows = pa.table({"uid": [f"{i:032x}" for i in range(len(paths))],
                     "url": [f"http://127.0.0.1:{port}{p}" for p in paths]})  # fmt: skip
    t0 = time.perf_counter()
    res = worker(rows)
    secs = time.perf_counter() - t0
    peak = _hwm()
    try:
        from pipeline.download.worker import memory_bound

        bound = memory_bound(cfg)
    except ImportError:
        bound = None
    out.put({"before_call": before, "peak": peak, "seconds": secs, "bound": bound,
             "statuses": res.column("status").to_pylist()})  # fmt: skip


def run_once(port: int, paths: list[str], threads: int, budget: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(port, paths, threads, budget, q))
    p.start()
    r = q.get()
    p.join()
    r["load_avg_1m"] = os.getloadavg()[0]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--side", type=int, default=9000)
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[16])
    ap.add_argument("--budget-mpx", type=int, nargs="+", default=[0, 30], help="0 = the default budget")
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode_memory.json"))
    args = ap.parse_args()

    files, paths = {}, []
    sizes = {}
    for kind in KINDS:
        data = make_image(kind, args.side)
        sizes[kind] = len(data)
        for i in range(args.per_kind):
            files[f"/{kind}/{i}"] = data
            paths.append(f"/{kind}/{i}")
    print("file sizes (kB):", {k: round(v / 1024) for k, v in sizes.items()}, flush=True)
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(files, ready, stop), daemon=True)
    server.start()
    port = ready.get()
    configs = [(t, b * 1_000_000) for t in args.threads for b in args.budget_mpx]
    runs: dict[str, list[dict]] = {f"threads={t},budget={b}": [] for t, b in configs}
    for rep in range(args.repeats):
        for t, b in configs:  # alternated: A B A B ...
            r = run_once(port, paths, t, b)
            key = f"threads={t},budget={b}"
            runs[key].append(r)
            ok = sum(s == "success" for s in r["statuses"])
            print(f"[{rep}] {key}: peak {r['peak'] / MIB:.0f} MiB, before call {r['before_call'] / MIB:.0f} MiB, "
                  f"bound {(r['bound'] or 0) / MIB:.0f} MiB, {r['seconds']:.1f} s, {ok}/{len(paths)} ok, "
                  f"load {r['load_avg_1m']:.2f}", flush=True)  # fmt: skip
    stop.set()
    server.join(5)
    summary = {}
    for key, rs in runs.items():
        extra = [(r["peak"] - r["before_call"]) / MIB for r in rs]
        summary[key] = {
            "peak_mib_median": statistics.median(r["peak"] / MIB for r in rs),
            "peak_over_before_call_mib": {
                "median": statistics.median(extra),
                "min": min(extra),
                "max": max(extra),
            },  # fmt: skip
            "bound_mib": (rs[0]["bound"] or 0) / MIB or None,
            "within_bound": all(r["bound"] is None or r["peak"] - r["before_call"] <= r["bound"] for r in rs),
            "seconds_median": statistics.median(r["seconds"] for r in rs),
            "load_avg_1m": [round(r["load_avg_1m"], 2) for r in rs],
            "statuses": sorted(set(s for r in rs for s in r["statuses"])),
        }
    result = {
        "side": args.side,
        "per_kind": args.per_kind,
        "file_kib": {k: round(v / 1024, 1) for k, v in sizes.items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "configs": summary,
        "before_change_mib": BEFORE_CHANGE_MIB,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
