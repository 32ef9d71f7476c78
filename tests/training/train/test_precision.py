"""bf16 autocast through the real forward and loss: on CPU always, on CUDA when a GPU is present.

The train step runs bf16 autocast on CUDA (training/train/step.py ``autocast``); no GPU exists where the suite
usually runs, so the same path is exercised under CPU autocast, and the ``gpu``-marked test repeats it on
CUDA when one is available (skipped otherwise, see tests/conftest.py). A whole optimizer step
(``training.train.step.train_step``) also runs under CPU bf16 autocast with both loss reductions.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.training.train.test_distributed import PAD, global_batch, tiny_module
from training.config import OptimConfig, TrainConfig
from training.losses.objectives import CLIPLossConfig, ProLIPLossConfig
from training.model.param_groups import is_unc_param
from training.model.towers import GaussianHead
from training.train.step import autocast, loss_shares, setup_state, train_step


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


def _step_batch() -> dict[str, torch.Tensor]:
    """Eight 64-px samples of the ``tiny`` model, two of them masked, the same at every call."""
    g = torch.Generator().manual_seed(2)
    small = global_batch()
    return {
        "images": torch.randn(8, 3, 64, 64, generator=g),
        "tokens": small["tokens"],
        "masked_tokens": small["masked_tokens"],
        "keep_idx": torch.stack([torch.randperm(64, generator=g)[:16].sort().values for _ in range(8)]),
        "masked_index": torch.tensor([0, 3]),
    }


def _one_train_step(precision: str, reduction: str) -> tuple[dict[str, float], list[torch.Tensor], Any]:
    """``training.train.step.train_step`` (forward, loss, backward, clipping, AdamW, schedule) on the ``tiny``
    model, from the same initial weights whatever the precision."""
    cfg = TrainConfig(
        model="tiny",
        global_batch_size=8,
        samples_seen=16,
        precision=precision,
        loss=ProLIPLossConfig(reduction=reduction),
        optim=OptimConfig(warmup_steps=1, grad_clip=1.0, unc_lr_mult=10.0),
    )
    state = setup_state(cfg, SimpleNamespace(vocab_size=64, pad_id=PAD), torch.device("cpu"), 0)
    terms, _ = train_step(state, _step_batch())
    grads = [p.grad.detach().float() for p in state.module.parameters() if p.grad is not None]
    return {k: float(v.detach()) for k, v in terms.items()}, grads, state


@pytest.mark.parametrize("reduction", ["joint", "official"])
def test_full_train_step_under_bf16_autocast_on_cpu(reduction: str) -> None:
    terms32, grads32, _ = _one_train_step("fp32", reduction)
    terms16, grads16, state = _one_train_step("bf16", reduction)
    assert all(math.isfinite(v) for v in terms16.values()), terms16
    # Four bf16 layers per tower at 64 px: the total (at logit scale 10) differs by ~2% from fp32.
    assert terms16["total"] == pytest.approx(terms32["total"], rel=5e-2)
    flat32, flat16 = torch.cat([g.flatten() for g in grads32]), torch.cat([g.flatten() for g in grads16])
    assert torch.isfinite(flat16).all()
    assert torch.nn.functional.cosine_similarity(flat32, flat16, dim=0) > 0.98
    assert all(torch.isfinite(p).all() for p in state.module.parameters())
    # The σ heads train in their own AdamW groups at 10× the base LR; every other parameter at the base LR.
    unc = {id(p) for n, p in state.module.named_parameters() if is_unc_param(n)}
    assert unc, "no σ-head parameters found"
    for group in state.opt.param_groups:
        ids = {id(p) for p in group["params"]}
        assert ids <= unc or not ids & unc
        assert group["initial_lr"] == pytest.approx(state.cfg.optim.lr * (10.0 if ids <= unc else 1.0))


# --- σ heads in float32 under autocast ----------------------------------------------------------------
#
# What these two tests show, and what they do not: given the same input features, the σ (and μ) heads
# compute under bf16 autocast exactly what they compute without it, bit for bit, so bf16's rounding (a step
# of 0.0625 near the −10 init) never reaches log σ²; and a whole ``train_step`` (loss, backward, clipping,
# AdamW) under bf16 updates the heads' parameters as the fp32 step does when the heads see the same
# features. They do not show that a real bf16 step's log σ² equals the fp32 step's: the trunks run in bf16,
# so the heads' inputs differ (~1e-2 relative) and that difference goes through the head (``_compare``
# above bounds the whole step against fp32).


def test_sigma_head_under_bf16_autocast_is_the_fp32_head_bit_for_bit() -> None:
    torch.manual_seed(0)
    head = GaussianHead(width=128, embed_dim=64, probabilistic=True, unc_bias_init=-10.0)
    head.reset_logvar_bias()
    h_cls, h_unc = torch.randn(32, 128), torch.randn(32, 128)  # LayerNorm-scaled trunk states
    mu32, logvar32 = head(h_cls, h_unc)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mu16, logvar16 = head(h_cls, h_unc)
        mu_bf, logvar_bf = head(h_cls.bfloat16(), h_unc.bfloat16())  # the trunk's bf16 states, cast up
        unguarded = head.logvar_proj(h_unc)  # what autocast makes of the same Linear outside the guard
    assert logvar16.dtype == mu16.dtype == torch.float32
    assert torch.equal(logvar16, logvar32) and torch.equal(mu16, mu32)
    ref = head(h_cls.bfloat16().float(), h_unc.bfloat16().float())
    assert torch.equal(mu_bf, ref[0]) and torch.equal(logvar_bf, ref[1])
    assert (logvar32 + 10).abs().max() < 3  # at the −10 init
    # The comparison can fail: a bf16 Linear's log σ² lies on bf16's grid (0.0625 apart in [−16, −8),
    # 0.03125 in [−8, −4)), far coarser than the fp32 head's values.
    u = unguarded.float()
    assert unguarded.dtype == torch.bfloat16 and torch.equal(u, torch.round(u * 32) / 32)
    assert (u - logvar32).abs().max() > 1e-2


def _step_with_fixed_head_inputs(precision: str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """One ``train_step`` on ``tiny`` whose four heads (image/text, full and masked rows) are fed the same
    float32 features whatever the precision (a forward pre-hook replaces the trunks' states); returns the
    heads' parameters after the step and each head's log σ² on its fixed features with them."""
    cfg = TrainConfig(
        model="tiny",
        global_batch_size=8,
        samples_seen=16,
        precision=precision,
        optim=OptimConfig(warmup_steps=1, grad_clip=1.0, unc_lr_mult=10.0),
    )
    state = setup_state(cfg, SimpleNamespace(vocab_size=64, pad_id=PAD), torch.device("cpu"), 0)
    model = state.module.model
    fixed: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def states(tower: str, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        if (tower, rows) not in fixed:
            g = torch.Generator().manual_seed(len(fixed) + 7)
            fixed[tower, rows] = (
                torch.randn(rows, width, generator=g),
                torch.randn(rows, width, generator=g),
            )
        return fixed[tower, rows]

    for tower in ("visual", "text"):
        getattr(model, tower).head.register_forward_pre_hook(
            lambda _m, args, tower=tower: states(tower, args[0].shape[0], args[0].shape[1])
        )
    train_step(state, _step_batch())
    assert state.update.skipped == 0
    trunk = [n for n, p in model.named_parameters() if ".head." not in n and p.grad is not None]
    assert not [n for n in trunk if n.startswith(("visual.transformer", "text.transformer"))], trunk
    heads = {n: p.detach().clone() for n, p in model.named_parameters() if ".head." in n}
    with torch.no_grad():
        logvars = [getattr(model, t).head(*fixed[t, r])[1] for t, r in sorted(fixed)]
    return heads, logvars


def test_bf16_step_updates_the_sigma_heads_as_the_fp32_step_given_the_same_features() -> None:
    heads32, logvar32 = _step_with_fixed_head_inputs("fp32")
    heads16, logvar16 = _step_with_fixed_head_inputs("bf16")
    assert any("logvar_proj" in n for n in heads32) and heads32.keys() == heads16.keys()
    eps = torch.finfo(torch.float32).eps
    for name, p32 in heads32.items():  # to fp32 precision: a few ulps of the parameter's magnitude
        assert (heads16[name] - p32).abs().max() <= 4 * eps * max(1.0, float(p32.abs().max())), name
    assert len(logvar32) == len(logvar16) >= 2
    for a, b in zip(logvar32, logvar16, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert (a + 10).abs().max() < 3  # still at the −10 init after one step
        assert (a - b).abs().max() <= 4 * eps * 16, float((a - b).abs().max())  # ulp at |x| ≈ 10 is 9.5e-7


# --- float16 amp with a loss scale (precision="amp", DataComp's setting) -------------------------------


def test_loss_scale_follows_torch_grad_scaler() -> None:
    """Our device-side loss scale against ``torch.amp.GradScaler`` on the same sequence of finite and
    overflowing steps (a short growth interval so that growth happens too)."""
    from training.train.optimizer import LossScale

    ours = LossScale(torch.device("cpu"), init=1024.0, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    for bad in [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0]:
        opt.zero_grad()
        (ref.scale(p.sum()) * (float("inf") if bad else 1.0)).backward()
        ref.step(opt)
        ref.update()
        ours.update(torch.tensor(float(bad)))
        assert float(ours.scale) == ref.get_scale()


def test_amp_train_step_scales_the_loss_and_skips_an_overflow() -> None:
    """A whole CLIP ``train_step`` under CPU float16 autocast: the gradients reaching AdamW are the loss's
    own (unscaled: within fp16 rounding of the fp32 step's), and a step whose scaled gradients overflow is
    skipped and halves the scale."""

    def step(precision: str, scale: float | None = None):
        cfg = TrainConfig(model="tiny", global_batch_size=8, samples_seen=16, precision=precision,
                          loss=CLIPLossConfig(), optim=OptimConfig(warmup_steps=1))  # fmt: skip
        state = setup_state(cfg, SimpleNamespace(vocab_size=64, pad_id=PAD), torch.device("cpu"), 0)
        if scale is not None:
            state.update.loss_scale.scale.fill_(scale)
        before = [p.detach().clone() for p in state.module.parameters()]
        train_step(state, _step_batch())
        grads = torch.cat([p.grad.float().flatten() for p in state.module.parameters() if p.grad is not None])
        moved = any(not torch.equal(a, p) for a, p in zip(before, state.module.parameters(), strict=True))
        return state, grads, moved

    _, g32, _ = step("fp32")
    state, g16, moved = step("amp")
    assert state.update.loss_scale is not None and float(state.update.loss_scale.scale) == 2.0**16
    assert moved and int(state.update.skipped) == 0
    assert torch.nn.functional.cosine_similarity(g32, g16, dim=0) > 0.98
    assert float(g16.norm()) == pytest.approx(float(g32.norm()), rel=5e-2)  # unscaled before the update
    state, _, moved = step("amp", scale=2.0**120)  # the scaled gradients overflow float32
    assert not moved and int(state.update.skipped) == 1 and float(state.update.loss_scale.scale) == 2.0**119
