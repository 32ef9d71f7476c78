"""Where the build's time goes: per-image stages (ours vs img2dataset's path), one download part, the driver.

Three profiles, each printed as a table and written to ``--out`` (JSON); CPU times are per-thread CPU
(``time.thread_time``), so they mean the same on a loaded machine as on a quiet one (the load is recorded):

``stages``  the same ``--n`` photo-like JPEGs as bench/build_throughput.py, bytes in memory, one thread,
            OpenCV single-threaded. Ours: header parse, decode straight to BGR (simplejpeg, DCT-domain
            scale-down at ``--dct-margin``), INTER_AREA resize, ``imencode`` q95, pHash (OpenCV 32×32 area
            reduction + DCT), sha256; face blur of one box
            (10% of the side) timed apart, as DataComp rows carry boxes on a minority of images.
            img2dataset 1.47's path over the same bytes: sha256 (its default ``compute_hash``), full
            ``cv2.imdecode``, albumentations ``LongestMaxSize`` (INTER_AREA), ``imencode`` q95, and its
            whole ``Resizer`` call.
``part``    one ``DownloadPart`` call (our actor's unit of work, no Ray) over ``--n`` rows fetched from
            127.0.0.1 with the default DownloadConfig: cProfile (thread CPU) in every download thread and in
            the calling thread, folded into stages (fetch, sha256, decode, resize, encode, pHash, Arrow,
            tar/parquet writes).
``driver``  ``pipeline.build.build`` on the demo pool (``jobs.build_dataset --preset demo``), cProfile of
            the driver thread (wall clock) and ``BuildResult.timings``, then a second call on the finished
            output (resume with nothing to do).

Usage: python -m bench.profile_build [--what stages,part,driver] [--n 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no network check on import
from bench import build_throughput as BT  # the corpus and its server

ROOT = Path(__file__).resolve().parents[1]


def _per_image_ms(fn, items) -> float:
    t = time.thread_time()
    for x in items:
        fn(x)
    return 1e3 * (time.thread_time() - t) / len(items)


def profile_stages(blobs: list[bytes], margin: float = 3.0, theirs: bool = True) -> dict:
    """Per-image CPU ms of each stage, ours (JPEG DCT margin ``margin``) and img2dataset's, same bytes."""
    import cv2
    import numpy as np
    from PIL import Image

    from pipeline.dedup.phash import phash64
    from pipeline.download import resize as R

    cv2.setNumThreads(1)
    for b in blobs[:3]:
        R.process_image(b)  # lazy imports are no part of the figure

    def header(b):
        with Image.open(io.BytesIO(b)) as im:
            return im.size, im.format

    heads = [header(b) for b in blobs]
    sizes = [R.output_size(w, h, 512) for (w, h), _ in heads]

    def decode(i):
        im = Image.open(io.BytesIO(blobs[i]))
        return R._decode(blobs[i], im, *sizes[i], margin)

    decoded = [decode(i) for i in range(len(blobs))]
    resized = [R.area_resize(d, s) for d, s in zip(decoded, sizes, strict=True)]
    box = [[0.45, 0.45, 0.55, 0.55]]
    idx = list(range(len(blobs)))
    ours = {
        "header (Image.open)": _per_image_ms(header, blobs),
        "decode (simplejpeg to BGR, DCT scale-down)": _per_image_ms(decode, idx),
        "resize (INTER_AREA)": _per_image_ms(lambda i: R.area_resize(decoded[i], sizes[i]), idx),
        "encode (imencode q95)": _per_image_ms(
            lambda p: cv2.imencode(".jpg", p, [cv2.IMWRITE_JPEG_QUALITY, 95]), resized
        ),
        "pHash (32×32 area reduction + DCT)": _per_image_ms(lambda p: phash64(p, "BGR"), resized),
        "sha256 of the body": _per_image_ms(lambda b: hashlib.sha256(b).hexdigest(), blobs),
    }
    ours["process_image, whole call"] = _per_image_ms(lambda b: R.process_image(b, dct_margin=margin), blobs)
    ours["face blur, one box (images with boxes only)"] = _per_image_ms(
        lambda p: R.blur_boxes(p, box), resized
    )
    dct = [R.dct_factor(w, h, *s, margin) for ((w, h), _), s in zip(heads, sizes, strict=True)]
    summary = {
        "images": len(blobs),
        "mean_kb": sum(map(len, blobs)) / len(blobs) / 1e3,
        "dct_margin": margin,
        "dct_factor_counts": {str(f): dct.count(f) for f in sorted(set(dct))},
        "ours_ms": ours,
    }
    if not theirs:
        return summary

    import albumentations as A
    from img2dataset.resizer import Resizer

    resizer = Resizer(512, "keep_ratio_largest", True, encode_quality=95)
    longest = A.LongestMaxSize(max_size=512, interpolation=cv2.INTER_AREA, p=1.0)
    full = [cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_UNCHANGED) for b in blobs]
    small = [longest(image=f)["image"] for f in full]
    summary["img2dataset_ms"] = {
        "sha256 of the body": ours["sha256 of the body"],
        "decode (cv2.imdecode, full size)": _per_image_ms(
            lambda b: cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_UNCHANGED), blobs
        ),
        "resize (albumentations LongestMaxSize, INTER_AREA)": _per_image_ms(
            lambda f: longest(image=f)["image"], full
        ),
        "encode (imencode q95)": _per_image_ms(
            lambda p: cv2.imencode(".jpg", p, [cv2.IMWRITE_JPEG_QUALITY, 95]), small
        ),
        "Resizer, whole call": _per_image_ms(lambda b: resizer(io.BytesIO(b)), blobs),
    }
    return summary


