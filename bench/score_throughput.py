"""CSD scoring throughput of pool pairs, as a ratio measured in one run.

1. CPU, ``tiny`` model (random init: throughput does not depend on the weights), ``--n`` demo pictures
   (tests/fixtures/train_shards.py, ``--px`` px JPEGs) with their captions, in memory:
     end_to_end  the scoring ``Encoder`` called in-process: decode → both towers → CSD, batches of ``--batch``
     forward     the ceiling: both towers only, on pre-decoded pixels and pre-tokenized captions, same
                 batch size and torch threads
   Ratio: end_to_end ÷ forward (how much of the model's speed survives decoding and scoring), by wall
   time (runs interleaved) and by this process's CPU time (robust to other load on a shared machine).
   Also the decode and tokenize shares, and (``--ray``) ``score_shards`` on a local Ray with 1 actor,
   wall time including actor start-up and the parquet write.
2. GPU (when CUDA is available): ViT-B-32 (deterministic, the DataComp small-track scorer) and
   ViT-B-16-ProLIP, bf16 autocast, 224 px pictures: forward-only pairs/s and in-process end-to-end
   pairs/s (single-process decode). Goal ≥ 10k pairs/s/GPU for ViT-B/32. Otherwise "no GPU" is recorded.
Writes bench/results/score_throughput.json. Usage: python -m bench.score_throughput [--n 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.ingest.tokenizer import train_tokenizer
from tests.fixtures.checkpoints import DEMO_CAPTIONS, make_checkpoint
from tests.fixtures.train_shards import demo_samples
from training.infer.encode import Encoder
from training.infer.scoring import score_columns
from training.model.checkpoint import save_checkpoint
from training.model.config import model_config
from training.model.two_tower import ProLIP

ROOT = Path(__file__).resolve().parents[1]


def _batches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _interleaved(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall s, process CPU s) per function, runs interleaved A B A B … after one warm-up each.

    On a shared machine wall time swings with other load; interleaving exposes both cases to the same
    swings, and CPU time (this process, all its threads) barely depends on them.
    """
    for fn in fns.values():
        fn()
    walls: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            walls[name].append(time.perf_counter() - w0)
            cpus[name].append(time.process_time() - c0)
    return {k: (statistics.median(walls[k]), statistics.median(cpus[k])) for k in fns}


def measure(scorer: Encoder, samples: list[dict], batch: int, repeats: int) -> dict[str, float]:
    n = len(samples)
    jpgs = np.array([s["jpg"] for s in samples], dtype=object)
    txts = np.array([s["txt"] for s in samples], dtype=object)
    uids = np.array([s["__key__"] for s in samples], dtype=object)
    parts = _batches(n, batch)
    enc = scorer

    def end_to_end() -> None:
        for p in parts:
            scorer({"uid": uids[p], "jpg": jpgs[p], "txt": txts[p]})

    pixels = [enc.preprocess(list(jpgs[p]))[0] for p in parts]
    tokens = [enc.tokenizer.encode_batch(list(txts[p]), enc.config.context_length) for p in parts]

    def forward() -> None:
        for px, tok in zip(pixels, tokens, strict=True):
            scorer.encode_pixels(px)
            scorer.encode_tokens(tok)
        if scorer.device.type == "cuda":
            torch.cuda.synchronize()

    def decode() -> None:
        for p in parts:
            enc.preprocess(list(jpgs[p]))

    t = _interleaved({"e2e": end_to_end, "fwd": forward}, repeats)
    d = _interleaved({"decode": decode}, 1)["decode"]
    out = {
        "end_to_end_pairs_per_s": n / t["e2e"][0],
        "forward_pairs_per_s": n / t["fwd"][0],
        "ratio_end_to_end_over_forward": t["fwd"][0] / t["e2e"][0],
        "end_to_end_pairs_per_cpu_s": n / t["e2e"][1],
        "forward_pairs_per_cpu_s": n / t["fwd"][1],
        "ratio_by_cpu_time": t["fwd"][1] / t["e2e"][1],
        "decode_pairs_per_s": n / d[0],
        "decode_share_of_end_to_end_cpu": d[1] / t["e2e"][1],
    }
    if scorer.device.type == "cuda":  # CPU time means little when the work is on the GPU
        out = {k: v for k, v in out.items() if "cpu" not in k}
    return out


