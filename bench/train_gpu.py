"""ViT-B/16 training step on one GPU in bf16: samples/s and MFU, ProLIP against CLIP in the same run.

Cases (synthetic batch of ``--batch`` 224-px images and 64-token captions, AdamW, bf16 autocast):
  prolip  the paper's model (ViT-B-16-ProLIP: probabilistic towers) with the ProLIP objective and masked
          variants for 12.5% of the batch (25% of patches kept, 75% of tokens masked)
  clip    the same architecture without the UNC token / σ head, CLIP InfoNCE
FLOPs: counted, not estimated — ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward
(matmuls and attention as executed, masked forward included). MFU = counted FLOPs per second ÷ the
device's peak dense bf16 FLOP/s (table below, or ``--peak-tflops``). The paper's setup (batch 512/GPU on
32 V100-class GPUs for the reported wall-clock) implies ≈8% MFU; the goal here is ≥ 45%.
Skips cleanly (exit 0, nothing written) without CUDA. Writes bench/results/train_gpu.json with the device.
Usage: python bench/train_gpu.py [--batch 256] [--steps 20] [--compile]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Dense bf16 peak FLOP/s (vendor datasheets, without sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}


def peak_flops(name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if "H100" in name and "PCIe" in name:
        return 756e12
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def make_case(objective: str, batch: int, device: torch.device, compile_model: bool):
    import numpy as np

    from pipeline.ingest.masking import choose_kept_patches, mask_text_tokens
    from training.config import LossConfig
    from training.losses.registry import build_loss_from_config, loss_spec
    from training.model.config import model_config
    from training.model.param_groups import param_groups
    from training.model.two_tower import ProLIP
    from training.train.step import TrainModule, loss_shares

    torch.manual_seed(0)
    loss = build_loss_from_config(LossConfig(name=objective))[0]
    cfg = model_config("ViT-B-16-ProLIP", probabilistic=loss_spec(objective).probabilistic)
    module = TrainModule(ProLIP(cfg), loss, loss_spec(objective)).to(device)
    opt = torch.optim.AdamW(param_groups(module, 0.2), lr=5e-4, betas=(0.9, 0.95), fused=True)
    forward = torch.compile(module) if compile_model else module

    rng = np.random.default_rng(0)
    length = cfg.context_length
    lengths = rng.integers(8, length - 1, batch)
    tokens = rng.integers(3, cfg.vocab_size, (batch, length))
    tokens[np.arange(length)[None, :] >= lengths[:, None]] = 0  # pad
    tokens[np.arange(batch), lengths] = 1  # end
    m = batch // 8  # 12.5% masked variants
    masked = tokens.copy()
    masked[:m] = mask_text_tokens(tokens[:m], pad_id=0, end_id=1, mask_id=2, rng=rng)
    keep = np.zeros((batch, round(0.25 * cfg.n_patches)), np.int64)
    keep[:m] = choose_kept_patches(cfg.n_patches, m, 0.25, rng=rng)
    images = torch.randn(batch, 3, cfg.image_size, cfg.image_size, device=device)
    tok = torch.from_numpy(tokens).to(device)
    extra = (None, None, None)
    if loss_spec(objective).uses_masked:
        extra = (torch.from_numpy(masked).to(device), torch.from_numpy(keep).to(device),
                 torch.arange(m, device=device))  # fmt: skip

    def fwd_bwd() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            feats = forward(images, tok, *extra)
        terms = loss_shares(loss, loss_spec(objective), feats, extra[2])
        terms["total"].backward()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        fwd_bwd()
        opt.step()

    return step, fwd_bwd, module


def measure(objective: str, args: argparse.Namespace, device: torch.device, peak: float | None) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    step, fwd_bwd, module = make_case(objective, args.batch, device, args.compile)
    for _ in range(args.warmup):
        step()
    counter = FlopCounterMode(display=False)
    with counter:
        fwd_bwd()
    flops = counter.get_total_flops()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    del module
    return {
        "step_s": dt,
        "samples_per_s": args.batch / dt,
        "flops_per_step": flops,
        "tflops_per_s": flops / dt / 1e12,
        "mfu": flops / dt / peak if peak else None,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--peak-tflops", type=float, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/train_gpu.py: no CUDA device — skipped (nothing written)")
        return 0
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name, args.peak_tflops)
    cases = {obj: measure(obj, args, device, peak) for obj in ("prolip", "clip")}
    result = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "batch": args.batch,
        "compile": args.compile,
        "peak_bf16_tflops": peak / 1e12 if peak else None,
        "cases": cases,
        "prolip_over_clip_step_time": cases["prolip"]["step_s"] / cases["clip"]["step_s"],
        "goal_mfu": 0.45,
    }
    print(f"device: {name}  batch {args.batch}  compile={args.compile}")
    print(f"{'case':<8}{'samples/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'mem GiB':>9}")
    for k, c in cases.items():
        mfu = f"{100 * c['mfu']:.1f}%" if c["mfu"] is not None else "n/a"
        print(
            f"{k:<8}{c['samples_per_s']:>12.0f}{c['tflops_per_s']:>10.0f}{mfu:>8}{c['max_memory_gib']:>9.1f}"
        )
    print(f"ProLIP ÷ CLIP step time: {result['prolip_over_clip_step_time']:.3f}")
    out = ROOT / "bench" / "results" / "train_gpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
