"""Bayesian Prompt Re-Weighting (BPRW, ProLIP §3.4, App. A.8, C.7), pure numpy.

Per class c the N prompt embeddings Z_n = N(μ_n, diag(σ²_n)) form a mixture Σ_n π_n N(μ_n, Σ_n + εI).
Observations x_j (M' = M·K of them) are K samples from each of M image Gaussians: the M images nearest to
the class embedding (zero-shot) or M labelled images (few-shot). With a Dirichlet(α) prior on π, EM finds
the MAP weights of

    log p(π | x) = Σ_n (α − 1) log π_n + Σ_j log Σ_n π_n f_n(x_j) + const,

E-step γ_jn ∝ π_n f_n(x_j); M-step π_n = (N_n + α − 1) / (M' + N(α − 1)), N_n = Σ_j γ_jn; π starts
∝ 1/tr(Σ_n) (precise prompts weigh more from the start). Defaults: ε = 0.02, zero-shot α = 5 with 5 nearest images × 10 samples, few-shot
α = 2 (§3.4 / C.7).

The new class embedding "Σ_n π_n Z_n" is taken as N(Σ_n π_n μ_n, Σ_n π_n σ²_n): the π-weighted form of the
prompt-ensemble rule of §4.2 (uniform π gives back N(mean μ, mean σ²)), not the moment-matched mixture,
whose extra spread of the means would change the ensemble's meaning. ε only enters the EM likelihood.
"""

from __future__ import annotations

import numpy as np
from scipy.special import logsumexp

ZERO_SHOT = {"alpha": 5.0, "n_images": 5, "n_samples": 10}
FEW_SHOT = {"alpha": 2.0, "n_samples": 10}
EPS = 0.02


def component_log_density(
    obs: np.ndarray, prompt_mu: np.ndarray, prompt_var: np.ndarray, eps: float = EPS
) -> np.ndarray:
    """log f_n(x_j) = log N(x_j; μ_n, diag(σ²_n + ε)), shapes (M', D), (N, D), (N, D) → (M', N)."""
    x = obs.astype(np.float64)
    mu = prompt_mu.astype(np.float64)
    v = prompt_var.astype(np.float64) + eps  # (N, D)
    # Σ_d (x − μ)²/v expanded as x²·(1/v) − 2x·(μ/v) + μ²/v: three GEMMs, never (M', N, D).
    quad = (x * x) @ (1.0 / v).T - 2.0 * x @ (mu / v).T + (mu * mu / v).sum(-1)[None, :]
    return -0.5 * (np.log(2.0 * np.pi * v).sum(-1)[None, :] + quad)


def log_posterior(
    pi: np.ndarray,
    obs: np.ndarray,
    prompt_mu: np.ndarray,
    prompt_var: np.ndarray,
    alpha: float,
    eps: float = EPS,
) -> float:
    """Σ_n (α − 1) log π_n + Σ_j log Σ_n π_n f_n(x_j) — the objective EM increases (up to a constant)."""
    logf = component_log_density(obs, prompt_mu, prompt_var, eps)
    with np.errstate(divide="ignore"):
        log_pi = np.log(pi)
    prior = (alpha - 1.0) * log_pi.sum() if alpha != 1.0 else 0.0
    return float(prior + logsumexp(logf + log_pi[None, :], axis=1).sum())


def bprw_weights(
    obs: np.ndarray,
    prompt_mu: np.ndarray,
    prompt_var: np.ndarray,
    alpha: float,
    eps: float = EPS,
    iters: int = 500,
    tol: float = 1e-10,
) -> np.ndarray:
    """MAP mixture weights π (N,) by EM (module docstring). Needs α ≥ 1 so the M-step stays a distribution."""
    if alpha < 1.0:
        raise ValueError(f"alpha must be >= 1 for the closed-form M-step, got {alpha}")
    n = prompt_mu.shape[0]
    m = obs.shape[0]
    logf = component_log_density(obs, prompt_mu, prompt_var, eps)  # (M', N), fixed across iterations
    inv_tr = 1.0 / np.maximum(prompt_var.astype(np.float64).sum(-1), 1e-300)
    pi = inv_tr / inv_tr.sum()
    for _ in range(iters):
        with np.errstate(divide="ignore"):
            log_resp = logf + np.log(pi)[None, :]
        log_resp -= logsumexp(log_resp, axis=1, keepdims=True)  # E-step: log γ_jn
        counts = np.exp(log_resp).sum(0)  # N_n
        new = (counts + alpha - 1.0) / (m + n * (alpha - 1.0))  # M-step with the Dirichlet prior
        new = np.maximum(new, 0.0)
        new /= new.sum()
        done = np.abs(new - pi).max() < tol
        pi = new
        if done:
            break
    return pi


def reweighted_class(
    prompt_mu: np.ndarray, prompt_var: np.ndarray, pi: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """N(Σ_n π_n μ_n, Σ_n π_n σ²_n) as (μ (D,), σ² (D,)): the new class embedding (see module docstring)."""
    return pi @ prompt_mu, pi @ prompt_var


def sample_observations(mu: np.ndarray, logvar: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """K draws from each of M image Gaussians N(μ, diag(exp(logvar))): (M, D) → (M·K, D)."""
    std = np.exp(0.5 * logvar.astype(np.float64))
    z = rng.standard_normal((mu.shape[0], k, mu.shape[1]))
    return (mu[:, None, :] + std[:, None, :] * z).reshape(-1, mu.shape[1])


def reweight_classes(
    prompt_mu: np.ndarray,
    prompt_logvar: np.ndarray,
    image_mu: np.ndarray,
    image_logvar: np.ndarray,
    members: list[np.ndarray],
    alpha: float,
    n_samples: int = 10,
    eps: float = EPS,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """New class embeddings for C classes: prompts (C, N, D); ``members[c]`` indexes the images whose
    samples are class c's observations. Returns (μ (C, D), log σ² (C, D), π (C, N))."""
    rng = np.random.default_rng(seed)
    prompt_var = np.exp(prompt_logvar.astype(np.float64))
    mus, vars_, pis = [], [], []
    for c, idx in enumerate(members):
        obs = sample_observations(image_mu[idx], image_logvar[idx], n_samples, rng)
        pi = bprw_weights(obs, prompt_mu[c], prompt_var[c], alpha, eps)
        mu_c, var_c = reweighted_class(prompt_mu[c].astype(np.float64), prompt_var[c], pi)
        mus.append(mu_c)
        vars_.append(var_c)
        pis.append(pi)
    return np.stack(mus), np.log(np.stack(vars_)), np.stack(pis)
