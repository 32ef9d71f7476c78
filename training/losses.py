"""Training objectives for ProLIP and its deterministic baselines, as pure tensor functions.

An embedding is a diagonal Gaussian Z = N(mu, diag(exp(logvar))) with L2-normalised `mu`; deterministic
baselines use `mu` alone. Equation numbers refer to ProLIP (Chun et al., ICLR 2025):
Eq. 1 CSD, Eq. 2 / A.4 PPCL, Eq. 3 / A.5 inclusion measure, Eq. 4 inclusion hypothesis, Eq. 5 inclusion
loss, Eq. A.2 VIB, Eq. 6 full objective. SigLIP is Zhai et al. (2023), CLIP InfoNCE Radford et al. (2021).
PCME++ lives in `training/pcmepp.py`; `training/objectives.py` is the registry of both modules' losses. Slips in the papers are resolved as in docs/math.md and
docs/fidelity.md.

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

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_LOG2 = math.log(2.0)
_LOG_2PI = math.log(2.0 * math.pi)
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


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
    cols = _columns(mu_t, mu_t_all)
    logits = torch.addmm(bias.expand(1, 1), log_scale.exp() * mu_v, cols.T)
    return sigmoid_pair_loss(logits, offset=offset)


@full_precision
def ppcl_loss(
    mu_v: Tensor,
    logvar_v: Tensor,
    mu_t: Tensor,
    logvar_t: Tensor,
    log_scale: Tensor,
    bias: Tensor,
    *,
    mu_t_all: Tensor | None = None,
    logvar_t_all: Tensor | None = None,
    offset: int = 0,
) -> Tensor:
    """Probabilistic pairwise contrastive loss share (Eq. 2): SigLIP's loss on `ppcl_logits`.

    Shapes: (B, D) local rows; (N, D) global text columns -> scalar, normalised by N.
    """
    if (mu_t_all is None) != (logvar_t_all is None):
        raise ValueError("pass both mu_t_all and logvar_t_all, or neither")
    logits = ppcl_logits(
        mu_v, logvar_v, _columns(mu_t, mu_t_all), _columns(logvar_t, logvar_t_all), log_scale, bias
    )
    return sigmoid_pair_loss(logits, offset=offset)


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


# ---------------------------------------------------------------- inclusion (Eq. 3-5) and VIB (A.2)


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


REDUCTIONS = ("joint", "official")


@full_precision
def inclusion_loss(
    mu1: Tensor,
    logvar1: Tensor,
    mu2: Tensor,
    logvar2: Tensor,
    *,
    c: float = 1000.0,
    log_eps: float = -20.0,
    reduction: str = "joint",
) -> Tensor:
    """Inclusion loss per sample (Eq. 5).

    ``joint`` (the paper's formula): -log sigmoid(c H(Z1 in Z2)) = softplus(-c H), H summed over d.
    ``official`` (the official code's reduction): mean_d softplus(-c H_d), one sigmoid per dimension, so a
    caller's mean over samples is the mean over B x D (docs/fidelity.md).
    Shapes: (B, D) each -> (B,). Callers divide the local sum by the global count (see module doc).
    """
    if reduction == "joint":
        return F.softplus(-c * inclusion_hypothesis(mu1, logvar1, mu2, logvar2, log_eps))
    if reduction == "official":
        h = inclusion_hypothesis(mu1, logvar1, mu2, logvar2, log_eps, per_dim=True)
        return F.softplus(-c * h).mean(-1)
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


@full_precision
def vib_kl(mu: Tensor, logvar: Tensor, reduction: str = "joint") -> Tensor:
    """VIB term per sample (Eq. A.2): KL(N(mu, sigma^2) || N(0, I)) = -1/2 sum_d (1 + log s - mu^2 - s), s = sigma^2.

    ``official``: the same per-dimension KL averaged over d instead of summed (a caller's mean over samples
    is then the official B x D mean); sigma^2 stays sigma^2 (docs/fidelity.md). Shapes: (B, D) -> (B,).
    """
    per_dim = -0.5 * (1.0 + logvar - mu.square() - logvar.exp())
    if reduction == "joint":
        return per_dim.sum(-1)
    if reduction == "official":
        return per_dim.mean(-1)
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


# ---------------------------------------------------------------- ProLIP objective (Eq. 6)


def prolip_objective(
    mu_v: Tensor,
    logvar_v: Tensor,
    mu_t: Tensor,
    logvar_t: Tensor,
    log_scale: Tensor,
    bias: Tensor,
    *,
    mu_t_all: Tensor | None = None,
    logvar_t_all: Tensor | None = None,
    offset: int = 0,
    mu_v_masked: Tensor | None = None,
    logvar_v_masked: Tensor | None = None,
    mu_t_masked: Tensor | None = None,
    logvar_t_masked: Tensor | None = None,
    masked_index: Tensor | None = None,
    n_masked_global: int | None = None,
    alpha1: float = 1e-7,
    alpha2: float = 1e-3,
    beta: float = 1e-4,
    c: float = 1000.0,
    log_eps: float = -20.0,
    reduction: str = "joint",
) -> dict[str, Tensor]:
    """ProLIP objective share (Eq. 6), returned as WEIGHTED terms whose sum is `total`:

        ppcl                       L_PPCL (Eq. 2), / N
        inc_vt        alpha1 *     sum_i L_inc(Z_v,i in Z_t,i) / N          (matched pairs)
        inc_masked_v  alpha2 *     sum_m L_inc(Z_v,m in Z_v,m^masked) / M_global
        inc_masked_t  alpha2 *     sum_m L_inc(Z_t,m in Z_t,m^masked) / M_global
        vib_v, vib_t  beta *       sum_i KL(Z_i || N(0, I)) / N              (Eq. A.2)

    The masked Gaussians `*_masked` (M, D) are the masked variants of local rows `masked_index` (M,)
    (the same samples in both towers); M may be 0, and when they are omitted those terms are zero.
    Defaults: alpha1 = 1e-7, alpha2 = 1e-3 (paper B.1), beta = 1e-4 (official runs), and c = 1000,
    log eps = -20 as in the paper's reported runs; the log-space inclusion terms stay finite for any
    log eps, so the paper's recommended (-100, 10) is also safe. N = rows of `mu_t_all` (default B).
    `reduction` ("joint" = the formulas above, "official" = per-dimension inclusion sigmoids and VIB
    averaged over d) is passed to `inclusion_loss` and `vib_kl`; the sample counts N and M are the same.
    """
    given = [t is not None for t in (mu_v_masked, logvar_v_masked, mu_t_masked, logvar_t_masked)]
    if any(given) and masked_index is None:
        raise ValueError("masked Gaussians need masked_index, the local rows they were made from")
    n = _columns(mu_t, mu_t_all).shape[0]
    m_global = n_masked_global
    if m_global is None:
        m_global = 0 if masked_index is None else masked_index.shape[0]

    def masked_share(
        mu: Tensor, logvar: Tensor, mu_masked: Tensor | None, logvar_masked: Tensor | None
    ) -> Tensor:
        if mu_masked is None or logvar_masked is None or masked_index is None:
            return mu.new_zeros((), dtype=torch.promote_types(mu.dtype, torch.float32))
        original = (mu.index_select(0, masked_index), logvar.index_select(0, masked_index))
        per_sample = inclusion_loss(
            *original, mu_masked, logvar_masked, c=c, log_eps=log_eps, reduction=reduction
        )
        # An empty (M = 0) selection sums to an exact zero with zero gradient; max() only guards 0 / 0.
        return per_sample.sum() / max(m_global, 1)

    ppcl = ppcl_loss(
        mu_v, logvar_v, mu_t, logvar_t, log_scale, bias,
        mu_t_all=mu_t_all, logvar_t_all=logvar_t_all, offset=offset,
    )  # fmt: skip
    inc_vt = inclusion_loss(mu_v, logvar_v, mu_t, logvar_t, c=c, log_eps=log_eps, reduction=reduction)
    inc_vt = inc_vt.sum() / n
    terms = {
        "ppcl": ppcl,
        "inc_vt": alpha1 * inc_vt,
        "inc_masked_v": alpha2 * masked_share(mu_v, logvar_v, mu_v_masked, logvar_v_masked),
        "inc_masked_t": alpha2 * masked_share(mu_t, logvar_t, mu_t_masked, logvar_t_masked),
        "vib_v": beta * vib_kl(mu_v, logvar_v, reduction).sum() / n,
        "vib_t": beta * vib_kl(mu_t, logvar_t, reduction).sum() / n,
    }
    terms["total"] = sum(terms.values())  # type: ignore[assignment]
    return terms


# ---------------------------------------------------------------- modules holding learnable scalars
# Every module's forward takes (mu_v, logvar_v, mu_t, logvar_t, **inputs) and accepts all four gathered
# column tensors (`mu_v_all`, `logvar_v_all`, `mu_t_all`, `logvar_t_all`) and `offset`, ignoring the ones
# its loss does not use, so the train loop calls every loss alike; any other unknown key is an error.
# Deterministic losses accept logvar = None. Flags tell the loop which extra inputs a loss consumes.


@dataclass(frozen=True)
class LossSpec:
    """Everything the train loop and the config need to know about one objective, declared beside it.

    ``columns``: the features gathered from every worker (with gradients) as the global columns each local
    row is scored against; ``uses_masked``: takes the masked image/text variants (ProLIP Eq. 6);
    ``uses_soft_labels``: takes PCME++'s mixed-image soft labels; ``probabilistic``: needs the σ² heads;
    ``config_kwargs``: (``LossConfig`` field, constructor argument) pairs; ``scale``/``bias``: the names of
    the learnable logit scale and bias parameters (``scale_is_log``: the parameter holds log a), logged as
    ``logit_scale``/``logit_bias``; ``terms``: the named terms ``forward`` returns besides ``total``.
    """

    name: str
    module: type[nn.Module]
    columns: tuple[str, ...]
    terms: tuple[str, ...]
    probabilistic: bool = False
    uses_masked: bool = False
    uses_soft_labels: bool = False
    config_kwargs: tuple[tuple[str, str], ...] = ()
    scale: str = "log_scale"
    scale_is_log: bool = True
    bias: str | None = "bias"

    def kwargs(self, loss_cfg: Any) -> dict[str, Any]:
        """Constructor arguments taken from a ``training.config.LossConfig``."""
        return {arg: getattr(loss_cfg, field) for field, arg in self.config_kwargs}


# open_clip clamps the logit scale at 100 after every step; clamping in forward has the same effect.
MAX_LOG_SCALE = math.log(100.0)


def _without(inputs: dict[str, Any], *ignored: str) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k not in ignored}


class ProLIPLoss(nn.Module):
    """Eq. 6 with learnable log a (init log 10) and b (init -10), SigLIP's initialisation."""

    def __init__(
        self,
        init_log_scale: float = math.log(10.0),
        init_bias: float = -10.0,
        alpha1: float = 1e-7,
        alpha2: float = 1e-3,
        beta: float = 1e-4,
        c: float = 1000.0,
        log_eps: float = -20.0,
        reduction: str = "joint",
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

    def __init__(self, init_log_scale: float = math.log(10.0), init_bias: float = -10.0) -> None:
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


SPECS = (
    LossSpec(
        "prolip",
        ProLIPLoss,
        columns=("mu_t", "logvar_t"),
        terms=("ppcl", "inc_vt", "inc_masked_v", "inc_masked_t", "vib_v", "vib_t"),
        probabilistic=True,
        uses_masked=True,
        config_kwargs=tuple(
            (k, k) for k in ("alpha1", "alpha2", "beta", "c", "log_eps", "init_bias", "reduction")
        ),
    ),
    LossSpec(
        "siglip",
        SigLIPLoss,
        columns=("mu_t",),
        terms=("siglip",),
        config_kwargs=(("init_bias", "init_bias"),),
    ),
    LossSpec("clip", CLIPLoss, columns=("mu_v", "mu_t"), terms=("clip",), bias=None),
)
