"""The fused kernels' hand-written gradients (training/losses/fused/pairwise.py, training/losses/fused/per_sample.py),
checked independently.

`torch.autograd.gradcheck` compares each kernel's backward with finite differences in float64; the full
ProLIP objective's gradients (both reductions, every input and both learnable scalars) must equal autograd
through the float64 references of tests/training/losses/test_losses.py and tests/training/losses/test_reduction.py, which build the
B x B x D variance sums and the per-dimension paper-form measure with no shared code. The kernels work in
blocks of rows; a small block size makes every test cross block boundaries, with a short last block.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.training.losses.test_losses import (
    MASKED_KEYS,
    close,
    gaussians,
    masked_inputs,
    ref_inclusion_loss,
    ref_ppcl,
    ref_softplus,
    ref_vib,
    scalar,
)
from tests.training.losses.test_reduction import ref_official_inclusion, ref_official_vib
from training.losses import contrastive as L
from training.losses import inclusion as INC
from training.losses.fused import pairwise as K
from training.losses.fused import per_sample as S

F64 = torch.float64


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(K, "BLOCK_ELEMENTS", 20)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_pair_sigmoid_loss_gradcheck_and_reference():
    g = torch.Generator().manual_seed(50)
    rows, cols = torch.randn(5, 4, generator=g, dtype=F64), torch.randn(9, 4, generator=g, dtype=F64)
    row_bias, col_bias = torch.randn(5, generator=g, dtype=F64), torch.randn(9, generator=g, dtype=F64)
    leaves = _leaves(rows, cols, row_bias, col_bias, scalar(-1.5))

    def kernel(r, c, rb, cb, b):
        return K.pair_sigmoid_loss(r, c, b, row_bias=rb, col_bias=cb, offset=3, n=11)

    assert torch.autograd.gradcheck(kernel, leaves)
    labels = -torch.ones(5, 9, dtype=F64)
    labels[torch.arange(5), torch.arange(5) + 3] = 1

    def reference(r, c, rb, cb, b):
        logits = r @ c.T + rb[:, None] + cb[None, :] + b
        return ref_softplus(-labels * logits).sum() / 11

    ours, ref = kernel(*leaves), reference(*leaves)
    close(ours, ref, rtol=1e-12, atol=0)
    for a, b in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(ref, leaves), strict=True):
        close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["joint", "official"])
@pytest.mark.parametrize(
    ("c", "log_eps", "logvar_range"), [(10.0, -2.0, (-3.0, 0.0)), (1000.0, -20.0, (-12.0, -8.0))]
)
def test_inclusion_kernel_gradcheck(reduction, c, log_eps, logvar_range):
    mu1, lv1 = gaussians(7, 5, 51, logvar_range=logvar_range)
    mu2, lv2 = gaussians(7, 5, 52, logvar_range=logvar_range)
    # Near-identical pairs keep c H in the sigmoid's sloped range, where the gradient is not ~0 or ~c.
    mu2, lv2 = mu1 + 0.1 * (mu2 - mu1), lv1 + 0.02 * (lv2 - lv1)
    leaves = _leaves(mu1, lv1, mu2, lv2)

    def kernel(*t):
        return INC.inclusion_loss(*t, c=c, log_eps=log_eps, reduction=reduction)

    assert torch.autograd.gradcheck(kernel, leaves)


def _objective_inputs(n: int, d: int, index: list[int]):
    mu_v, lv_v = gaussians(n, d, 53)
    mu_t, lv_t = gaussians(n, d, 54)
    masked = masked_inputs(n, d, index, 55)
    return _leaves(mu_v, lv_v, mu_t, lv_t, *masked.values(), scalar(math.log(10.0)), scalar(-10.0))


def _reference_objective(reduction, idx, mu_v, lv_v, mu_t, lv_t, mv, lvm, mt, ltm, log_a, b, kw):
    if reduction == "joint":
        inc = lambda *t: ref_inclusion_loss(*t, kw["c"], kw["log_eps"]).mean()  # noqa: E731
        vib = lambda mu, lv: ref_vib(mu, lv).mean()  # noqa: E731
    else:
        inc = lambda *t: ref_official_inclusion(*t, kw["c"], kw["log_eps"])  # noqa: E731
        vib = ref_official_vib
    ppcl = ref_ppcl(mu_v, lv_v, mu_t, lv_t, log_a.exp(), b)
    return (
        ppcl
        + kw["alpha1"] * inc(mu_v, lv_v, mu_t, lv_t)
        + kw["alpha2"] * (inc(mu_v[idx], lv_v[idx], mv, lvm) + inc(mu_t[idx], lv_t[idx], mt, ltm))
        + kw["beta"] * (vib(mu_v, lv_v) + vib(mu_t, lv_t))
    )


@pytest.mark.parametrize("reduction", ["joint", "official"])
def test_objective_gradients_match_reference_autograd(reduction):
    """Every input's gradient, log σ² included, equals autograd through the float64 reference formulas."""
    n, d, index = 8, 6, [1, 4, 6]
    leaves = _objective_inputs(n, d, index)
    idx = torch.tensor(index)
    kw = dict(alpha1=0.3, alpha2=0.2, beta=0.1, c=10.0, log_eps=-2.0)
    masked = dict(zip(MASKED_KEYS, leaves[4:8], strict=True))
    ours = L.prolip_objective(
        *leaves[:4], *leaves[8:], masked_index=idx, reduction=reduction, **masked, **kw
    )["total"]
    ref = _reference_objective(reduction, idx, *leaves, kw)
    close(ours, ref, rtol=1e-10, atol=0)
    names = ["mu_v", "logvar_v", "mu_t", "logvar_t", *MASKED_KEYS, "log_scale", "bias"]
    grads = zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(ref, leaves), names, strict=True)
    for a, b, name in grads:
        close(a, b, rtol=1e-9, atol=1e-12, msg=name)


