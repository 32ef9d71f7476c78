"""Salience-driven masked captions: ``data.text_mask_mode="salient"``, the demo scorer's masking.

The masked-inclusion term L_inc(t ⊂ t_masked) (ProLIP §4.1, Eq. 6) asks a masked caption to be the more
uncertain one. With random words removed, a masked caption mostly loses filler ("a", "photo", "of") and
the term teaches σ² to read length. Here the model itself chooses what to remove: the words whose
removal moves the caption's mean embedding most, i.e. the words that say the most about the image.

For each selected caption with n content tokens (not pad, not end, not protected):

1. encode the caption and its n leave-one-out versions (token p removed, the rest moved left, padding at
   the end), no gradient, with the current weights;
2. shift(p) = ‖μ(caption without p) − μ(caption)‖₂;
3. remove the tokens with shift(p) above the median shift over every leave-one-out version in the batch,
   largest first, at most max(1, round_half_up(ratio · n)) per caption; a caption none of whose tokens
   is above the median keeps all of them (its masked variant equals the caption).

The median is over this worker's batch, so the choice does not depend on other workers. Cost: one
no-grad text forward over Σ n sequences (~ the selected captions × their length): +14–15% of the ViT
scorer's training time in the replica, within the spread of ``bench/train_step.py``'s ``prolip_salient``
case (docs/decisions/0004-salient-masked-captions.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def leave_one_out(tokens: Tensor, pad_id: int) -> Tensor:
    """(M, L) → (M, L, L): ``[m, p]`` is row m with position p removed, later tokens moved left, pad last."""
    m, length = tokens.shape
    j = torch.arange(length, device=tokens.device)
    src = j[None, :] + (j[None, :] >= j[:, None]).long()  # (L, L): column j of variant p reads j or j + 1
    padded = torch.cat([tokens, tokens.new_full((m, 1), pad_id)], dim=1)  # (M, L + 1)
    return padded[:, src]  # (M, L, L)


def remove_positions(tokens: Tensor, drop: Tensor, pad_id: int) -> Tensor:
    """Each row of ``tokens`` (M, L) without the positions where ``drop`` (M, L) is true: the kept tokens in
    their order, then padding."""
    order = torch.argsort(drop.to(torch.int8), dim=1, stable=True)  # kept first, each group in order
    out = tokens.gather(1, order)
    return out.masked_fill(drop.gather(1, order), pad_id)


class SalientDrop:
    """The masked captions of the selected rows, chosen by the model's own salience (module docstring).

    ``__call__(encode_text, tokens, rows)`` → (M, L) masked tokens for ``tokens[rows]``; ``encode_text``
    maps (N, L) int64 tokens to (μ (N, E), log σ² or None).
    """

    def __init__(
        self, pad_id: int, end_id: int, ratio: float = 0.5, protected_ids: Sequence[int] = ()
    ) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        self.pad_id, self.end_id, self.ratio = pad_id, end_id, ratio
        self.protected_ids = tuple(protected_ids)

    def content(self, tokens: Tensor) -> Tensor:
        keep_out = torch.tensor([self.pad_id, self.end_id, *self.protected_ids], device=tokens.device)
        return ~torch.isin(tokens, keep_out)

    def shifts(self, encode_text: Callable[[Tensor], tuple[Tensor, Tensor | None]], tokens: Tensor) -> Tensor:
        """(M, L) float: shift(p) for every content position, NaN elsewhere."""
        m, length = tokens.shape
        content = self.content(tokens)  # (M, L)
        variants = leave_one_out(tokens, self.pad_id)[content]  # (N, L), N = content tokens
        with torch.no_grad():
            mu, _ = encode_text(torch.cat([tokens, variants]))  # (M + N, E)
        mu = mu.float()
        owner = torch.arange(m, device=tokens.device)[:, None].expand(m, length)[content]  # (N,)
        out = torch.full((m, length), float("nan"), device=tokens.device)
        out[content] = torch.linalg.vector_norm(mu[m:] - mu[owner], dim=1)
        return out

    def __call__(
        self, encode_text: Callable[[Tensor], tuple[Tensor, Tensor | None]], tokens: Tensor, rows: Tensor
    ) -> Tensor:
        selected = tokens[rows]  # (M, L)
        if selected.numel() == 0:
            return selected
        shift = self.shifts(encode_text, selected)  # (M, L)
        content = ~torch.isnan(shift)
        if not bool(content.any()):
            return selected
        threshold = torch.quantile(shift[content], 0.5)  # the median, halfway between the middle two
        n = content.sum(dim=1)  # (M,)
        k = torch.clamp(torch.floor(self.ratio * n + 0.5).long(), min=1)  # (M,)
        ranked = torch.where(content, shift, torch.full_like(shift, -1.0))
        order = torch.argsort(ranked, dim=1, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
        drop = content & (shift > threshold) & (rank < k[:, None])
        return remove_positions(selected, drop, self.pad_id)

    def rewrite(
        self,
        encode_text: Callable[[Tensor], tuple[Tensor, Tensor | None]],
        tokens: Tensor,
        masked_tokens: Tensor,
        rows: Tensor,
    ) -> Tensor:
        """A copy of the collated ``masked_tokens`` (B, L) with ``rows`` replaced by this rule's captions."""
        out = masked_tokens.clone()
        out[rows] = self(encode_text, tokens, rows)
        return out
