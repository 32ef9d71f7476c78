"""ProLIP's per-sample terms: the inclusion measure, hypothesis and loss (Eq. 3-5) and VIB (Eq. A.2).

Equation numbers refer to ProLIP (Chun et al., ICLR 2025); the paper's slips are resolved as in
docs/math.md and docs/fidelity.md. Each function takes (B, D) Gaussians (mean, log-variance) and returns
one value per sample, so memory is O(BD); `training/losses/contrastive.py` combines them into the objective (Eq. 6)
and re-exports every public name here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from training.losses.fused.pairwise import full_precision, gaussian_kl
from training.losses.fused.per_sample import inclusion_terms
from training.losses.objectives import ProLIPLossConfig

_LOG2 = math.log(2.0)
_LOG_2PI = math.log(2.0 * math.pi)
REDUCTIONS = ("joint", "official")


@full_precision
def inclusion_log_measure(
    mu1: Tensor, logvar1: Tensor, mu2: Tensor, logvar2: Tensor, log_eps: float = 0.0
) -> Tensor:
    """Log inclusion measure inc(Z1, Z2) = sum_d log int p1(x)^2 p2(x) dx (Eq. 3, derived in A.5).

    Per dimension, with precisions scaled by eps = exp(log_eps) (as if every variance were sigma^2/eps):
        -log v1 - 1/2 log v2 - 1/2 log A + B^2/(4A) - C - log(pi) - 3/2 log(2),   v = sigma^2 / eps,
        A = 1/v1 + 1/(2 v2),  B = 2 mu1/v1 + mu2/v2,  C = mu1^2/v1 + mu2^2/(2 v2),
    which simplifies exactly to -1/2 log v1 - 1/2 log(v1 + 2 v2) - (mu1 - mu2)^2 / (v1 + 2 v2) - log(2 pi).
    We evaluate the simplified form in log space: B^2/(4A) - C is a difference of two numbers of size
    1/sigma^2 that cancels catastrophically in float32, and exp(log_eps) alone is subnormal for
    log_eps = -100. The additive constant (which the paper omits) makes the value the true log-integral
    of the eps-rescaled Gaussians; eps also shifts the prefactors by +log eps per dimension, a constant
    that cancels in the hypothesis (Eq. 4). Shapes: (B, D) each -> (B,).
    """
    log_v1 = logvar1 - log_eps
    log_v1_2v2 = torch.logaddexp(logvar1, logvar2 + _LOG2) - log_eps  # log(v1 + 2 v2)
    per_dim = -0.5 * log_v1 - 0.5 * log_v1_2v2 - (mu1 - mu2).square() * torch.exp(-log_v1_2v2) - _LOG_2PI
    return per_dim.sum(-1)


def _hypothesis_per_dim(mu1: Tensor, logvar1: Tensor, mu2: Tensor, logvar2: Tensor, log_eps: float) -> Tensor:
    log_s2_2s1 = torch.logaddexp(logvar2, logvar1 + _LOG2)
    log_s1_2s2 = torch.logaddexp(logvar1, logvar2 + _LOG2)
    mean_term = (mu1 - mu2).square() * (torch.exp(log_eps - log_s2_2s1) - torch.exp(log_eps - log_s1_2s2))
    return 0.5 * (logvar2 - logvar1) + 0.5 * (log_s2_2s1 - log_s1_2s2) + mean_term


@full_precision
def inclusion_hypothesis(
    mu1: Tensor, logvar1: Tensor, mu2: Tensor, logvar2: Tensor, log_eps: float = 0.0, *, per_dim: bool = False
) -> Tensor:
    """Inclusion hypothesis H(Z1 in Z2) = inc(Z1, Z2) - inc(Z2, Z1) (Eq. 4); > 0 iff Z1 is included in Z2.

    Per dimension, from `inclusion_log_measure`, the difference collapses to
        1/2 (log s2 - log s1) + 1/2 [log(s2 + 2 s1) - log(s1 + 2 s2)]
        + eps (mu1 - mu2)^2 [1/(s2 + 2 s1) - 1/(s1 + 2 s2)],      s = sigma^2,
    evaluated directly, so no two large sums over D are subtracted. eps enters only the mean term; the
    log terms are scale-free. H is antisymmetric: H(Z1 in Z2) = -H(Z2 in Z1).
    Shapes: (B, D) -> (B,) summed over d (Eq. 4), or (B, D) per dimension with ``per_dim``.
    """
    h = _hypothesis_per_dim(mu1, logvar1, mu2, logvar2, log_eps)
    return h if per_dim else h.sum(-1)


@full_precision
def inclusion_loss(
    mu1: Tensor,
    logvar1: Tensor,
    mu2: Tensor,
    logvar2: Tensor,
    *,
    c: float = ProLIPLossConfig.c,
    log_eps: float = ProLIPLossConfig.log_eps,
    reduction: str = ProLIPLossConfig.reduction,
) -> Tensor:
    """Inclusion loss per sample (Eq. 5).

    ``joint`` (the paper's formula): -log sigmoid(c H(Z1 in Z2)) = softplus(-c H), H summed over d.
    ``official`` (the official code's reduction): mean_d softplus(-c H_d), one sigmoid per dimension, so a
    caller's mean over samples is the mean over B x D (docs/fidelity.md).
    H_d is `inclusion_hypothesis`'s per-dimension value; the loss and its gradient are computed together
    by `training.losses.fused.per_sample.inclusion_terms` (one pass over the inputs, no autograd graph of H).
    Shapes: (B, D) each -> (B,). Callers divide the local sum by the global count (see losses' module doc).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return inclusion_terms(mu1, logvar1, mu2, logvar2, c, log_eps, joint=reduction == "joint")


@full_precision
def vib_kl(mu: Tensor, logvar: Tensor, reduction: str = ProLIPLossConfig.reduction) -> Tensor:
    """VIB term per sample (Eq. A.2): KL(N(mu, sigma^2) || N(0, I)) = -1/2 sum_d (1 + log s - mu^2 - s), s = sigma^2.

    ``official``: the same per-dimension KL averaged over d instead of summed (a caller's mean over samples
    is then the official B x D mean); sigma^2 stays sigma^2 (docs/fidelity.md). Shapes: (B, D) -> (B,).
    Computed by `training.losses.fused.pairwise.gaussian_kl` from the sums over d (hand-derived gradient).
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return gaussian_kl(mu, logvar, 1.0 if reduction == "joint" else 1.0 / mu.shape[-1])
