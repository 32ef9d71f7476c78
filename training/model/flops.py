"""Training FLOPs per sample of a model config, counted on the ``meta`` device (no memory, no arithmetic).

``train_flops_per_sample`` runs one forward and backward of both towers on meta tensors under
``torch.utils.flop_counter.FlopCounterMode`` (matrix products and attention, as MFU figures count them) for
a batch shaped as the train step's: every sample's image and caption, plus — for ProLIP — the masked
variants of ``mask_fraction`` of the samples (their image with ``patch_keep_ratio`` of the patches, their
caption again; ProLIP Eq. 6). Text runs at ``text_length`` tokens (the full context by default; the train
step trims each batch to its longest caption, so this is an upper bound).

``samples_per_s(flops, peak, mfu)`` turns it into a throughput, and ``cores_needed`` into the decode cores
that throughput takes at a measured per-core ingest rate (docs/gpu.md).
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from training.model.config import ModelConfig
from training.model.two_tower import ProLIP

H100_BF16_DENSE = 989.4e12  # FLOP/s, H100 SXM bf16 tensor cores without sparsity (NVIDIA's datasheet)


def train_flops_per_sample(
    mcfg: ModelConfig,
    masked: bool,
    mask_fraction: float = 0.125,
    patch_keep_ratio: float = 0.25,
    text_length: int | None = None,
    batch: int = 8,
) -> dict[str, float]:
    """{"forward", "total"} FLOPs per sample (total = forward + backward) on the meta device."""
    length = text_length or mcfg.context_length
    n_masked = max(1, round(mask_fraction * batch)) if masked else 0
    keep = max(1, math.floor(patch_keep_ratio * mcfg.n_patches + 0.5))
    with torch.device("meta"):
        model = ProLIP(mcfg)
        images = torch.empty(batch, 3, mcfg.image_size, mcfg.image_size)
        tokens = torch.zeros(batch + n_masked, length, dtype=torch.long)
        keep_idx = torch.zeros(n_masked, keep, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter:
        outs = [*model.encode_image(images), *model.encode_text(tokens)]
        if n_masked:
            outs += list(model.encode_image(images[:n_masked], keep_idx))
        forward = counter.get_total_flops()
        sum(o.sum() for o in outs if o is not None).backward()
    total = counter.get_total_flops()
    return {"forward": forward / batch, "total": total / batch}


def samples_per_s(flops_per_sample: float, peak: float = H100_BF16_DENSE, mfu: float = 0.30) -> float:
    return peak * mfu / flops_per_sample


def cores_needed(samples_per_second: float, per_core_rate: float) -> float:
    """Decode cores that feed ``samples_per_second`` at ``per_core_rate`` samples/s per core."""
    return samples_per_second / per_core_rate


def saved_bytes_per_sample(
    mcfg: ModelConfig,
    masked: bool,
    mask_fraction: float = 0.125,
    patch_keep_ratio: float = 0.25,
    text_length: int | None = None,
    batch: int = 8,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Bytes the forward keeps for backward per sample (the activation memory of a step), counted on the
    meta device: every tensor autograd saves, each storage once, for the batch ``train_flops_per_sample``
    runs. ``dtype=torch.bfloat16`` runs the towers in bf16 (the heads stay float32), a stand-in for
    autocast, which the meta device does not apply."""
    length = text_length or mcfg.context_length
    n_masked = max(1, round(mask_fraction * batch)) if masked else 0
    keep = max(1, math.floor(patch_keep_ratio * mcfg.n_patches + 0.5))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
        return t

    with torch.device("meta"):
        model = ProLIP(mcfg).to(dtype)
        images = torch.empty(batch, 3, mcfg.image_size, mcfg.image_size, dtype=dtype)
        tokens = torch.zeros(batch + n_masked, length, dtype=torch.long)
        keep_idx = torch.zeros(n_masked, keep, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.encode_image(images)
        model.encode_text(tokens)
        if n_masked:
            model.encode_image(images[:n_masked], keep_idx)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    return sum(n for k, n in seen.items() if k not in params) / batch
