"""The official code's reduction of ProLIP's auxiliary terms (``reduction="official"``), against float64
references written from its description in docs/fidelity.md: one inclusion sigmoid per dimension, the
inclusion losses and the VIB KL averaged over batch x dimensions, σ² kept as σ²."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.common.config import ConfigError
from tests.training.losses.test_losses import (
    MASKED_KEYS,
    close,
    gaussians,
    masked_inputs,
    ref_inc,
    ref_ppcl,
    ref_softplus,
    scalar,
)
from training.config import TrainConfig
from training.losses import contrastive as L
from training.losses import inclusion as INC
from training.losses.objectives import ProLIPLossConfig as LossConfig
from training.losses.registry import build_loss_from_config


def ref_h_per_dim(mu1, lv1, mu2, lv2, log_eps):
    """H_d for every dimension d, from the paper-form measure one column at a time."""
    cols = [
        ref_inc(mu1[:, d : d + 1], lv1[:, d : d + 1], mu2[:, d : d + 1], lv2[:, d : d + 1], log_eps)
        - ref_inc(mu2[:, d : d + 1], lv2[:, d : d + 1], mu1[:, d : d + 1], lv1[:, d : d + 1], log_eps)
        for d in range(mu1.shape[1])
    ]
    return torch.stack(cols, dim=1)  # (B, D)


def ref_official_inclusion(mu1, lv1, mu2, lv2, c, log_eps):
    """Mean over B x D of -log sigmoid(c H_d)."""
    return ref_softplus(-c * ref_h_per_dim(mu1, lv1, mu2, lv2, log_eps)).mean()


def ref_official_vib(mu, lv):
    """Mean over B x D of the per-dimension KL(N(mu_d, s_d) || N(0, 1)), from torch.distributions."""
    p = torch.distributions.Normal(mu, (0.5 * lv).exp())
    q = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
    return torch.distributions.kl_divergence(p, q).mean()


def test_official_inclusion_and_vib_match_references():
    mu1, lv1 = gaussians(7, 5, 31, logvar_range=(-4.0, 0.5))
    mu2, lv2 = gaussians(7, 5, 32, logvar_range=(-4.0, 0.5))
    for c, log_eps in ((1.0, 0.0), (10.0, -2.0), (1000.0, -20.0)):
        got = INC.inclusion_loss(mu1, lv1, mu2, lv2, c=c, log_eps=log_eps, reduction="official")
        assert got.shape == (7,)
        close(got.mean(), ref_official_inclusion(mu1, lv1, mu2, lv2, c, log_eps), rtol=1e-9, atol=1e-12)
    close(INC.vib_kl(mu1, lv1, "official").mean(), ref_official_vib(mu1, lv1), rtol=1e-9, atol=1e-12)


def test_reductions_agree_in_one_dimension_and_differ_beyond():
    """With D = 1 there is one sigmoid either way; with D > 1 a violated pair costs D sigmoids' worth under
    the joint form and an average under the official one."""
    mu1, lv1 = gaussians(6, 1, 33, logvar_range=(-3.0, 0.0))
    mu2, lv2 = gaussians(6, 1, 34, logvar_range=(-3.0, 0.0))
    kw = dict(c=5.0, log_eps=-1.0)
    close(
        INC.inclusion_loss(mu1, lv1, mu2, lv2, **kw, reduction="official"),
        INC.inclusion_loss(mu1, lv1, mu2, lv2, **kw),
    )
    close(INC.vib_kl(mu1, lv1, "official"), INC.vib_kl(mu1, lv1))
    mu1, lv1 = gaussians(6, 8, 35)
    mu2, lv2 = gaussians(6, 8, 36)
    close(INC.vib_kl(mu1, lv1, "official") * 8, INC.vib_kl(mu1, lv1), rtol=1e-12, atol=0)
    joint = INC.inclusion_loss(mu1, lv1, mu2, lv2, **kw)
    official = INC.inclusion_loss(mu1, lv1, mu2, lv2, **kw, reduction="official")
    assert not torch.allclose(joint, official)


def test_prolip_objective_official_matches_reference():
    n, d, index = 8, 6, [0, 3, 5]
    mu_v, lv_v = gaussians(n, d, 37)
    mu_t, lv_t = gaussians(n, d, 38)
    masked = masked_inputs(n, d, index, 39)
    idx = torch.tensor(index)
    kw = dict(alpha1=0.3, alpha2=0.2, beta=0.1, c=10.0, log_eps=-2.0)
    out = L.prolip_objective(
        mu_v, lv_v, mu_t, lv_t, scalar(math.log(10.0)), scalar(-10.0),
        masked_index=idx, reduction="official", **masked, **kw,
    )  # fmt: skip
    mv, lvm, mt, ltm = (masked[k] for k in MASKED_KEYS)
    ref = {
        "ppcl": ref_ppcl(mu_v, lv_v, mu_t, lv_t, 10.0, -10.0),
        "inc_vt": 0.3 * ref_official_inclusion(mu_v, lv_v, mu_t, lv_t, 10.0, -2.0),
        "inc_masked_v": 0.2 * ref_official_inclusion(mu_v[idx], lv_v[idx], mv, lvm, 10.0, -2.0),
        "inc_masked_t": 0.2 * ref_official_inclusion(mu_t[idx], lv_t[idx], mt, ltm, 10.0, -2.0),
        "vib_v": 0.1 * ref_official_vib(mu_v, lv_v),
        "vib_t": 0.1 * ref_official_vib(mu_t, lv_t),
    }
    for key, value in ref.items():
        close(out[key], value, rtol=1e-9, atol=1e-12, msg=key)


def test_official_gradients_wrt_logvar_match_reference():
    mu1, lv1 = gaussians(5, 4, 40)
    mu2, lv2 = gaussians(5, 4, 41)
    a = lv1.clone().requires_grad_()
    INC.inclusion_loss(mu1, a, mu2, lv2, c=10.0, log_eps=-2.0, reduction="official").mean().backward()
    b = lv1.clone().requires_grad_()
    ref_official_inclusion(mu1, b, mu2, lv2, 10.0, -2.0).backward()
    close(a.grad, b.grad, rtol=1e-7, atol=1e-12)


def test_reduction_is_a_validated_config_option():
    loss, _ = build_loss_from_config(LossConfig(reduction="official"))
    assert loss.weights["reduction"] == "official"
    with pytest.raises(ConfigError, match=r"LossConfig\.reduction: input should be 'joint' or 'official'"):
        TrainConfig(loss=LossConfig(reduction="mean"))
    with pytest.raises(ValueError, match="reduction"):
        INC.vib_kl(*gaussians(2, 3, 42), "mean")
