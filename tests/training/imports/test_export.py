"""Export to open_clip and the released ProLIP layout: open_clip's own files and code are the reference.

- our ``ViT-B-32`` equals open_clip's ``model_configs/ViT-B-32.json`` field by field, its ``CLIP`` parameter
  for parameter (names and shapes), and its weight-decay groups are open_clip_train's rule, read from the
  installed ``open_clip_train/main.py``;
- a ViT-B-32 exported by us loads in open_clip's ``create_model_and_transforms("ViT-B-32", pretrained=FILE)``
  (the real package, in a child process: tests/fixtures/open_clip_real.py) and gives our embeddings on
  open_clip's own tokens; importing the export gives back the checkpoint tensor for tensor;
- a ProLIP with the released heads goes out and back unchanged; one with the paper's heads is refused.

The trained case (a tiny CLIP through the trainer, then exported) is checked on the tiny track's subset
models (tests/jobs/test_track_datacomp.py).
"""

from __future__ import annotations

import ast
import json

import numpy as np
import pytest
import torch

from tests.fixtures import open_clip_real, open_clip_src
from training.imports.export import ExportError, export_open_clip, export_prolip, open_clip_state
from training.imports.load import import_checkpoint
from training.model.checkpoint import load_checkpoint, save_checkpoint
from training.model.config import MODEL_CONFIGS, ModelConfig, model_config, text_table
from training.model.param_groups import decay_split
from training.model.two_tower import ProLIP

TOL = 1e-5
CAPTIONS = ["a photo of a red car", "Two dogs! On a beach, at sunset.", ""]


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


def _open_clip_json(name: str) -> dict:
    root = open_clip_src.package_dir()
    if root is None:
        pytest.skip("open_clip_torch not installed (make install adds it with --no-deps)")
    return json.loads((root / "model_configs" / f"{name}.json").read_text())


