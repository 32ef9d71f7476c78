"""The two-tower module: images and texts to diagonal Gaussians in one space (ProLIP; CLIP when deterministic).

Presets (``MODEL_CONFIGS``):

- ``tiny``: CPU tests and ``jobs.train --preset demo`` (64 px, patch 8, 4×128 per tower, context 32, vocab
  4096 = the default of ``pipeline.ingest.tokenizer.train_tokenizer``); ≈2.2M parameters.
- ``demo-32px``: the track demo's (``make demo``) — ``tiny`` at 32 px with 2 layers per tower; ``demo-32px-cnn`` the
  same with a small CNN (convolutional stem, mean-pooled, no transformer) as the image tower (CLIP only).
- ``ViT-B-32``: the DataComp small-track architecture (CLIP ViT-B/32 with a 12×512 causal text tower,
  context 77, vocab 49408 = CLIP BPE). Table C.6 "ViT-B/32": 151.7M base parameters.
- ``ViT-B-16-ProLIP``: the paper's model (§4.1): ViT-B/16 at 224 px, 12×768 text tower, context 64,
  embedding 768 "following SigLIP ViT-B/16", hence SigLIP's 32000-token vocabulary and its bidirectional
  text attention. Table C.6 "ViT-B/16-768": 197.3M base parameters; with vocab 49408 the count would be
  ≈210M, 6% off, so 32000 is the vocabulary the paper's table implies.

A tokenizer that adds tokens (a [MASK] or [PAD] that CLIP's BPE lacks) changes ``vocab_size`` and
``pad_id``: build the config with ``model_config(name, vocab_size=tok.vocab_size, pad_id=tok.pad_id)``.
"""

from __future__ import annotations

import torch
from torch import nn

from training.model.config import ModelConfig
from training.model.towers import TextTower, VisionTower


class ProLIP(nn.Module):
    """Two towers mapping images and texts to diagonal Gaussians ``(mu, logvar)`` in one space.

    ``mu`` is L2-normalised (B, E) float32; ``logvar`` is (B, E) float32, or None when the config is
    deterministic (CLIP/SigLIP baselines).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTower(config)
        self.text = TextTower(config)
        self.set_grad_checkpointing(config.grad_checkpointing)

    def set_grad_checkpointing(self, enabled: bool = True) -> None:
        self.visual.transformer.grad_checkpointing = enabled
        self.text.transformer.grad_checkpointing = enabled

    def encode_image(
        self, images: torch.Tensor, keep_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """images (B, 3, H, W) normalised floats; keep_idx (B, K) patch indices to keep (patch drop)."""
        return self.visual(images, keep_idx)

    def encode_image_with_dropped(
        self, images: torch.Tensor, dropped: torch.Tensor, keep_idx: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
        """``(encode_image(images), encode_image(dropped, keep_idx))`` in one run of the image trunk."""
        return self.visual.forward_with_dropped(images, dropped, keep_idx)

    def encode_text(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens (B, L) int64, L ≤ context_length, padded with ``config.pad_id``."""
        return self.text(tokens)

    def forward(
        self, images: torch.Tensor, tokens: torch.Tensor, keep_idx: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor | None]:
        image_mu, image_logvar = self.encode_image(images, keep_idx)  # (B, E), (B, E) | None
        text_mu, text_logvar = self.encode_text(tokens)  # (B, E), (B, E) | None
        return {
            "image_mu": image_mu,
            "image_logvar": image_logvar,
            "text_mu": text_mu,
            "text_logvar": text_logvar,
        }


def num_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (works for models built on the ``meta`` device)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def unwrap(model: nn.Module) -> nn.Module:
    # DDP keeps the model in ``.module``, torch.compile in ``._orig_mod``.
    for attr in ("_orig_mod", "module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            model = inner
    return model
