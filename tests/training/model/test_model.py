"""Tests for training/model/two_tower.py and training/model/towers.py (tiny config on CPU; big configs on the meta device)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.common.config import ConfigError
from pipeline.ingest.masking import choose_kept_patches
from pipeline.ingest.tokenizer import train_tokenizer
from training.config import OptimConfig, TrainConfig
from training.model.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    load_checkpoint,
    load_extra,
    save_checkpoint,
)
from training.model.config import MODEL_CONFIGS, ModelConfig, model_config
from training.model.param_groups import decay_split, is_unc_param, param_groups
from training.model.two_tower import ProLIP, num_params

B = 4
PAD, END = 0, 1


@pytest.fixture(scope="module")
def model() -> ProLIP:
    torch.manual_seed(0)
    return ProLIP(model_config("tiny")).eval()


def _images(seed: int = 0, b: int = B) -> torch.Tensor:
    return torch.randn(b, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def _tokens(lengths: list[int], context: int = 32, seed: int = 0) -> torch.Tensor:
    """Rows of random content tokens of the given lengths, then END, then PAD."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((len(lengths), context), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(3, 4096, (n,), generator=g)
        tokens[i, n] = END
    return tokens


def _meta_model(name: str, **overrides) -> ProLIP:
    with torch.device("meta"):
        return ProLIP(model_config(name, **overrides))


# ---------------------------------------------------------------- shapes and heads


def test_forward_shapes_and_init(model: ProLIP) -> None:
    out = model(_images(), _tokens([5, 10, 0, 30]))
    for side in ("image", "text"):
        mu, logvar = out[f"{side}_mu"], out[f"{side}_logvar"]
        assert mu.shape == (B, 128) and logvar.shape == (B, 128)
        assert mu.dtype == logvar.dtype == torch.float32
        torch.testing.assert_close(mu.norm(dim=-1), torch.ones(B))
        # §4.1: the σ head's bias starts at −10, so log σ² ≈ −10 at init.
        assert abs(logvar.mean().item() + 10) < 0.5


def test_deterministic_variant_has_no_logvar() -> None:
    det = ProLIP(model_config("tiny", probabilistic=False))
    assert det.visual.unc_token is None and det.text.unc_token is None
    assert det.visual.head.logvar_proj is None and det.text.head.logvar_proj is None
    assert not any("unc" in n or "logvar" in n for n, _ in det.named_parameters())
    mu, logvar = det.encode_image(_images())
    assert mu.shape == (B, 128) and logvar is None
    mu, logvar = det.encode_text(_tokens([3, 4, 5, 6]))
    assert mu.shape == (B, 128) and logvar is None
    out = det(_images(), _tokens([3, 4, 5, 6]))
    assert out["image_logvar"] is None and out["text_logvar"] is None


def _perturb_output_row(module: nn.Module, index: int):
    """Forward hook adding 1.0 to the final hidden state of one token position."""

    def hook(_m, _inp, out):
        out = out.clone()
        out[:, index] += 1.0
        return out

    return module.register_forward_hook(hook)


@pytest.mark.parametrize(
    "tower, unc_index, cls_index", [("text", -2, -1), ("visual", 1, 0)], ids=["text", "image"]
)
def test_logvar_comes_from_unc_token(model: ProLIP, tower: str, unc_index: int, cls_index: int) -> None:
    """Perturbing only the UNC output moves logvar and not mu; perturbing only CLS moves mu, not logvar.

    This is what separates the paper (σ from UNC) from the official code (text σ from projected CLS).
    """
    encode = (
        (lambda: model.encode_text(_tokens([5, 10, 20, 31])))
        if tower == "text"
        else (lambda: model.encode_image(_images()))
    )
    ln_post = getattr(model, tower).ln_post
    with torch.no_grad():
        mu, logvar = encode()
        handle = _perturb_output_row(ln_post, unc_index)
        mu_u, logvar_u = encode()
        handle.remove()
        handle = _perturb_output_row(ln_post, cls_index)
        mu_c, logvar_c = encode()
        handle.remove()
    torch.testing.assert_close(mu_u, mu, rtol=0, atol=0)
    assert (logvar_u - logvar).abs().max() > 1e-3
    torch.testing.assert_close(logvar_c, logvar, rtol=0, atol=0)
    assert (mu_c - mu).abs().max() > 1e-4


