"""Training objectives for ProLIP and its deterministic baselines, as pure tensor functions.

An embedding is a diagonal Gaussian Z = N(mu, diag(exp(logvar))) with L2-normalised `mu`; deterministic
baselines use `mu` alone. Equation numbers refer to ProLIP (Chun et al., ICLR 2025):
Eq. 1 CSD, Eq. 2 / A.4 PPCL, Eq. 3 / A.5 inclusion measure, Eq. 4 inclusion hypothesis, Eq. 5 inclusion
loss, Eq. A.2 VIB, Eq. 6 full objective. SigLIP is Zhai et al. (2023), CLIP InfoNCE Radford et al. (2021).
The per-sample terms (inclusion, VIB) live in `training/losses/inclusion.py`, PPCL's loss and the full objective
in `training/losses/prolip.py`; the fused forward/backward kernels in
`training/losses/fused/pairwise.py` and `training/losses/fused/per_sample.py`. PCME++ lives in `training/losses/pcmepp.py`;
`training/losses/registry.py` is the registry of both modules' losses. Slips in the papers are resolved as in
docs/math.md and docs/fidelity.md.

Distributed contract (the train loop relies on it)
--------------------------------------------------
Every loss takes this worker's LOCAL rows (`mu_v`, `logvar_v`, `mu_t`, `logvar_t`, B rows) and optionally
the GLOBAL columns (`*_all`, gathered from every worker in rank order, this worker included) plus
`offset`, the index of this worker's first sample in the global batch; positives sit at (i, offset + i).
Defaults: global = local, offset = 0. Each loss returns this worker's SHARE, scaled so that summing the
shares over workers gives exactly the single-process loss on the global batch of N samples:
sigmoid losses sum local rows x global columns and divide by N; CLIP sums the local cross-entropies of
both directions and divides by 2N; per-sample terms (inclusion, VIB) divide their local sum by N; masked
terms divide by M_global, the number of masked samples over all workers (`n_masked_global`). The shares
therefore hold no process-group calls. For the gradient of the global loss, gather the columns with an
autograd-aware all-gather and undo DDP's gradient averaging (multiply the share by the world size).

Precision: every function runs with autocast disabled and its floating inputs promoted to float32 at
least (float64 stays float64), so bf16 activations never reach exp/log-sigmoid or the inclusion terms.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.losses.fused.pairwise import full_precision, pair_sigmoid_loss
from training.losses.inclusion import REDUCTIONS
from training.losses.objectives import ProLIPLossConfig, SigLIPLossConfig
from training.losses.prolip import prolip_objective


def _columns(local: Tensor, gathered: Tensor | None) -> Tensor:
    return local if gathered is None else gathered


# ---------------------------------------------------------------- distances and logits (Eq. 1, 2)


@full_precision
def csd(mu1: Tensor, logvar1: Tensor, mu2: Tensor, logvar2: Tensor) -> Tensor:
    """Paired closed-form sampled distance (Eq. 1): ||mu1 - mu2||^2 + sum_d (sigma1^2 + sigma2^2).

    Shapes: all inputs (B, D) -> (B,).
    """
    return (mu1 - mu2).square().sum(-1) + (logvar1.exp() + logvar2.exp()).sum(-1)


@full_precision
def csd_matrix(mu_a: Tensor, logvar_a: Tensor, mu_b: Tensor, logvar_b: Tensor) -> Tensor:
    """All-pairs CSD (Eq. 1): d_ij = ||a_i||^2 + ||b_j||^2 - 2 a_i.b_j + sum_d (sigma_a,i^2 + sigma_b,j^2).

    Exact for any mu (unit norm is not assumed); each sum over D is a row or a column vector, so memory
    is O(AB + (A+B)D) and the (A, B, D) tensor is never built. Shapes: (A, D), (B, D) -> (A, B).
    """
    row = mu_a.square().sum(-1) + logvar_a.exp().sum(-1)
    col = mu_b.square().sum(-1) + logvar_b.exp().sum(-1)
    return torch.addmm(row[:, None] + col[None, :], mu_a, mu_b.T, alpha=-2.0)


@full_precision
def ppcl_logits(
    mu_v: Tensor, logvar_v: Tensor, mu_t: Tensor, logvar_t: Tensor, log_scale: Tensor, bias: Tensor
) -> Tensor:
    """PPCL logits (Eq. 2, A.4): l_vt = a (mu_v.mu_t - 1/2 sum_d (sigma_v,d^2 + sigma_t,d^2)) + b, a = exp(log_scale).

    Equals -a/2 CSD + a + b for unit-norm mu. Shapes: (Bv, D), (Bt, D) -> (Bv, Bt).
    """
    # Append [-1/2 sum sigma_v^2, 1] to the image side and [1, -1/2 sum sigma_t^2] to the text side: the
    # variance terms then ride inside the single GEMM and cost no extra pass over the (Bv, Bt) matrix.
    a = log_scale.exp()
    ones_v = torch.ones_like(mu_v[:, :1])
    ones_t = torch.ones_like(mu_t[:, :1])
    half_v = -0.5 * logvar_v.exp().sum(-1, keepdim=True)
    half_t = -0.5 * logvar_t.exp().sum(-1, keepdim=True)
    rows = a * torch.cat([mu_v, half_v, ones_v], dim=1)
    cols = torch.cat([mu_t, ones_t, half_t], dim=1)
    return torch.addmm(bias.expand(1, 1), rows, cols.T)


# ---------------------------------------------------------------- pairwise contrastive losses


@full_precision
def sigmoid_pair_loss(
    logits: Tensor, labels: Tensor | None = None, *, offset: int = 0, n_global: int | None = None
) -> Tensor:
    """SigLIP pairwise loss share: -sum_{v,t} log sigmoid(y_vt l_vt) / N_global.

    `logits` (B_local, N) are local rows x global columns. `labels` (B_local, N) in {+1, -1}; when None,
    y = +1 exactly at (i, offset + i), and the sum is taken as sum softplus(l) - sum_i l_{i, offset+i}
    (-log sigmoid(-l) = softplus(l), -log sigmoid(l) = softplus(l) - l), which needs no label matrix.
    `n_global` defaults to N, the number of columns. Returns a scalar.
    """
    n = logits.shape[1] if n_global is None else n_global
    if labels is not None:
        return -F.logsigmoid(labels * logits).sum() / n
    return (F.softplus(logits).sum() - logits.diagonal(offset).sum()) / n


@full_precision
def siglip_loss(
    mu_v: Tensor,
    mu_t: Tensor,
    log_scale: Tensor,
    bias: Tensor,
    *,
    mu_t_all: Tensor | None = None,
    offset: int = 0,
) -> Tensor:
    """SigLIP share: logits a mu_v.mu_t + b (a = exp(log_scale)) fed to `sigmoid_pair_loss`.

    Shapes: mu_v, mu_t (B, D) local; mu_t_all (N, D) global -> scalar.
    """
    # `pair_sigmoid_loss` is `sigmoid_pair_loss` on these logits, fused with their matrix product.
    return pair_sigmoid_loss(log_scale.exp() * mu_v, _columns(mu_t, mu_t_all), bias, offset=offset)


@full_precision
def clip_loss(
    mu_v: Tensor,
    mu_t: Tensor,
    log_scale: Tensor,
    *,
    mu_v_all: Tensor | None = None,
    mu_t_all: Tensor | None = None,
    offset: int = 0,
) -> Tensor:
    """Symmetric InfoNCE share: [sum_i CE_i(image -> texts) + sum_i CE_i(text -> images)] / (2 N).

    Logits a mu_v.mu_t with a = exp(log_scale) (a learnable inverse temperature). Local rows
    (B, D) are scored against global columns (N, D); the target of row i is column offset + i.
    """
    scale = log_scale.exp()
    targets = torch.arange(mu_v.shape[0], device=mu_v.device) + offset
    image_to_text = F.cross_entropy(scale * mu_v @ _columns(mu_t, mu_t_all).T, targets, reduction="sum")
    text_to_image = F.cross_entropy(scale * mu_t @ _columns(mu_v, mu_v_all).T, targets, reduction="sum")
    n = _columns(mu_t, mu_t_all).shape[0]
    return (image_to_text + text_to_image) / (2 * n)


# ---------------------------------------------------------------- modules holding learnable scalars
# Every module's forward takes (mu_v, logvar_v, mu_t, logvar_t, **inputs) and accepts all four gathered
# column tensors (`mu_v_all`, `logvar_v_all`, `mu_t_all`, `logvar_t_all`) and `offset`, ignoring the ones
# its loss does not use, so the train loop calls every loss alike; any other unknown key is an error.
# Deterministic losses accept logvar = None. Flags tell the loop which extra inputs a loss consumes.


# open_clip clamps the logit scale at 100 after every step; clamping in forward has the same effect.
MAX_LOG_SCALE = math.log(100.0)


def _without(inputs: dict[str, Any], *ignored: str) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k not in ignored}


class ProLIPLoss(nn.Module):
    """Eq. 6 with learnable log a (init log 10) and b (init -10), SigLIP's initialisation."""

    def __init__(
        self,
        init_log_scale: float = math.log(10.0),
        init_bias: float = ProLIPLossConfig.init_bias,
        alpha1: float = ProLIPLossConfig.alpha1,
        alpha2: float = ProLIPLossConfig.alpha2,
        beta: float = ProLIPLossConfig.beta,
        c: float = ProLIPLossConfig.c,
        log_eps: float = ProLIPLossConfig.log_eps,
        reduction: str = ProLIPLossConfig.reduction,
    ) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.log_scale = nn.Parameter(torch.tensor(float(init_log_scale)))
        self.bias = nn.Parameter(torch.tensor(float(init_bias)))
        self.weights = dict(
            alpha1=alpha1, alpha2=alpha2, beta=beta, c=c, log_eps=log_eps, reduction=reduction
        )

    def forward(
        self, mu_v: Tensor, logvar_v: Tensor, mu_t: Tensor, logvar_t: Tensor, **inputs: Any
    ) -> dict[str, Tensor]:
        """Weighted terms of `prolip_objective` plus `total`; `inputs` are its keyword arguments."""
        log_scale = self.log_scale.clamp(max=MAX_LOG_SCALE)
        inputs = _without(inputs, "mu_v_all", "logvar_v_all")
        return prolip_objective(
            mu_v, logvar_v, mu_t, logvar_t, log_scale, self.bias, **inputs, **self.weights
        )


