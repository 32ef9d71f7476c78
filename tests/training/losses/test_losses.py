"""Losses against float64 references written here from the formulas (training/losses/contrastive.py, pcmepp.py).

The references deliberately use the naive forms (B x B x D broadcasts, the paper's A, B, C expression,
numerical quadrature) rather than the implementation's helpers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import integrate

from tests.fixtures import open_clip_src
from training.losses import contrastive as L
from training.losses import inclusion as INC
from training.losses import pcmepp as P
from training.losses import prolip as PPCL
from training.losses.registry import LOSS_SPECS, build_loss

F64 = torch.float64


def gaussians(n: int, d: int, seed: int, dtype=F64, logvar_range=(-3.0, 0.0)):
    g = torch.Generator().manual_seed(seed)
    mu = F.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=-1)
    lo, hi = logvar_range
    logvar = lo + (hi - lo) * torch.rand(n, d, generator=g, dtype=dtype)
    return mu, logvar


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def close(actual, expected, *, rtol: float = 1e-6, atol: float = 1e-6, msg: str = "") -> None:
    # numpy's checker: torch.testing.assert_close imports torch.distributed.tensor (about 1 s) on first use.
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_allclose(
        actual.detach().numpy(), expected.detach().numpy(), rtol=rtol, atol=atol, err_msg=msg
    )


# ---------------------------------------------------------------- references (float64, naive)


def ref_softplus(x):
    return torch.where(x > 30, x, torch.log1p(torch.exp(torch.clamp(x, max=30))))


def ref_sigmoid_loss(logits, n):
    labels = 2 * torch.eye(*logits.shape, dtype=F64) - 1
    return ref_softplus(-labels * logits).sum() / n


def ref_ppcl(mu_v, lv_v, mu_t, lv_t, a, b):
    dot = (mu_v[:, None, :] * mu_t[None, :, :]).sum(-1)
    var = (lv_v.exp()[:, None, :] + lv_t.exp()[None, :, :]).sum(-1)
    return ref_sigmoid_loss(a * (dot - 0.5 * var) + b, mu_v.shape[0])


def ref_inc(mu1, lv1, mu2, lv2, log_eps):
    """Paper form (Eq. 3 / A.5) with v = sigma^2 / eps, plus the constant it omits, -log(pi) - 1.5 log(2)."""
    v1, v2 = lv1.exp() / math.exp(log_eps), lv2.exp() / math.exp(log_eps)
    A = 1 / v1 + 1 / (2 * v2)
    B = 2 * mu1 / v1 + mu2 / v2
    C = mu1**2 / v1 + mu2**2 / (2 * v2)
    per_dim = (
        -torch.log(v1)
        - 0.5 * torch.log(v2)
        - 0.5 * torch.log(A)
        + B**2 / (4 * A)
        - C
        - math.log(math.pi)
        - 1.5 * math.log(2)
    )
    return per_dim.sum(-1)


def ref_inclusion_loss(mu1, lv1, mu2, lv2, c, log_eps):
    h = ref_inc(mu1, lv1, mu2, lv2, log_eps) - ref_inc(mu2, lv2, mu1, lv1, log_eps)
    return ref_softplus(-c * h)


def ref_vib(mu, lv):
    return -0.5 * (1 + lv - mu**2 - lv.exp()).sum(-1)


def quad_log_inclusion(m1, s1, m2, s2):
    def pdf(x, m, s):
        return math.exp(-((x - m) ** 2) / (2 * s)) / math.sqrt(2 * math.pi * s)

    half = 14 * math.sqrt(max(s1, s2))
    val, _ = integrate.quad(
        lambda x: pdf(x, m1, s1) ** 2 * pdf(x, m2, s2),
        min(m1, m2) - half,
        max(m1, m2) + half,
        points=[m1, m2],
        epsabs=0,
        epsrel=1e-11,
        limit=200,
    )
    return math.log(val)


# ---------------------------------------------------------------- distances, logits, pairwise losses


def test_csd_and_matrix_match_reference():
    mu_a, lv_a = gaussians(5, 7, 0)
    mu_b, lv_b = gaussians(4, 7, 1)
    mu_a = mu_a * 1.7  # the matrix form must be exact without unit norm too
    ref = ((mu_a[:, None] - mu_b[None]) ** 2).sum(-1) + (lv_a.exp()[:, None] + lv_b.exp()[None]).sum(-1)
    close(L.csd_matrix(mu_a, lv_a, mu_b, lv_b), ref, rtol=0, atol=1e-12)
    close(L.csd(mu_a[:4], lv_a[:4], mu_b, lv_b), ref.diagonal(), rtol=0, atol=1e-12)


def test_ppcl_logits_match_reference():
    mu_v, lv_v = gaussians(5, 8, 2)
    mu_t, lv_t = gaussians(6, 8, 3)
    a, b = 7.0, -3.0
    ref = (
        a * ((mu_v[:, None] * mu_t[None]).sum(-1) - 0.5 * (lv_v.exp()[:, None] + lv_t.exp()[None]).sum(-1))
        + b
    )
    out = L.ppcl_logits(mu_v, lv_v, mu_t, lv_t, scalar(math.log(a)), scalar(b))
    close(out, ref, rtol=0, atol=1e-12)


def test_sigmoid_pair_loss_label_free_form_equals_labelled():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(4), dtype=F64) * 5
    labels = -torch.ones(4, 10, dtype=F64)
    labels[torch.arange(4), torch.arange(4) + 3] = 1
    ref = ref_softplus(-labels * logits).sum() / 10
    close(L.sigmoid_pair_loss(logits, labels), ref, rtol=0, atol=1e-12)
    close(L.sigmoid_pair_loss(logits, offset=3), ref, rtol=0, atol=1e-12)


def test_siglip_and_ppcl_match_reference():
    mu_v, lv_v = gaussians(6, 8, 5)
    mu_t, lv_t = gaussians(6, 8, 6)
    a, b = 10.0, -10.0
    log_a, bias = scalar(math.log(a)), scalar(b)
    ref_sig = ref_sigmoid_loss(a * mu_v @ mu_t.T + b, 6)
    close(L.siglip_loss(mu_v, mu_t, log_a, bias), ref_sig, rtol=0, atol=1e-10)
    ref = ref_ppcl(mu_v, lv_v, mu_t, lv_t, a, b)
    close(PPCL.ppcl_loss(mu_v, lv_v, mu_t, lv_t, log_a, bias), ref, rtol=0, atol=1e-10)


def test_ppcl_with_vanishing_variance_equals_siglip():
    mu_v, _ = gaussians(6, 8, 7)
    mu_t, _ = gaussians(6, 8, 8)
    tiny = torch.full_like(mu_v, -60.0)
    log_a, bias = scalar(math.log(10.0)), scalar(-10.0)
    ppcl = PPCL.ppcl_loss(mu_v, tiny, mu_t, tiny, log_a, bias)
    close(ppcl, L.siglip_loss(mu_v, mu_t, log_a, bias), rtol=1e-12, atol=0)


def test_clip_loss_matches_infonce_reference():
    mu_v, _ = gaussians(6, 8, 9)
    mu_t, _ = gaussians(6, 8, 10)
    scale = 1 / 0.07
    logits = scale * mu_v @ mu_t.T

    def ce(lg):  # mean over rows of -log softmax at the diagonal
        m = lg.max(dim=1, keepdim=True).values
        lse = m.squeeze(1) + torch.log(torch.exp(lg - m).sum(1))
        return (lse - lg.diagonal()).mean()

    ref = 0.5 * (ce(logits) + ce(logits.T))
    close(L.clip_loss(mu_v, mu_t, scalar(math.log(scale))), ref, rtol=0, atol=1e-10)


def test_against_open_clip():
    open_clip_loss = open_clip_src.load_or_skip("loss")
    mu_v, _ = gaussians(6, 8, 11, dtype=torch.float32)
    mu_t, _ = gaussians(6, 8, 12, dtype=torch.float32)
    scale, bias = torch.tensor(12.0), torch.tensor(-8.0)
    ref_clip = open_clip_loss.ClipLoss()(mu_v, mu_t, scale)
    ref_sig = open_clip_loss.SigLipLoss()(mu_v, mu_t, scale, bias)
    close(L.clip_loss(mu_v, mu_t, scale.log()), ref_clip, rtol=1e-5)
    close(L.siglip_loss(mu_v, mu_t, scale.log(), bias), ref_sig, rtol=1e-5)


# ---------------------------------------------------------------- inclusion and VIB


def test_inclusion_measure_matches_quadrature():
    grid = [
        (m1, s1, m2, s2)
        for m1 in (-1.0, 0.0)
        for m2 in (0.0, 0.7)
        for s1 in (0.1, 0.6, 2.0)
        for s2 in (0.1, 0.6, 2.0)
    ]
    m1, s1, m2, s2 = (torch.tensor([g[i] for g in grid], dtype=F64)[:, None] for i in range(4))
    out = INC.inclusion_log_measure(m1, s1.log(), m2, s2.log(), log_eps=0.0)
    ref = torch.tensor([quad_log_inclusion(*g) for g in grid], dtype=F64)
    close(out, ref, rtol=0, atol=1e-8)
    # With eps != 1 the measure is the log-integral of the Gaussians with variances sigma^2 / eps.
    log_eps = -1.5
    out_eps = INC.inclusion_log_measure(m1, s1.log(), m2, s2.log(), log_eps=log_eps)
    ref_eps = [quad_log_inclusion(a, b / math.exp(log_eps), c, d / math.exp(log_eps)) for a, b, c, d in grid]
    close(out_eps, torch.tensor(ref_eps, dtype=F64), rtol=0, atol=1e-8)


def test_inclusion_measure_sums_dimensions_and_matches_paper_form():
    mu1, lv1 = gaussians(3, 5, 13)
    mu2, lv2 = gaussians(3, 5, 14)
    per_dim = [
        quad_log_inclusion(mu1[0, d].item(), lv1[0, d].exp().item(), mu2[0, d].item(), lv2[0, d].exp().item())
        for d in range(5)
    ]
    out = INC.inclusion_log_measure(mu1, lv1, mu2, lv2)
    assert abs(out[0].item() - sum(per_dim)) < 1e-7
    for log_eps in (0.0, -2.0, -5.0):
        close(
            INC.inclusion_log_measure(mu1, lv1, mu2, lv2, log_eps),
            ref_inc(mu1, lv1, mu2, lv2, log_eps),
            rtol=1e-10,
            atol=1e-8,
        )


def test_inclusion_hypothesis_is_antisymmetric_difference_of_measures():
    mu1, lv1 = gaussians(6, 5, 15, logvar_range=(-4, 1))
    mu2, lv2 = gaussians(6, 5, 16, logvar_range=(-4, 1))
    for log_eps in (0.0, -3.0):
        h = INC.inclusion_hypothesis(mu1, lv1, mu2, lv2, log_eps)
        ref = ref_inc(mu1, lv1, mu2, lv2, log_eps) - ref_inc(mu2, lv2, mu1, lv1, log_eps)
        close(h, ref, rtol=1e-10, atol=1e-8)
        close(INC.inclusion_hypothesis(mu2, lv2, mu1, lv1, log_eps), -h, rtol=0, atol=1e-12)


def test_inclusion_hypothesis_signs():
    zero, one = torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64)
    narrow, wide = torch.full((1, 1), math.log(0.1), dtype=F64), torch.full((1, 1), math.log(2.0), dtype=F64)
    assert INC.inclusion_hypothesis(zero, narrow, zero, wide).item() > 0  # narrow inside wide
    assert INC.inclusion_hypothesis(zero, wide, zero, narrow).item() < 0
    assert INC.inclusion_hypothesis(zero, wide, zero, wide).item() == 0
    # Eq. 4 is antisymmetric, so "negative both ways" cannot hold for any pair; what separates disjoint
    # Gaussians is that the inclusion measure (Eq. 3) is far lower in both directions than when they overlap.
    far = 6 * one
    for lv1, lv2 in ((narrow, narrow), (narrow, wide)):
        for a, la, b, lb in ((zero, lv1, far, lv2), (far, lv2, zero, lv1)):
            overlapping = INC.inclusion_log_measure(a, la, a, lb).item()
            assert INC.inclusion_log_measure(a, la, b, lb).item() < overlapping - 5


def test_inclusion_hypothesis_sign_is_set_by_the_variances_alone():
    # Per dimension H(Z1 in Z2) has the sign of sigma2^2 - sigma1^2 whatever the means (docs/fidelity.md,
    # section 3): a caption far from its image includes it no less than a near one with the same variances,
    # so no inclusion term can ask a distant (general) caption for a larger sigma^2 than a near one.
    g = torch.Generator().manual_seed(7)
    mu1, mu2 = (torch.randn(400, 1, generator=g, dtype=F64) * 5 for _ in range(2))
    lv1, lv2 = (torch.rand(400, 1, generator=g, dtype=F64) * 8 - 6 for _ in range(2))
    for log_eps in (0.0, -20.0):
        h = INC.inclusion_hypothesis(mu1, lv1, mu2, lv2, log_eps, per_dim=True)
        ref = ref_inc(mu1, lv1, mu2, lv2, log_eps) - ref_inc(mu2, lv2, mu1, lv1, log_eps)
        assert torch.equal(torch.sign(h), torch.sign(lv2 - lv1))
        assert torch.equal(torch.sign(ref), torch.sign(lv2 - lv1)[:, 0])
    # ... and with sigma2 > sigma1 a larger mean distance makes the inclusion stronger, not weaker.
    lv_narrow, lv_wide = torch.full((5, 1), -2.0, dtype=F64), torch.full((5, 1), -1.0, dtype=F64)
    far = torch.tensor([[0.0], [0.1], [0.3], [1.0], [3.0]], dtype=F64)
    h = INC.inclusion_hypothesis(torch.zeros_like(far), lv_narrow, far, lv_wide)
    assert bool((h.diff() > 0).all())


@pytest.mark.parametrize(("c", "log_eps"), [(1000.0, -20.0), (10.0, -100.0)])
def test_inclusion_loss_finite_and_ordered_at_paper_settings(c, log_eps):
    mu, _ = gaussians(4, 512, 17, dtype=torch.float32)
    mu2 = F.normalize(mu + 0.05 * torch.randn_like(mu), dim=-1)
    small, large = torch.full_like(mu, -12.0), torch.full_like(mu, -8.0)
    included = INC.inclusion_loss(mu, small, mu2, large, c=c, log_eps=log_eps)
    not_included = INC.inclusion_loss(mu, large, mu2, small, c=c, log_eps=log_eps)
    assert torch.isfinite(included).all() and torch.isfinite(not_included).all()
    assert (included < math.log(2)).all() and (not_included > math.log(2)).all()


def test_vib_matches_torch_kl_divergence():
    mu, lv = gaussians(5, 7, 18, logvar_range=(-5, 2))
    mu = mu * 3
    q = torch.distributions.Normal(mu, (0.5 * lv).exp())
    p = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
    ref = torch.distributions.kl_divergence(q, p).sum(-1)
    close(INC.vib_kl(mu, lv), ref, rtol=1e-12, atol=1e-12)
    close(INC.vib_kl(mu, lv), ref_vib(mu, lv), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- ProLIP objective


MASKED_KEYS = ("mu_v_masked", "logvar_v_masked", "mu_t_masked", "logvar_t_masked")


def masked_inputs(n: int, d: int, index: list[int], seed: int):
    mu_vm, lv_vm = gaussians(len(index), d, seed)
    mu_tm, lv_tm = gaussians(len(index), d, seed + 1)
    return dict(zip(MASKED_KEYS, (mu_vm, lv_vm, mu_tm, lv_tm), strict=True))


def test_prolip_objective_matches_reference():
    n, d, index = 8, 6, [1, 4, 6]
    mu_v, lv_v = gaussians(n, d, 19)
    mu_t, lv_t = gaussians(n, d, 20)
    masked = masked_inputs(n, d, index, 21)
    idx = torch.tensor(index)
    kw = dict(alpha1=0.3, alpha2=0.2, beta=0.1, c=10.0, log_eps=-2.0)
    out = L.prolip_objective(
        mu_v, lv_v, mu_t, lv_t, scalar(math.log(10.0)), scalar(-10.0), masked_index=idx, **masked, **kw
    )
    ref = {
        "ppcl": ref_ppcl(mu_v, lv_v, mu_t, lv_t, 10.0, -10.0),
        "inc_vt": 0.3 * ref_inclusion_loss(mu_v, lv_v, mu_t, lv_t, 10.0, -2.0).mean(),
        "inc_masked_v": 0.2
        * ref_inclusion_loss(
            mu_v[idx], lv_v[idx], masked["mu_v_masked"], masked["logvar_v_masked"], 10.0, -2.0
        ).mean(),
        "inc_masked_t": 0.2
        * ref_inclusion_loss(
            mu_t[idx], lv_t[idx], masked["mu_t_masked"], masked["logvar_t_masked"], 10.0, -2.0
        ).mean(),
        "vib_v": 0.1 * ref_vib(mu_v, lv_v).mean(),
        "vib_t": 0.1 * ref_vib(mu_t, lv_t).mean(),
    }
    assert set(out) == set(ref) | {"total"}
    for key, value in ref.items():
        close(out[key], value, rtol=1e-9, atol=1e-10, msg=key)
    close(out["total"], sum(out[k] for k in ref), rtol=0, atol=1e-12)


def test_empty_masked_subset_gives_zero_and_finite_gradients():
    mu_v, lv_v = gaussians(4, 6, 22, dtype=torch.float32)
    mu_t, lv_t = gaussians(4, 6, 23, dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (mu_v, lv_v, mu_t, lv_t)]
    empty = torch.empty(0, 6)
    loss = build_loss("prolip")
    out = loss(
        *leaves, mu_v_masked=empty, logvar_v_masked=empty, mu_t_masked=empty, logvar_t_masked=empty,
        masked_index=torch.empty(0, dtype=torch.long), n_masked_global=0,
    )  # fmt: skip
    assert out["inc_masked_v"].item() == 0 and out["inc_masked_t"].item() == 0
    out["total"].backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert torch.isfinite(loss.log_scale.grad) and torch.isfinite(loss.bias.grad)
    with pytest.raises(ValueError, match="masked_index"):
        loss(*leaves, mu_v_masked=empty, logvar_v_masked=empty)


# ---------------------------------------------------------------- PCME++


def ref_pcmepp(mu_v, lv_v, mu_t, lv_t, a, b, labels, alpha, beta):
    n, d = mu_t.shape
    dist = ((mu_v[:, None] - mu_t[None]) ** 2).sum(-1) + (lv_v.exp()[:, None] + lv_t.exp()[None]).sum(-1)
    logits = -a * dist + b

    def bce(lab):
        return (lab * ref_softplus(-logits) + (1 - lab) * ref_softplus(logits)).mean()

    pp = labels.clone()
    for i in range(labels.shape[0]):
        j = int(labels[i].argmax())
        for k in range(n):
            if logits[i, k] >= logits[i, j]:
                pp[i, k] = labels[i, j]
    return {
        "match": bce(labels),
        "pseudo_pos": alpha * bce(pp),
        "vib_v": beta * ref_vib(mu_v, lv_v).mean() / d,
        "vib_t": beta * ref_vib(mu_t, lv_t).mean() / d,
    }


def test_pcmepp_matches_reference_with_soft_labels():
    n, d = 6, 5
    mu_v, lv_v = gaussians(n, d, 24)
    mu_t, lv_t = gaussians(n, d, 25)
    lam = torch.tensor([1.0, 0.3, 1.0, 0.8, 1.0, 1.0], dtype=F64)
    labels = P.pcmepp_soft_labels(torch.tensor([0, 4, 2, 0, 4, 5]), lam, 0, n)
    out = P.pcmepp_loss(
        mu_v, lv_v, mu_t, lv_t, scalar(5.0), scalar(5.0), soft_labels=labels, alpha=0.1, beta=1e-4
    )
    ref = ref_pcmepp(mu_v, lv_v, mu_t, lv_t, 5.0, 5.0, labels, 0.1, 1e-4)
    for key, value in ref.items():
        close(out[key], value, rtol=1e-10, atol=1e-12, msg=key)
    close(out["total"], sum(ref.values()), rtol=1e-10, atol=1e-12)


def test_pcmepp_pseudo_positive_rule_on_hand_made_case():
    # Image (1, 0); captions: the true one (CSD 0.8), a far one (4), a closer one (0.4), a tie (0.8).
    mu_v = torch.tensor([[1.0, 0.0]], dtype=F64)
    mu_t = torch.tensor([[0.6, 0.8], [-1.0, 0.0], [0.8, 0.6], [0.6, -0.8]], dtype=F64)
    lv_v, lv_t = torch.full((1, 2), -40.0, dtype=F64), torch.full((4, 2), -40.0, dtype=F64)
    hard = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=F64)
    out = P.pcmepp_loss(
        mu_v, lv_v, mu_t, lv_t, scalar(1.0), scalar(0.0), soft_labels=hard, alpha=1.0, beta=0.0
    )
    logits = -torch.tensor([[0.8, 4.0, 0.4, 0.8]], dtype=F64)  # -CSD with vanishing variance

    def bce(labels):
        return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / 16

    close(out["match"], bce(hard), rtol=1e-9, atol=1e-12)
    pp_labels = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=F64)  # closer and tied captions become positives
    close(out["pseudo_pos"], bce(pp_labels), rtol=1e-9, atol=1e-12)


def test_mix_images_fraction_and_labels():
    images = torch.rand(16, 3, 8, 8)
    seen = set()
    for seed in range(12):
        mixed, partner, lam = P.mix_images(images, torch.Generator().manual_seed(seed))
        changed = (partner != torch.arange(16)).nonzero().squeeze(1)
        assert len(changed) == 4 and (lam[changed] < 1).all() and (lam[changed] > 0).all()
        assert (lam[partner == torch.arange(16)] == 1).all()
        assert torch.equal(mixed[lam == 1], images[lam == 1])
        i, j = int(changed[0]), int(partner[changed[0]])
        lam_i = float(lam[i])
        if torch.allclose(mixed[i], lam_i * images[i] + (1 - lam_i) * images[j], atol=1e-6):
            seen.add("mixup")
        else:  # CutMix: lam is exactly the share of pixels still from the own image
            own = (mixed[i] == images[i]).all(0).float().mean().item()
            assert abs(own - lam_i) < 1e-6
            seen.add("cutmix")
        labels = P.pcmepp_soft_labels(partner, lam, offset=16, n_global=48)
        assert labels.shape == (16, 48)
        close(labels.sum(1), torch.ones(16))
        assert labels[i, 16 + i] == lam_i and abs(labels[i, 16 + j].item() - (1 - lam_i)) < 1e-7
    assert seen == {"mixup", "cutmix"}


# ---------------------------------------------------------------- distributed contract and numerics


def objective_call(name: str, n: int, d: int):
    """Inputs for one loss and a function computing a worker's share from global tensors and a slice."""
    mu_v, lv_v = gaussians(n, d, 30)
    mu_t, lv_t = gaussians(n, d, 31)
    extra = [t.clone() for t in masked_inputs(n, d, [4, 5, 6], 32).values()]
    leaves = [t.clone().requires_grad_() for t in (mu_v, lv_v, mu_t, lv_t, *extra)]
    global_index = torch.tensor([4, 5, 6])  # worker 0 of the split below has none of them
    labels = P.pcmepp_soft_labels(
        torch.tensor([0, 2, 1, 3, 4, 5, 7, 6]),
        torch.tensor([1, 0.6, 0.6, 1, 1, 1, 0.3, 0.3], dtype=F64),
        0,
        n,
    )

    if name == "prolip":
        module = L.ProLIPLoss(c=10.0, log_eps=-2.0, alpha1=0.5, alpha2=0.5, beta=0.5)
    else:
        module = build_loss(name)
    module.double()
    leaves += list(module.parameters())  # the learnable scale and bias must get the global gradient too

    def share(lo: int, hi: int):
        mv, lvv, mt, lvt, *masked = leaves[: 4 + len(extra)]
        common = dict(mu_v_all=mv, logvar_v_all=lvv, mu_t_all=mt, logvar_t_all=lvt, offset=lo)
        local = (mv[lo:hi], lvv[lo:hi], mt[lo:hi], lvt[lo:hi])
        if name == "prolip":
            keep = (global_index >= lo) & (global_index < hi)
            rows = keep.nonzero().squeeze(1)
            masked_kw = {k: t[rows] for k, t in zip(MASKED_KEYS, masked, strict=True)}
            return module(
                *local, **common, **masked_kw, masked_index=global_index[keep] - lo, n_masked_global=3
            )["total"]
        if name == "pcmepp":
            return module(*local, **common, soft_labels=labels[lo:hi])["total"]
        return module(*local, **common)["total"]

    return leaves, share


