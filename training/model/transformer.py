"""The pre-LN transformer trunk both towers share: blocks of attention and MLP, optionally checkpointed.

``forward`` runs one (B, S, D) batch; ``forward_packed`` runs several batches of different sequence
lengths laid end to end as one (N, D) matrix, so their per-token layers are one product each and only
attention runs per batch (docs/decisions/0021-patch-dropped-images-share-the-trunk-run.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x·σ(1.702·x): the GELU approximation OpenAI's CLIP weights were trained with."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": quick_gelu}


class Block(nn.Module):
    """Pre-LN transformer block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(
        self, width: int, heads: int, mlp_ratio: float, activation: str = "gelu", eps: float = 1e-5
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.act = ACTIVATIONS[activation]
        hidden = int(width * mlp_ratio)
        self.ln_1 = nn.LayerNorm(width, eps=eps)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width, eps=eps)
        self.fc_1 = nn.Linear(width, hidden)
        self.fc_2 = nn.Linear(hidden, width)

    def _attend(self, qkv: torch.Tensor, b: int, s: int, attn_mask: torch.Tensor | None) -> torch.Tensor:
        d = qkv.shape[-1] // 3
        q, k, v = (
            qkv.view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        )  # 3×(B,H,S,Dh)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, H, S, Dh)
        return attn.transpose(1, 2).reshape(b, s, d)  # (B, S, D)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_2(self.act(self.fc_1(self.ln_2(x))))  # (..., D)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        x = x + self.attn_out(self._attend(self.qkv(self.ln_1(x)), b, s, attn_mask))  # (B, S, D)
        return self._mlp(x)  # (B, S, D)

    def forward_packed(self, x: torch.Tensor, groups: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """``x`` (N, D): batches of sequences with shapes ``groups`` = ((B_i, S_i), ...) laid end to end
        (N = Σ B_i·S_i). The per-token layers run once over all N rows; attention stays within each batch,
        so every batch's rows equal ``forward`` on it alone."""
        qkv = self.qkv(self.ln_1(x))  # (N, 3D)
        parts = qkv.split([b * s for b, s in groups])
        attn = torch.cat(
            [self._attend(q, b, s, None).flatten(0, 1) for q, (b, s) in zip(parts, groups, strict=True)]
        )
        return self._mlp(x + self.attn_out(attn))  # (N, D)


class Transformer(nn.Module):
    """A stack of pre-LN blocks with optional activation checkpointing (recompute in backward)."""

    def __init__(
        self,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float,
        activation: str = "gelu",
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio, activation, eps) for _ in range(layers))
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S, D) → (B, S, D)."""
        return self._run(x, lambda block: block, attn_mask)

    def forward_packed(self, x: torch.Tensor, groups: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """Several unmasked batches at once: see ``Block.forward_packed``; (N, D) → (N, D)."""
        return self._run(x, lambda block: block.forward_packed, groups)

    def _run(self, x: torch.Tensor, call, arg) -> torch.Tensor:
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(call(block), x, arg, use_reentrant=False)
            else:
                x = call(block)(x, arg)
        return x
