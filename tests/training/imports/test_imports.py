"""Checkpoint import: open_clip CLIP and official-ProLIP state dicts into our model, checked against the
source library's own forward (open_clip's ``model.py`` run from the installed wheel, tests/fixtures/open_clip_src.py).

The state dicts are written here in each library's naming at small widths and depths (no weights can be
downloaded in tests), with every parameter randomised so no term can hide behind a zero or identity init.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pipeline.ingest.tokenizer import TextTokenizer, clip_bpe_tokenizer
from tests.fixtures import open_clip_src
from tests.pipeline.ingest.test_tokenizer_clip import CORPUS
from training.imports.common import read_weights
from training.imports.open_clip import convert_open_clip
from training.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

TOL = 1e-5


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p + 0.05 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def oc_model():
    return open_clip_src.load_or_skip("model")


@pytest.fixture(scope="module")
def clip_tok():
    if open_clip_src.package_dir() is None:
        pytest.skip("open_clip_torch not installed (make install adds it with --no-deps)")
    return clip_bpe_tokenizer()


def _open_clip_reference(oc_model, patch: int, quick_gelu: bool, seed: int):
    """open_clip's own ``CLIP`` with a ViT-B/``patch`` layout at 224 px, shrunk to 2 layers × 128 wide."""
    vision = oc_model.CLIPVisionCfg(layers=2, width=128, head_width=64, patch_size=patch, image_size=224)
    text = oc_model.CLIPTextCfg(context_length=77, vocab_size=49408, width=128, heads=2, layers=2)
    model = oc_model.CLIP(embed_dim=64, vision_cfg=vision, text_cfg=text, quick_gelu=quick_gelu).eval()
    _randomise(model, seed)
    return model


@pytest.mark.parametrize(("patch", "quick_gelu"), [(32, True), (16, False)], ids=["B32-openai", "B16"])
def test_open_clip_embeddings_equal(oc_model, clip_tok, tmp_path, patch: int, quick_gelu: bool) -> None:
    ref = _open_clip_reference(oc_model, patch, quick_gelu, seed=patch)
    weights = tmp_path / "open_clip_model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(weights))
    model, extra = convert_open_clip(read_weights(weights), clip_tok, quick_gelu=quick_gelu)
    cfg = model.config
    assert (cfg.patch_size, cfg.image_size, cfg.vision_heads, cfg.text_heads) == (patch, 224, 2, 2)
    assert cfg.activation == ("quick_gelu" if quick_gelu else "gelu") and not cfg.probabilistic
    assert extra["logit_scale"] == pytest.approx(float(ref.logit_scale.detach()))

    images = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    ours_tokens = torch.from_numpy(clip_tok.encode_batch(CORPUS, 77))
    ref_tokens = oc_model_tokens(CORPUS)
    with torch.no_grad():
        ref_img, ref_txt = (
            ref.encode_image(images, normalize=True),
            ref.encode_text(ref_tokens, normalize=True),
        )
        img, img_var = model.encode_image(images)
        txt, txt_var = model.encode_text(ours_tokens)
    assert img_var is None and txt_var is None
    assert (img - ref_img).abs().max() < TOL and (txt - ref_txt).abs().max() < TOL
    # Trimmed padding (the ingest's trim_text_padding) gives the same text embeddings.
    width = int((ours_tokens != clip_tok.pad_id).sum(1).max())
    with torch.no_grad():
        assert (model.encode_text(ours_tokens[:, :width])[0] - ref_txt).abs().max() < TOL

    # Through our checkpoint directory (what every job loads) the model is unchanged.
    model2, _, tok2 = load_checkpoint(save_checkpoint(tmp_path / "ckpt", model, cfg, clip_tok, extra))
    with torch.no_grad():
        assert torch.equal(model2.encode_image(images)[0], img)
    assert tok2.to_state() == clip_tok.to_state()


def oc_model_tokens(texts: list[str]) -> torch.Tensor:
    return open_clip_src.load("tokenizer").SimpleTokenizer()(texts, context_length=77)