def ray_path(samples: list[dict], ckpt: str, batch: int, workdir: str) -> dict[str, float]:
    import ray

    from pipeline.shards.writer import write_shard
    from training.infer.batch_inference import score_shards

    shard_dir = os.path.join(workdir, "shards")
    os.makedirs(shard_dir)
    per = 500
    for i in range(0, len(samples), per):
        write_shard(os.path.join(shard_dir, f"{i // per:08d}.tar"), samples[i : i + per])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        res = score_shards(shard_dir, ckpt, os.path.join(workdir, "scores.parquet"), batch_size=batch)
    finally:
        ray.shutdown()
    return {"rows": res.n_rows, "wall_s": res.wall_s, "pairs_per_s": res.pairs_per_s}


def gpu_case(name: str, n: int, batch: int, repeats: int, workdir: str) -> dict[str, float | str]:
    tok = train_tokenizer(DEMO_CAPTIONS * 4, vocab_size=512)
    cfg = model_config(name, vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    ckpt = str(save_checkpoint(os.path.join(workdir, name), ProLIP(cfg), cfg, tok, {"loss": name}))
    # bf16 autocast on CUDA; JPEG decoding split over every core of the machine
    scorer = Encoder(
        ckpt, device="cuda", batch_size=batch, decode_threads=os.cpu_count() or 1, output=score_columns
    )
    samples = demo_samples(n, size=cfg.image_size, seed=1)
    return {"model": name, "batch": batch, **measure(scorer, samples, batch, repeats)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--px", type=int, default=128, help="JPEG side of the demo pictures (CPU part)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both CPU measurements")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ray", action="store_true", help="also time score_shards on a local Ray")
    ap.add_argument("--gpu-n", type=int, default=8192)
    ap.add_argument("--gpu-batch", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "score_throughput.json"))
    args = ap.parse_args()

    samples = demo_samples(args.n, size=args.px, seed=1)
    results: dict = {
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "params": {k: v for k, v in vars(args).items() if k != "out"},
    }
    with tempfile.TemporaryDirectory() as workdir:
        ckpt = make_checkpoint(os.path.join(workdir, "tiny"), probabilistic=True)
        scorer = Encoder(ckpt, batch_size=args.batch, threads=args.threads, output=score_columns)
        cpu = measure(scorer, samples, args.batch, args.repeats)
        results["cpu_tiny"] = cpu
        rows = [("cpu tiny", k, v) for k, v in cpu.items()]
        if args.ray:
            results["cpu_tiny_ray_1_actor"] = ray_path(samples, ckpt, args.batch, workdir)
            rows += [("ray 1 actor", k, v) for k, v in results["cpu_tiny_ray_1_actor"].items()]
        if torch.cuda.is_available():
            results["gpu"] = {"device": torch.cuda.get_device_name(0), "cases": []}
            for name in ("ViT-B-32", "ViT-B-16-ProLIP"):
                try:
                    case = gpu_case(name, args.gpu_n, args.gpu_batch, args.repeats, workdir)
                except Exception as exc:  # record and go on: one model failing must not lose the other
                    case = {"model": name, "error": f"{type(exc).__name__}: {exc}"}
                results["gpu"]["cases"].append(case)
                rows += [(f"gpu {name}", k, v) for k, v in case.items() if k != "model"]
        else:
            results["gpu"] = "no GPU"

    print(f"\n{'case':<22}{'metric':<34}{'value':>12}")
    for case, metric, value in rows:
        shown = f"{value:12.3f}" if isinstance(value, float) else f"{value!s:>12}"
        print(f"{case:<22}{metric:<34}{shown}")
    print(
        f"\nend-to-end ÷ forward-only (CPU tiny): {cpu['ratio_end_to_end_over_forward']:.3f} by wall time, "
        f"{cpu['ratio_by_cpu_time']:.3f} by CPU time"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