# --- one part ------------------------------------------------------------------------------------------

# (stage, function names whose cumulative thread-CPU time is that stage); first match wins per stage.
PART_STAGES = [
    ("fetch (guard, connect, HTTP, body read)", ["fetch"]),
    ("sha256", ["openssl_sha256"]),
    ("header (Image.open)", ["open"]),
    ("decode", ["_decode"]),
    ("resize (cv2.resize)", ["resize"]),
    ("encode (imencode)", ["imencode"]),
    ("pHash", ["phash64"]),
    ("pixel budget / deadline bookkeeping", ["hold"]),
    ("process_image, whole", ["process_image"]),
    ("row result → Arrow (from_pylist)", ["from_pylist"]),
    ("sort / one row per uid", ["one_row_per_uid"]),
    ("tar members (to_pylist, json)", ["_samples"]),
    ("tar write", ["write_members"]),
    ("parquet write", ["write_parquet"]),
]


def _cum(stats: pstats.Stats, names: list[str]) -> float:
    total = 0.0
    for (_file, _line, fn), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        bare = fn.split(".")[-1].split(" ")[-1].strip("<>'")
        if bare in names or any(fn.endswith(f"{n}>") or fn.endswith(f".{n}") for n in names):
            total = max(total, ct) if bare == "open" else total + ct
    return total


def profile_part(paths: list[Path], n: int, tmp: Path) -> dict:

    from pipeline.config import DownloadConfig
    from pipeline.download.part import DownloadPart

    server = BT.ImageServer(paths[0].parent)
    try:
        meta = BT.write_metadata(paths[:n], server.base_url, tmp / "meta", 0)
        import pyarrow.parquet as pq

        rows = pq.read_table(meta).select(["uid", "url", "text"])
        cfg = DownloadConfig(allow_hosts=["127.0.0.1"], verify_sha256=False)
        part = DownloadPart(cfg, str(tmp / "parts"), "t0")
        part.download(0, rows.slice(0, 8))  # warm: lazy imports, first connections
        profiles: list[cProfile.Profile] = []
        lock = threading.Lock()
        inner = part.worker._one

        def profiled(*a):
            prof = cProfile.Profile(time.thread_time)
            with lock:
                profiles.append(prof)
            return prof.runcall(inner, *a)

        part.worker._one = profiled
        main = cProfile.Profile(time.thread_time)
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        main.runcall(part.download, 0, rows)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        part.worker.close()
        fetch_ms = compare_fetch(rows.column("url").to_pylist(), cfg)
    finally:
        server.stop()
    threads = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        threads.add(p)
    driver = pstats.Stats(main)
    stages = {}
    for name, fns in PART_STAGES:
        ms = 1e3 * (_cum(threads, fns) + _cum(driver, fns)) / n
        stages[name] = ms
    return {
        "rows": n,
        "threads": cfg.threads_per_actor,
        "per_host_connections": cfg.per_host_connections,
        "wall_s": wall,
        "images_per_s_wall": n / wall,
        "process_cpu_ms_per_image": 1e3 * cpu / n,
        "thread_cpu_ms_per_image": stages,
        "load_avg_1m": load,
        "serial_fetch_cpu_ms_per_image": fetch_ms,
    }


def compare_fetch(urls: list[str], cfg) -> dict:
    """Thread CPU per image of one serial fetch, no profiler: ours vs img2dataset's ``download_image``."""
    from img2dataset.downloader import download_image

    from pipeline.download.fetch import fetch
    from pipeline.download.netguard import UrlGuard

    guard = UrlGuard(cfg.allow_hosts)
    ours = lambda u: fetch(u, timeout_s=10, retries=0, max_bytes=cfg.max_bytes, guard=guard,  # noqa: E731
                           user_agent=cfg.user_agent, honor_robots=True)  # fmt: skip
    theirs = lambda u: download_image((0, u), 10, None, ["noai", "noimageai", "noindex", "noimageindex"])  # noqa: E731
    out: dict = {"ours": [], "img2dataset": []}
    for _ in range(3):  # alternated
        out["ours"].append(_per_image_ms(ours, urls))
        out["img2dataset"].append(_per_image_ms(theirs, urls))
    return {k: float(sorted(v)[1]) for k, v in out.items()} | {"runs": out}


