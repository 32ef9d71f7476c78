"""ProLIP's probabilistic pairwise loss (PPCL, Eq. 2) and full objective (Eq. 6), as pure tensor functions.

Re-exported by `training/losses/contrastive.py`, whose module doc states the distributed contract these follow (local
rows, optional global text columns `*_all` and `offset`; each returns this worker's share) and the
precision rule. The logits are `training.losses.contrastive.ppcl_logits`, never built as a matrix of their own:
`pair_sigmoid_loss` (training/losses/fused/pairwise.py) takes the mean product and the σ² sums as row and column
vectors. The objective's per-sample terms come from one fused kernel, `sample_terms`
(training/losses/fused/per_sample.py), whose sums over d serve PPCL's variance terms and VIB alike.
"""

from __future__ import annotations

from torch import Tensor

from training.losses.fused.pairwise import exp_row_sum, full_precision, kl_from_sums, pair_sigmoid_loss
from training.losses.fused.per_sample import sample_terms
from training.losses.inclusion import REDUCTIONS
from training.losses.objectives import ProLIPLossConfig


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
    mu_cols, logvar_cols = _text_columns(mu_t, logvar_t, mu_t_all, logvar_t_all)
    return _ppcl_share(
        mu_v, exp_row_sum(logvar_v), mu_cols, exp_row_sum(logvar_cols), log_scale, bias, offset
    )


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Whether `a` and `b` are the same values in the same memory (one process: columns = local rows)."""
    return a is b or (
        a.shape == b.shape
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )


def _text_columns(
    mu_t: Tensor, logvar_t: Tensor, mu_t_all: Tensor | None, logvar_t_all: Tensor | None
) -> tuple[Tensor, Tensor]:
    if (mu_t_all is None) != (logvar_t_all is None):
        raise ValueError("pass both mu_t_all and logvar_t_all, or neither")
    return (mu_t, logvar_t) if mu_t_all is None or logvar_t_all is None else (mu_t_all, logvar_t_all)


@full_precision
def _ppcl_share(
    mu_v: Tensor,
    var_v: Tensor,
    mu_cols: Tensor,
    var_cols: Tensor,
    log_scale: Tensor,
    bias: Tensor,
    offset: int,
) -> Tensor:
    # The logits of `ppcl_logits`, as a mu_v.mu_t plus a row and a column vector (-a/2 sum_d sigma^2 of
    # each side, `var_*`) plus b, fused with the loss in `pair_sigmoid_loss`: one (B, N) buffer in all.
    a = log_scale.exp()
    row_var, col_var = var_v.mul(-0.5 * a), var_cols.mul(-0.5 * a)
    return pair_sigmoid_loss(a * mu_v, mu_cols, bias, row_bias=row_var, col_bias=col_var, offset=offset)


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
    alpha1: float = ProLIPLossConfig.alpha1,
    alpha2: float = ProLIPLossConfig.alpha2,
    beta: float = ProLIPLossConfig.beta,
    c: float = ProLIPLossConfig.c,
    log_eps: float = ProLIPLossConfig.log_eps,
    reduction: str = ProLIPLossConfig.reduction,
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
    averaged over d) means what it does in `inclusion_loss` and `vib_kl`; the counts N and M are the same.
    """
    given = [t is not None for t in (mu_v_masked, logvar_v_masked, mu_t_masked, logvar_t_masked)]
    if any(given) and masked_index is None:
        raise ValueError("masked Gaussians need masked_index, the local rows they were made from")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    mu_cols, logvar_cols = _text_columns(mu_t, logvar_t, mu_t_all, logvar_t_all)
    n, dim = mu_cols.shape[0], mu_v.shape[-1]
    m_global = n_masked_global
    if m_global is None:
        m_global = 0 if masked_index is None else masked_index.shape[0]

    def masked(mu_m: Tensor | None, logvar_m: Tensor | None) -> tuple[Tensor, Tensor, Tensor] | None:
        return (
            None
            if mu_m is None or logvar_m is None or masked_index is None
            else (masked_index, mu_m, logvar_m)
        )

    # Every O(B D) term from one fused kernel (training/losses/fused/per_sample.py); the sums over d it returns
    # serve PPCL's row (and, in one process, column) variance terms and VIB alike.
    s = sample_terms(
        mu_v, logvar_v, mu_t, logvar_t, masked(mu_v_masked, logvar_v_masked),
        masked(mu_t_masked, logvar_t_masked), c=c, log_eps=log_eps, joint=reduction == "joint",
    )  # fmt: skip
    var_cols = s.var_t if _same_tensor(logvar_cols, logvar_t) else exp_row_sum(logvar_cols)
    kl_scale = 1.0 if reduction == "joint" else 1.0 / dim
    # An empty (M = 0) selection sums to an exact zero with zero gradient; max() only guards 0 / 0.
    terms = {
        "ppcl": _ppcl_share(mu_v, s.var_v, mu_cols, var_cols, log_scale, bias, offset),
        "inc_vt": alpha1 * s.inc_vt.sum() / n,
        "inc_masked_v": alpha2 * s.inc_masked_v.sum() / max(m_global, 1),
        "inc_masked_t": alpha2 * s.inc_masked_t.sum() / max(m_global, 1),
        "vib_v": beta * kl_from_sums(s.var_v, s.quad_v, dim, kl_scale).sum() / n,
        "vib_t": beta * kl_from_sums(s.var_t, s.quad_t, dim, kl_scale).sum() / n,
    }
    terms["total"] = sum(terms.values())  # type: ignore[assignment]
    return terms
