"""Fused forward/backward kernels for the pairwise sigmoid loss, the inclusion loss and VIB.

Autograd through the plain formulas allocates a fresh tensor for every intermediate and runs every
elementwise step as its own pass over memory. At B = 4096 a (B, B) float32 matrix is 64 MiB: each such
temporary costs a pass through main memory and page faults on a fresh allocation, and the pairwise loss's
softplus, its backward, the label diagonal's scatter and the gradient sum made four of them. The inclusion
loss's many small (B, D) steps each left a buffer for the backward. The `autograd.Function`s here
compute the same formulas (written out in `training/losses.py` and `training/inclusion.py`) with
hand-derived gradients, on CPU in blocks of rows small enough to stay in the cache (one block elsewhere):

- `pair_sigmoid_loss`: one (B, N) buffer in all. The forward turns the logits into sigmoids in place,
  block by block, after taking the loss from them; the backward multiplies that buffer into the two
  gradient products and subtracts the positives' rows as (B, K) corrections, so it never writes to the
  buffer and can run twice (``retain_graph``).
- `inclusion_terms`: the loss per sample and, when an input needs it, its gradient for a unit upstream
  gradient, both in the forward's blocks; the backward scales those by the upstream gradient.
- `gaussian_kl` (VIB) and `exp_row_sum` (PPCL's σ² sums): each sum over d taken before the terms are
  combined, with the one-line gradients written out.

Every result equals autograd on the plain formulas to float rounding; tests/test_loss_kernels.py checks
every kernel with `torch.autograd.gradcheck` in float64 and against autograd on the references.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

_LOG2 = math.log(2.0)
_Fn = TypeVar("_Fn", bound=Callable[..., Any])
# Elements per block on CPU: 64K float32 = 256 KiB, so a block and the few temporaries made from it stay
# in a core's L2 cache; larger blocks fall out of it, smaller ones pay Python's per-op overhead. On an
# accelerator every op is a kernel launch and there is no such cache to fit: one block of all rows.
BLOCK_ELEMENTS = 1 << 16


def full_precision(fn: _Fn) -> _Fn:
    """Run `fn` outside autocast with floating tensor arguments promoted to >= float32."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        floats = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and a.is_floating_point()]
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in floats), torch.float32)

        def cast(a: Any) -> Any:
            return a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() else a

        with torch.autocast(device_type=floats[0].device.type, enabled=False):
            return fn(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

    return wrapper  # type: ignore[return-value]


def _block_rows(t: Tensor) -> int:
    """Rows per block for a (rows, width) tensor `t`."""
    if t.device.type != "cpu":
        return max(1, t.shape[0])
    return max(1, BLOCK_ELEMENTS // max(t.shape[-1], 1))


# ---------------------------------------------------------------- pairwise sigmoid loss


class _PairSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        rows: Tensor,
        cols: Tensor,
        row_bias: Tensor,
        col_bias: Tensor,
        bias: Tensor,
        offset: int,
        n: int,
    ) -> Tensor:
        b = rows.shape[0]
        probs = torch.mm(rows, cols.T)  # the one (B, N) buffer: logits, then sigmoids
        want_rows, want_cols = ctx.needs_input_grad[2], ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        row_sums = probs.new_zeros(b) if want_rows or ctx.needs_input_grad[4] else None
        col_sums = probs.new_zeros(probs.shape[1]) if want_cols else None
        total = probs.new_zeros(())
        step = _block_rows(probs)
        for i in range(0, b, step):
            block = probs[i : i + step]
            block.add_(col_bias).add_((row_bias[i : i + step] + bias)[:, None])
            total += F.softplus(block).sum() - block.diagonal(offset + i).sum()
            block.sigmoid_()
            if row_sums is not None:
                torch.sum(block, dim=1, out=row_sums[i : i + step])
            if col_sums is not None:
                col_sums += block.sum(0)
        ctx.save_for_backward(rows, cols, probs, row_sums, col_sums)
        ctx.offset, ctx.n = offset, n
        return total / n

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        rows, cols, probs, row_sums, col_sums = ctx.saved_tensors
        b, lo = rows.shape[0], ctx.offset
        scale = grad / ctx.n
        # d loss / d logit_ij = (sigmoid(l_ij) - [j = offset + i]) / n; the label term is a (B, K) slice.
        g_rows = g_cols = g_row_bias = g_col_bias = g_bias = None
        if ctx.needs_input_grad[0]:
            g_rows = torch.mm(probs, cols).sub_(cols[lo : lo + b]).mul_(scale)
        if ctx.needs_input_grad[1]:
            g_cols = torch.mm(probs.T, rows)
            g_cols[lo : lo + b] -= rows
            g_cols.mul_(scale)
        if ctx.needs_input_grad[2]:
            g_row_bias = (row_sums - 1.0) * scale
        if ctx.needs_input_grad[3]:
            g_col_bias = col_sums.clone()
            g_col_bias[lo : lo + b] -= 1.0
            g_col_bias.mul_(scale)
        if ctx.needs_input_grad[4]:
            g_bias = (row_sums.sum() - b) * scale
        return g_rows, g_cols, g_row_bias, g_col_bias, g_bias, None, None


def pair_sigmoid_loss(
    rows: Tensor,
    cols: Tensor,
    bias: Tensor,
    *,
    row_bias: Tensor | None = None,
    col_bias: Tensor | None = None,
    offset: int = 0,
    n: int | None = None,
) -> Tensor:
    """sum_ij softplus(l_ij) - sum_i l_{i, offset+i}, divided by n, for l = rows.cols^T + r_i + c_j + bias.

    That is -sum log sigmoid(y l) / n with y = +1 at (i, offset + i) and -1 elsewhere (SigLIP's loss with
    the positives on the shifted diagonal). Shapes: rows (B, K), cols (N, K), row_bias (B,), col_bias (N,),
    bias a scalar; n defaults to N. Memory: one (B, N) buffer. Callers promote dtypes (`full_precision`).
    """
    row_bias = rows.new_zeros(rows.shape[0]) if row_bias is None else row_bias
    col_bias = cols.new_zeros(cols.shape[0]) if col_bias is None else col_bias
    n = cols.shape[0] if n is None else n
    return _PairSigmoid.apply(rows, cols, row_bias, col_bias, bias, offset, n)


# ---------------------------------------------------------------- inclusion loss (Eq. 5)


def _inclusion_block(
    gaussians: tuple[Tensor, ...], c: float, log_eps: float, joint: bool, out: tuple[Tensor, ...] | None
) -> Tensor:
    """Loss per row of (mu1, lv1, mu2, lv2); with `out`, writes (d/d mu1, d/d lv1, d/d lv2) of it there
    (d/d mu2 = -d/d mu1).

    Per dimension, with x = l1 - l2, s = exp(l), P = log(s2 + 2 s1) = l2 + softplus(x + log 2),
    Q = log(s1 + 2 s2) = l1 + softplus(log 2 - x), eP = eps e^-P, eQ = eps e^-Q, k = eP - eQ:
        2 h = P - Q - x + 2 (mu1 - mu2)^2 k                             (training/inclusion.py's H_d)
        2 dh/dl1 = p - q - 1 - 2 (mu1 - mu2)^2 (eP p - eQ q),  p = dP/dl1 = sigmoid(x + log 2),
                                                               q = dQ/dl1 = sigmoid(x - log 2)
        dh/dl2 = -(mu1 - mu2)^2 k - dh/dl1,   dh/dmu1 = 2 (mu1 - mu2) k = -dh/dmu2.
    Twice h and its derivatives are formed (one multiply fewer each) and the 1/2 rides on the coefficient.
    """
    mu1, lv1, mu2, lv2 = gaussians
    x = lv1 - lv2
    x_plus = x + _LOG2
    x_minus = torch.rsub(x, _LOG2)  # log 2 - x
    big_p = F.softplus(x_plus).add_(lv2)
    big_q = F.softplus(x_minus).add_(lv1)
    e_p = torch.rsub(big_p, log_eps).exp_()
    e_q = torch.rsub(big_q, log_eps).exp_()
    d = mu1 - mu2
    d2 = d.square()
    k = e_p - e_q
    h2 = big_p.sub_(big_q).sub_(x).addcmul_(d2, k, value=2.0)
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
    p, q = torch.sigmoid(x_plus), torch.sigmoid(x_minus).neg_().add_(1.0)
    t = e_p.mul_(p).addcmul_(e_q, q, value=-1.0)
    g_lv1 = p.sub_(q).sub_(1.0).addcmul_(d2, t, value=-2.0)
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
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _Inclusion.apply(*inputs, c, log_eps, joint)
    return _inclusion_rows(*inputs, c, log_eps, joint, grads=False)[0]


# ---------------------------------------------------------------- VIB (Eq. A.2)


class _GaussianKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, mu: Tensor, lv: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        var = lv.exp()
        kl = (var.sum(-1) + torch.linalg.vecdot(mu, mu) - lv.sum(-1) - mu.shape[-1]).mul_(0.5 * scale)
        # d kl / d mu = scale mu, d kl / d lv = scale (sigma^2 - 1) / 2, kept in the exp's own buffer.
        ctx.save_for_backward(mu, var.sub_(1.0).mul_(0.5 * scale))
        ctx.scale = scale
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        mu, d_lv = ctx.saved_tensors
        per_row = grad[:, None]
        g_mu = mu * (per_row * ctx.scale) if ctx.needs_input_grad[0] else None
        return g_mu, d_lv * per_row if ctx.needs_input_grad[1] else None, None


def gaussian_kl(mu: Tensor, lv: Tensor, scale: float = 1.0) -> Tensor:
    """scale * KL(N(mu, exp(lv)) || N(0, I)) per row: scale/2 sum_d (sigma^2 + mu^2 - lv - 1). (B, D) -> (B,)."""
    return _GaussianKL.apply(mu, lv, scale)


class _ExpRowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, lv: Tensor) -> Tensor:  # type: ignore[override]
        out = lv.new_empty(lv.shape[0])
        step = _block_rows(lv)
        for i in range(0, lv.shape[0], step):  # exp per block, summed in cache: no (B, D) buffer
            torch.sum(lv[i : i + step].exp(), dim=-1, out=out[i : i + step])
        ctx.save_for_backward(lv)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (lv,) = ctx.saved_tensors
        return lv.exp().mul_(grad[:, None])


def exp_row_sum(lv: Tensor) -> Tensor:
    """sum_d exp(lv_d) per row, (B, D) -> (B,): the sigma^2 sums of PPCL's logits (Eq. 2)."""
    return _ExpRowSum.apply(lv)
