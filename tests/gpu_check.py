"""The first GPU run, prepared: every GPU-only part checked in one script, and a results file.

On a CUDA machine (``bash tests/gpu_check.sh``, about 10 minutes on one H100):

1. ``pytest -m gpu``: the CUDA copies of the tests (bf16 steps of every loss against fp32, the device
   augmentation against the CPU, the fp32 σ heads, the train step under ``torch.cuda.set_sync_debug_mode
   ("error")``, a checkpoint saved and resumed on the GPU, and the two-rank NCCL parity test when two
   GPUs are visible);
2. the trainer's own step (``setup_state``/``train_step``, bf16, fused AdamW) for datacomp-small's
   ViT-B/32 and prolip-b16's ViT-B/16 at their per-GPU batch (512): samples/s, and MFU from the FLOPs
   counted on the meta device against the device's bf16 peak;
3. checks on the same steps: loss finite, log σ² in range (no NaN, within [−30, 10]), no step skipped,
   and no host sync inside ``train_step`` (CUDA's sync debug mode raises on one);
4. the ingest rate this machine's CPUs reach: decode + crop + tokenize per core (uint8 out) and over
   every core at once, and the cores per GPU that the measured step rate needs.

``--cpu`` runs the same code on the CPU with the ``demo-32px`` model and small batches (the bf16 step under
CPU autocast, the sync check with the CPU counter of tests/fixtures/sync_counter.py, the checkpoint round
trip, the rates), so the script cannot rot: tests/test_gpu_check.py runs it in ``make test``.
Writes ``--out`` (default bench/results/gpu_check.json; --cpu: a file under the system temp dir) and prints
the same report as one ``gpu_check report: {...}`` line last, so a run submitted to a cluster
(``ray job submit --entrypoint-num-gpus 1 ... -- bash tests/gpu_check.sh``, docs/cluster.md) leaves it in
``ray job logs`` whatever happens to the node's disk.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.common.config import merge
from pipeline.ingest import augment as A
from pipeline.ingest.transforms import MaskedVariants, TrainCollate
from training.config import TRAIN_PRESETS
from training.model.flops import H100_BF16_DENSE, train_flops_per_sample
from training.train.step import setup_state, train_step

ROOT = Path(__file__).resolve().parents[1]

# Dense bf16 peak FLOP/s (vendor datasheets, without sparsity); the PCIe H100 first, its name also says H100.
PEAKS = {"H100 PCIe": 756e12, "H100": H100_BF16_DENSE, "H200": H100_BF16_DENSE, "A100": 312e12,
         "L40S": 362e12, "A10G": 70e12, "L4": 121e12}  # fmt: skip


def batch_for(mcfg, tok, n: int, recipe_jitter: bool, seed: int = 0) -> dict:
    """A collated batch as the loop gets it: uint8 crops, trimmed captions, masked variants, pixel draws."""
    rng = np.random.default_rng(seed)
    tokens = np.full((n, mcfg.context_length), tok.pad_id, np.int64)
    for i, length in enumerate(rng.integers(8, 31, n)):
        length = min(int(length), mcfg.context_length - 1)
        tokens[i, :length] = rng.integers(0, 49406, length)  # CLIP's ordinary tokens
        tokens[i, length] = tok.end_id
    raw = {"key": np.array([f"{seed:016x}{i:016x}" for i in range(n)], dtype=object),
           "image": rng.integers(0, 256, (n, mcfg.image_size, mcfg.image_size, 3), dtype=np.uint8),
           "tokens": tokens}  # fmt: skip
    if recipe_jitter:
        raw["jitter"], raw["jitter_order"] = A.draw_jitter(n, (0.32, 0.32, 0.32, 0.08), 0.8, rng)
        raw["gray"] = A.draw_grayscale(n, 0.2, rng)
    masker = MaskedVariants(
        mcfg.n_patches, tok.pad_id, tok.end_id, tok.mask_id, protected_ids=(tok.start_id,)
    )
    return TrainCollate(masker, 0, tok.pad_id)(raw)


def syncs_in(fn, device: torch.device) -> list[str]:
    """The host syncs ``fn()`` makes: CUDA's own sync check where there is CUDA (it raises on the first), else
    the CPU counter of the same operations (tests/fixtures/sync_counter.py)."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        except RuntimeError as exc:
            return [str(exc).splitlines()[0]]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return []
    from tests.fixtures.sync_counter import SyncCounter

    with SyncCounter() as counter:
        fn()
    return counter.events