def test_open_clip_import_refuses_bad_input(oc_model, clip_tok, tmp_path) -> None:
    ref = _open_clip_reference(oc_model, 32, False, seed=0)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    missing = dict(state)
    del missing["visual.proj"]
    with pytest.raises(CheckpointError, match="visual.proj"):
        convert_open_clip(missing, clip_tok)
    with pytest.raises(CheckpointError, match="unexpected keys"):
        convert_open_clip({**state, "visual.extra_head.weight": torch.zeros(2)}, clip_tok)
    pickled = tmp_path / "model.pt"
    torch.save({"state_dict": state, "optimizer": object()}, pickled)
    with pytest.raises(CheckpointError, match="cannot read"):
        read_weights(pickled)  # weights_only refuses arbitrary objects
    wrapped = tmp_path / "wrapped.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, wrapped)
    assert set(read_weights(wrapped)) == set(state)
    np.testing.assert_array_equal(read_weights(wrapped)["visual.proj"].numpy(), state["visual.proj"].numpy())


# ------------------------------------------------------------------ official ProLIP


class _OfficialLayout(torch.nn.Module):
    """The released ProLIP model's parameter names and forward arithmetic (facts from the official
    repository's ``ProLIP``/``VisionTransformer``/``TextTransformer``), built on open_clip's own
    ``Transformer`` and ``LayerNorm`` (the official code's blocks are open_clip's). The official package is
    not on PyPI, so this is the reference that can run here."""

    def __init__(self, T, patch: int, width: int = 128, layers: int = 2, context: int = 64, vocab: int = 100):
        super().__init__()
        nn, grid, embed = torch.nn, 224 // patch, width
        self.visual, self.text = nn.Module(), nn.Module()
        v, t = self.visual, self.text
        v.conv1 = nn.Conv2d(3, width, patch, patch, bias=False)
        v.class_embedding, v.unc_embedding = (
            nn.Parameter(torch.zeros(width)),
            nn.Parameter(torch.zeros(width)),
        )
        v.positional_embedding = nn.Parameter(torch.zeros(grid * grid + 2, width))
        v.ln_pre, v.ln_post = T.LayerNorm(width), T.LayerNorm(width)
        v.transformer = T.Transformer(width, layers, width // 64)
        v.proj = nn.Parameter(torch.zeros(width, embed))
        v.uncertainty_proj = nn.Linear(width, embed)
        t.token_embedding = nn.Embedding(vocab, width)
        t.positional_embedding = nn.Parameter(torch.zeros(context + 2, width))
        t.cls_emb, t.unc_emb = nn.Parameter(torch.zeros(width)), nn.Parameter(torch.zeros(width))
        text_norm = functools.partial(T.LayerNorm, eps=1e-6)  # the released text config's norm_kwargs
        t.transformer = T.Transformer(width, layers, width // 64, norm_layer=text_norm)
        t.ln_final = text_norm(width)
        t.text_projection, t.text_uncertainty_projection = nn.Linear(width, embed), nn.Linear(width, embed)
        self.logit_scale, self.logit_bias = nn.Parameter(torch.tensor(2.3)), nn.Parameter(torch.tensor(-10.0))

    def encode_image(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.visual
        x = v.conv1(images).flatten(2).transpose(1, 2)  # (B, N, D)
        b = x.shape[0]
        x = torch.cat([v.class_embedding.expand(b, 1, -1), v.unc_embedding.expand(b, 1, -1), x], dim=1)
        x = v.ln_post(v.transformer(v.ln_pre(x + v.positional_embedding)))
        mean = v.ln_post(x[:, 0]) @ v.proj  # the CLS state is normalised a second time
        return torch.nn.functional.normalize(mean, dim=-1), v.uncertainty_proj(x[:, 1])

    def encode_text(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.text
        x = t.token_embedding(tokens)
        b, length = tokens.shape
        x = torch.cat([x, t.unc_emb.expand(b, 1, -1), t.cls_emb.expand(b, 1, -1)], dim=1)
        x = t.transformer(x + t.positional_embedding[: length + 2])  # no attention mask at all
        mean = t.text_projection(t.ln_final(x[:, -1]))
        return torch.nn.functional.normalize(mean, dim=-1), t.text_uncertainty_projection(mean)


@pytest.mark.parametrize("patch", [16, 32])
def test_official_prolip_embeddings_equal(tmp_path, patch: int) -> None:
    from tests.pipeline.ingest.test_tokenizer_clip import _siglip_style_file
    from training.imports.prolip_official import convert_prolip

    T = open_clip_src.load_or_skip("transformer")
    ref = _OfficialLayout(T, patch).eval()
    _randomise(ref, seed=patch)
    weights = tmp_path / "model.safetensors"
    save_file({k: v.detach().contiguous() for k, v in ref.state_dict().items()}, str(weights))
    tok = TextTokenizer.from_file(_siglip_style_file(tmp_path / "t.json"), clean="canonicalize")
    model, extra = convert_prolip(read_weights(weights), tok)
    cfg = model.config
    assert (cfg.context_length, cfg.patch_size, cfg.head_variant, cfg.probabilistic) == (
        64,
        patch,
        "prolip_official",
        True,
    )
    assert extra["logit_bias"] == pytest.approx(float(ref.logit_bias.detach()))

    images = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    tokens = torch.from_numpy(tok.encode_batch(["A photo of the red car", "a dog and a cat " * 30, ""], 64))
    with torch.no_grad():
        (ri, rvi), (rt, rvt) = ref.encode_image(images), ref.encode_text(tokens)
        (mi, vi), (mt, vt) = model.encode_image(images), model.encode_text(tokens)
    for ours, theirs in ((mi, ri), (mt, rt)):
        assert (ours - theirs).abs().max() < TOL
    for ours, theirs in ((vi, rvi), (vt, rvt)):  # log σ² of magnitude ~10: compare relatively
        assert ((ours - theirs).abs() / theirs.abs().clamp(min=1)).max() < TOL


# ------------------------------------------------------------------ the import job


def test_import_job_prolip_with_released_config(tmp_path, capsys) -> None:
    """``prolip:DIR`` reads ``model.safetensors`` and the released ``config.json`` beside it (text LN eps,
    tokenizer cleaning); the result is a checkpoint directory every job loads."""
    from jobs import import_checkpoint as job
    from tests.pipeline.ingest.test_tokenizer_clip import _siglip_style_file

    T = open_clip_src.load_or_skip("transformer")
    ref = _OfficialLayout(T, 32).eval()
    _randomise(ref, seed=5)
    src = tmp_path / "released"
    src.mkdir()
    save_file(
        {k: v.detach().contiguous() for k, v in ref.state_dict().items()}, str(src / "model.safetensors")
    )
    text_cfg = {
        "context_length": 64,
        "tokenizer_kwargs": {"clean": "canonicalize"},
        "norm_kwargs": {"eps": 1e-6},
    }
    (src / "config.json").write_text(json.dumps({"embed_dim": 128, "text_cfg": text_cfg}))
    tok_file = _siglip_style_file(tmp_path / "tokenizer.json")
    out = tmp_path / "ours"
    assert job.main(["--source", f"prolip:{src}", "--tokenizer", tok_file, "--out", str(out)]) == 0
    assert "Gaussian" in capsys.readouterr().out
    model, cfg, tok = load_checkpoint(out)
    assert tok.clean == "canonicalize" and cfg.text_ln_eps == 1e-6 and cfg.head_variant == "prolip_official"
    tokens = torch.from_numpy(tok.encode_batch(["the red car"], 64))
    with torch.no_grad():
        (mt, vt), (rt, rvt) = model.encode_text(tokens), ref.encode_text(tokens)
    assert (mt - rt).abs().max() < TOL and ((vt - rvt).abs() / rvt.abs().clamp(min=1)).max() < TOL


def test_import_job_errors_name_the_problem(oc_model, clip_tok, tmp_path, capsys) -> None:
    from jobs import import_checkpoint as job
    from training.imports.load import is_import_source, parse_source

    assert parse_source("openclip:ViT-B-16:hf-hub:org/repo").location == "hf-hub:org/repo"
    assert parse_source("prolip:hf-hub:org/repo").location == "hf-hub:org/repo"
    assert is_import_source("prolip:/w") and not is_import_source("/runs/ckpt")
    ref = _open_clip_reference(oc_model, 32, False, seed=0)
    weights = tmp_path / "w.safetensors"
    save_file({k: v.detach().contiguous() for k, v in ref.state_dict().items()}, str(weights))
    cases = [  # exit 2 a malformed spec, 3 an input that is missing or does not fit (docs/jobs.md)
        (f"openclip:ViT-B-16:{weights}", "patch size 32", 3),  # the name says /16, the weights are /32
        ("openclip:ViT-B-32", "expected openclip:MODEL:LOCATION", 2),
        (f"openclip:ViT-B-32:{tmp_path / 'missing.safetensors'}", "missing.safetensors: not found", 3),
        (f"prolip:{weights}", "give the SigLIP tokenizer.json", 3),
    ]
    for source, message, code in cases:
        assert job.main(["--source", source, "--out", str(tmp_path / "o")]) == code
        assert message in capsys.readouterr().err
