"""ProLIP step ÷ CLIP step through the trainer's own ``setup_state``/``train_step``, and FLOPs per sample.

For each model (``ViT-B-32``, datacomp-small's; ``tiny``, the CPU tests'), two single-process train states
built by ``training.train.step.setup_state`` exactly as a Ray Train worker builds its own: ``loss.name=
prolip`` on the probabilistic towers (UNC tokens, σ heads, masked variants of 12.5% of the batch: their
images with 25% of the patches and their captions through the towers again) and ``loss.name=clip`` on the
deterministic towers. Each round runs one ``train_step`` of each in turn (bench/alternate.py), on the batch
the collate step would hand over (uint8 crops, captions of 8–30 tokens trimmed to the longest, masked
variants for ProLIP). Ratio: ProLIP ÷ CLIP step time per round, median (min–max) over ``--rounds`` with the
load average; process CPU time (and its user and kernel parts, with the page faults) and wall time.
``--keep-memory`` runs both with glibc keeping the memory it frees, as a GPU's caching allocator does: on
CPU the kernel time of faulting freshly unmapped gradient buffers in again lands on whichever model's peak
crosses glibc's thresholds. ``--warmup N`` untimed steps of each first (default 2): the kept heap needs a
few more steps to stop growing.

Beside it, the FLOPs per sample of forward + backward counted on the meta device
(training/model/flops.py) for every preset model: the ratio a GPU would see when compute-bound.

Writes bench/results/train_step_ratio.json. Usage: python -m bench.train_step_ratio [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bench.alternate import MIN_ROUNDS, alternate, loads_note, ratios, results_path, times
from pipeline.ingest.transforms import MaskedVariants, TrainCollate
from training.config import DataConfig, OptimConfig, TrainConfig
from training.model.config import model_config, objective_model_config
from training.model.flops import samples_per_s, train_flops_per_sample
from training.train.step import setup_state, train_step

ROOT = Path(__file__).resolve().parents[1]

RESULT = ROOT / "bench" / "results" / "train_step_ratio.json"
# glibc's settings that keep freed memory in the process: no mmap'd blocks to unmap, no trimming of the heap.
KEEP_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
CASES = {"ViT-B-32": 32, "tiny": 64}  # model → batch on a CPU (4 and 8 masked variants)
PRESET_MODELS = {"datacomp-small": ("ViT-B-32", 49410), "prolip-b16": ("ViT-B-16-ProLIP", 32001)}
TOK = SimpleNamespace(vocab_size=49410, pad_id=49408, end_id=49407, mask_id=49409, start_id=49406)


def collated(model: str, batch: int, masked: bool, seed: int = 0) -> dict:
    mcfg = model_config(model)
    vocab = TOK.vocab_size - 4  # ordinary tokens; the last four ids are the special ones
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 31, batch)
    tokens = np.full((batch, mcfg.context_length), TOK.pad_id, np.int64)
    for i, n in enumerate(np.minimum(lengths, mcfg.context_length - 1)):
        tokens[i, :n] = rng.integers(0, vocab, n)
        tokens[i, n] = TOK.end_id
    raw = {
        "key": np.array([f"{seed:016x}{i:016x}" for i in range(batch)], dtype=object),
        "image": rng.integers(0, 256, (batch, mcfg.image_size, mcfg.image_size, 3), dtype=np.uint8),
        "tokens": tokens,
    }
    masker = MaskedVariants(mcfg.n_patches, TOK.pad_id, TOK.end_id, TOK.mask_id) if masked else None
    return TrainCollate(masker, 0, TOK.pad_id)(raw)


def state(model: str, loss: str, batch: int):
    cfg = TrainConfig(model=model, global_batch_size=batch, samples_seen=batch * 1000, loss={"name": loss},
                      data=DataConfig(augment=False), optim=OptimConfig(warmup_steps=10))  # fmt: skip
    return setup_state(cfg, TOK, torch.device("cpu"), 0)  # CLIP's BPE ids (+ pad, mask) for every model


def step_ratio(model: str, batch: int, rounds: int, warmup: int = 2) -> dict:
    cases = {}
    for loss in ("prolip", "clip"):
        st = state(model, loss, batch)
        b = collated(model, batch, masked=loss == "prolip")
        cases[loss] = lambda st=st, b=b: train_step(st, b)
    log = alternate(cases, rounds, warmup=warmup)
    return {"model": model, "batch": batch, "step": {k: times(log, k) for k in cases},
            "prolip_over_clip": ratios(log, "prolip", "clip"), "rounds": log}  # fmt: skip


def flops() -> dict:
    out = {}
    for preset, (model, vocab) in PRESET_MODELS.items():
        p = train_flops_per_sample(objective_model_config(model, True, vocab_size=vocab), masked=True)
        c = train_flops_per_sample(objective_model_config(model, False, vocab_size=vocab), masked=False)
        out[preset] = {"model": model, "prolip_gflop": p["total"] / 1e9, "clip_gflop": c["total"] / 1e9,
                       "ratio": p["total"] / c["total"], "h100_samples_per_s_at_30pct": samples_per_s(p["total"])}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--models", default=",".join(CASES), help="MODEL[:BATCH],... (batch: CASES' by default)")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--allow-loaded", action="store_true")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each model before the rounds")
    ap.add_argument("--keep-memory", action="store_true",
                    help="glibc keeps the memory it frees (no mmap, no trim), as a GPU's caching allocator does")  # fmt: skip
    args = ap.parse_args()
    if args.keep_memory and any(os.environ.get(k) != v for k, v in KEEP_MEMORY.items()):
        # glibc reads these once, at start: run again with them set.
        os.execve(
            sys.executable,
            [sys.executable, "-m", __spec__.name, *sys.argv[1:]],
            {**os.environ, **KEEP_MEMORY},
        )
    assert args.rounds >= MIN_ROUNDS
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the train loop does on CPU
    date = datetime.datetime.now().isoformat(timespec="seconds")
    counted = flops()
    results, records, loads = {}, [], []
    cmd = (
        f"python -m bench.train_step_ratio --rounds {args.rounds}"
        + (f" --threads {args.threads}" if args.threads else "")
        + (f" --models {args.models}" if args.models != ",".join(CASES) else "")
        + (f" --warmup {args.warmup}" if args.warmup != 2 else "")
        + (" --keep-memory" if args.keep_memory else "")
    )
    for case in args.models.split(","):
        model, _, batch = case.partition(":")
        r = results[case] = step_ratio(model, int(batch or CASES[model]), args.rounds, args.warmup)
        q = r["prolip_over_clip"]
        loads += [q["load_min"], q["load_max"]]
        note = loads_note([q["load_min"], q["load_max"]], os.cpu_count() or 1)
        kernel = {k: (r["step"][k]["sys_s"]["median"], r["step"][k]["minflt"]["median"]) for k in r["step"]}
        faults = "; ".join(
            f"{k} {s:.2f} s kernel time, {f:.0f} page faults a step" for k, (s, f) in kernel.items()
        )
        print(f"{model} batch {r['batch']}: ProLIP ÷ CLIP step {q['cpu']['median']:.3f} CPU "
              f"({q['cpu']['min']:.3f}–{q['cpu']['max']:.3f}), user {q['user']['median']:.3f} "
              f"({q['user']['min']:.3f}–{q['user']['max']:.3f}), wall {q['wall']['median']:.3f}; {faults}; {note}")  # fmt: skip
        records.append({"what": f"ProLIP step ÷ CLIP step, {model} at batch {r['batch']} (setup_state/train_step, CPU)",
                        "command": cmd, "figure": f"{q['cpu']['median']:.3f}× (CPU time)",
                        "spread": f"{q['cpu']['min']:.3f}–{q['cpu']['max']:.3f} over {q['cpu']['n']} rounds; wall "
                                  f"{q['wall']['median']:.3f}× ({q['wall']['min']:.3f}–{q['wall']['max']:.3f}); "
                                  f"user time {q['user']['median']:.3f}× ({q['user']['min']:.3f}–{q['user']['max']:.3f}); "
                                  f"median {faults}",
                        "load": f"{q['load_min']:.1f}–{q['load_max']:.1f} on {os.cpu_count()} cores", "date": date})  # fmt: skip
    for preset, f in counted.items():
        records.append({"what": f"{preset} ({f['model']}): training FLOPs per sample, ProLIP (12.5% masked variants) "
                                "and CLIP, meta device", "command": cmd,
                        "figure": f"{f['prolip_gflop']:.1f} GFLOP (CLIP {f['clip_gflop']:.1f}; {f['ratio']:.3f}×)",
                        "spread": f"{f['h100_samples_per_s_at_30pct']:.0f} samples/s on an H100 at 30% MFU "
                                  "(989.4 TFLOP/s bf16 dense)", "load": "—", "date": date})  # fmt: skip
    doc = {"title": "ProLIP step vs CLIP step through the trainer's step, and FLOPs per sample",
           "about": "Alternated single-process train steps built by training.train.step.setup_state; FLOPs "
                    "counted on the meta device at the full text context (an upper bound: batches are trimmed).",
           "records": records, "results": results, "flops": counted}  # fmt: skip
    out = results_path(args.out, RESULT, max(loads), os.cpu_count() or 1, args.allow_loaded)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