def test_backward_twice_and_without_grad_give_the_same_numbers():
    """The kernels keep nothing they modify: a retained graph differentiates twice to the same values,
    and the no-grad path (evaluation) returns the same loss."""
    leaves = _objective_inputs(8, 6, [0, 5])
    masked = dict(zip(MASKED_KEYS, leaves[4:8], strict=True))
    kw = dict(masked_index=torch.tensor([0, 5]), c=10.0, log_eps=-2.0, **masked)
    total = L.prolip_objective(*leaves[:4], *leaves[8:], **kw)["total"]
    first = torch.autograd.grad(total, leaves, retain_graph=True)
    second = torch.autograd.grad(total, leaves)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        again = L.prolip_objective(*leaves[:4], *leaves[8:], **kw)["total"]
    close(again, total.detach(), rtol=1e-14, atol=0)


def test_inputs_that_need_no_gradient_get_none_and_the_others_match():
    mu1, lv1 = gaussians(6, 5, 56)
    mu2, lv2 = gaussians(6, 5, 57)
    only_lv1 = lv1.clone().requires_grad_()
    loss = INC.inclusion_loss(mu1, only_lv1, mu2, lv2, c=10.0, log_eps=-2.0).sum()
    (grad,) = torch.autograd.grad(loss, [only_lv1])
    ref_lv1 = lv1.clone().requires_grad_()
    (ref,) = torch.autograd.grad(ref_inclusion_loss(mu1, ref_lv1, mu2, lv2, 10.0, -2.0).sum(), [ref_lv1])
    close(grad, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("scale", [1.0, 1 / 5])
def test_gaussian_kl_gradcheck(scale):
    mu, lv = gaussians(6, 5, 58, logvar_range=(-4.0, 2.0))
    assert torch.autograd.gradcheck(lambda m, v: K.gaussian_kl(m, v, scale), _leaves(3 * mu, lv))


@pytest.mark.parametrize("reduction", ["joint", "official"])
def test_sample_terms_gradcheck_with_one_tower_masked(reduction):
    """The fused per-sample kernel: every output against finite differences, with masked variants of the
    image tower only (the text tower's masked terms are then empty) and a masked row listed twice."""
    mu_v, lv_v = gaussians(7, 5, 60)
    mu_t, lv_t = gaussians(7, 5, 61)
    mu_vm, lv_vm = gaussians(3, 5, 62)
    index = torch.tensor([5, 0, 5])
    leaves = _leaves(mu_v, lv_v, mu_t, lv_t, mu_vm, lv_vm)

    def kernel(mv, lv, mt, lt, mvm, lvm):
        terms = S.sample_terms(mv, lv, mt, lt, (index, mvm, lvm), None, c=10.0, log_eps=-2.0,
                               joint=reduction == "joint")  # fmt: skip
        assert terms.inc_masked_t.shape == (0,)
        return tuple(terms)

    assert torch.autograd.gradcheck(kernel, leaves)
    terms = kernel(*leaves)
    inc = lambda *t: INC.inclusion_loss(*t, c=10.0, log_eps=-2.0, reduction=reduction)  # noqa: E731
    close(terms[0], inc(mu_v, lv_v, mu_t, lv_t), rtol=1e-14, atol=0)
    close(terms[1], inc(mu_v[index], lv_v[index], mu_vm, lv_vm), rtol=1e-14, atol=0)
    close(terms[3], lv_v.exp().sum(-1), rtol=1e-14, atol=0)
    close(terms[6], (mu_t.square() - lv_t).sum(-1), rtol=1e-14, atol=0)


def test_exp_row_sum_gradcheck():
    _, lv = gaussians(7, 5, 59, logvar_range=(-4.0, 2.0))
    (leaf,) = _leaves(lv)
    assert torch.autograd.gradcheck(K.exp_row_sum, (leaf,))
    close(K.exp_row_sum(leaf), lv.exp().sum(-1), rtol=1e-14, atol=0)


def test_columns_that_alias_the_local_rows_give_the_same_objective_and_gradients():
    """One process may pass the text columns as a view of its own rows (the benchmark does); the objective
    then reuses the rows' σ² sums for the columns, with the same value and gradients as passing none."""
    leaves = _objective_inputs(8, 6, [2, 3])
    masked = dict(zip(MASKED_KEYS, leaves[4:8], strict=True))
    kw = dict(masked_index=torch.tensor([2, 3]), c=10.0, log_eps=-2.0, **masked)
    plain = L.prolip_objective(*leaves[:4], *leaves[8:], **kw)["total"]
    mu_t, lv_t = leaves[2], leaves[3]
    alias = L.prolip_objective(*leaves[:4], *leaves[8:], mu_t_all=mu_t[:], logvar_t_all=lv_t[:], **kw)[
        "total"
    ]
    close(alias, plain, rtol=1e-14, atol=0)
    for a, b in zip(torch.autograd.grad(alias, leaves), torch.autograd.grad(plain, leaves), strict=True):
        close(a, b, rtol=1e-12, atol=1e-15)
