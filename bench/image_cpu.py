"""Per-image CPU of the download worker's image path, before/after, and the cost in quality of the JPEG
DCT-domain scale-down (``DownloadConfig.jpeg_dct_margin``).

``cpu``      the per-stage thread-CPU profile of bench/profile_build.py (``--what stages``, ours only) run
             in fresh processes, alternating a baseline tree (``git archive --rev``, default ``main``) with
             this tree at each ``--margins`` value, ``--rounds`` rounds (A B C A B C …). Per stage: the
             median ms and min–max over rounds; the whole-call ratio to the baseline per round (same minute,
             same load), median and min–max. The 1-min load is recorded beside every run.
``quality``  for each margin, the 512-px output pixels (before the JPEG encode) against the full decode
             (margin 0) on bench/build_throughput.py's corpus (640–1280 px) and on larger photo-like
             JPEGs (2000–4000 px, rendered here): PSNR over all pixels, per-image minimum PSNR, mean and
             max absolute difference, and the per-image CPU of ``process_image`` at that margin.
             And a worst case: per-pixel luma noise at 2100×1575 and 4000×3000 (``render_detail``).
``phash``    the new pHash against imagehash's on the corpus outputs (share of images > the dedupe
             threshold apart) and the per-image cost of both.

Writes bench/results/image_cpu.json. Usage: python -m bench.image_cpu [--what cpu,quality,phash]
[--rounds 3] [--n 300] [--margins 3,1] [--rev main]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import build_throughput as BT  # the corpus

ROOT = Path(__file__).resolve().parents[1]

OUT = ROOT / "bench" / "results" / "image_cpu.json"
LARGE_CACHE = BT.CACHE / "large"


def _load() -> float:
    return round(os.getloadavg()[0], 2)


# --- cpu: alternate the baseline tree and this one ----------------------------------------------------


def _baseline_tree(rev: str) -> Path:
    dest = Path(tempfile.mkdtemp(prefix="image-cpu-baseline-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "pipeline", "bench"], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _stages_run(tree: Path, n: int, margin: float | None) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    # the measured tree is on PYTHONPATH and the cwd, so -m imports its bench/
    cmd = [sys.executable, "-m", "bench.profile_build", "--what", "stages", "--n", str(n)]
    cmd += ["--out", str(out)]
    if margin is not None:  # this tree: ours only, at the margin; the baseline has no such flags
        cmd += ["--dct-margin", str(margin), "--no-img2dataset"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    load = _load()
    subprocess.run(cmd, check=True, env=env, cwd=tree, capture_output=True)
    res = json.loads(out.read_text())["stages"]
    out.unlink()
    return {"load_avg_1m": load, "ours_ms": res["ours_ms"], "dct_factor_counts": res["dct_factor_counts"]}


def bench_cpu(n: int, rounds: int, margins: list[float], rev: str) -> dict:
    base = _baseline_tree(rev)
    contenders = [("baseline", base, None)] + [(f"margin {m:g}", ROOT, m) for m in margins]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in contenders}
    for r in range(rounds):
        for name, tree, margin in contenders:
            runs[name].append(_stages_run(tree, n, margin))
            run = runs[name][-1]
            whole = [v for k, v in run["ours_ms"].items() if k.startswith("process_image")][0]
            print(f"round {r + 1} {name:>10}: process_image {whole:.2f} ms/image, load {run['load_avg_1m']}")
    summary = {}
    for name, rs in runs.items():
        stages = {k: [x["ours_ms"][k] for x in rs] for k in rs[0]["ours_ms"]}
        summary[name] = {k: _med(v) for k, v in stages.items()}
        summary[name]["dct_factor_counts"] = rs[0]["dct_factor_counts"]
        summary[name]["loads"] = [x["load_avg_1m"] for x in rs]
    whole = {name: [[v for k, v in x["ours_ms"].items() if k.startswith("process_image")][0] for x in rs]
             for name, rs in runs.items()}  # fmt: skip
    ratios = {
        name: _med([a / b for a, b in zip(w, whole["baseline"], strict=True)]) for name, w in whole.items()
    }
    return {"images": n, "rounds": rounds, "baseline_rev": rev, "stages_ms": summary,
            "process_image_ratio_to_baseline": ratios, "runs": runs}  # fmt: skip


def _med(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


# --- quality of the DCT-domain scale-down --------------------------------------------------------------


def render_large(seed: int, index: int) -> bytes:
    """A photo-like JPEG of 2000–4000 px: colour field, soft shapes, grain drawn at full resolution."""
    import cv2

    rng = np.random.default_rng([seed, index, 4000])
    w = int(rng.integers(2000, 4001))
    h = int(w * rng.choice([0.5625, 0.667, 0.75, 1.0, 1.333]))
    field = rng.integers(0, 256, (int(rng.integers(3, 8)), int(rng.integers(3, 8)), 3), dtype=np.uint8)
    img = cv2.resize(field, (w, h), interpolation=cv2.INTER_CUBIC).astype(np.float32)
    for _ in range(int(rng.integers(6, 16))):
        mask = np.zeros((h, w), np.float32)
        pts = rng.integers(0, [w, h], (int(rng.integers(3, 7)), 2)).astype(np.int32)
        cv2.fillPoly(mask, [pts], 1.0) if rng.random() < 0.5 else cv2.circle(
            mask, tuple(int(v) for v in pts[0]), int(rng.integers(w // 40, w // 6)), 1.0, -1
        )
        mask = cv2.GaussianBlur(mask, (0, 0), 1.5)[..., None]
        img = img * (1 - mask) + mask * rng.integers(0, 256, 3).astype(np.float32)
    sigma = rng.uniform(2.5, 6.0)
    coarse = cv2.resize(rng.normal(0, 1, (h // 2, w // 2)).astype(np.float32), (w, h))[..., None]
    img += sigma * coarse + (sigma / 3) * rng.normal(0, 1, (h, w, 3)).astype(np.float32)
    ok, buf = cv2.imencode(".jpg", np.clip(img, 0, 255).astype(np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 90])
    return buf.tobytes()


def render_detail(index: int) -> bytes:
    """Worst case for the scale-down: a smooth base plus luma noise in every pixel (detail up to the
    sampling limit, as fine foliage or fabric), 2100×1575 or 4000×3000, JPEG q90."""
    import cv2

    rng = np.random.default_rng([index, 2100])
    w, h = ((2100, 1575), (4000, 3000))[index % 2]
    base = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    img = cv2.resize(base, (w, h), interpolation=cv2.INTER_CUBIC).astype(np.float32)
    img += rng.normal(0, (8, 30)[index // 2 % 2], (h, w, 1)).astype(np.float32)
    ok, buf = cv2.imencode(".jpg", np.clip(img, 0, 255).astype(np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 90])
    return buf.tobytes()


def large_corpus(n: int) -> list[bytes]:
    LARGE_CACHE.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        path = LARGE_CACHE / f"{i:04d}.jpg"
        if not path.exists():
            path.with_suffix(".tmp").write_bytes(render_large(0, i))
            path.with_suffix(".tmp").rename(path)
        out.append(path.read_bytes())
    return out


def _pixels(data: bytes, margin: float) -> np.ndarray:
    from PIL import Image

    from pipeline.download import resize as R

    im = Image.open(io.BytesIO(data))
    return R._decode_resized(data, im, *R.output_size(*im.size, 512), margin)[0]


def _quality(blobs: list[bytes], margins: list[float]) -> dict:
    from pipeline.download import resize as R
    from pipeline.download.resize import process_image

    full = [_pixels(b, 0).astype(np.int16) for b in blobs]
    out = {}
    for m in [0.0, *margins]:
        t = time.thread_time()
        for b in blobs:
            process_image(b, dct_margin=m)
        cpu = 1e3 * (time.thread_time() - t) / len(blobs)
        diffs = [np.abs(_pixels(b, m).astype(np.int16) - f) for b, f in zip(blobs, full, strict=True)]
        mse = [float(np.mean(d.astype(np.float64) ** 2)) for d in diffs]
        pooled = float(np.mean(mse))
        out[f"{m:g}"] = {
            "process_image_cpu_ms": round(cpu, 3),
            "load_avg_1m": _load(),
            "images_scaled_down": sum(d.size and 1 for d, x in zip(diffs, mse, strict=True) if x > 0),
            "psnr_db": None if pooled == 0 else round(10 * math.log10(255**2 / pooled), 2),
            "min_image_psnr_db": None if max(mse) == 0 else round(10 * math.log10(255**2 / max(mse)), 2),
            "mean_abs_diff": round(float(np.mean([d.mean() for d in diffs])), 4),
            "max_abs_diff": int(max(d.max() for d in diffs)),
        }
        print(f"margin {m:g}: {out[f'{m:g}']}")
    del R
    return out


def bench_quality(n: int, n_large: int, margins: list[float]) -> dict:
    import cv2

    cv2.setNumThreads(1)
    corpus = [p.read_bytes() for p in BT.make_corpus(n, 0, os.cpu_count() or 1)]
    return {"corpus_640_1280": {"images": len(corpus), **_quality(corpus, margins)},
            "large_2000_4000": {"images": n_large, **_quality(large_corpus(n_large), margins)},
            "fine_detail_2100_4000": {"images": 4, **_quality([render_detail(i) for i in range(4)], margins)}}  # fmt: skip


# --- pHash: new against imagehash on the same output pixels ----------------------------------------------


def bench_phash(n: int) -> dict:
    import cv2
    import imagehash
    from PIL import Image

    from pipeline.dedup.phash import hamming, phash64

    cv2.setNumThreads(1)
    pixels = [_pixels(p.read_bytes(), 3.0) for p in BT.make_corpus(n, 0, os.cpu_count() or 1)]
    rgb = [Image.fromarray(np.ascontiguousarray(p[..., ::-1])) for p in pixels]

    def old(im: Image.Image) -> int:
        return int(np.packbits(imagehash.phash(im).hash.ravel()).view(">i8")[0])

    t = time.thread_time()
    new_h = np.array([phash64(p, "BGR") for p in pixels])
    new_ms = 1e3 * (time.thread_time() - t) / n
    t = time.thread_time()
    old_h = np.array([old(im) for im in rgb])
    old_ms = 1e3 * (time.thread_time() - t) / n
    d = hamming(new_h, old_h)
    return {"images": n, "load_avg_1m": _load(), "new_ms": round(new_ms, 3), "imagehash_ms": round(old_ms, 3),
            "bits_apart": {str(k): int((d == k).sum()) for k in range(int(d.max()) + 1)},
            "share_over_threshold_4": float((d > 4).mean())}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", default="cpu,quality,phash")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--n-large", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--margins", default="3,1")
    p.add_argument("--rev", default="main")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    margins = [float(m) for m in args.margins.split(",")]
    what = set(args.what.split(","))
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    res.update({"cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    if "cpu" in what:
        res["cpu"] = bench_cpu(args.n, args.rounds, margins, args.rev)
    if "quality" in what:
        res["quality"] = bench_quality(args.n, args.n_large, sorted({*margins, 2.0, 1.0}))
    if "phash" in what:
        res["phash"] = bench_phash(args.n)
        print(res["phash"])
    loads = [x for x in (os.getloadavg()[0],)]
    if max(loads) > (os.cpu_count() or 1):
        print(
            f"WARNING: load {max(loads):.1f} exceeds the {os.cpu_count()} cores: ratios hold, times inflate"
        )
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