class SigLIPLoss(nn.Module):
    """SigLIP on the means; learnable log a (init log 10) and b (init -10). Log-variances are ignored."""

    def __init__(
        self, init_log_scale: float = math.log(10.0), init_bias: float = SigLIPLossConfig.init_bias
    ) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(float(init_log_scale)))
        self.bias = nn.Parameter(torch.tensor(float(init_bias)))

    def forward(
        self, mu_v: Tensor, logvar_v: Tensor | None, mu_t: Tensor, logvar_t: Tensor | None, **inputs: Any
    ) -> dict[str, Tensor]:
        """{"siglip", "total"} (the same share); `inputs`: `mu_t_all`, `offset`."""
        log_scale = self.log_scale.clamp(max=MAX_LOG_SCALE)
        inputs = _without(inputs, "mu_v_all", "logvar_v_all", "logvar_t_all")
        loss = siglip_loss(mu_v, mu_t, log_scale, self.bias, **inputs)
        return {"siglip": loss, "total": loss}


class CLIPLoss(nn.Module):
    """Symmetric InfoNCE on the means; learnable log a initialised at log(1/0.07) (CLIP)."""

    def __init__(self, init_log_scale: float = math.log(1.0 / 0.07)) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(float(init_log_scale)))

    def forward(
        self, mu_v: Tensor, logvar_v: Tensor | None, mu_t: Tensor, logvar_t: Tensor | None, **inputs: Any
    ) -> dict[str, Tensor]:
        """{"clip", "total"} (the same share); `inputs`: `mu_v_all`, `mu_t_all`, `offset`."""
        log_scale = self.log_scale.clamp(max=MAX_LOG_SCALE)
        loss = clip_loss(mu_v, mu_t, log_scale, **_without(inputs, "logvar_v_all", "logvar_t_all"))
        return {"clip": loss, "total": loss}