@pytest.mark.parametrize("name", ["prolip", "siglip", "clip", "pcmepp"])
def test_worker_shares_sum_to_single_process_loss_and_gradients(name):
    n, d = 8, 6
    leaves, share = objective_call(name, n, d)
    whole = share(0, n)
    grads_whole = torch.autograd.grad(whole, leaves, allow_unused=True)
    split = share(0, 3) + share(3, n)  # uneven split: offsets and per-worker sizes both matter
    grads_split = torch.autograd.grad(split, leaves, allow_unused=True)
    close(split, whole, rtol=0, atol=1e-10)
    for gw, gs in zip(grads_whole, grads_split, strict=True):
        if gw is None:
            assert gs is None
            continue
        close(gs, gw, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["prolip", "siglip", "clip", "pcmepp"])
@pytest.mark.parametrize("fill", ["-10", "-30", "+30", "mixed"])
@pytest.mark.parametrize("autocast", [False, True])
def test_gradients_finite_in_fp32_and_bf16_autocast(name, fill, autocast):
    n, d = 8, 16
    g = torch.Generator().manual_seed(40)
    mu_v, mu_t = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    if fill == "mixed":
        lv_v = 30 * torch.sign(torch.randn(n, d, generator=g))
        lv_t = 30 * torch.sign(torch.randn(n, d, generator=g))
    else:
        lv_v, lv_t = torch.full((n, d), float(fill)), torch.full((n, d), float(fill))
    leaves = [t.clone().requires_grad_() for t in (mu_v, lv_v, mu_t, lv_t)]
    loss = build_loss(name)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        dtype = torch.bfloat16 if autocast else torch.float32
        mv, lvv, mt, lvt = (t.to(dtype) for t in leaves)
        mv, mt = F.normalize(mv, dim=-1), F.normalize(mt, dim=-1)
        kw = {}
        if name == "prolip":
            idx = torch.tensor([0, 3])
            kw = dict(
                mu_v_masked=mv[idx],
                logvar_v_masked=lvv[idx] + 1,
                mu_t_masked=mt[idx],
                logvar_t_masked=lvt[idx] + 1,
                masked_index=idx,
            )
        out = loss(mv, lvv, mt, lvt, **kw)
    assert out["total"].dtype == torch.float32
    assert all(torch.isfinite(v) for v in out.values())
    out["total"].backward()
    grads = [t.grad for t in leaves if t.grad is not None] + [p.grad for p in loss.parameters()]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)