def _open_clip_train_exclude():
    """open_clip_train's no-decay predicate, the lambda in its ``main.py`` as written there."""
    main = open_clip_src.package_dir().parent / "open_clip_train" / "main.py"
    for node in ast.walk(ast.parse(main.read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "exclude":
            return eval(compile(ast.Expression(node.value), str(main), "eval"))  # noqa: S307 (their code)
    raise AssertionError(f"no 'exclude' rule in {main}")


def _their_clip(model_cfg: dict) -> torch.nn.Module:
    oc = open_clip_src.load_or_skip("model")
    return oc.CLIP(**model_cfg)


def test_vit_b_32_is_open_clips_field_by_field_and_parameter_for_parameter():
    from training.imports.export import open_clip_model_cfg

    theirs_cfg = _open_clip_json("ViT-B-32")
    ours = MODEL_CONFIGS["ViT-B-32"]
    # Every field of their file, with their defaults for the rest (head width 64, MLP ratio 4, GELU, argmax
    # pooling of CLIP's end token 49407, LayerNorm eps 1e-5): nothing more, nothing less.
    assert open_clip_model_cfg(ours, 49407, {}) == theirs_cfg
    assert (ours.text_pool, ours.text_causal, ours.probabilistic, ours.activation) == (
        "eot",
        True,
        False,
        "gelu",
    )
    assert (ours.vision_width // ours.vision_heads, ours.mlp_ratio, ours.text_ln_eps) == (64, 4.0, 1e-5)
    with torch.device("meta"):
        mine, theirs = ProLIP(model_config("ViT-B-32", pad_id=49408)), _their_clip(theirs_cfg)
    mapped = open_clip_state(mine.state_dict(), ours, {"logit_scale": 0.0})
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {
        k: tuple(v.shape) for k, v in theirs.state_dict().items()
    }
    assert sum(p.numel() for p in mine.parameters()) + 1 == sum(p.numel() for p in theirs.parameters())


def test_open_clip_decay_rule_is_open_clip_trains():
    exclude = _open_clip_train_exclude()
    cfg = MODEL_CONFIGS["demo-32px-clip"]
    mine = ProLIP(dataclasses_replace(cfg, vocab_size=64, pad_id=0))
    decay, _ = decay_split(mine, "open_clip")
    marks = {n: torch.full_like(p, float(n in decay)) for n, p in mine.named_parameters()}
    mapped = open_clip_state(marks, mine.config, {"logit_scale": 0.0})
    theirs = _their_clip(_model_cfg(mine.config))
    for name, p in theirs.named_parameters():
        assert bool(mapped[name].flatten()[0]) == (not exclude(name, p)), name
    # the ProLIP rule differs from theirs exactly on the positional embeddings
    prolip_decay, _ = decay_split(mine, "prolip")
    assert set(decay) - set(prolip_decay) == {"visual.pos_embed", "text.pos_embed"}


def dataclasses_replace(cfg: ModelConfig, **kw) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def _model_cfg(cfg: ModelConfig) -> dict:
    from training.imports.export import open_clip_model_cfg

    return open_clip_model_cfg(cfg, 1, {})


@pytest.fixture(scope="module")
def clip_tok():
    from pipeline.ingest.tokenizer import clip_bpe_tokenizer

    if open_clip_src.package_dir() is None:
        pytest.skip("open_clip_torch not installed (make install adds it with --no-deps)")
    return clip_bpe_tokenizer()


_LOAD_AND_ENCODE = """
import json, numpy as np, torch
name, weights, images, captions, out = sys.argv[1:]
model, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=weights or None)
model.eval()
tokens = open_clip.get_tokenizer(name)(json.loads(open(captions).read()))
with torch.no_grad():
    img = model.encode_image(torch.from_numpy(np.load(images)), normalize=True)
    txt = model.encode_text(tokens, normalize=True)
np.savez(out, image=img.numpy(), text=txt.numpy(), tokens=tokens.numpy(), scale=model.logit_scale.item())
print(type(preprocess).__name__)
"""


def open_clip_encode(tmp_path, name: str, weights: str, images: torch.Tensor) -> dict:
    """open_clip's own embeddings (and tokens) of ``images`` and ``CAPTIONS`` for ``name``/``weights``."""
    np.save(tmp_path / "images.npy", images.numpy())
    (tmp_path / "captions.json").write_text(json.dumps(CAPTIONS))
    out = tmp_path / "theirs.npz"
    printed = open_clip_real.run_or_skip(
        _LOAD_AND_ENCODE,
        name,
        weights,
        str(tmp_path / "images.npy"),
        str(tmp_path / "captions.json"),
        str(out),
    )
    assert printed.strip() == "Compose"  # the real transforms were built too
    return dict(np.load(out))


def test_vit_b_32_export_loads_in_open_clip_and_imports_back_exactly(clip_tok, tmp_path):
    assert text_table(clip_tok, eot=True) == 49408  # the pad and mask we add stay outside the table
    cfg = model_config("ViT-B-32", pad_id=clip_tok.pad_id)
    torch.manual_seed(0)
    model = ProLIP(cfg).eval()
    _randomise(model, seed=1)
    extra = {
        "loss": "clip",
        "loss_state": {"log_scale": 2.5},
        "pixel_mean": [0.5] * 3,
        "pixel_std": [0.25] * 3,
    }
    ckpt = save_checkpoint(tmp_path / "ckpt", model, cfg, clip_tok, extra)
    out = export_open_clip(ckpt, tmp_path / "open_clip", {"unofficial": False})
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    theirs = open_clip_encode(tmp_path, "ViT-B-32", str(out / "open_clip_model.safetensors"), images)
    ours_tokens = torch.from_numpy(clip_tok.encode_batch(CAPTIONS, 77))
    # open_clip's tokens are ours with its pad (0) for our added <pad>
    assert np.array_equal(
        theirs["tokens"], ours_tokens.masked_fill(ours_tokens == clip_tok.pad_id, 0).numpy()
    )
    with torch.no_grad():
        img, txt = model.encode_image(images)[0], model.encode_text(ours_tokens)[0]
    assert np.abs(img.numpy() - theirs["image"]).max() <= TOL
    assert np.abs(txt.numpy() - theirs["text"]).max() <= TOL
    assert theirs["scale"] == pytest.approx(2.5)
    config = json.loads((out / "open_clip_config.json").read_text())
    assert config["prolip_ray"]["unofficial"] is False and config["preprocess_cfg"]["mean"] == [0.5] * 3
    # import(export(x)) == x, tensor for tensor
    back = import_checkpoint(f"openclip:ViT-B-32:{out}", str(tmp_path / "back"))
    model2, cfg2, tok2 = load_checkpoint(back)
    assert cfg2 == cfg and tok2.to_state() == clip_tok.to_state()
    state, state2 = model.state_dict(), model2.state_dict()
    assert state.keys() == state2.keys() and all(torch.equal(state[k], state2[k]) for k in state)


def _official_prolip(tok) -> ProLIP:
    cfg = ModelConfig(
        image_size=32, patch_size=8, vision_width=64, vision_layers=1, vision_heads=1, text_width=64,
        text_layers=1, text_heads=1, context_length=16, vocab_size=tok.vocab_size, embed_dim=64,
        pad_id=tok.pad_id, text_mask_padding=False, text_proj_bias=True, text_ln_eps=1e-6,
        head_variant="prolip_official",
    )  # fmt: skip
    model = ProLIP(cfg).eval()
    _randomise(model, seed=3)
    return model


def test_released_prolip_layout_round_trip_and_refusals(tmp_path):
    from pipeline.ingest.tokenizer import TextTokenizer
    from tests.pipeline.ingest.test_tokenizer_clip import _siglip_style_file

    tok = TextTokenizer.from_file(_siglip_style_file(tmp_path / "t.json"), clean="canonicalize")
    model = _official_prolip(tok)
    extra = {"loss": "prolip", "loss_state": {"log_scale": 2.0, "bias": -9.0}}
    ckpt = save_checkpoint(tmp_path / "ckpt", model, model.config, tok, extra)
    out = export_prolip(ckpt, tmp_path / "released")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "special_tokens.json", "tokenizer.json",
    ]  # fmt: skip
    back = import_checkpoint(f"prolip:{out}", str(tmp_path / "back"))
    model2, cfg2, _ = load_checkpoint(back)
    assert cfg2 == model.config
    state, state2 = model.state_dict(), model2.state_dict()
    assert all(torch.equal(state[k], state2[k]) for k in state) and state.keys() == state2.keys()
    # The paper's heads compute other embeddings from the same weights: refused, naming the field; a
    # Gaussian model is no open_clip CLIP.
    paper = ProLIP(dataclasses_replace(model.config, head_variant="paper"))
    ckpt2 = save_checkpoint(tmp_path / "paper", paper, paper.config, tok, extra)
    with pytest.raises(ExportError, match="head_variant='paper', the layout needs 'prolip_official'"):
        export_prolip(ckpt2, tmp_path / "x")
    with pytest.raises(ExportError, match="open_clip: model config probabilistic=True"):
        export_open_clip(ckpt2, tmp_path / "y")


def test_export_job_writes_and_refuses(tmp_path, capsys):
    from jobs.export_checkpoint.cli import main

    tok = _TinyTok()
    cfg = dataclasses_replace(MODEL_CONFIGS["demo-32px-clip"], vocab_size=tok.vocab_size, pad_id=tok.pad_id)
    ckpt = save_checkpoint(tmp_path / "ckpt", ProLIP(cfg), cfg, None, {"loss": "clip"})
    assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "oc")]) == 0
    assert "format" in capsys.readouterr().out and (tmp_path / "oc" / "open_clip_model.safetensors").is_file()
    model_cfg = json.loads((tmp_path / "oc" / "open_clip_config.json").read_text())["model_cfg"]
    assert model_cfg["vision_cfg"]["head_width"] == 32 and model_cfg["text_cfg"]["heads"] == 4
    assert main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "p"), "--format", "prolip"]) != 0
    assert "probabilistic=False" in capsys.readouterr().err


class _TinyTok:
    vocab_size, pad_id, mask_id, end_id = 64, 0, 2, 1
