"""Transformer towers of ProLIP: a ViT image encoder and a text encoder, each ending in a Gaussian head.

Architecture (ProLIP paper §3.2, Fig. 2):

- Image tower: tokens ``[CLS, UNC, patch_1..patch_N]`` with learned positional embeddings for all N+2.
  Patch drop (MAE-style, He et al. 2022, used for the masked inputs of Eq. 6 with 25% kept) gathers the
  kept patches *and* their positional embeddings before the transformer; CLS/UNC are always kept.
- Text tower: ``[tok_1..tok_L, UNC, CLS]`` — UNC and CLS are appended at the end as in the paper (CLIP's
  text tower pools the final EOS position, and ProLIP keeps that convention).
- Heads: ``mu = normalize(W_mu · LN(h_CLS))``, ``logvar = W_sigma · LN(h_UNC) + b`` with ``b`` initialised to
  −10 (σ² ≈ 4.5e−5, §4.1), both computed in float32 under autocast too. The official code feeds the
  projected text CLS into the text σ head; we follow the paper and use the UNC output in both towers.
- ``probabilistic=False`` drops the UNC token and the σ head and keeps everything else, so the CLIP/SigLIP
  baselines differ from ProLIP only in the objective (Table C.6 "Deterministic").

Judgement calls (documented in docs/fidelity.md):

- The μ projection has no bias (CLIP's ``proj``): a bias before L2 normalisation only shifts every
  embedding towards one direction.
- One final LayerNorm (``ln_post``) feeds both heads, so UNC costs one token, one positional row and one
  linear layer per tower (≈0.6M for ViT-B/16-768, Table C.6 "+0.6M").
- Text padding is never attended to (key padding mask), and UNC/CLS always sit at the fixed positional
  rows ``C`` and ``C+1`` (C = context length) whatever the input length, so their outputs do not depend on
  how much padding a sequence carries (a (B, 20) batch and its (B, C) padded copy encode identically).
- Text attention is bidirectional or causal per config (``text_causal``): CLIP is causal, SigLIP — whose
  text setup ProLIP B/16 follows (§4.1) — is bidirectional, and [MASK] inputs (BERT-style) profit from
  seeing both sides. Either way every query may attend to itself, so no attention row is ever empty
  (an all-masked softmax row gives NaN, whose gradient would poison the batch).

Variants selected by ``ModelConfig`` so that imported weights (training/imports/) run in this one model:

- ``activation="quick_gelu"``: x·σ(1.702x), the MLP activation OpenAI's CLIP weights were trained with.
- ``text_pool="eot"`` (deterministic only): no appended CLS; the text embedding is read at the end token,
  the last non-pad position (CLIP pools its EOT token; with causal attention it sees the whole caption). A
  pad id past the token table (our added ``<pad>`` after CLIP's 49,408 ids) embeds as id 0, open_clip's
  padding, so the model is open_clip's CLIP parameter for parameter.
- ``head_variant="prolip_official"`` with ``text_mask_padding=False``, ``text_proj_bias=True`` and
  ``text_ln_eps=1e-6``: the released ProLIP checkpoints' arithmetic — the image CLS state passes the final
  LayerNorm twice, the text σ head reads the projected (unnormalised) text mean, and text attention sees
  the padding (so such a model needs full-length, padded token rows, as its tokenizer gives).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from training.model.transformer import Transformer

if TYPE_CHECKING:
    from training.model.config import ModelConfig

# Init scales: ViT/GPT-2 style (std 0.02 for weights and token rows, 0.01 for positional rows).
_INIT_STD = 0.02
_POS_INIT_STD = 0.01


class GaussianHead(nn.Module):
    """Maps the final CLS (and UNC) states to ``(mu, logvar)``; ``logvar`` is None when deterministic.

    ``logvar_from_mu`` (official ProLIP text head): ``logvar`` is read from the projected mean before
    normalisation instead of from the UNC state."""

    def __init__(
        self,
        width: int,
        embed_dim: int,
        probabilistic: bool,
        unc_bias_init: float,
        mu_bias: bool = False,
        logvar_from_mu: bool = False,
    ) -> None:
        super().__init__()
        self.mu_proj = nn.Linear(width, embed_dim, bias=mu_bias)
        self.logvar_from_mu = logvar_from_mu
        logvar_in = embed_dim if logvar_from_mu else width
        self.logvar_proj = nn.Linear(logvar_in, embed_dim) if probabilistic else None
        self.unc_bias_init = unc_bias_init

    def reset_logvar_bias(self) -> None:
        if self.logvar_proj is not None:
            nn.init.constant_(self.logvar_proj.bias, self.unc_bias_init)

    def forward(
        self, h_cls: torch.Tensor, h_unc: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Both heads run in float32 even under autocast: bf16 has 8 bits of mantissa, so near the −10 init a
        # log σ² moves in steps of 0.0625 (σ² by 6%), which swamps the differences the inclusion loss and
        # CSD compare; the heads are a (B, D)×(D, E) product each, a rounding error of the step's cost.
        kind = h_cls.device.type
        wide = torch.promote_types(h_cls.dtype, torch.float32)  # float64 stays float64 (exactness tests)
        with torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else nullcontext():
            projected = self.mu_proj(h_cls.to(wide))  # (B, E)
            mu = F.normalize(projected, dim=-1)  # (B, E)
            if self.logvar_proj is None or (h_unc is None and not self.logvar_from_mu):
                return mu, None
            logvar = self.logvar_proj(projected if self.logvar_from_mu else h_unc.to(wide))  # (B, E)
        return mu, logvar


class ConvStem(nn.Module):
    """3×3 convolutions from pixels to the patch grid: log2(p) stages, each a stride-1 and a stride-2
    convolution, each followed by a GroupNorm over all channels (one group: per-sample statistics, so
    nothing depends on the batch) and GELU (channels doubling up to ``width``), then a 1×1 projection;
    ``(B, 3, H, W) → (B, N, width)`` in the patch projection's row-major token order. Xiao et al. 2021
    ("Early convolutions help transformers see better") replace the ViT's patchify with such a stem;
    docs/decisions/0002-demo-subset-model.md has the measurements behind the demo's use of one.
    """

    def __init__(self, patch_size: int, width: int) -> None:
        super().__init__()
        n = patch_size.bit_length() - 1
        if n < 1 or 1 << n != patch_size:
            raise ValueError(f"a convolutional stem needs a power-of-two patch_size > 1, got {patch_size}")
        channels = [3] + [max(16, width >> (n - 1 - k)) for k in range(n)]
        layers: list[nn.Module] = []
        for c_in, c_out in zip(channels[:-1], channels[1:], strict=True):
            mid = max(16, c_out // 2)
            layers += [nn.Conv2d(c_in, mid, 3, padding=1), nn.GroupNorm(1, mid), nn.GELU()]
            layers += [nn.Conv2d(mid, c_out, 3, stride=2, padding=1), nn.GroupNorm(1, c_out), nn.GELU()]
        layers.append(nn.Conv2d(channels[-1], width, 1, bias=False))  # no bias: ln_pre follows
        self.layers = nn.Sequential(*layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # Channels-last input: the stem's oneDNN convolutions and GroupNorm run faster on the demo's CPU step
        # (30–32 ms against 34–40 ms; docs/decisions/0002-demo-subset-model.md), and the (B, H, W, C)
        # result flattens to the token grid without a copy.
        x = self.layers(images.contiguous(memory_format=torch.channels_last))  # (B, width, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # (B, N, width)


def _init_weights(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")  # GELU ≈ ReLU's gain
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=_INIT_STD)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=_INIT_STD)
        elif isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class _Tower(nn.Module):
    """What both towers share: the transformer trunk, the final LayerNorm, the Gaussian head and the init.

    Subclasses register their embeddings (``cls_token``, ``unc_token``, ``pos_embed``) first, then call
    ``_add_trunk``, so parameters keep their names and registration order (checkpoints load unchanged).
    """

    cls_token: nn.Parameter | None
    unc_token: nn.Parameter | None
    pos_embed: nn.Parameter

    def _add_trunk(
        self, cfg: ModelConfig, width: int, layers: int, heads: int, eps: float = 1e-5, text: bool = False
    ) -> None:
        self.transformer = Transformer(width, layers, heads, cfg.mlp_ratio, cfg.activation, eps)
        self.ln_post = nn.LayerNorm(width, eps=eps)
        official = cfg.head_variant == "prolip_official"
        self.head = GaussianHead(
            width,
            cfg.embed_dim,
            cfg.probabilistic,
            cfg.unc_bias_init,
            mu_bias=text and cfg.text_proj_bias,
            logvar_from_mu=text and official,
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_weights(self)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=_INIT_STD)
        if self.unc_token is not None:
            nn.init.normal_(self.unc_token, std=_INIT_STD)
        nn.init.normal_(self.pos_embed, std=_POS_INIT_STD)
        self.head.reset_logvar_bias()


class VisionTower(_Tower):
    """ViT over ``[CLS, UNC, patches]``; ``forward(images, keep_idx)`` returns ``(mu, logvar)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size {cfg.image_size} is not divisible by patch_size {cfg.patch_size}")
        width = cfg.vision_width
        self.image_size = cfg.image_size
        self.patch_size = cfg.patch_size
        self.grid = cfg.image_size // cfg.patch_size
        self.n_patches = self.grid * self.grid
        self.n_special = 2 if cfg.probabilistic else 1
        # A linear layer on flattened patches equals a stride-p convolution; no bias because ln_pre follows.
        # ``vision_stem="conv"`` puts a small strided CNN in its place (same token grid).
        if cfg.vision_stem == "conv":
            self.conv_stem = ConvStem(cfg.patch_size, width)
        else:
            self.patch_embed = nn.Linear(3 * cfg.patch_size * cfg.patch_size, width, bias=False)
        self.cls_token = nn.Parameter(torch.empty(width))
        self.unc_token = nn.Parameter(torch.empty(width)) if cfg.probabilistic else None
        self.pos_embed = nn.Parameter(torch.empty(self.n_special + self.n_patches, width))
        self.ln_pre = nn.LayerNorm(width)
        self.cls_ln_twice = cfg.head_variant == "prolip_official"
        self.mean_pool = cfg.vision_pool == "mean"
        self._add_trunk(cfg, width, cfg.vision_layers, cfg.vision_heads)

    def _checked(self, images: torch.Tensor) -> torch.Tensor:
        if tuple(images.shape[1:]) != (3, self.image_size, self.image_size):
            raise ValueError(
                f"expected images (B, 3, {self.image_size}, {self.image_size}), got {tuple(images.shape)}"
            )
        return images

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) → (B, N, 3·p·p), patches in row-major grid order (index = row·grid + col)."""
        b, c, _, _ = self._checked(images).shape
        p, g = self.patch_size, self.grid
        x = images.reshape(b, c, g, p, g, p)  # (B, 3, g, p, g, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)  # (B, N, 3·p·p)

    def embed_patches(self, images: torch.Tensor, keep_idx: torch.Tensor | None) -> torch.Tensor:
        """(B, K, D) patch tokens plus their positional rows, only the ``keep_idx`` ones when given.

        The patch projection gathers the kept patches first: dropped patches cost nothing and cannot leak
        into the output. A convolutional stem sees the whole picture, so its tokens are gathered after it
        (a kept token's receptive field reaches into dropped neighbours, as in ConvMAE-style stems)."""
        b = images.shape[0]
        pos = self.pos_embed[self.n_special :].expand(b, -1, -1)  # (B, N, D)
        conv = getattr(self, "conv_stem", None)
        x = conv(self._checked(images)) if conv is not None else self.patchify(images)  # (B, N, D | 3·p·p)
        if keep_idx is not None:
            idx = keep_idx.long()  # (B, K)
            x = torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, K, ·)
            pos = torch.gather(pos, 1, idx.unsqueeze(-1).expand(-1, -1, pos.shape[-1]))  # (B, K, D)
        return (x if conv is not None else self.patch_embed(x)) + pos  # (B, K, D)

    def special_tokens(self) -> torch.Tensor:
        tokens = [self.cls_token] if self.unc_token is None else [self.cls_token, self.unc_token]
        return torch.stack(tokens) + self.pos_embed[: self.n_special]  # (S0, D)

    def _tokens(self, images: torch.Tensor, keep_idx: torch.Tensor | None) -> torch.Tensor:
        x = self.embed_patches(images, keep_idx)  # (B, K, D)
        special = self.special_tokens().unsqueeze(0).expand(x.shape[0], -1, -1).to(x.dtype)  # (B, S0, D)
        return self.ln_pre(torch.cat([special, x], dim=1))  # (B, S0 + K, D)

    def forward(
        self, images: torch.Tensor, keep_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._pool(self.transformer(self._tokens(images, keep_idx)))

    def forward_with_dropped(
        self, images: torch.Tensor, dropped: torch.Tensor, keep_idx: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
        """``(self(images), self(dropped, keep_idx))`` in one run of the trunk: the patch-dropped pictures'
        tokens join the whole pictures' rows in every per-token product (one large product instead of a
        second, small pass; docs/decisions/0021-patch-dropped-images-share-the-trunk-run.md), attention stays
        within each batch."""
        full, part = self._tokens(images, None), self._tokens(dropped, keep_idx)  # (B, S, D), (M, S', D)
        groups = (tuple(full.shape[:2]), tuple(part.shape[:2]))
        x = self.transformer.forward_packed(torch.cat([full.flatten(0, 1), part.flatten(0, 1)]), groups)
        x_full, x_part = x.split([full.shape[0] * full.shape[1], part.shape[0] * part.shape[1]])
        return self._pool(x_full.view(full.shape)), self._pool(x_part.view(part.shape))

    def _pool(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The trunk's output (B, S0 + K, D) → the head's ``(mu, logvar)``."""
        if self.mean_pool:  # the image's state is the mean of its patch tokens, not CLS
            x = torch.cat([x[:, self.n_special :].mean(dim=1, keepdim=True), x[:, 1 : self.n_special]], 1)
        x = self.ln_post(x)  # (B, S0 + K, D), or (B, S0, D) when mean-pooled
        h_unc = x[:, 1] if self.unc_token is not None else None  # (B, D)
        h_cls = self.ln_post(x[:, 0]) if self.cls_ln_twice else x[:, 0]  # (B, D)
        return self.head(h_cls, h_unc)


class TextTower(_Tower):
    """Transformer over ``[tok_1..tok_L, UNC, CLS]``; ``forward(tokens)`` returns ``(mu, logvar)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.text_width
        self.context_length = cfg.context_length
        self.pad_id = cfg.pad_id
        self.pad_in_table = cfg.pad_id < cfg.vocab_size  # else padding embeds as id 0 (open_clip's padding)
        self.causal = cfg.text_causal
        self.mask_padding = cfg.text_mask_padding
        self.eot_pool = cfg.text_pool == "eot"
        self.n_special = (2 if cfg.probabilistic else 1) - int(self.eot_pool)
        self.token_embed = nn.Embedding(cfg.vocab_size, width)
        self.unc_token = nn.Parameter(torch.empty(width)) if cfg.probabilistic else None
        self.cls_token = None if self.eot_pool else nn.Parameter(torch.empty(width))
        # Rows 0..C-1 for text positions, C (UNC) and C+1 (CLS): fixed rows whatever the input length.
        self.pos_embed = nn.Parameter(torch.empty(cfg.context_length + self.n_special, width))
        self._add_trunk(cfg, width, cfg.text_layers, cfg.text_heads, eps=cfg.text_ln_eps, text=True)

    def special_tokens(self) -> torch.Tensor:
        tokens = [t for t in (self.unc_token, self.cls_token) if t is not None]
        if not tokens:
            return self.pos_embed[:0]  # (0, D)
        return torch.stack(tokens) + self.pos_embed[self.context_length :]  # (S0, D)

    def attention_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """Boolean (B, 1, S, S) mask, True = may attend: no padding keys, causal if configured, self always."""
        b, length = tokens.shape
        s = length + self.n_special
        special_ok = torch.ones(b, self.n_special, dtype=torch.bool, device=tokens.device)  # (B, S0)
        text_ok = tokens != self.pad_id if self.mask_padding else torch.ones_like(tokens, dtype=torch.bool)
        key_ok = torch.cat([text_ok, special_ok], dim=1)  # (B, S)
        mask = key_ok[:, None, None, :].expand(b, 1, s, s)  # (B, 1, S, S)
        eye = torch.eye(s, dtype=torch.bool, device=tokens.device)  # (S, S)
        if self.causal:
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()  # (B, 1, S, S)
        return mask | eye  # (B, 1, S, S)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, length = tokens.shape
        if length > self.context_length:
            raise ValueError(f"tokens have length {length} > context_length {self.context_length}")
        ids = tokens if self.pad_in_table else tokens.masked_fill(tokens == self.pad_id, 0)  # (B, L)
        x = self.token_embed(ids) + self.pos_embed[:length]  # (B, L, D)
        special = self.special_tokens().unsqueeze(0).expand(b, -1, -1).to(x.dtype)  # (B, S0, D)
        x = torch.cat([x, special], dim=1)  # (B, L + S0, D)
        x = self.transformer(x, self.attention_mask(tokens))  # (B, L + S0, D)
        x = self.ln_post(x)  # (B, L + S0, D)
        if self.eot_pool:
            # The end token is the last non-pad position (pipeline/ingest/tokenizer.py's layout), also when the
            # pad id is a real token (a BPE's 0) that a caption may contain.
            pos = torch.arange(1, length + 1, device=tokens.device)  # (L,)
            last = ((tokens != self.pad_id) * pos).argmax(dim=1)  # (B,)
            return self.head(x[torch.arange(b, device=x.device), last], None)
        h_unc = x[:, -2] if self.unc_token is not None else None  # (B, D)
        return self.head(x[:, -1], h_unc)