# --- the driver ----------------------------------------------------------------------------------------


def profile_driver(tmp: Path, demo_n: int) -> dict:
    from jobs.common import init_ray
    from pipeline.build import build
    from pipeline.common.config import merge
    from pipeline.config import BUILD_PRESETS
    from pipeline.demo.source import demo_source

    cfg = merge(BUILD_PRESETS["demo"], {"output": str(tmp / "demo"), "demo_n": demo_n})
    t = time.perf_counter()
    init_ray(cfg.num_cpus)
    ray_init = time.perf_counter() - t
    out: dict = {"ray_init_s": ray_init, "demo_n": demo_n}
    with demo_source(cfg, log=lambda m: None) as run_cfg:
        for label in ("first", "rerun"):
            prof = cProfile.Profile()
            load = os.getloadavg()[0]
            t = time.perf_counter()
            res = prof.runcall(build, run_cfg, log=lambda m: None)
            wall = time.perf_counter() - t
            st = pstats.Stats(prof)
            top = sorted(
                ((fn, v[3]) for fn, v in st.stats.items() if "pipeline/" in fn[0] or "ray/data" in fn[0]),  # type: ignore[attr-defined]
                key=lambda kv: -kv[1],
            )[:25]
            out[label] = {
                "wall_s": wall,
                "rows": res.n_input,
                "successes": res.status_counts.get("success", 0),
                "timings_s": res.timings,
                "load_avg_1m": load,
                "top_cumulative_s": [(f"{Path(f[0]).name}:{f[2]}", round(c, 3)) for f, c in top],
            }
    out["rerun_fraction"] = out["rerun"]["wall_s"] / out["first"]["wall_s"]
    import ray

    ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", default="stages,part,driver")
    p.add_argument("--n", type=int, default=300, help="images for the stages and part profiles")
    p.add_argument("--dct-margin", type=float, default=3.0, help="DownloadConfig.jpeg_dct_margin (stages)")
    p.add_argument("--no-img2dataset", action="store_true", help="stages: ours only")
    p.add_argument("--demo-n", type=int, default=0, help="demo pool rows (0: the preset's)")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "profile_build.json"))
    args = p.parse_args(argv)
    what = set(args.what.split(","))
    cores = os.cpu_count() or 1
    res: dict = {"cores": cores, "load_avg_1m_start": os.getloadavg()[0]}
    paths = BT.make_corpus(args.n, 0, cores)
    tmp = Path(tempfile.mkdtemp(prefix="profile-build-"))
    if "stages" in what:
        blobs = [q.read_bytes() for q in paths]
        res["stages"] = profile_stages(blobs, args.dct_margin, not args.no_img2dataset)
        res["stages"]["load_avg_1m"] = os.getloadavg()[0]
        for side in ("ours_ms", "img2dataset_ms")[: 1 if args.no_img2dataset else 2]:
            print(f"\n{side} (thread CPU per image, load {res['stages']['load_avg_1m']:.1f}):")
            for k, v in res["stages"][side].items():
                print(f"  {v:7.2f}  {k}")
    if "part" in what:
        res["part"] = profile_part(paths, args.n, tmp)
        r = res["part"]
        print(f"\npart of {r['rows']} rows: {r['wall_s']:.2f}s wall, {r['process_cpu_ms_per_image']:.2f} ms "
              f"process CPU/image, load {r['load_avg_1m']:.1f}")  # fmt: skip
        for k, v in r["thread_cpu_ms_per_image"].items():
            print(f"  {v:7.2f}  {k}")
        print(f"serial fetch, thread CPU ms/image (median of 3): {r['serial_fetch_cpu_ms_per_image']}")
    if "driver" in what:
        from pipeline.config import BUILD_PRESETS

        res["driver"] = profile_driver(tmp, args.demo_n or BUILD_PRESETS["demo"].demo_n)
        for label in ("first", "rerun"):
            r = res["driver"][label]
            print(
                f"\ndriver, {label} build(): {r['wall_s']:.1f}s, load {r['load_avg_1m']:.1f}; {r['timings_s']}"
            )
            for name, c in r["top_cumulative_s"][:15]:
                print(f"  {c:7.2f}s  {name}")
    Path(args.out).write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
