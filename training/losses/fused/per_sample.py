"""Fused kernels for ProLIP's per-sample terms: the inclusion loss (Eq. 5) and, for the objective (Eq. 6),
every O(B·D) term in one `autograd.Function` with one gradient buffer per input.

Autograd on the objective's per-sample terms would give each input a separate (B, D) gradient per term
(PPCL's σ² sums, inclusion, masked inclusion through an index, VIB) and add them up: a fresh (B, D)
buffer and a pass over memory for each, and a zero-filled (B, D) buffer per indexed masked term. At B = 4096
such buffers are 8 MiB each, freshly mapped pages included. `sample_terms` instead computes the inclusion
losses (with their gradients for a unit upstream gradient, as `inclusion_terms` does) and the sums over d
that PPCL and VIB need (`training.losses.fused.pairwise.row_sums`) in the forward, and its backward writes each
input's whole gradient into one buffer: the scaled inclusion gradient, then the σ² and VIB parts, then
the masked rows added at their indices. Formulas: `_inclusion_block` and `training/losses/inclusion.py`;
tests/training/losses/test_fused.py checks both kernels with `gradcheck` and the objective against autograd on
float64 references.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from training.losses.fused.pairwise import _block_rows, add_row_sums_grad, full_precision, row_sums


def _inclusion_block(
    gaussians: tuple[Tensor, ...], c: float, log_eps: float, joint: bool, out: tuple[Tensor, ...] | None
) -> tuple[Tensor, Tensor | None]:
    """Loss per row of (mu1, lv1, mu2, lv2) and, with `out`, its gradient: writes (G_mu, G_l1, G_l2) there
    and returns a per-row factor r (None: r = 1) with d/d mu1 = 4 r G_mu = -d/d mu2, d/d lv1 = r G_l1,
    d/d lv2 = -r G_l2 (for a unit upstream gradient; the caller folds its own into r).

    Per dimension, with s = exp(l), x = l1 - l2 and t = sigmoid(x) = s1 / S (S = s1 + s2), the two
    variance sums of H are s2 + 2 s1 = S (1 + t) and s1 + 2 s2 = S (2 - t). With i1 = 1 / (1 + t),
    i2 = 1 / (2 - t), w = eps / S = exp(log_eps - max(l1, l2)) max(t, 1 - t) (finite for any l) and
    k = w (i1 - i2) = eps / (s2 + 2 s1) - eps / (s1 + 2 s2):
        2 h      = log(i2 / i1) - x + 2 (mu1 - mu2)^2 k                    (training/losses/inclusion.py's H_d)
        2 dh/dl1 = 2 t i1 - t i2 - 1 - 2 (mu1 - mu2)^2 w t (2 i1^2 - i2^2)  = G_l1
        -2 dh/dl2 = 2 dh/dl1 + 2 (mu1 - mu2)^2 k = G_l2,   dh/dmu1 = 2 (mu1 - mu2) k = 2 G_mu.
    One sigmoid, one exp and one log per element: the log-sum-exp form of the same H takes two softplus,
    each about ten times an exp on CPU. r is d loss / d (2 h_d): one value per row for `joint`, so it
    is applied in the backward with the upstream gradient instead of here; per element (r = 1) otherwise.
    """
    mu1, lv1, mu2, lv2 = gaussians
    x = lv1 - lv2
    t = torch.sigmoid(x)
    w = torch.rsub(torch.maximum(lv1, lv2), log_eps).exp_().mul_(torch.sub(t, 0.5).abs_().add_(0.5))
    i1 = t.add(1.0).reciprocal_()
    i2 = torch.rsub(t, 2.0).reciprocal_()
    d = mu1 - mu2
    d2 = d.square()
    k = torch.sub(i1, i2).mul_(w)
    h2 = torch.div(i2, i1).log_().sub_(x).addcmul_(d2, k, value=2.0)
    if joint:
        ch = h2.sum(-1).mul_(-0.5 * c)
        loss = F.softplus(ch)
    else:
        ch = h2.mul_(-0.5 * c)
        loss = F.softplus(ch).mean(-1)
    if out is None:
        return loss, None
    coef = torch.sigmoid(ch).mul_(-0.5 * c / (1 if joint else h2.shape[-1]))  # d loss / d (2 h_d)
    ti1 = t * i1
    ti2 = t.mul_(i2)
    g_l1 = torch.mul(ti1, 2.0, out=out[1]).sub_(ti2).sub_(1.0)
    z = ti2.mul_(i2).sub_(ti1.mul_(i1), alpha=2.0)  # -t (2 i1^2 - i2^2)
    g_l1.addcmul_(w.mul_(d2), z, value=2.0)
    torch.add(g_l1, d2.mul_(k), alpha=2.0, out=out[2])
    torch.mul(d, k, out=out[0])
    if joint:
        return loss, coef
    for o in out:
        o.mul_(coef)
    return loss, None


def _inclusion_rows(
    mu1: Tensor, lv1: Tensor, mu2: Tensor, lv2: Tensor, c: float, log_eps: float, joint: bool, grads: bool
) -> tuple[Tensor, list[Tensor]]:
    """`_inclusion_block` over blocks of rows: the loss (B,) and, with `grads`, its (G_mu, G_l1, G_l2)
    (B, D) and the per-row factor r (B,)."""
    loss = mu1.new_empty(mu1.shape[0])
    out = [torch.empty_like(mu1) for _ in range(3)] + [mu1.new_ones(mu1.shape[0])] if grads else []
    step = _block_rows(mu1)
    for i in range(0, mu1.shape[0], step):
        s = slice(i, i + step)
        dst = (out[0][s], out[1][s], out[2][s]) if grads else None
        loss[s], row = _inclusion_block((mu1[s], lv1[s], mu2[s], lv2[s]), c, log_eps, joint, dst)
        if row is not None:
            out[3][s] = row
    return loss, out


def _wants_grad(*inputs: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


class _Inclusion(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        mu1: Tensor,
        lv1: Tensor,
        mu2: Tensor,
        lv2: Tensor,
        c: float,
        log_eps: float,
        joint: bool,
    ) -> Tensor:
        loss, grads = _inclusion_rows(mu1, lv1, mu2, lv2, c, log_eps, joint, grads=True)
        ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        g_mu, g_l1, g_l2, row = ctx.saved_tensors
        r = (row * grad)[:, None]
        need = ctx.needs_input_grad
        return (
            g_mu * (4.0 * r) if need[0] else None,
            g_l1 * r if need[1] else None,
            g_mu * (-4.0 * r) if need[2] else None,
            g_l2 * -r if need[3] else None,
            None,
            None,
            None,
        )


def inclusion_terms(
    mu1: Tensor, lv1: Tensor, mu2: Tensor, lv2: Tensor, c: float, log_eps: float, joint: bool
) -> Tensor:
    """Inclusion loss per sample (B,): softplus(-c sum_d h_d) if `joint`, else mean_d softplus(-c h_d).

    The gradients are computed (in the forward's blocks) only when autograd will ask for them.
    """
    inputs = (mu1, lv1, mu2, lv2)
    if _wants_grad(*inputs):
        return _Inclusion.apply(*inputs, c, log_eps, joint)
    return _inclusion_rows(*inputs, c, log_eps, joint, grads=False)[0]


class SampleTerms(NamedTuple):
    """`sample_terms`' outputs: inclusion losses per sample and the sums over d of each tower's Gaussians."""

    inc_vt: Tensor  # (B,) L_inc(Z_v,i in Z_t,i)
    inc_masked_v: Tensor  # (M_v,) L_inc(Z_v,m in Z_v,m^masked)
    inc_masked_t: Tensor  # (M_t,) L_inc(Z_t,m in Z_t,m^masked)
    var_v: Tensor  # (B,) sum_d sigma_v^2
    quad_v: Tensor  # (B,) sum_d (mu_v^2 - log sigma_v^2)
    var_t: Tensor
    quad_t: Tensor


def _pairs(inputs: tuple[Tensor, ...]) -> list[tuple[Tensor, ...]]:
    """The three inclusion pairs: (v, t), (v[index_v], v masked), (t[index_t], t masked)."""
    mu_v, lv_v, mu_t, lv_t, mu_vm, lv_vm, mu_tm, lv_tm, index_v, index_t = inputs
    return [
        (mu_v, lv_v, mu_t, lv_t),
        (mu_v.index_select(0, index_v), lv_v.index_select(0, index_v), mu_vm, lv_vm),
        (mu_t.index_select(0, index_t), lv_t.index_select(0, index_t), mu_tm, lv_tm),
    ]


def _sample_forward(inputs: tuple[Tensor, ...], c: float, log_eps: float, joint: bool, grads: bool):
    rows = [_inclusion_rows(*p, c, log_eps, joint, grads) for p in _pairs(inputs)]
    mu_v, lv_v, mu_t, lv_t = inputs[:4]
    terms = SampleTerms(*(loss for loss, _ in rows), *row_sums(mu_v, lv_v), *row_sums(mu_t, lv_t))  # type: ignore[arg-type]
    return terms, [g for _, gs in rows for g in gs]


class _SampleTermsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any) -> tuple[Tensor, ...]:  # type: ignore[override]
        inputs, (c, log_eps, joint) = args[:10], args[10:]
        terms, grads = _sample_forward(inputs, c, log_eps, joint, grads=True)
        ctx.save_for_backward(*inputs[:4], *inputs[8:10], *grads)
        return tuple(terms)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, *g: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        mu_v, lv_v, mu_t, lv_t, index_v, index_t, *inc = ctx.saved_tensors
        (vt_mu, vt_l1, vt_l2, vt_r), (mv_mu, mv_l1, mv_l2, mv_r), (mt_mu, mt_l1, mt_l2, mt_r) = (
            inc[i : i + 4] for i in (0, 4, 8)
        )
        # Per-row factors: the kernel's r times the upstream gradient of each inclusion term.
        r_vt, r_mv, r_mt = ((r * gi)[:, None] for r, gi in ((vt_r, g[0]), (mv_r, g[1]), (mt_r, g[2])))
        # Each input's gradient in one buffer: inclusion (v in t), the sums' part, the masked rows.
        g_mu_v = torch.mul(vt_mu, 4.0 * r_vt).addcmul_(mu_v, g[4][:, None], value=2.0)
        g_mu_t = torch.mul(vt_mu, -4.0 * r_vt).addcmul_(mu_t, g[6][:, None], value=2.0)
        g_lv_v, g_lv_t = torch.mul(vt_l1, r_vt), torch.mul(vt_l2, -r_vt)
        add_row_sums_grad(lv_v, g[3], g[4], g_lv_v, accumulate=True)
        add_row_sums_grad(lv_t, g[5], g[6], g_lv_t, accumulate=True)
        g_mu_v.index_add_(0, index_v, mv_mu * (4.0 * r_mv))
        g_lv_v.index_add_(0, index_v, mv_l1 * r_mv)
        g_mu_t.index_add_(0, index_t, mt_mu * (4.0 * r_mt))
        g_lv_t.index_add_(0, index_t, mt_l1 * r_mt)
        masked = (mv_mu * (-4.0 * r_mv), mv_l2 * -r_mv, mt_mu * (-4.0 * r_mt), mt_l2 * -r_mt)
        return g_mu_v, g_lv_v, g_mu_t, g_lv_t, *masked, None, None, None, None, None


@full_precision
def sample_terms(
    mu_v: Tensor,
    lv_v: Tensor,
    mu_t: Tensor,
    lv_t: Tensor,
    masked_v: tuple[Tensor, Tensor, Tensor] | None = None,
    masked_t: tuple[Tensor, Tensor, Tensor] | None = None,
    *,
    c: float,
    log_eps: float,
    joint: bool,
) -> SampleTerms:
    """ProLIP's per-sample terms of one worker's rows, with one fused backward (see the module doc).

    `masked_v` / `masked_t`: (index (M,) into the local rows, mu (M, D), log sigma^2 (M, D)) of the
    masked variants, or None (M = 0). Inclusion losses as `inclusion_terms` (`joint` or per-dimension).
    """
    none = mu_v.new_zeros(0, mu_v.shape[1])
    empty = (mu_v.new_zeros(0, dtype=torch.long), none, none)
    # The masked tensors sit inside tuples, which `full_precision` does not reach: cast them here.
    (index_v, mu_vm, lv_vm), (index_t, mu_tm, lv_tm) = (
        (m[0], m[1].to(mu_v.dtype), m[2].to(mu_v.dtype)) for m in (masked_v or empty, masked_t or empty)
    )
    inputs = (mu_v, lv_v, mu_t, lv_t, mu_vm, lv_vm, mu_tm, lv_tm, index_v, index_t)
    if _wants_grad(*inputs[:8]):
        return SampleTerms(*_SampleTermsFn.apply(*inputs, c, log_eps, joint))
    return _sample_forward(inputs, c, log_eps, joint, grads=False)[0]
