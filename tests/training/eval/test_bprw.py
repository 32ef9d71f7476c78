"""BPRW: EM's fixed point against a direct MAP maximisation, and the class-embedding rule."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import log_softmax
from scipy.stats import multivariate_normal

from training.eval.uncertainty.bprw import (
    bprw_weights,
    component_log_density,
    log_posterior,
    reweighted_class,
)


def _toy(seed: int = 0):
    rng = np.random.default_rng(seed)
    n, d = 4, 3
    mu = rng.normal(size=(n, d))
    var = rng.uniform(0.05, 0.5, size=(n, d))
    # observations mostly near prompts 0 and 2
    obs = np.concatenate([mu[0] + 0.3 * rng.normal(size=(30, d)), mu[2] + 0.5 * rng.normal(size=(20, d))])
    return obs, mu, var


def test_component_density_matches_scipy():
    obs, mu, var = _toy()
    logf = component_log_density(obs[:5], mu, var, eps=0.02)
    ref = np.array(
        [[multivariate_normal(mu[n], np.diag(var[n] + 0.02)).logpdf(x) for n in range(4)] for x in obs[:5]]
    )
    np.testing.assert_allclose(logf, ref, rtol=1e-10)


@pytest.mark.parametrize("alpha", [2.0, 5.0])
def test_em_fixed_point_equals_direct_map(alpha):
    obs, mu, var = _toy()
    pi_em = bprw_weights(obs, mu, var, alpha, eps=0.02, iters=5000, tol=1e-13)

    def neg(theta):  # softmax parametrisation of the simplex (first logit pinned to 0)
        log_pi = log_softmax(np.concatenate([[0.0], theta]))
        return -log_posterior(np.exp(log_pi), obs, mu, var, alpha, eps=0.02)

    best = minimize(neg, np.zeros(3), method="BFGS", options={"gtol": 1e-10})
    pi_direct = np.exp(log_softmax(np.concatenate([[0.0], best.x])))
    np.testing.assert_allclose(pi_em, pi_direct, atol=1e-4)
    assert pi_em[0] + pi_em[2] > 0.8  # the prompts the observations came from win


def test_em_increases_posterior_and_prior_pulls_towards_uniform():
    obs, mu, var = _toy(1)
    weak = bprw_weights(obs, mu, var, alpha=1.0, eps=0.02)
    strong = bprw_weights(obs, mu, var, alpha=500.0, eps=0.02)
    assert np.abs(strong - 0.25).max() < np.abs(weak - 0.25).max()
    inv_tr = 1 / var.sum(1)
    assert log_posterior(weak, obs, mu, var, 1.0) >= log_posterior(inv_tr / inv_tr.sum(), obs, mu, var, 1.0)


def test_reweighted_class_is_weighted_mean_and_uniform_gives_ensemble():
    _, mu, var = _toy()
    m, v = reweighted_class(mu, var, np.full(4, 0.25))
    np.testing.assert_allclose(m, mu.mean(0))
    np.testing.assert_allclose(v, var.mean(0))
    m, v = reweighted_class(mu, var, np.array([0.0, 1.0, 0.0, 0.0]))
    np.testing.assert_allclose(m, mu[1])