def step_check(
    preset: str, device: torch.device, batch: int, model: str | None, steps: int, compiled: bool = False
) -> dict:
    """The trainer's step for ``preset`` at ``batch`` per device: rate, MFU, finiteness, σ², syncs, resume."""
    from pipeline.ingest.tokenizer import clip_bpe_tokenizer
    from training.train.checkpointing import save_state

    base = TRAIN_PRESETS[preset]
    name = model or base.model
    one_device = {"num_workers": 1, "min_workers": 0}  # one device of the preset's run
    cfg = merge(base, {"model": name, "global_batch_size": batch, "samples_seen": batch * 1000,
                       "precision": "bf16", "scaling": one_device, "compile": compiled})  # fmt: skip
    tok = clip_bpe_tokenizer()  # CLIP's BPE for both presets (SigLIP's vocabulary needs the Hub)
    state = setup_state(cfg, tok, device, 0)
    jitter = cfg.data.color_jitter_p > 0
    batches = [
        {k: v.to(device) for k, v in batch_for(state.mcfg, tok, batch, jitter, s).items()} for s in range(2)
    ]
    for b in batches[: 2 if device.type == "cuda" else 1]:  # warm-up: allocator, autotuning, optimizer state
        train_step(state, b)
    events = syncs_in(lambda: train_step(state, batches[0]), device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        terms, feats = train_step(state, batches[i % 2])
    sync()
    rate = steps * batch / (time.perf_counter() - t0)
    flops = train_flops_per_sample(state.mcfg, masked=state.module.spec.uses_masked)["total"]
    peak = next(
        (v for k, v in PEAKS.items() if device.type == "cuda" and k in torch.cuda.get_device_name()), None
    )
    logvar = torch.cat([feats[k].detach().float().flatten() for k in ("logvar_v", "logvar_t")])
    with tempfile.TemporaryDirectory() as d:  # checkpoint and resume on this device
        save_state(d, state, tok)
        resumed = setup_state(cfg, tok, device, 0, restore_dir=d)
        pairs = list(zip(state.module.parameters(), resumed.module.parameters(), strict=True))
        same = all(torch.equal(a, b) for a, b in pairs)
        train_step(state, batches[0])
        train_step(resumed, batches[0])
        after = max(float((a - b).abs().max()) for a, b in pairs)
    return {
        "preset": preset, "model": name, "batch": batch, "samples_per_s": rate, "gflop_per_sample": flops / 1e9,
        "mfu": rate * flops / peak if peak else None, "loss_finite": bool(torch.isfinite(terms["total"])),
        "logvar_range": [float(logvar.min()), float(logvar.max())],
        "logvar_ok": bool(torch.isfinite(logvar).all() and logvar.min() > -30 and logvar.max() < 10),
        "skipped_steps": int(state.update.skipped), "fused_adamw": state.update.fused, "host_syncs": events,
        "resume_equal_weights": same, "resume_step_max_diff": after,
    }  # fmt: skip


def ingest_check(samples: int) -> dict:
    """Decode + crop + tokenize (uint8 out) per core, and on every core at once (one process each, their
    rates over the same span summed), on photo JPEGs."""
    from concurrent.futures import ProcessPoolExecutor

    cores = os.cpu_count() or 1
    per_core = _decode_rate(samples)[0]
    with ProcessPoolExecutor(cores) as pool:
        all_cores = sum(wall for _, wall in pool.map(_decode_rate, [samples] * cores))
    return {"cores": cores, "per_core_samples_per_s": per_core, "all_cores_samples_per_s": all_cores}


def _decode_rate(n: int) -> tuple[float, float]:
    """(samples per CPU second, samples per wall second) of the datacomp-small decode stage on ``n`` photos."""
    from bench.ingest_224 import photo_samples, raw_columns
    from pipeline.ingest.tokenizer import clip_bpe_tokenizer
    from pipeline.ingest.transforms import DecodeAugment

    samples = photo_samples(n, seed=os.getpid() % 7)
    stage = DecodeAugment(224, 77, clip_bpe_tokenizer(), TRAIN_PRESETS["datacomp-small"].data, seed=0)
    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(0, n, 64):
        stage(raw_columns(samples[i : i + 64]))
    return n / (time.process_time() - cpu), n / (time.perf_counter() - wall)


def gpu_tests() -> dict:
    """``pytest -m gpu`` over the suite (CUDA only)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    return {"returncode": done.returncode, "summary": done.stdout.strip().splitlines()[-1:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="the CPU fallback: a small model, small batches")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="also time the step under torch.compile")
    args = ap.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.cpu:
        print("no CUDA device: pass --cpu for the CPU fallback", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_flush_denormal(True)
        torch.set_num_threads(1)  # checks behaviour, not speed: idle OpenMP threads spin on a shared CPU
    report: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                    "device": str(device),
                    "device_name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                    "torch": torch.__version__}  # fmt: skip
    if device.type == "cuda":
        report["gpu_tests"] = gpu_tests()
    model, batch, steps = (None, 512, args.steps) if device.type == "cuda" else ("demo-32px", 8, 2)
    report["steps"] = [step_check(p, device, batch, model, steps) for p in ("datacomp-small", "prolip-b16")]
    if args.compile:
        report["compiled_steps"] = [step_check(p, device, batch, model, steps, compiled=True)
                                    for p in ("datacomp-small", "prolip-b16")]  # fmt: skip
    report["ingest"] = ingest_check(256 if device.type == "cuda" else 32)
    for s in report["steps"]:
        s["cores_per_gpu_needed"] = s["samples_per_s"] / report["ingest"]["per_core_samples_per_s"]
    failed = [f"{s['preset']}: {k}" for s in report["steps"] for k, ok in
              (("loss not finite", s["loss_finite"]), ("log σ² out of range", s["logvar_ok"]),
               ("skipped steps", s["skipped_steps"] == 0), ("host syncs", not s["host_syncs"]),
               ("resume", s["resume_equal_weights"] and s["resume_step_max_diff"] <= 1e-4)) if not ok]  # fmt: skip
    if report.get("gpu_tests", {}).get("returncode", 0) not in (0, 5):
        failed.append(f"pytest -m gpu: {report['gpu_tests']['summary']}")
    report["failed"] = failed
    out = args.out or (
        Path(tempfile.gettempdir()) / "gpu_check_cpu.json"
        if args.cpu
        else ROOT / "bench" / "results" / "gpu_check.json"
    )
    out.write_text(json.dumps(report, indent=1) + "\n")
    for s in report["steps"]:
        mfu = f", MFU {100 * s['mfu']:.1f}%" if s["mfu"] else ""
        print(f"{s['preset']} ({s['model']}, batch {s['batch']}): {s['samples_per_s']:.0f} samples/s{mfu}; "
              f"needs {s['cores_per_gpu_needed']:.1f} decode cores")  # fmt: skip
    print(
        f"ingest: {report['ingest']['per_core_samples_per_s']:.0f} samples/s per core, "
        f"{report['ingest']['all_cores_samples_per_s']:.0f} on {report['ingest']['cores']} cores"
    )
    print("FAILED: " + "; ".join(failed) if failed else "all checks passed", f"({out})")
    print("gpu_check report: " + json.dumps(report, separators=(",", ":")))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