def test_text_unc_token_parameter_feeds_logvar(model: ProLIP) -> None:
    tokens = _tokens([5, 10, 20, 31])
    # A random direction: a constant shift of the token would be removed by the LayerNorms.
    delta = torch.randn(model.text.unc_token.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, logvar = model.encode_text(tokens)
        model.text.unc_token.add_(delta)
        _, logvar_2 = model.encode_text(tokens)
        model.text.unc_token.sub_(delta)
    assert (logvar_2 - logvar).abs().max() > 1e-3


# ---------------------------------------------------------------- patch drop


def _count_tokens(model: ProLIP, call) -> int:
    seen = []
    handle = model.visual.transformer.blocks[0].register_forward_pre_hook(
        lambda _m, a: seen.append(a[0].shape[1])
    )
    call()
    handle.remove()
    return seen[0]


def test_patch_drop_keeps_quarter(model: ProLIP) -> None:
    n = model.config.n_patches  # 64
    keep = torch.from_numpy(choose_kept_patches(n, B, keep_ratio=0.25, rng=0))  # (B, 16)
    assert keep.shape == (B, 16)
    images = _images()
    with torch.no_grad():
        assert _count_tokens(model, lambda: model.encode_image(images, keep)) == 16 + 2
        ref_mu, ref_logvar = model.encode_image(images, keep)

        # Invariant to the content of dropped patches.
        patches = model.visual.patchify(images)  # (B, N, P)
        dropped = torch.ones(B, n, dtype=torch.bool).scatter_(1, keep, False)
        noisy = patches.clone()
        noisy[dropped] = torch.randn_like(noisy[dropped]) * 5
        mu, logvar = model.encode_image(_unpatchify(noisy, 8, 8), keep)
        torch.testing.assert_close(mu, ref_mu, rtol=0, atol=1e-6)
        torch.testing.assert_close(logvar, ref_logvar, rtol=0, atol=1e-6)

        # Sensitive to every kept patch: change one kept patch of sample 0 only.
        changed = patches.clone()
        changed[0, keep[0, 3]] += 1.0
        mu, _ = model.encode_image(_unpatchify(changed, 8, 8), keep)
        assert (mu[0] - ref_mu[0]).abs().max() > 1e-4
        torch.testing.assert_close(mu[1:], ref_mu[1:], rtol=0, atol=1e-6)

        # Positional embeddings travel with their patches: the kept set in another order gives the same
        # CLS/UNC outputs (attention is permutation-equivariant), which fails if positions were not gathered.
        shuffled = keep[:, torch.randperm(16, generator=torch.Generator().manual_seed(1))]
        mu, logvar = model.encode_image(images, shuffled)
        torch.testing.assert_close(mu, ref_mu, rtol=0, atol=1e-5)
        torch.testing.assert_close(logvar, ref_logvar, rtol=0, atol=1e-5)

        # Keeping every patch is the undropped forward.
        full = model.encode_image(images, torch.arange(n).expand(B, n))
        torch.testing.assert_close(full[0], model.encode_image(images)[0], rtol=0, atol=1e-6)
    assert _count_tokens(model, lambda: model.encode_image(images)) == n + 2


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("tiny", {}), ("tiny", {"grad_checkpointing": True}), ("demo-32px-cnn", {"probabilistic": False})],
)
def test_dropped_pictures_in_the_same_trunk_run_equal_a_second_pass(name: str, overrides: dict) -> None:
    """``encode_image_with_dropped`` (the train step's joined run) = two ``encode_image`` calls, in outputs
    and in every parameter's gradient; attention never mixes the two batches."""
    torch.manual_seed(0)
    m = ProLIP(model_config(name, **overrides))
    size = m.config.image_size
    images = torch.randn(6, 3, size, size, generator=torch.Generator().manual_seed(2))
    dropped = images[torch.tensor([4, 1])]
    keep = torch.from_numpy(choose_kept_patches(m.config.n_patches, 2, keep_ratio=0.25, rng=3))

    def run(joined: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        m.zero_grad(set_to_none=True)
        if joined:
            full, part = m.encode_image_with_dropped(images, dropped, keep)
        else:
            full, part = m.encode_image(images), m.encode_image(dropped, keep)
        outs = [t for t in (*full, *part) if t is not None]
        weights = [
            torch.randn(t.shape, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(outs)
        ]
        sum((w * t).sum() for w, t in zip(weights, outs, strict=True)).backward()
        grads = [p.grad.clone() for p in m.visual.parameters() if p.grad is not None]
        return [t.detach() for t in outs], grads

    (ref_out, ref_grad), (out, grad) = run(False), run(True)
    assert len(out) == (4 if m.config.probabilistic else 2) and len(grad) == len(ref_grad) > 10
    for a, b in zip(ref_out + ref_grad, out + grad, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # The dropped pictures' outputs do not depend on the whole batch beside them.
    with torch.no_grad():
        _, part = m.encode_image_with_dropped(images * 3 + 1, dropped, keep)
    torch.testing.assert_close(part[0], ref_out[2 if m.config.probabilistic else 1], rtol=1e-5, atol=1e-6)


def _unpatchify(patches: torch.Tensor, grid: int, p: int) -> torch.Tensor:
    b = patches.shape[0]
    x = patches.reshape(b, grid, grid, 3, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, 3, grid * p, grid * p)


def test_patchify_round_trip(model: ProLIP) -> None:
    images = _images()
    torch.testing.assert_close(_unpatchify(model.visual.patchify(images), 8, 8), images, rtol=0, atol=0)
    # Patch index = row·grid + col: patch 9 is the block at rows 8..15, cols 8..15.
    torch.testing.assert_close(model.visual.patchify(images)[:, 9], images[:, :, 8:16, 8:16].reshape(B, -1))


def test_conv_stem_tokens_keep_the_patch_grid(tmp_path) -> None:
    """``vision_stem="conv"``: the same (B, N, D) token grid in row-major order, the kept tokens of a patch
    drop are those of the full forward, and the model saves and loads like the patch projection."""
    torch.manual_seed(0)
    m = ProLIP(model_config("demo-32px", vision_stem="conv")).eval()
    assert not hasattr(m.visual, "patch_embed") and m.config.n_patches == 16
    images = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = m.visual.embed_patches(images, None)  # (B, 16, D)
        assert full.shape == (B, 16, m.config.vision_width)
        # Token index = row·grid + col: a small change in the top-left 4×4 pixels moves the top-left 2×2
        # tokens (0, 1, 4, 5) far more than any token of the last row or column, which it reaches only
        # through the per-sample normalisation statistics.
        changed = images.clone()
        changed[:, :, :4, :4] += 0.05
        moved = (m.visual.embed_patches(changed, None) - full).abs().mean(dim=(0, 2))  # (16,)
        assert moved[[0, 1, 4, 5]].min() > 3 * moved[[3, 7, 11, 12, 13, 14, 15]].max()
        keep = torch.from_numpy(choose_kept_patches(16, B, keep_ratio=0.25, rng=0))  # (B, 4)
        kept = m.visual.embed_patches(images, keep)
        torch.testing.assert_close(
            kept, torch.gather(full, 1, keep[..., None].expand(-1, -1, full.shape[-1]))
        )
        assert _count_tokens(m, lambda: m.encode_image(images, keep)) == 4 + 2
        everything = m.encode_image(images, torch.arange(16).expand(B, 16))[0]
        torch.testing.assert_close(everything, m.encode_image(images)[0], rtol=0, atol=1e-6)
    decay, no_decay = decay_split(m)
    assert "visual.conv_stem.layers.0.weight" in decay and "visual.conv_stem.layers.0.bias" in no_decay
    save_checkpoint(tmp_path / "conv", m, m.config)
    loaded, cfg, _ = load_checkpoint(tmp_path / "conv")
    assert cfg.vision_stem == "conv"
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval().encode_image(images)[0], m.encode_image(images)[0])
    with pytest.raises(ConfigError, match="patch_size"):
        model_config("demo-32px", vision_stem="conv", patch_size=1)


def test_conv_stem_channels_last_equals_plain_layout() -> None:
    """The stem runs its convolutions on channels-last input for speed; tokens and weight gradients must be
    what the same layers give on the plain (B, C, H, W) layout, in the same row-major token order."""
    torch.manual_seed(0)
    stem = ProLIP(model_config("demo-32px-cnn")).visual.conv_stem
    images = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    tokens = stem(images)  # (B, 16, D)
    assert tokens.shape == (B, 16, stem.layers[-1].out_channels)
    plain = stem.layers(images.contiguous()).flatten(2).transpose(1, 2)  # (B, 16, D)
    torch.testing.assert_close(tokens, plain, rtol=1e-5, atol=1e-5)
    w = stem.layers[0].weight
    (g_fast,) = torch.autograd.grad(tokens.square().sum(), w)
    (g_plain,) = torch.autograd.grad(plain.square().sum(), w)
    # Summation order differs between the two layouts' kernels: compare in norm, not element by element.
    assert ((g_fast - g_plain).norm() / g_plain.norm()).item() < 1e-5


def test_mean_pooled_cnn_tower() -> None:
    """``demo-32px-cnn``: the stem's tokens (plus positions, normalised) averaged, then ``ln_post`` and the
    head; no transformer layer, so it cannot be probabilistic (its UNC token would see no image)."""
    torch.manual_seed(0)
    m = ProLIP(model_config("demo-32px-cnn")).eval()
    v = m.visual
    assert len(v.transformer.blocks) == 0 and v.unc_token is None
    images = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = v.ln_pre(v.conv_stem(images) + v.pos_embed[1:])  # (B, 16, D)
        expected = torch.nn.functional.normalize(v.head.mu_proj(v.ln_post(tokens.mean(1))), dim=-1)
        torch.testing.assert_close(m.encode_image(images)[0], expected)
    assert m.encode_image(images)[1] is None
    with pytest.raises(ConfigError, match="vision_layers"):
        model_config("demo-32px-cnn", probabilistic=True)
    with pytest.raises(ConfigError, match="vision_layers"):
        model_config("demo-32px", vision_layers=0)
    with pytest.raises(ConfigError, match="vision_stem"):
        model_config("demo-32px", vision_stem="resnet")


def test_probabilistic_cnn_tower_reads_uncertainty_from_the_picture() -> None:
    """``demo-32px-cnn-unc`` (the demo scorer): one transformer layer over the stem's tokens, so its UNC
    state — and log σ² — depends on the picture and on which patches a masked variant keeps."""
    torch.manual_seed(0)
    m = ProLIP(model_config("demo-32px-cnn-unc")).eval()
    v = m.visual
    assert len(v.transformer.blocks) == 1 and v.unc_token is not None and v.mean_pool
    torch.nn.init.normal_(v.head.logvar_proj.weight)  # the head starts near a constant (its bias)
    g = torch.Generator().manual_seed(3)
    images = torch.randn(B, 3, 32, 32, generator=g)
    keep = torch.stack([torch.randperm(16, generator=g)[:4].sort().values for _ in range(B)])
    with torch.no_grad():
        mu, logvar = m.encode_image(images)
        _, logvar_other = m.encode_image(images.flip(0))
        _, logvar_masked = m.encode_image(images, keep)
    assert mu.shape == logvar.shape == (B, m.config.embed_dim) and torch.isfinite(logvar).all()
    torch.testing.assert_close(
        logvar, logvar_other.flip(0), rtol=1e-5, atol=1e-5
    )  # per picture, no batch mixing
    assert (logvar[0] - logvar[1]).abs().max() > 1e-3, "log σ² does not depend on the picture"
    assert (logvar - logvar_masked).abs().max() > 1e-3, "log σ² ignores which patches are kept"


# ---------------------------------------------------------------- text padding and masking


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_text_outputs_independent_of_padding_length(causal: bool) -> None:
    torch.manual_seed(0)
    m = ProLIP(model_config("tiny", text_causal=causal)).eval()
    tokens = _tokens([3, 7, 10, 0], context=32)
    with torch.no_grad():
        mu_full, logvar_full = m.encode_text(tokens)  # 32 positions, mostly padding
        mu_short, logvar_short = m.encode_text(tokens[:, :12])  # same text, 12 positions
    torch.testing.assert_close(mu_short, mu_full, rtol=0, atol=1e-5)
    torch.testing.assert_close(logvar_short, logvar_full, rtol=0, atol=1e-5)


def test_text_too_long_raises(model: ProLIP) -> None:
    with pytest.raises(ValueError, match="context_length"):
        model.encode_text(torch.zeros(2, 33, dtype=torch.long))


def test_causal_mask_blocks_future_tokens() -> None:
    m = ProLIP(model_config("tiny", text_causal=True))
    mask = m.text.attention_mask(_tokens([3], context=6))[0, 0]  # (8, 8)
    assert not mask[0, 1] and mask[1, 0] and mask[-1].sum() == 4 + 2  # CLS sees 3 tokens, END, UNC, itself
    assert not mask[-1, 4:6].any()  # padding keys
    bi = ProLIP(model_config("tiny")).text.attention_mask(_tokens([3], context=6))[0, 0]
    assert bi[0, 1] and bi[0, -1] and not bi[0, 4:6].any()


# ---------------------------------------------------------------- precision, checkpointing, compile


def test_bf16_autocast_forward_backward_finite() -> None:
    torch.manual_seed(0)
    m = ProLIP(model_config("tiny"))
    keep = torch.from_numpy(choose_kept_patches(64, B, rng=0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(_images(), _tokens([2, 5, 31, 0]), keep)
        loss = sum(v.float().square().mean() for v in out.values())
    loss.backward()
    assert all(torch.isfinite(v).all() for v in out.values())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_grad_checkpointing_gives_same_gradients() -> None:
    torch.manual_seed(0)
    m = ProLIP(model_config("tiny"))
    images, tokens = _images(), _tokens([4, 8, 12, 16])

    def grads() -> list[torch.Tensor]:
        m.zero_grad()
        out = m(images, tokens)
        sum(v.sum() for v in out.values()).backward()
        return [p.grad.clone() for p in m.parameters()]

    ref = grads()
    m.set_grad_checkpointing(True)
    for a, b in zip(ref, grads(), strict=True):
        torch.testing.assert_close(a, b)
    assert ProLIP(model_config("tiny", grad_checkpointing=True)).text.transformer.grad_checkpointing


@pytest.mark.slow
def test_compiles_without_graph_breaks() -> None:
    """fullgraph=True fails on any Python branch on tensor values in the forward paths."""
    m = ProLIP(model_config("tiny"))
    keep = torch.from_numpy(choose_kept_patches(64, B, rng=0))
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    out = compiled(_images(), _tokens([2, 5, 31, 0]), keep)
    assert out["text_logvar"].shape == (B, 128)


# ---------------------------------------------------------------- configs and parameter counts


@pytest.mark.parametrize(
    "name, overrides, paper_millions",
    [
        ("ViT-B-32", {}, 151.7),  # Table C.6 "ViT-B/32"
        ("ViT-B-32", {"patch_size": 16}, 150.0),  # Table C.6 "ViT-B/16" (CLIP B/16: B/32 with patch 16)
        ("ViT-B-16-ProLIP", {}, 197.3),  # Table C.6 "ViT-B/16-768"
    ],
)
def test_named_config_param_counts_match_paper(name: str, overrides: dict, paper_millions: float) -> None:
    """Table C.6 "Base param" is the deterministic model; ours must agree within 2%."""
    count = num_params(_meta_model(name, probabilistic=False, **overrides)) / 1e6
    assert abs(count - paper_millions) / paper_millions < 0.02, count


@pytest.mark.parametrize(
    "name, overrides, low, high",
    [
        ("ViT-B-32", {}, 0.25, 0.45),  # Table C.6: "+0.3M" (ours 0.395M: D + D + D·E + E)
        ("ViT-B-32", {"patch_size": 16}, 0.25, 0.45),
        ("ViT-B-16-ProLIP", {}, 0.55, 0.65),  # Table C.6: "+0.6M"
    ],
)
def test_unc_additions_match_table_c6(name: str, overrides: dict, low: float, high: float) -> None:
    """Table C.6 compares image encoders only: UNC token + its positional row + the σ head."""
    # the same text pooling on both sides (ViT-B-32's CLIP pools the end token; a ProLIP appends CLS)
    prob = _meta_model(name, **{"probabilistic": True, "text_pool": "cls", **overrides})
    det = _meta_model(name, **{"probabilistic": False, "text_pool": "cls", **overrides})
    extra_image = (num_params(prob.visual) - num_params(det.visual)) / 1e6
    assert low < extra_image < high, extra_image
    cfg = prob.config
    expected_text = 2 * cfg.text_width + cfg.text_width * cfg.embed_dim + cfg.embed_dim
    assert num_params(prob.text) - num_params(det.text) == expected_text


def test_tiny_is_small() -> None:
    assert 1.0e6 < num_params(ProLIP(model_config("tiny"))) < 2.5e6


def test_model_config_overrides_and_errors() -> None:
    cfg = model_config("tiny", vocab_size=300, text_causal=True)
    assert cfg.vocab_size == 300 and cfg.text_causal and cfg.image_size == 64
    assert MODEL_CONFIGS["tiny"].vocab_size == 4096  # presets are not mutated
    # One error type for every config problem (ConfigError, a ValueError), naming the field.
    with pytest.raises(ConfigError, match="vision_widht"):
        model_config("tiny", vision_widht=64)
    with pytest.raises(ConfigError, match="ViT-Z"):
        model_config("ViT-Z")
    with pytest.raises(ConfigError, match="vision_width"):
        model_config("tiny", vision_heads=3)
    with pytest.raises(ConfigError, match="vocab_size"):
        model_config("tiny", vocab_size="4096")
    with pytest.raises(ConfigError, match="pad_id"):
        model_config("tiny", pad_id=4096)
    with pytest.raises(ConfigError, match="ModelConfig.colour"):
        ModelConfig.from_dict({**cfg.to_dict(), "colour": 1})
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------- weight decay groups


def test_param_groups_exempt_gains_biases_embeddings_and_scalars(model: ProLIP) -> None:
    holder = nn.Module()
    holder.model = model
    holder.logit_scale = nn.Parameter(torch.tensor(2.3))
    holder.logit_bias = nn.Parameter(torch.tensor(-10.0))
    decay, no_decay = decay_split(holder)
    assert set(decay).isdisjoint(no_decay)
    assert set(decay) | set(no_decay) == {n for n, _ in holder.named_parameters()}
    for name in (
        "logit_scale",
        "logit_bias",
        "model.visual.pos_embed",
        "model.text.pos_embed",
        "model.visual.cls_token",
        "model.text.unc_token",
        "model.text.head.logvar_proj.bias",
        "model.visual.transformer.blocks.0.ln_1.weight",
        "model.text.ln_post.weight",
    ):
        assert name in no_decay, name
    for name in (
        "model.text.token_embed.weight",
        "model.visual.patch_embed.weight",
        "model.visual.transformer.blocks.0.qkv.weight",
        "model.text.head.mu_proj.weight",
        "model.text.head.logvar_proj.weight",
    ):
        assert name in decay, name
    groups = param_groups(holder, 0.2)
    assert [g["weight_decay"] for g in groups] == [0.2, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(holder.parameters()))
    torch.optim.AdamW(groups, lr=5e-4)  # accepted as-is


def test_param_groups_give_each_towers_sigma_head_its_own_lr(model: ProLIP) -> None:
    holder = nn.Module()
    holder.model = model
    names = {id(p): n for n, p in holder.named_parameters()}
    decay = dict.fromkeys(decay_split(holder)[0])

    def lrs(groups: list[dict]) -> dict[str, tuple[float, float]]:
        """parameter name → (its group's LR, its group's decay); every parameter in exactly one group."""
        out: dict[str, tuple[float, float]] = {}
        for g in groups:
            for p in g["params"]:
                assert names[id(p)] not in out
                out[names[id(p)]] = (g.get("lr", 1e-3), g["weight_decay"])
        assert set(out) == set(names.values())
        return out

    def expect(text: float, image: float) -> dict[str, tuple[float, float]]:
        def lr(n: str) -> float:
            if not is_unc_param(n):
                return 1e-3
            return 1e-3 * (image if n.startswith("model.visual.") else text)

        return {n: (pytest.approx(lr(n)), 0.2 if n in decay else 0.0) for n in names.values()}

    assert lrs(param_groups(holder, 0.2, 1e-3, 10.0, 0.1)) == expect(10.0, 0.1)
    assert lrs(param_groups(holder, 0.2, 1e-3, 10.0)) == expect(10.0, 10.0)  # None: the text multiplier
    assert lrs(param_groups(holder, 0.2, 1e-3, 1.0, 3.0)) == expect(1.0, 3.0)  # image alone still splits
    assert len(param_groups(holder, 0.2, 1e-3, 1.0, 1.0)) == 2  # nothing to split
    with pytest.raises(ConfigError, match=r"OptimConfig\.unc_lr_mult_image: input should be greater than 0"):
        TrainConfig(model="tiny", optim=OptimConfig(unc_lr_mult_image=0.0))


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip(tmp_path, model: ProLIP) -> None:
    tok = train_tokenizer(["a red circle", "a blue square", "a green triangle"] * 20, vocab_size=300)
    cfg = model.config

    class Wrapper(nn.Module):  # stands in for DDP's .module
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    save_checkpoint(tmp_path / "ckpt", Wrapper(model), cfg, tokenizer=tok, extra={"step": 7})
    state = torch.load(tmp_path / "ckpt" / WEIGHTS_FILE, weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    loaded, loaded_cfg, loaded_tok = load_checkpoint(tmp_path / "ckpt")
    assert loaded_cfg == cfg and load_extra(tmp_path / "ckpt") == {"step": 7}
    assert loaded_tok is not None and loaded_tok.special_ids == tok.special_ids
    images, tokens = _images(), _tokens([1, 2, 3, 4])
    with torch.no_grad():
        for a, b in zip(
            model.eval()(images, tokens).values(), loaded.eval()(images, tokens).values(), strict=True
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpoint_errors_name_the_file(tmp_path, model: ProLIP) -> None:
    d = save_checkpoint(tmp_path / "ckpt", model, model.config)
    assert load_checkpoint(d)[2] is None
    (d / WEIGHTS_FILE).write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=WEIGHTS_FILE):
        load_checkpoint(d)
    (d / WEIGHTS_FILE).unlink()
    with pytest.raises(CheckpointError, match=WEIGHTS_FILE):
        load_checkpoint(d)
    save_checkpoint(d, model, model.config)
    (d / CONFIG_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=CONFIG_FILE):
        load_checkpoint(d)
    (d / CONFIG_FILE).write_text(json.dumps(model_config("tiny", text_width=64).to_dict()))
    with pytest.raises(CheckpointError, match=WEIGHTS_FILE):  # shapes do not match the config
        load_checkpoint(d)


def test_checkpoint_refuses_pickled_objects(tmp_path, model: ProLIP) -> None:
    d = save_checkpoint(tmp_path / "ckpt", model, model.config)
    torch.save({"weights": np.array([1, 2])}, d / WEIGHTS_FILE)  # needs unpickling of numpy objects
    with pytest.raises(CheckpointError, match=WEIGHTS_FILE):
        load_checkpoint(d)