def test_build_loss_initial_scalars_and_names():
    prolip, siglip, clip, pcmepp = (build_loss(k) for k in ("prolip", "siglip", "clip", "pcmepp"))
    assert prolip.log_scale.item() == pytest.approx(math.log(10)) and prolip.bias.item() == -10
    assert siglip.log_scale.item() == pytest.approx(math.log(10)) and siglip.bias.item() == -10
    assert clip.log_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert pcmepp.scale.item() == 5 and pcmepp.shift.item() == 5
    with pytest.raises(ValueError, match="unknown loss"):
        build_loss("triplet")
    mu, lv = gaussians(4, 6, 41, dtype=torch.float32)
    keys = set(prolip(mu, lv, mu, lv))
    assert keys == {"ppcl", "inc_vt", "inc_masked_v", "inc_masked_t", "vib_v", "vib_t", "total"}
    assert set(pcmepp(mu, lv, mu, lv)) == {"match", "pseudo_pos", "vib_v", "vib_t", "total"}


def test_float64_inputs_stay_float64_and_bf16_inputs_promote():
    mu, lv = gaussians(4, 6, 42)
    assert INC.vib_kl(mu, lv).dtype == F64
    assert (
        INC.inclusion_hypothesis(mu.bfloat16(), lv.bfloat16(), mu.bfloat16(), lv.bfloat16()).dtype
        == torch.float32
    )
    assert np.isfinite(L.csd_matrix(mu, lv, mu, lv).numpy()).all()
    # The objective promotes its masked variants with the rest (bf16 towers, float32 losses).
    bf = [t.bfloat16().requires_grad_() for t in (mu, lv, mu, lv, mu, lv, mu, lv)]
    masked = dict(zip(MASKED_KEYS, bf[4:], strict=True))
    total = L.prolip_objective(*bf[:4], scalar(2.3).float(), scalar(-10.0).float(),
                               masked_index=torch.arange(4), **masked)["total"]  # fmt: skip
    assert total.dtype == torch.float32 and math.isfinite(total.item())
    grads = torch.autograd.grad(total, bf)
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", sorted(LOSS_SPECS))
def test_loss_spec_declares_what_its_module_does(name):
    """The spec is the one place the loop and config read: its terms, scalars and kwargs must be the module's."""
    from training.losses.registry import build_loss_from_config, logit_scalars

    spec = LOSS_SPECS[name]
    given = {"init_bias": -3.0, "alpha": 0.2, "beta": 2e-4}
    loss, got = build_loss_from_config(
        spec(**{k: v for k, v in given.items() if k in spec.__dataclass_fields__})
    )
    assert type(got) is spec and isinstance(loss, got.module_class())
    mu, lv = gaussians(4, 6, 43, dtype=torch.float32)
    assert set(loss(mu, lv, mu, lv)) == {*spec.terms, "total"}
    assert all(c in ("mu_v", "logvar_v", "mu_t", "logvar_t") for c in spec.columns)
    scale, bias = logit_scalars(loss, spec)
    assert scale > 0 and math.isfinite(bias)
    if name in ("prolip", "siglip"):
        assert bias == -3.0  # init_bias reached the constructor through config_kwargs
    if name == "prolip":
        assert loss.weights["beta"] == 2e-4
    if name == "pcmepp":
        assert loss.alpha == 0.2
    assert spec.probabilistic == (name in ("prolip", "pcmepp"))
