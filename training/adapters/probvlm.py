"""ProbVLM (docs/math.md "ProbVLM"): a post-hoc probabilistic adapter on frozen image and text embeddings.

Each modality gets its own head Ψ: z ↦ (ẑ, α, β), a generalized Gaussian per embedding dimension.

- Architecture (ProbVLM §4 "Implementation details"): an MLP d→256→256→d with ReLU and dropout 0.1,
  then — as in the authors' code — a residual on the input and three small heads (ẑ; α > 0; β > 0).
  Positivity by softplus plus a floor (``ALPHA_MIN``, ``BETA_MIN``) so Γ(1/β) and (r/α)^β stay finite.
- Loss (Eqs. 7–8): ``L = L_rec^V + L_rec^T + λ·L_cross`` with the generalized-Gaussian NLL
  ``(|x−ẑ|/α)^β − log(β/α) + log Γ(1/β) + log 2``; ``L_cross`` scores the *paired other modality's*
  embedding under each head. λ = 1e−4 (the authors' code). The paper drops the constant log 2; we keep
  it so the value is the exact negative log density (``scipy.stats.gennorm``), gradients are unchanged.
- Uncertainty (Eq. 9): aleatoric variance ``α²Γ(3/β)/Γ(1/β)`` per dimension; epistemic = the variance
  of ẑ across M forward passes with dropout active (population variance, 1/M, as Eq. 9 writes it).
  A scalar per input = sum over dimensions; we report aleatoric and total (aleatoric + epistemic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HIDDEN = 256  # ProbVLM §4: embedding → 256 → 256 → embedding
DROPOUT = 0.1  # ProbVLM §3.2: dropout 0.1, kept on at inference for the epistemic term
LAMBDA_CROSS = 1e-4  # authors' code (ProbVLM's training script), the weight of L_cross
ALPHA_MIN = 1e-4  # floor on the scale: unit-norm embeddings have per-dimension spread ≈ 1/√d ≫ 1e-4
BETA_MIN = 0.1  # floor on the shape: log Γ(1/β) grows like (1/β)·log(1/β) as β → 0
LOG2 = math.log(2.0)


def gg_nll(x: Tensor, mu: Tensor, alpha: Tensor, beta: Tensor) -> Tensor:
    """Elementwise negative log density of the generalized Gaussian (ProbVLM Eq. 3 / Eq. 7).

    ``−log p(x) = (|x−μ|/α)^β − log(β/α) + log Γ(1/β) + log 2``, i.e. ``−scipy.stats.gennorm.logpdf(x,
    β, loc=μ, scale=α)``. The residual is floored at 1e−12 so the power's gradient in β stays finite.
    """
    r = (x - mu).abs().clamp_min(1e-12)
    return (r / alpha).pow(beta) - torch.log(beta / alpha) + torch.lgamma(1.0 / beta) + LOG2


def gg_variance(alpha: Tensor, beta: Tensor) -> Tensor:
    """Variance of the generalized Gaussian: ``α² Γ(3/β) / Γ(1/β)`` (ProbVLM §3.2, aleatoric term)."""
    return alpha.pow(2) * torch.exp(torch.lgamma(3.0 / beta) - torch.lgamma(1.0 / beta))


class GGHead(nn.Module):
    """One modality's adapter: frozen embedding (B, d) → (ẑ, α, β), each (B, d)."""

    def __init__(self, dim: int, hidden: int = HIDDEN, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.trunk = nn.Sequential(
            nn.Linear(dim, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, dim),
        )
        self.mu = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.alpha = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.beta = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = self.trunk(z) + z  # (B, d); residual as in the authors' code: start near the input
        mu = self.mu(h)
        alpha = F.softplus(self.alpha(h)) + ALPHA_MIN
        beta = F.softplus(self.beta(h)) + BETA_MIN
        return mu, alpha, beta


class ProbVLM(nn.Module):
    """The pair of heads: ``image`` (Ψ_V) and ``text`` (Ψ_T)."""

    def __init__(self, dim: int, hidden: int = HIDDEN, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.dim = dim
        self.image = GGHead(dim, hidden, dropout)
        self.text = GGHead(dim, hidden, dropout)


def probvlm_loss(
    model: ProbVLM, z_image: Tensor, z_text: Tensor, lambda_cross: float = LAMBDA_CROSS
) -> dict[str, Tensor]:
    """ProbVLM Eq. 8 on a batch of paired frozen embeddings (B, d), each NLL averaged over batch and dims.

    ``rec_image = NLL(z_V | Ψ_V(z_V))``, ``rec_text = NLL(z_T | Ψ_T(z_T))``,
    ``cross = NLL(z_T | Ψ_V(z_V)) + NLL(z_V | Ψ_T(z_T))`` (Eq. 7); ``loss = rec_image + rec_text + λ·cross``.
    """
    mu_v, a_v, b_v = model.image(z_image)
    mu_t, a_t, b_t = model.text(z_text)
    rec_image = gg_nll(z_image, mu_v, a_v, b_v).mean()
    rec_text = gg_nll(z_text, mu_t, a_t, b_t).mean()
    cross = gg_nll(z_text, mu_v, a_v, b_v).mean() + gg_nll(z_image, mu_t, a_t, b_t).mean()
    return {
        "rec_image": rec_image,
        "rec_text": rec_text,
        "cross": cross,
        "loss": rec_image + rec_text + lambda_cross * cross,
    }


@dataclass(frozen=True)
class GGUncertainty:
    """Per-input uncertainty from one head: ``mu`` (n, d) = ẑ with dropout off; the scalars are (n,)."""

    mu: Tensor
    aleatoric: Tensor  # Σ_d α²Γ(3/β)/Γ(1/β), deterministic pass
    epistemic: Tensor  # Σ_d Var_m[ẑ_m], M passes with dropout on

    @property
    def total(self) -> Tensor:
        return self.aleatoric + self.epistemic


@torch.no_grad()
def head_uncertainty(
    head: GGHead, z: Tensor, n_passes: int = 10, seed: int = 0, batch_size: int = 4096
) -> GGUncertainty:
    """Aleatoric (dropout off) and epistemic (``n_passes`` dropout passes, seeded) uncertainty of ``z``."""
    was_training = head.training
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    mus, ale, epi = [], [], []
    try:
        for start in range(0, z.shape[0], batch_size):
            zb = z[start : start + batch_size]
            head.eval()
            mu, alpha, beta = head(zb)
            ale.append(gg_variance(alpha, beta).sum(-1))
            if n_passes > 1:
                head.train()  # dropout on: MC-dropout samples of ẑ
                samples = torch.stack([head(zb)[0] for _ in range(n_passes)])  # (M, B, d)
                epi.append(samples.var(dim=0, unbiased=False).sum(-1))
            else:
                epi.append(torch.zeros(zb.shape[0], dtype=zb.dtype))
            mus.append(mu)
    finally:
        head.train(was_training)
        torch.random.set_rng_state(gen_state)
    return GGUncertainty(mu=torch.cat(mus), aleatoric=torch.cat(ale), epistemic=torch.cat(epi))
