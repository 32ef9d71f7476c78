"""PCME++ objective (Chun, ICLR 2024; docs/math.md "PCME++") and its mixed-sample augmentation, as pure functions.

Matching loss (PCME++ Eq. 2): logit l_vt = -a CSD(Z_v, Z_t) + b with learnable a, b (init 5, 5, the COCO
setting), binary cross-entropy against soft match labels m_vt in [0, 1] over every image-caption pair.
Pseudo-positives (Sec. 2.3, pseudo-code Fig. A.2): in each image row, every caption whose logit is at
least the row's ground-truth logit takes the row's ground-truth label, and the BCE is taken again with
those labels (weight alpha = 0.1). VIB (Eq. A.2 of ProLIP, weight beta = 1e-4). Mixup / CutMix (Sec. 2.4):
25% of a batch's images are mixed with another image of the batch with lambda ~ Beta(2, 2), one of the two
methods per batch; the mixed image's own caption gets label lambda and its partner's caption 1 - lambda.

Normalisation follows the paper's pseudo-code, for which alpha and beta were tuned: both BCE terms are
means over the N x N pairs of the global batch and VIB is a mean over samples and dimensions. The shares
obey the distributed contract of `training/losses/contrastive.py` (local rows x global columns, sums of shares equal
the single-process loss); mixing partners are drawn inside each worker's local batch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.losses.contrastive import csd_matrix
from training.losses.fused.pairwise import full_precision
from training.losses.inclusion import vib_kl
from training.losses.objectives import PCMEppLossConfig


@full_precision
def pcmepp_loss(
    mu_v: Tensor,
    logvar_v: Tensor,
    mu_t: Tensor,
    logvar_t: Tensor,
    scale: Tensor,
    shift: Tensor,
    *,
    alpha: float = PCMEppLossConfig.alpha,
    beta: float = PCMEppLossConfig.beta,
    soft_labels: Tensor | None = None,
    mu_t_all: Tensor | None = None,
    logvar_t_all: Tensor | None = None,
    offset: int = 0,
) -> dict[str, Tensor]:
    """PCME++ share: L = L_match + alpha L_pseudo-match + beta (L_VIB(Z_v) + L_VIB(Z_t)).

    Returns the WEIGHTED terms {match, pseudo_pos, vib_v, vib_t} and their sum `total`.
    Shapes: local rows (B, D); global text columns `mu_t_all`, `logvar_t_all` (N, D), default local;
    `soft_labels` (B, N) in [0, 1] from `pcmepp_soft_labels`, default 1 at (i, offset + i) and 0 elsewhere.
    logits = -scale * CSD + shift, with `scale`, `shift` the raw learnable a, b of the paper.
    """
    if (mu_t_all is None) != (logvar_t_all is None):
        raise ValueError("pass both mu_t_all and logvar_t_all, or neither")
    cols_mu = mu_t if mu_t_all is None else mu_t_all
    cols_logvar = logvar_t if logvar_t_all is None else logvar_t_all
    n, dim = cols_mu.shape
    logits = shift - scale * csd_matrix(mu_v, logvar_v, cols_mu, cols_logvar)  # (B, N)
    if soft_labels is None:
        soft_labels = torch.zeros_like(logits)
        rows = torch.arange(logits.shape[0], device=logits.device)
        soft_labels[rows, rows + offset] = 1.0
    pairs = n * n
    match = F.binary_cross_entropy_with_logits(logits, soft_labels, reduction="sum") / pairs

    # The comparison picks which labels change; it carries no gradient, as in the paper's pseudo-code.
    gt_label, gt_index = soft_labels.max(dim=1)
    gt_logit = logits.detach().gather(1, gt_index[:, None])
    pseudo = logits.detach() >= gt_logit
    pp_labels = torch.where(pseudo, gt_label[:, None].expand_as(soft_labels), soft_labels)
    pseudo_pos = F.binary_cross_entropy_with_logits(logits, pp_labels, reduction="sum") / pairs

    terms = {
        "match": match,
        "pseudo_pos": alpha * pseudo_pos,
        "vib_v": beta * vib_kl(mu_v, logvar_v).sum() / (n * dim),
        "vib_t": beta * vib_kl(mu_t, logvar_t).sum() / (n * dim),
    }
    terms["total"] = sum(terms.values())  # type: ignore[assignment]
    return terms


def pcmepp_soft_labels(partner_index: Tensor, lam: Tensor, offset: int, n_global: int) -> Tensor:
    """Soft match labels (B_local, N) for mixed images: lam at the own caption (i, offset + i) and
    1 - lam at the partner's caption (i, offset + partner_i); unmixed rows (partner_i = i, lam_i = 1)
    get 1 on the diagonal. `partner_index` (B,) indexes the local batch, `lam` (B,) is float.
    """
    b = partner_index.shape[0]
    labels = lam.new_zeros((b, n_global))
    rows = torch.arange(b, device=lam.device)
    labels.index_put_((rows, rows + offset), lam, accumulate=True)
    labels.index_put_((rows, partner_index.to(lam.device) + offset), 1.0 - lam, accumulate=True)
    return labels


def mix_images(
    images: Tensor,
    generator: torch.Generator,
    fraction: float = PCMEppLossConfig.mix_fraction,
    alpha: float = 2.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mix `fraction` of the float images (B, C, H, W) with another image of the batch (PCME++ Sec. 2.4).

    One method per batch, chosen with probability 1/2: Mixup (lam x_i + (1 - lam) x_j) or CutMix (a box of
    area about (1 - lam) H W from x_j pasted into x_i; lam is then corrected to the exact unpasted share).
    lam ~ Beta(alpha, alpha), one draw per batch. Returns (mixed images, partner_index (B,) long,
    lam (B,) float32), both on the images' device, where unmixed rows have partner_index = own index and
    lam = 1. The input is not modified. All randomness comes from `generator` (a CPU torch.Generator).
    """
    b, _, h, w = images.shape
    n_mix = min(b, int(round(fraction * b))) if b > 1 else 0
    # torch has no seeded Beta sampler; a numpy Generator seeded from the torch one keeps one seed source.
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))
    rows = torch.randperm(b, generator=generator)[:n_mix]
    # A non-zero shift modulo b guarantees every mixed image gets a different partner.
    partners = (rows + torch.randint(1, max(b, 2), (n_mix,), generator=generator)) % max(b, 1)
    lam = float(rng.beta(alpha, alpha))

    mixed = images.clone()
    rows_d, partners_d = rows.to(images.device), partners.to(images.device)
    if rng.random() < 0.5:
        mixed[rows_d] = lam * images[rows_d] + (1.0 - lam) * images[partners_d]
    else:
        cut_h, cut_w = int(h * math.sqrt(1.0 - lam)), int(w * math.sqrt(1.0 - lam))
        cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
        y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h - cut_h // 2, h)
        x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w - cut_w // 2, w)
        patch = images[partners_d][:, :, y0:y1, x0:x1]
        mixed[rows_d, :, y0:y1, x0:x1] = patch
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)

    partner_index = torch.arange(b)
    partner_index[rows] = partners
    lam_per_row = torch.ones(b)
    lam_per_row[rows] = lam
    return mixed, partner_index.to(images.device), lam_per_row.to(images.device)


class PCMEppLoss(nn.Module):
    """PCME++ with learnable raw scale a and shift b (init 5, 5), pseudo-positive weight alpha, VIB beta."""

    def __init__(
        self,
        init_scale: float = 5.0,
        init_shift: float = 5.0,
        alpha: float = PCMEppLossConfig.alpha,
        beta: float = PCMEppLossConfig.beta,
    ) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(init_scale)))
        self.shift = nn.Parameter(torch.tensor(float(init_shift)))
        self.alpha, self.beta = alpha, beta

    def forward(
        self, mu_v: Tensor, logvar_v: Tensor, mu_t: Tensor, logvar_t: Tensor, **inputs: Any
    ) -> dict[str, Tensor]:
        """Weighted terms of `pcmepp_loss` plus `total`; `inputs`: `mu_t_all`, `logvar_t_all`, `offset`,
        `soft_labels` (image columns are accepted and ignored, see training/losses/contrastive.py)."""
        inputs = {k: v for k, v in inputs.items() if k not in ("mu_v_all", "logvar_v_all")}
        return pcmepp_loss(
            mu_v, logvar_v, mu_t, logvar_t, self.scale, self.shift, alpha=self.alpha, beta=self.beta, **inputs
        )
