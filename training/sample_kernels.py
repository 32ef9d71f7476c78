"""Fused kernels for ProLIP's per-sample terms: the inclusion loss (Eq. 5) and, for the objective (Eq. 6),
every O(B·D) term in one `autograd.Function` with one gradient buffer per input.

Autograd on the objective's per-sample terms would give each input a separate (B, D) gradient per term
(PPCL's σ² sums, inclusion, masked inclusion through an index, VIB) and add them up: a fresh (B, D)
buffer and a pass over memory for each, and a zero-filled (B, D) buffer per indexed masked term. At B = 4096
such buffers are 8 MiB each, freshly mapped pages included. `sample_terms` instead computes the inclusion
losses (with their gradients for a unit upstream gradient, as `inclusion_terms` does) and the sums over d
that PPCL and VIB need (`training.loss_kernels.row_sums`) in the forward, and its backward writes each
input's whole gradient into one buffer: the scaled inclusion gradient, then the σ² and VIB parts, then
the masked rows added at their indices. Formulas: `_inclusion_block` and `training/inclusion.py`;
tests/test_loss_kernels.py checks both kernels with `gradcheck` and the objective against autograd on
float64 references.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from training.loss_kernels import _block_rows, add_row_sums_grad, full_precision, row_sums


def _inclusion_block(
    gaussians: tuple[Tensor, ...], c: float, log_eps: float, joint: bool, out: tuple[Tensor, ...] | None
) -> Tensor:
    """Loss per row of (mu1, lv1, mu2, lv2); with `out`, writes (d/d mu1, d/d lv1, d/d lv2) of it there
    (d/d mu2 = -d/d mu1).

    Per dimension, with s = exp(l), x = l1 - l2 and t = sigmoid(x) = s1 / S (S = s1 + s2), the two
    variance sums of H are s2 + 2 s1 = S (1 + t) and s1 + 2 s2 = S (2 - t). With i1 = 1 / (1 + t),
    i2 = 1 / (2 - t), w = eps / S = exp(log_eps - max(l1, l2)) max(t, 1 - t) (finite for any l) and
    k = w (i1 - i2) = eps / (s2 + 2 s1) - eps / (s1 + 2 s2):
        2 h      = log(i2 / i1) - x + 2 (mu1 - mu2)^2 k                    (training/inclusion.py's H_d)
        2 dh/dl1 = 2 t i1 - t i2 - 1 - 2 (mu1 - mu2)^2 w t (2 i1^2 - i2^2)
        dh/dl2 = -(mu1 - mu2)^2 k - dh/dl1,   dh/dmu1 = 2 (mu1 - mu2) k = -dh/dmu2.
    One sigmoid, one exp and one log per element: the log-sum-exp form of the same H takes two softplus,
    each about ten times an exp on CPU. Twice h and its derivatives are formed (one multiply fewer each)
    and the 1/2 rides on the coefficient.
    """
    mu1, lv1, mu2, lv2 = gaussians
    x = lv1 - lv2
    t = torch.sigmoid(x)
    w = torch.maximum(lv1, lv2).sub_(log_eps).neg_().exp_().mul_(torch.sub(t, 0.5).abs_().add_(0.5))
    i1 = t.add(1.0).reciprocal_()
    i2 = torch.rsub(t, 2.0).reciprocal_()
    d = mu1 - mu2
    d2 = d.square()
    k = torch.sub(i1, i2).mul_(w)
    h2 = torch.div(i2, i1).log_().sub_(x).addcmul_(d2, k, value=2.0)
    if joint:
        ch = h2.sum(-1).mul_(-0.5 * c)
        loss = F.softplus(ch)
        coef = torch.sigmoid(ch).mul_(-0.5 * c)[:, None]  # d loss / d (2 h_d), the same for every d
    else:
        ch = h2.mul_(-0.5 * c)
        loss = F.softplus(ch).mean(-1)
        coef = torch.sigmoid(ch).mul_(-0.5 * c / h2.shape[-1])
    if out is None:
        return loss
    ti1 = t * i1
    ti2 = t.mul_(i2)
    g_lv1 = ti1.mul(2.0).sub_(ti2).sub_(1.0)
    z = ti2.mul_(i2).sub_(ti1.mul_(i1), alpha=2.0)  # -t (2 i1^2 - i2^2)
    g_lv1.addcmul_(w.mul_(d2), z, value=2.0)
    g_lv2 = torch.add(g_lv1, d2.mul_(k), alpha=2.0).neg_()
    torch.mul(d.mul_(k), coef, out=out[0]).mul_(4.0)
    torch.mul(g_lv1, coef, out=out[1])
    torch.mul(g_lv2, coef, out=out[2])
    return loss


def _inclusion_rows(
    mu1: Tensor, lv1: Tensor, mu2: Tensor, lv2: Tensor, c: float, log_eps: float, joint: bool, grads: bool
) -> tuple[Tensor, list[Tensor]]:
    """`_inclusion_block` over blocks of rows: the loss (B,) and, with `grads`, its three (B, D) gradients."""
    loss = mu1.new_empty(mu1.shape[0])
    out = [torch.empty_like(mu1) for _ in range(3)] if grads else []
    step = _block_rows(mu1)
    for i in range(0, mu1.shape[0], step):
        s = slice(i, i + step)
        dst = (out[0][s], out[1][s], out[2][s]) if grads else None
        loss[s] = _inclusion_block((mu1[s], lv1[s], mu2[s], lv2[s]), c, log_eps, joint, dst)
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
        g_mu1, g_lv1, g_lv2 = ctx.saved_tensors
        per_row = grad[:, None]
        need = ctx.needs_input_grad
        return (
            g_mu1 * per_row if need[0] else None,
            g_lv1 * per_row if need[1] else None,
            g_mu1 * -per_row if need[2] else None,
            g_lv2 * per_row if need[3] else None,
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
        vt_mu, vt_lv1, vt_lv2, mv_mu, mv_lv1, mv_lv2, mt_mu, mt_lv1, mt_lv2 = inc
        g_vt, g_mv, g_mt, g_var_v, g_quad_v, g_var_t, g_quad_t = (x[:, None] for x in g)
        # Each input's gradient in one buffer: inclusion (v in t), the sums' part, the masked rows.
        g_mu_v = torch.mul(vt_mu, g_vt).addcmul_(mu_v, g_quad_v, value=2.0)
        g_mu_t = torch.mul(vt_mu, -g_vt).addcmul_(mu_t, g_quad_t, value=2.0)
        g_lv_v, g_lv_t = torch.mul(vt_lv1, g_vt), torch.mul(vt_lv2, g_vt)
        add_row_sums_grad(lv_v, g[3], g[4], g_lv_v, accumulate=True)
        add_row_sums_grad(lv_t, g[5], g[6], g_lv_t, accumulate=True)
        g_mu_v.index_add_(0, index_v, mv_mu * g_mv)
        g_lv_v.index_add_(0, index_v, mv_lv1 * g_mv)
        g_mu_t.index_add_(0, index_t, mt_mu * g_mt)
        g_lv_t.index_add_(0, index_t, mt_lv1 * g_mt)
        masked = (mv_mu * -g_mv, mv_lv2 * g_mv, mt_mu * -g_mt, mt_lv2 * g_mt)
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
    (index_v, mu_vm, lv_vm), (index_t, mu_tm, lv_tm) = masked_v or empty, masked_t or empty
    inputs = (mu_v, lv_v, mu_t, lv_t, mu_vm, lv_vm, mu_tm, lv_tm, index_v, index_t)
    if _wants_grad(*inputs[:8]):
        return SampleTerms(*_SampleTermsFn.apply(*inputs, c, log_eps, joint))
    return _sample_forward(inputs, c, log_eps, joint, grads=False)[0]
