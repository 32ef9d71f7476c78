"""Peak memory and time of one train step against the number of micro-batches k, on the CPU; and the
activation memory per sample of each preset's model counted on the meta device.

1. The trainer's own step (``setup_state`` + ``train_step``, ProLIP with masked variants, AdamW) on one
   local batch of ``--batch`` samples with ``scaling.max_local_batch = batch / k`` for k in ``--ks``: peak
   resident memory during the step minus the resident memory just before it (a thread samples
   /proc/self/statm every 0.5 ms; glibc's free memory handed back by ``malloc_trim`` first; AdamW's moments
   already allocated by a first step), and its wall time. One fresh subprocess per (k, repeat), the ks
   alternated, ``--repeats`` (>= 3) each: median (min–max), load average beside them. The step's gradients
   (one float32 copy of the weights) are part of every peak: accumulation cannot go below them.
2. Bytes autograd keeps per sample (``training.model.flops.saved_bytes_per_sample``) for every preset's
   model, in float32 and with bf16 towers, against the CPU-measured slope of the peak over the micro-batch
   size for ``--model`` (a check of the count).

Writes bench/results/accumulation_memory.json. Usage: python -m bench.accumulation_memory [--batch 128]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bench.alternate import results_path
from training.config import TRAIN_PRESETS, OptimConfig, TrainConfig, WorkersConfig
from training.losses.objectives import ProLIPLossConfig
from training.model.config import MODEL_CONFIGS
from training.model.flops import saved_bytes_per_sample
from training.train.step import setup_state, train_step

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_OUT = ROOT / "bench" / "results" / "accumulation_memory.json"
TOKENIZER = SimpleNamespace(vocab_size=4096, pad_id=0, end_id=1, mask_id=2, start_id=None)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _batch(n: int, size: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, TOKENIZER.vocab_size, (n, length), generator=g)
    tokens[:, -1] = TOKENIZER.end_id
    patches = (size // MODEL_CONFIGS["tiny"].patch_size) ** 2
    return {
        "images": torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=g),
        "tokens": tokens,
        "masked_tokens": torch.where(torch.rand(n, length, generator=g) < 0.75, TOKENIZER.mask_id, tokens),
        "keep_idx": torch.stack(
            [torch.randperm(patches, generator=g)[: patches // 4].sort().values for _ in range(n)]
        ),
        "masked_index": torch.arange(0, n, 8),  # 1 in 8 rows, ProLIP's 12.5%
    }


def child(model: str, batch: int, k: int, length: int) -> dict:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    cfg = TrainConfig(
        model=model,
        global_batch_size=batch,
        samples_seen=batch * 4,
        loss=ProLIPLossConfig(),
        optim=OptimConfig(warmup_steps=1),
        scaling=WorkersConfig(num_workers=1, max_local_batch=-(-batch // k)),
    )
    state = setup_state(cfg, TOKENIZER, torch.device("cpu"), 0)
    size = state.mcfg.image_size
    train_step(state, _batch(batch, size, length, 0))  # AdamW's moments allocated
    step_batch = _batch(batch, size, length, 1)
    state.opt.zero_grad(set_to_none=True)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before, peak, running = _rss(), [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    watcher = threading.Thread(target=sample)
    watcher.start()
    t0 = time.perf_counter()
    train_step(state, step_batch)
    wall = time.perf_counter() - t0
    running[0] = False
    watcher.join()
    grads = sum(p.numel() * p.element_size() for p in state.module.parameters())
    return {
        "k": state.micro,
        "peak_mib": (max(peak[0], _rss()) - before) / 2**20,
        "wall_s": wall,
        "grad_mib": grads / 2**20,
        "load": os.getloadavg()[0],
    }


def counted() -> dict:
    out = {}
    for name, preset in TRAIN_PRESETS.items():
        spec = preset.loss
        mcfg = MODEL_CONFIGS[preset.model]
        if spec.probabilistic:
            mcfg = dataclasses.replace(mcfg, probabilistic=True, text_pool="cls")
        out[name] = {
            "model": preset.model,
            "loss": preset.loss.name,
            **{
                f"{label}_mib_per_sample": saved_bytes_per_sample(mcfg, spec.uses_masked, dtype=dt) / 2**20
                for label, dt in (("float32", torch.float32), ("bf16", torch.bfloat16))
            },
        }
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--length", type=int, default=32, help="caption tokens")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--allow-loaded", action="store_true")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.batch, args.child, args.length)))
        return
    if args.repeats < 3:
        raise SystemExit("--repeats must be >= 3")
    runs: dict[int, list[dict]] = {k: [] for k in args.ks}
    for _ in range(args.repeats):
        for k in args.ks:
            cmd = [
                sys.executable,
                "-m",
                __spec__.name,
                "--child",
                str(k),
                "--model",
                args.model,
                "--batch",
                str(args.batch),
            ]
            cmd += ["--length", str(args.length)]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                raise SystemExit(f"k={k} failed:\n{out.stderr[-3000:]}")
            runs[k].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for k in args.ks:
        peaks = [r["peak_mib"] for r in runs[k]]
        rows.append(
            {
                "k": k,
                "micro_batch": -(-args.batch // k),
                "peak_mib": _spread(peaks),
                "wall_s": _spread([r["wall_s"] for r in runs[k]]),
                "runs": runs[k],
            }
        )
    base = rows[0]
    for r in rows:
        r["peak_vs_k1"] = r["peak_mib"]["median"] / base["peak_mib"]["median"]
        r["wall_vs_k1"] = r["wall_s"]["median"] / base["wall_s"]["median"]
    # The slope of the peak over the micro-batch size: activation memory per sample, measured.
    xs = np.array([r["micro_batch"] for r in rows], dtype=float)
    ys = np.array([r["peak_mib"]["median"] for r in rows])
    slope = float(np.polyfit(xs, ys, 1)[0])
    mcfg = dataclasses.replace(MODEL_CONFIGS[args.model], probabilistic=True, text_pool="cls")
    count = saved_bytes_per_sample(mcfg, True, text_length=args.length) / 2**20
    loads = [r["load"] for k in args.ks for r in runs[k]]
    cores = os.cpu_count() or 1
    result = {
        "benchmark": "accumulation_memory",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"cpu {platform.machine()}, {cores} cores, torch threads 1",
        "torch": torch.__version__,
        "model": args.model,
        "batch": args.batch,
        "caption_tokens": args.length,
        "method": "peak RSS during one train_step (sampled every 0.5 ms) minus RSS before it, after malloc_trim "
        "and a first step; one subprocess per (k, repeat), ks alternated; median (min-max)",
        "grad_mib": base["runs"][0]["grad_mib"],
        "rows": rows,
        "measured_mib_per_sample": slope,
        "counted_mib_per_sample_float32": count,
        "presets_counted": counted(),
        "max_load_avg_1m": max(loads),
    }
    for r in rows:
        print(
            f"k={r['k']} micro={r['micro_batch']}: peak {r['peak_mib']['median']:.1f} MiB "
            f"({r['peak_mib']['min']:.1f}-{r['peak_mib']['max']:.1f}), x{r['peak_vs_k1']:.2f}; "
            f"step {r['wall_s']['median']:.2f} s, x{r['wall_vs_k1']:.2f}"
        )
    print(
        f"per sample: measured {slope:.2f} MiB, counted {count:.2f} MiB; grads {result['grad_mib']:.1f} MiB"
    )
    print(json.dumps(result["presets_counted"], indent=1))
    path = results_path(args.out, DEFAULT_OUT, max(loads), cores, args.allow_loaded)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
