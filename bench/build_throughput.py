"""Dataset build throughput against img2dataset, as ratios measured in one run.

Corpus: ``--n`` photo-like JPEGs (640–1280 px wide, smooth colour fields + shapes + film-grain-like noise,
JPEG q90, ≈50–250 kB, median ≈130 kB: the size of a typical web photo before DataComp's 512-px resize),
rendered once per ``--seed`` into a cache under the temp dir and served on 127.0.0.1 by a threaded HTTP
server that this script starts in a subprocess (all bodies in memory, one request per connection) and
stops by PID.

Measured, same URLs, DataComp's settings (longest side 512, downscale only, JPEG q95, timeout 10 s,
2 retries):
  (a) ours      ``pipeline.build.build``: metadata → URL dedupe → download parts (plain Ray actors) →
                exact-image dedupe → shards → the ``no_filter`` subset; wall time of the whole ``build()``
                call (Ray already up; ``ray.init`` reported apart) and of its download phase alone
                (``BuildResult.timings["download"]``). Run with the BuildConfig defaults, and with ``--tuned``
                overrides as a further contender when given.
  (b) img2dataset  ``img2dataset.download`` with the multiprocessing distributor, as DataComp's
                ``download_upstream.py`` calls it (image_size 512, keep_ratio_largest, resize_only_if_bigger,
                encode_quality 95, webdataset), ``processes_count = --cores``, ``thread_count`` = our
                ``threads_per_actor``, shards of our ``part_size`` so both split the work the same way.
                It runs in a subprocess (its spawn pool needs a ``__main__`` guard); we report the call
                alone (the runner times it) and the subprocess wall time including ``import img2dataset``.
  (c) ceiling   ``pipeline.download.resize.process_image`` (decode, resize, encode, pHash) over the same bytes in
                memory, one thread, OpenCV single-threaded: images/s per core.
Order: (c) once, then ``--rounds`` rounds of b, a (, a tuned): the contenders alternate (A B A B A B), each
of our runs in its own Ray session started after img2dataset finished and stopped before the next round,
so no contender shares the CPUs with another's idle processes; before each contender the script waits
(``--settle-s``, 150 s at most) for the 1-min load to fall under the core count, so that no run starts on the
load its predecessor left in the average. Ratios a/b are taken per round (same
minute, same load) and reported as the median with min–max over the rounds (goals: whole build() ≥ 1.2,
download phase ≥ 1.4). The 1-min load average is printed beside every figure and a warning when it exceeds
the core count; a loaded run does not overwrite bench/results/build_throughput.json (``--allow-loaded``).

Writes bench/results/build_throughput.json. Usage: python -m bench.build_throughput [--n 2000] [--rounds 3] [--cores N] [--tuned part_size=500]
"""

from __future__ import annotations

import argparse
import datetime
import glob
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from bench.alternate import load_note, spread
from pipeline.common.config import merge, parse_set
from pipeline.config import BuildConfig

ROOT = Path(__file__).resolve().parents[1]

CACHE = Path(tempfile.gettempdir()) / "prolip-bench-build-throughput"
DEFAULT_OUT = ROOT / "bench" / "results" / "build_throughput.json"
_BANK = 1400  # noise bank side (px) ≥ the largest image side, so every image crops its own window


# --- corpus -------------------------------------------------------------------------------------------

_noise: tuple[np.ndarray, np.ndarray] | None = None


