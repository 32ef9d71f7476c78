"""Fused forward/backward kernels for the pairwise sigmoid loss and the sums over d behind PPCL and VIB.

Autograd through the plain formulas allocates a fresh tensor for every intermediate and runs every
elementwise step as its own pass over memory. At B = 4096 a (B, B) float32 matrix is 64 MiB: each such
temporary costs a pass through main memory and page faults on a fresh allocation, and the pairwise loss's
softplus, its backward, the label diagonal's scatter and the gradient sum made four of them. The
`autograd.Function`s here
compute the same formulas (written out in `training/losses/contrastive.py` and `training/losses/inclusion.py`) with
hand-derived gradients, on CPU in blocks of rows small enough to stay in the cache (one block elsewhere):

- `pair_sigmoid_loss`: one (B, N) buffer in all. The forward turns the logits into sigmoids in place,
  block by block, after taking the loss from them; the backward multiplies that buffer into the two
  gradient products and subtracts the positives' rows as (B, K) corrections, so it never writes to the
  buffer and can run twice (``retain_graph``).
- `gaussian_sums` (sum_d σ² and sum_d (μ² − log σ²), from which `gaussian_kl` is VIB) and `exp_row_sum`
  (PPCL's σ² sums): each sum over d taken block by block, the exp recomputed in the backward.
- The inclusion loss and the fused per-sample terms of the ProLIP objective are in
  `training/losses/fused/per_sample.py`.

Every result equals autograd on the plain formulas to float rounding; tests/training/losses/test_fused.py checks
every kernel with `torch.autograd.gradcheck` in float64 and against autograd on the references.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

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
        # Row sums serve the row-bias and bias gradients, column sums only the column bias's.
        want_rows, want_cols = ctx.needs_input_grad[2] or ctx.needs_input_grad[4], ctx.needs_input_grad[3]
        row_sums = probs.new_zeros(b) if want_rows else None
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


# ---------------------------------------------------------------- sums over d: σ² (Eq. 2) and VIB (Eq. A.2)


def row_sums(mu: Tensor | None, lv: Tensor) -> tuple[Tensor, Tensor | None]:
    """(sum_d exp(lv), sum_d (mu^2 - lv)) per row, (B, D) -> (B,) each (the second None without `mu`).

    Block by block, so the exp never fills a (B, D) buffer.
    """
    var = lv.new_empty(lv.shape[0])
    quad = None if mu is None else lv.new_empty(lv.shape[0])
    step = _block_rows(lv)
    for i in range(0, lv.shape[0], step):
        s = slice(i, i + step)
        torch.sum(lv[s].exp(), dim=-1, out=var[s])
        if quad is not None and mu is not None:
            torch.sum(mu[s].square().sub_(lv[s]), dim=-1, out=quad[s])
    return var, quad


def add_row_sums_grad(
    lv: Tensor, g_var: Tensor, g_quad: Tensor | None, out: Tensor, accumulate: bool
) -> None:
    """`out` (+)= d/d lv of `row_sums` for upstream (B,) gradients: exp(lv) g_var - g_quad, per row.

    (d/d mu is 2 mu g_quad.) The exp is recomputed block by block instead of kept from the forward.
    """
    step = _block_rows(lv)
    for i in range(0, lv.shape[0], step):
        s = slice(i, i + step)
        if accumulate:
            out[s].addcmul_(lv[s].exp(), g_var[s, None])
        else:
            torch.mul(lv[s].exp(), g_var[s, None], out=out[s])
        if g_quad is not None:
            out[s].sub_(g_quad[s, None])


class _GaussianSums(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, mu: Tensor, lv: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.save_for_backward(mu, lv)
        return row_sums(mu, lv)  # type: ignore[return-value]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_var: Tensor, g_quad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        mu, lv = ctx.saved_tensors
        g_lv = None
        if ctx.needs_input_grad[1]:
            g_lv = torch.empty_like(lv)
            add_row_sums_grad(lv, g_var, g_quad, g_lv, accumulate=False)
        return mu * (2.0 * g_quad)[:, None] if ctx.needs_input_grad[0] else None, g_lv


def gaussian_sums(mu: Tensor, lv: Tensor) -> tuple[Tensor, Tensor]:
    """Differentiable `row_sums(mu, lv)`: sum_d sigma^2 and sum_d (mu^2 - log sigma^2), (B,) each."""
    return _GaussianSums.apply(mu, lv)


def kl_from_sums(var: Tensor, quad: Tensor, dim: int, scale: float = 1.0) -> Tensor:
    """scale * KL(N(mu, sigma^2) || N(0, I)) per row from `gaussian_sums`: scale/2 (sum s + sum (mu^2 - lv) - D)."""
    return (var + quad - dim).mul(0.5 * scale)


def gaussian_kl(mu: Tensor, lv: Tensor, scale: float = 1.0) -> Tensor:
    """scale * KL(N(mu, exp(lv)) || N(0, I)) per row: scale/2 sum_d (sigma^2 + mu^2 - lv - 1). (B, D) -> (B,)."""
    return kl_from_sums(*gaussian_sums(mu, lv), mu.shape[-1], scale)


class _ExpRowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, lv: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(lv)
        return row_sums(None, lv)[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (lv,) = ctx.saved_tensors
        out = torch.empty_like(lv)
        add_row_sums_grad(lv, grad, None, out, accumulate=False)
        return out


def exp_row_sum(lv: Tensor) -> Tensor:
    """sum_d exp(lv_d) per row, (B, D) -> (B,): the sigma^2 sums of PPCL's logits (Eq. 2)."""
    return _ExpRowSum.apply(lv)
