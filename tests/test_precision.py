"""bf16 autocast through the real forward and loss: on CPU always, on CUDA when a GPU is present.

The train step runs bf16 autocast on CUDA (training/step.py ``autocast``); no GPU exists where the suite
usually runs, so the same path is exercised under CPU autocast, and the ``gpu``-marked test repeats it on
CUDA when one is available (skipped otherwise, see tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_distributed import global_batch, tiny_module
from training.step import autocast, loss_shares


def _loss_and_grads(name: str, device: str, precision: str) -> tuple[float, list[torch.Tensor]]:
    module = tiny_module(name).to(device)
    batch = {k: v.to(device) for k, v in global_batch().items()}
    masked_index = torch.tensor([0, 3], device=device)
    with autocast(torch.device(device), precision):
        feats = module(
            batch["images"], batch["tokens"], batch["masked_tokens"], batch["keep_idx"], masked_index
        )
    terms = loss_shares(module.loss, module.spec, feats, masked_index)
    terms["total"].backward()
    grads = [p.grad.detach().float().cpu() for p in module.parameters() if p.grad is not None]
    return float(terms["total"].detach()), grads


def _compare(name: str, device: str) -> None:
    loss32, grads32 = _loss_and_grads(name, device, "fp32")
    loss16, grads16 = _loss_and_grads(name, device, "bf16")
    assert torch.isfinite(torch.tensor(loss16)) and all(torch.isfinite(g).all() for g in grads16)
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    flat32, flat16 = torch.cat([g.flatten() for g in grads32]), torch.cat([g.flatten() for g in grads16])
    cos = torch.nn.functional.cosine_similarity(flat32, flat16, dim=0)
    assert cos > 0.98, float(cos)  # bf16 keeps ~3 significant digits; the gradient direction must hold


@pytest.mark.parametrize("name", ["prolip", "clip"])
def test_bf16_autocast_step_on_cpu_matches_fp32(name: str) -> None:
    _compare(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["prolip", "siglip", "clip", "pcmepp"])
def test_bf16_autocast_step_on_cuda_matches_fp32(name: str) -> None:
    _compare(name, "cuda")