def _noise_bank() -> tuple[np.ndarray, np.ndarray]:
    """Coarse (grain) and fine (sensor) noise, made once per process: drawing it per image dominated."""
    global _noise
    if _noise is None:
        from PIL import Image

        rng = np.random.default_rng(12345)
        half = rng.normal(0, 1, (_BANK // 2, _BANK // 2)).astype(np.float32)
        coarse = np.asarray(Image.fromarray(half).resize((_BANK, _BANK), Image.BILINEAR))[..., None]
        _noise = (coarse, rng.normal(0, 1, (_BANK, _BANK, 3)).astype(np.float32))
    return _noise


def render_photo(seed: int, index: int) -> bytes:
    """One photo-like JPEG: a smooth colour field, a few soft shapes, grain; its size is seeded."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, index])
    w = int(rng.integers(640, 1281))
    h = int(np.clip(w * rng.choice([0.5625, 0.667, 0.75, 1.0, 1.333]), 480, 1280))
    field = rng.integers(0, 256, (int(rng.integers(3, 7)), int(rng.integers(3, 7)), 3), dtype=np.uint8)
    img = Image.fromarray(field).resize((w // 2, h // 2), Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
        s = int(rng.integers(w // 40, w // 6))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x0, y0, x0 + s, y0 + int(s * rng.uniform(0.5, 1.5))], fill=colour)
        else:
            pts = [
                (x0 + int(rng.integers(-s, s)), y0 + int(rng.integers(-s, s)))
                for _ in range(int(rng.integers(3, 6)))
            ]
            draw.polygon(pts, fill=colour)
    # Drawn at half size and upsampled: soft edges, like a photo's, rather than aliased ones.
    pixels = np.asarray(img.resize((w, h), Image.BILINEAR), dtype=np.float32)
    coarse, fine = _noise_bank()
    oy, ox = int(rng.integers(0, _BANK - h + 1)), int(rng.integers(0, _BANK - w + 1))
    sigma = rng.uniform(2.5, 6.0)  # grain strength sets the JPEG size (≈50–250 kB at q90)
    pixels += sigma * coarse[oy : oy + h, ox : ox + w] + (sigma / 3) * fine[oy : oy + h, ox : ox + w]
    buf = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _render_range(args: tuple[int, list[int], str]) -> int:
    seed, indices, folder = args
    for i in indices:
        path = Path(folder) / f"{i:06d}.jpg"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(render_photo(seed, i))
        tmp.rename(path)  # a killed run leaves no half-written image in the cache
    return len(indices)


def make_corpus(n: int, seed: int, cores: int) -> list[Path]:
    """Images 0..n-1 of ``seed`` in the cache (only missing ones are rendered)."""
    folder = CACHE / f"seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i:06d}.jpg" for i in range(n)]
    missing = [i for i, p in enumerate(paths) if not p.exists()]
    if missing:
        t = time.perf_counter()
        chunks = [(seed, missing[k::cores], str(folder)) for k in range(cores)]
        with ProcessPoolExecutor(cores) as pool:
            list(pool.map(_render_range, chunks))
        print(f"corpus: rendered {len(missing)} images in {time.perf_counter() - t:.0f}s into {folder}")
    return paths


def write_metadata(paths: list[Path], base_url: str, out: Path, seed: int) -> Path:
    """DataComp-schema parquet: 32-hex uid, url, caption, original sizes, real sha256."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(seed)
    cols = ("uid", "url", "text", "original_width", "original_height", "sha256")
    rows: dict[str, list] = {k: [] for k in cols}
    for i, path in enumerate(paths):
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
        rows["uid"].append(rng.bytes(16).hex())
        rows["url"].append(f"{base_url}/{path.name}")
        rows["text"].append(f"a photo of a scene, number {i}")
        rows["original_width"].append(w)
        rows["original_height"].append(h)
        rows["sha256"].append(hashlib.sha256(data).hexdigest())
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metadata.parquet"
    pq.write_table(pa.table(rows), path)
    return path


# --- the server (a subprocess: its threads must not share a GIL with either client) ----------------------


def serve(folder: str) -> None:
    """``--serve DIR``: serve every *.jpg of DIR from memory on 127.0.0.1:<free port>; print the port."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies = {"/" + p.name: p.read_bytes() for p in Path(folder).glob("*.jpg")}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_GET(self) -> None:
            body = bodies.get(self.path.split("?")[0])  # a query names a row, not an image
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # 32+ clients connect at once; the default 5 drops SYNs (1 s stalls)

    httpd = Server(("127.0.0.1", 0), Handler)
    print(httpd.server_address[1], flush=True)
    httpd.serve_forever()


class ImageServer:
    def __init__(self, folder: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __spec__.name, "--serve", str(folder)], stdout=subprocess.PIPE, text=True
        )
        self.base_url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- (a) ours, (b) img2dataset, (c) the ceiling ---------------------------------------------------------


def bench_config(meta: Path, output: Path, overrides: dict) -> BuildConfig:
    base = merge(
        BuildConfig(),
        {
            "metadata": str(meta),
            "output": str(output),
            "download": {"allow_hosts": ["127.0.0.1"], "verify_sha256": False},
            "dedupe": {"near_duplicates": False},
            "filters": {"names": ["no_filter"]},  # the language model is no part of the figure
        },
    )
    return merge(base, overrides)


def run_ours(cfg: BuildConfig) -> dict:
    from pipeline.build import build

    events: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    res = build(cfg, log=lambda msg: events.append((time.perf_counter() - t0, msg)))
    wall = time.perf_counter() - t0
    parts = [t for t, m in events if m.startswith("  part(s) done")]
    ok = res.status_counts.get("success", 0)
    return {
        "settings": {k: getattr(cfg, k) for k in ("download_actors", "download_cpus", "part_size")}
        | {"threads_per_actor": cfg.download.threads_per_actor},
        "successes": ok,
        "status_counts": res.status_counts,
        "wall_s": wall,
        "images_per_s": ok / wall,
        "download_s": res.timings["download"],
        "download_images_per_s": ok / res.timings["download"],
        "timings_s": res.timings,
        "first_part_done_s": parts[0] if parts else None,
        "part_done_s": parts,
        "load_avg_1m": load,
    }


RUNNER = """
import json, sys, time
t0 = time.perf_counter()
import img2dataset
import_s = time.perf_counter() - t0
if __name__ == "__main__":  # the multiprocessing distributor spawns: children re-import this file
    t1 = time.perf_counter()
    img2dataset.download(**json.loads(sys.argv[1]))
    print(json.dumps({"import_s": import_s, "call_s": time.perf_counter() - t1}))
"""


def run_img2dataset(meta: Path, output: Path, processes: int, threads: int, shard_size: int) -> dict:
    """img2dataset as DataComp's download_upstream.py calls it, in a subprocess."""
    args = dict(
        url_list=str(meta),
        output_folder=str(output),
        input_format="parquet",
        url_col="url",
        caption_col="text",
        save_additional_columns=["uid"],
        image_size=512,
        resize_mode="keep_ratio_largest",
        resize_only_if_bigger=True,
        encode_quality=95,
        output_format="webdataset",
        processes_count=processes,
        thread_count=threads,
        number_sample_per_shard=shard_size,
        distributor="multiprocessing",
        timeout=10,
        retries=2,
        enable_wandb=False,
    )
    runner = output.parent / "img2dataset_runner.py"
    runner.write_text(RUNNER)
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(runner), json.dumps(args)], env=env, capture_output=True, text=True, timeout=600
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"img2dataset failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    times = json.loads(proc.stdout.strip().splitlines()[-1])
    ok = sum(json.loads(Path(p).read_text())["successes"] for p in glob.glob(f"{output}/*_stats.json"))
    return {
        "settings": {k: args[k] for k in ("processes_count", "thread_count", "number_sample_per_shard")},
        "successes": ok,
        "call_s": times["call_s"],
        "images_per_s": ok / times["call_s"],
        "import_s": times["import_s"],
        "subprocess_wall_s": wall,
        "images_per_s_with_import": ok / wall,
        "load_avg_1m": load,
    }


def run_ceiling(paths: list[Path], n: int) -> dict:
    """process_image over ``n`` of the images (evenly spaced), bytes in memory, one thread."""
    import cv2

    from pipeline.download.resize import process_image

    cv2.setNumThreads(1)
    step = max(1, len(paths) // n)
    blobs = [p.read_bytes() for p in paths[::step][:n]]
    for data in blobs[:5]:  # first calls pay lazy imports (cv2, simplejpeg)
        process_image(data)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    for data in blobs:
        res = process_image(data, image_size=512, jpeg_quality=95)
        assert res.status == "success", res.error
    dt = time.perf_counter() - t0
    kb = sum(map(len, blobs)) / len(blobs) / 1e3
    return {"images": len(blobs), "seconds": dt, "images_per_s": len(blobs) / dt, "mean_kb": kb, "load_avg_1m": load}  # fmt: skip


# --- main -----------------------------------------------------------------------------------------------


def summarise(rounds: list[dict], names: list[str]) -> dict:
    """Per-round ratios against img2dataset in the same round, then their median and min–max."""
    out = {}
    for name in names:
        whole = [r[name]["images_per_s"] / r["img2dataset"]["images_per_s"] for r in rounds]
        dl = [r[name]["download_images_per_s"] / r["img2dataset"]["images_per_s"] for r in rounds]
        out[name] = {
            "a_over_b": spread(whole),
            "download_over_b": spread(dl),
            "images_per_s": spread([r[name]["images_per_s"] for r in rounds]),
            "download_images_per_s": spread([r[name]["download_images_per_s"] for r in rounds]),
        }
    out["img2dataset"] = {"images_per_s": spread([r["img2dataset"]["images_per_s"] for r in rounds])}
    return out


def print_report(results: dict, n: int, cores: int) -> None:
    from jobs.common import print_table

    c = results["ceiling"]
    s = results["summary"]
    fmt = lambda d: f"{d['median']:.2f} ({d['min']:.2f}–{d['max']:.2f})"  # noqa: E731
    loads = [
        x for r in results["rounds"] for x in (v["load_avg_1m"] for v in r.values() if isinstance(v, dict))
    ]
    table = [
        (
            "(c) process_image, 1 thread",
            f"{c['images_per_s']:.1f}",
            "",
            "",
            load_note(c["load_avg_1m"], cores),
        )
    ]
    b = s["img2dataset"]["images_per_s"]

    def loads_of(name: str) -> str:
        ls = [r[name]["load_avg_1m"] for r in results["rounds"]]
        return f"load {min(ls):.1f}–{max(ls):.1f}" + (" (> cores!)" if max(ls) > cores else "")

    table.append(("(b) img2dataset.download", fmt(b), "1.00", "1.00", loads_of("img2dataset")))
    for name in results["contenders"]:
        table.append((f"(a) {name} build()", fmt(s[name]["images_per_s"]), fmt(s[name]["a_over_b"]),
                      fmt(s[name]["download_over_b"]), loads_of(name)))  # fmt: skip
    headers = ("what", "images/s median (min–max)", "÷ (b), whole", "÷ (b), download phase", "load")
    rounds = len(results["rounds"])
    print_table(f"build throughput: {n} images, {cores} cores, {rounds} alternated rounds", table, headers)
    for i, r in enumerate(results["rounds"]):
        line = "; ".join(
            f"{k} {v['images_per_s']:.1f}/s {load_note(v['load_avg_1m'], cores)}"
            for k, v in r.items()
            if isinstance(v, dict)
        )
        print(f"  round {i + 1}: {line}")
    print(f"1-min load over the runs: {min(loads):.1f}–{max(loads):.1f} on {cores} cores")
    if max(loads) > cores:
        print(
            f"WARNING: load exceeded the core count ({max(loads):.1f} > {cores}): these ratios are not evidence"
        )


def settle(cores: int, max_wait_s: float) -> None:
    """Wait (up to ``max_wait_s``) until the 1-min load falls under the core count: a contender's own threads
    keep the average up for a minute or two after it ends, and the next one must not start on that."""
    t0 = time.perf_counter()
    while os.getloadavg()[0] >= cores and time.perf_counter() - t0 < max_wait_s:
        time.sleep(2.0)


def run_round(
    meta: Path, work: Path, i: int, cores: int, contenders: dict[str, dict], settle_s: float = 0.0
) -> dict:
    """One round: img2dataset, then each of our contenders, each in its own cold Ray session."""
    import ray

    from jobs.common import init_ray

    defaults = bench_config(meta, work / "unused", {})
    threads, shard = defaults.download.threads_per_actor, defaults.part_size
    settle(cores, settle_s)
    out = {"img2dataset": run_img2dataset(meta, work / f"img2dataset{i}", cores, threads, shard)}
    print(f"  (b) img2dataset: {out['img2dataset']['images_per_s']:.1f} images/s, "
          f"{load_note(out['img2dataset']['load_avg_1m'], cores)}")  # fmt: skip
    for name, overrides in contenders.items():
        # Ray is started for each of our runs and stopped after it: img2dataset never shares the CPUs with
        # an idle Ray, and every build() is cold, as a user's one build is (ray.init is reported apart).
        settle(cores, settle_s)
        t = time.perf_counter()
        init_ray(num_cpus=cores)
        ray_init = time.perf_counter() - t
        try:
            out[name] = run_ours(bench_config(meta, work / f"{name}{i}", overrides)) | {
                "overrides": overrides,
                "ray_init_s": ray_init,
            }
        finally:
            ray.shutdown()
        print(f"  (a) {name}: {out[name]['images_per_s']:.1f} images/s, "
              f"{load_note(out[name]['load_avg_1m'], cores)}")  # fmt: skip
        shutil.rmtree(work / f"{name}{i}", ignore_errors=True)
    shutil.rmtree(work / f"img2dataset{i}", ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="images in the corpus")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (b, a[, tuned]) — at least 3")
    p.add_argument("--ceiling-n", type=int, default=400, help="images timed for the ceiling (c)")
    p.add_argument("--tuned", action="append", default=None, metavar="KEY=VALUE",
                   help="BuildConfig override for a second contender of ours, repeatable (default: none)")  # fmt: skip
    p.add_argument("--settle-s", type=float, default=150.0,
                   help="before each contender, wait up to this long for the 1-min load to fall under the cores")  # fmt: skip
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--allow-loaded", action="store_true",
                   help=f"write {DEFAULT_OUT.name} even when the load exceeded the core count")  # fmt: skip
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    if args.rounds < 3:
        print(f"note: --rounds {args.rounds} < 3: a smoke run, not a measurement")

    cores = args.cores
    contenders = {"ours_default": {}}
    if args.tuned is not None:
        contenders["ours_tuned"] = parse_set(args.tuned)
    paths = make_corpus(args.n, args.seed, cores)
    work = Path(tempfile.mkdtemp(prefix="bench-build-"))
    server = ImageServer(paths[0].parent)
    results: dict = {"contenders": list(contenders), "rounds": []}
    try:
        meta = write_metadata(paths, server.base_url, work / "metadata", args.seed)
        print(
            f"corpus: {args.n} JPEGs at {server.base_url}; {cores} cores; {load_note(os.getloadavg()[0], cores)}"
        )
        results["ceiling"] = run_ceiling(paths, args.ceiling_n)
        print(f"(c) ceiling: {results['ceiling']['images_per_s']:.1f} images/s on one core")
        for i in range(args.rounds):
            print(f"round {i + 1}/{args.rounds}")
            results["rounds"].append(run_round(meta, work, i, cores, contenders, args.settle_s))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    results["summary"] = summarise(results["rounds"], list(contenders))
    print_report(results, args.n, cores)
    loads = [v["load_avg_1m"] for r in results["rounds"] for v in r.values()]
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": cores,
        "n": args.n,
        "seed": args.seed,
        "goals": {"a_over_b": 1.2, "download_over_b": 1.4},
        "max_load_avg_1m": max(loads),
        "loaded": max(loads) > cores,
        **results,
    }
    out = Path(args.out)
    if report["loaded"] and out.resolve() == DEFAULT_OUT.resolve() and not args.allow_loaded:
        out = Path(tempfile.gettempdir()) / DEFAULT_OUT.name
        print(f"loaded machine: not overwriting {DEFAULT_OUT} (pass --allow-loaded to force)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
