"""AsymVLM (docs/math.md "AsymVLM"): text-only spherical uncertainty on top of a frozen deterministic VLM.

Only the text side becomes a random variable: an MLP maps the frozen text embedding to η ∈ R^d,
``κ = ‖η‖`` and ``μ = η/κ`` parametrise a von Mises–Fisher or Power Spherical distribution on S^{d−1};
the (unit-norm) image embedding stays a point. Everything is a log-likelihood of an image under a caption:

- ``L(m, n) = log p_{z_T,m}(z_I,n)`` (§4.1), the (texts × images) matrix;
- loss: symmetric InfoNCE on ``τ·L`` (Eq. 2), τ learnable (App. B.1), initialised at 1 and capped at 100
  like CLIP's logit scale so one step cannot blow it up;
- uncertainty ``u = 1/κ`` (§4.3); retrieval by maximum likelihood (App. A.2).

Normalisers (checked against scipy in tests/training/adapters/test_adapters.py):

- vMF: ``log C_d(κ) = (d/2−1) log κ − (d/2) log 2π − log I_{d/2−1}(κ)``. ``F_d`` (Eq. 4, docs/math.md) integrates
  the midpoint of the Ruiz-Antolín–Segura bounds on ``I_{d/2}/I_{d/2−1} = −d log C_d/dκ``, so it equals
  ``log C_d`` only *up to an additive constant in d*. ``vmf_log_normaliser`` fixes that constant by the
  exact value at κ = 0 (the uniform density ``Γ(d/2)/(2π^{d/2})``); the error then grows at most like
  ``∫_0^κ (h−g)/2`` (half the gap between the bounds), which ``vmf_error_bound`` returns. A constant
  shift of every entry of L changes neither the softmax nor any argmax, so the choice only matters for
  reading L as a log density.
- Power Spherical: closed form ``log C_d(κ) = −[(d−1+κ) log 2 + ((d−1)/2) log π + log Γ((d−1)/2+κ)
  − log Γ(d−1+κ)]``. The paper's kernel drops the ``((d−1)/2) log π`` term (constant in κ); we keep it.

Defaults (App. B): hidden 1024, SGD with momentum, lr 1e−2 cosine to 1e−6, batch 2048, 200 epochs —
the optimisation lives in ``training/adapters/fit.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HIDDEN = 1024  # App. B.1: two hidden layers of 1024, ReLU, linear output of the input's width
FAMILIES = ("vmf", "ps")
TAU_MIN, TAU_MAX = 1e-3, 100.0  # τ stays positive; 100 is CLIP's cap on its logit scale
KAPPA_MIN = 1e-6  # κ = ‖η‖ is 0 only on a measure-zero set; the floor keeps 1/κ finite
PS_COS_FLOOR = 1e-6  # log(1+μᵀz) is −∞ at the antipode; the floor keeps the loss finite there


def _sqrt_terms(kappa: Tensor, d: int) -> tuple[float, Tensor, Tensor]:
    a = (d - 1) / 2.0
    s_minus = torch.sqrt(a**2 + kappa**2)  # √(((d−1)/2)² + κ²)
    s_plus = torch.sqrt(((d + 1) / 2.0) ** 2 + kappa**2)  # √(((d+1)/2)² + κ²)
    return a, s_minus, s_plus


def vmf_f_d(kappa: Tensor, d: int) -> Tensor:
    """``F_d(κ)`` of AsymVLM Eq. 4 (docs/math.md), the approximation of ``log C_d(κ)`` up to a constant.

    ``F_d = (d−1)/4·log((d−1)/2 + √(((d−1)/2)² + κ²)) − ½√(((d−1)/2)² + κ²)
          + (d−1)/4·log((d−1)/2 + √(((d+1)/2)² + κ²)) − ½√(((d+1)/2)² + κ²)``.
    """
    a, s_minus, s_plus = _sqrt_terms(kappa, d)
    return (d - 1) / 4.0 * (torch.log(a + s_minus) + torch.log(a + s_plus)) - 0.5 * (s_minus + s_plus)


def vmf_log_normaliser_at_zero(d: int) -> float:
    """``log C_d(0) = log Γ(d/2) − log 2 − (d/2) log π``: the uniform density on S^{d−1}."""
    return math.lgamma(d / 2.0) - math.log(2.0) - (d / 2.0) * math.log(math.pi)


def vmf_log_normaliser(kappa: Tensor, d: int) -> Tensor:
    """Approximate ``log C_d(κ)`` = ``F_d(κ) − F_d(0) + log C_d(0)`` (exact at κ = 0)."""
    f0 = vmf_f_d(torch.zeros((), dtype=kappa.dtype), d)
    return vmf_f_d(kappa, d) - f0 + vmf_log_normaliser_at_zero(d)


def vmf_error_bound(kappa: Tensor, d: int) -> Tensor:
    """Upper bound on ``|vmf_log_normaliser(κ) − log C_d(κ)|``: ``∫_0^κ (h(t) − g(t))/2 dt``.

    ``g, h`` are the lower/upper Ruiz-Antolín–Segura bounds of ``I_{d/2}/I_{d/2−1}`` (App. A.1, Remark 2),
    ``h(t) = t/(a + √(a² + t²))``, ``g(t) = t/(a + √(b² + t²))``, ``a = (d−1)/2``, ``b = (d+1)/2``.
    ``∫ t/(a + √(c² + t²)) dt = √(c²+t²) − a·log(a + √(c²+t²))`` gives the closed form.
    """
    a, s_minus, s_plus = _sqrt_terms(kappa, d)

    def antiderivative(s: Tensor) -> Tensor:
        return s - a * torch.log(a + s)

    zero = torch.zeros((), dtype=kappa.dtype)
    _, s_minus0, s_plus0 = _sqrt_terms(zero, d)
    h_int = antiderivative(s_minus) - antiderivative(s_minus0)
    g_int = antiderivative(s_plus) - antiderivative(s_plus0)
    return 0.5 * (h_int - g_int)


def ps_log_normaliser(kappa: Tensor, d: int) -> Tensor:
    """Exact Power Spherical ``log C_d(κ)`` (De Cao & Aziz 2020; AsymVLM §4.2 with α=(d−1)/2+κ, β=(d−1)/2).

    ``log C_d(κ) = −[(α+β) log 2 + β log π + log Γ(α) − log Γ(α+β)]``.
    """
    beta = (d - 1) / 2.0
    alpha = beta + kappa
    return -(
        (alpha + beta) * math.log(2.0)
        + beta * math.log(math.pi)
        + torch.lgamma(alpha)
        - torch.lgamma(alpha + beta)
    )


def loglik_matrix(mu_text: Tensor, kappa: Tensor, z_image: Tensor, family: str) -> Tensor:
    """``L(m, n) = log p_{z_T,m}(z_I,n)`` for texts (M, d) with κ (M,) and unit images (N, d) → (M, N).

    vMF: ``κ_m μ_mᵀz_n + log C_d(κ_m)``; PS: ``κ_m log(1 + μ_mᵀz_n) + log C_d(κ_m)``.
    """
    d = mu_text.shape[-1]
    cos = mu_text @ z_image.T  # (M, N)
    if family == "vmf":
        return kappa[:, None] * cos + vmf_log_normaliser(kappa, d)[:, None]
    if family == "ps":
        return (
            kappa[:, None] * torch.log((1.0 + cos).clamp_min(PS_COS_FLOOR))
            + ps_log_normaliser(kappa, d)[:, None]
        )
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def symmetric_infonce(logits: Tensor) -> Tensor:
    """AsymVLM Eq. 2 on ``logits = τ·L`` (texts × images, pairs on the diagonal).

    ``−1/(2B) Σ_n [log softmax_m(τL(n, ·))_n + log softmax_m(τL(·, n))_n]``: text n against all images,
    and image n against all captions (where each caption's own normaliser now matters).
    """
    target = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


class AsymVLM(nn.Module):
    """Text head ``z_T ↦ η`` (d→1024→1024→d, ReLU) plus the learnable InfoNCE temperature τ."""

    def __init__(self, dim: int, family: str = "vmf", hidden: int = HIDDEN) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        self.dim = dim
        self.family = family
        self.head = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, dim)
        )
        self.tau_raw = nn.Parameter(torch.ones(()))

    @property
    def tau(self) -> Tensor:
        # A plain scalar, as the authors' code: an exp-parametrised τ grows multiplicatively and soaks up
        # the scale κ should carry (measured on the toy of tests/training/adapters/test_adapters.py: κ stops separating).
        return self.tau_raw.clamp(TAU_MIN, TAU_MAX)

    def forward(self, z_text: Tensor) -> tuple[Tensor, Tensor]:
        """(μ (B, d) unit, κ (B,)) of each caption's distribution."""
        eta = self.head(z_text)
        kappa = eta.norm(dim=-1).clamp_min(KAPPA_MIN)
        return eta / kappa[:, None], kappa

    def loglik(self, z_text: Tensor, z_image: Tensor) -> Tensor:
        mu, kappa = self(z_text)
        return loglik_matrix(mu, kappa, F.normalize(z_image, dim=-1), self.family)


def asymvlm_loss(model: AsymVLM, z_image: Tensor, z_text: Tensor) -> dict[str, Tensor]:
    """Symmetric InfoNCE on ``τ·L`` for a batch of pairs; also reports τ and the mean κ."""
    mu, kappa = model(z_text)
    L = loglik_matrix(mu, kappa, F.normalize(z_image, dim=-1), model.family)
    loss = symmetric_infonce(model.tau * L)
    return {"loss": loss, "tau": model.tau.detach(), "kappa_mean": kappa.detach().mean()}


@torch.no_grad()
def text_distributions(model: AsymVLM, z_text: Tensor, batch_size: int = 8192) -> tuple[Tensor, Tensor]:
    """(μ (n, d), κ (n,)) for many captions, in eval mode and batches."""
    was_training = model.training
    model.eval()
    try:
        outs = [model(z_text[i : i + batch_size]) for i in range(0, z_text.shape[0], batch_size)]
    finally:
        model.train(was_training)
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
