"""CLIP's BPE built with HF ``tokenizers`` against open_clip's own ``SimpleTokenizer`` (run from the wheel's
files, tests/fixtures/open_clip_src.py), and a SigLIP-style ``tokenizer.json`` pointed at by the train config."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from pipeline.ingest.masking import mask_text_tokens
from pipeline.ingest.tokenizer import CLEANERS, TextTokenizer, clip_bpe_tokenizer
from tests.fixtures import open_clip_src

CORPUS = [
    "A photo of a DOG &amp; a cat",
    "Café naïve — “curly quotes” and 'single' ones",
    "🐶🐱 emoji 👍🏽 skin tone, family 👨‍👩‍👧 ZWJ, flag 🇯🇵",
    "東京タワーの夜景 写真 and 北京 (CJK) 한국어 텍스트",
    "&lt;b&gt;bold&lt;/b&gt; &#x27;hex&#39; &amp;amp;double&amp;amp; &nbsp;entity",
    "Ã©tÃ© mojibake that ftfy repairs",
    "  leading\t\ttabs\n\nnewlines \u00a0nbsp\u3000ideographic\u2028line-sep   trailing  ",
    "don't WE'LL it's THEY'RE i'm you've he'd",
    "prices 123,456.78 $5 #hashtag @user https://example.com/a_b?c=d",
    "Ünïcödé ÆØÅ ß ſ İstanbul ΑΘΗΝΑ Привет мир",
    "a very long caption " * 40,  # over-long: truncated to 77 with the end token kept
    "",
    "!!!??? ... --- ___",
    "x" * 300,  # one word far longer than the context
    "e\u0301 combining accent vs é; ﬁ ligature; ＦＵＬＬＷＩＤＴＨ",
]


@pytest.fixture(scope="module")
def clip_tok() -> TextTokenizer:
    if open_clip_src.package_dir() is None:
        pytest.skip("open_clip_torch not installed (make install adds it with --no-deps)")
    return clip_bpe_tokenizer()


@pytest.fixture(scope="module")
def reference():
    return open_clip_src.load_or_skip("tokenizer")


def _as_open_clip(tok: TextTokenizer, ids: np.ndarray) -> np.ndarray:
    """open_clip pads with id 0 (a real token, '!'); ours pads with an added ``<pad>``."""
    return np.where(ids == tok.pad_id, 0, ids)


def test_ids_equal_open_clip(clip_tok: TextTokenizer, reference) -> None:
    ref = reference.SimpleTokenizer()(CORPUS, context_length=77).numpy()
    ours = clip_tok.encode_batch(CORPUS, 77)
    assert ours.shape == ref.shape == (len(CORPUS), 77)
    np.testing.assert_array_equal(_as_open_clip(clip_tok, ours), ref)
    # open_clip's numbering: start 49406, end 49407; our pad/mask come after its 49,408 ids.
    assert (clip_tok.start_id, clip_tok.end_id) == (49406, 49407)
    assert (clip_tok.pad_id, clip_tok.mask_id, clip_tok.vocab_size) == (49408, 49409, 49410)
    long = ours[CORPUS.index("x" * 300)]
    assert long[0] == 49406 and long[-1] == 49407 and (long != clip_tok.pad_id).all()
    # Every row is unpadded up to its end token: pads never sit inside a caption.
    for row in ours:
        n = int(np.argmax(row == clip_tok.end_id))
        assert (row[n + 1 :] == clip_tok.pad_id).all() and (row[:n] != clip_tok.pad_id).all()


def test_ids_equal_open_clip_other_context(clip_tok: TextTokenizer, reference) -> None:
    ref = reference.SimpleTokenizer()(CORPUS, context_length=16).numpy()
    np.testing.assert_array_equal(_as_open_clip(clip_tok, clip_tok.encode_batch(CORPUS, 16)), ref)


def test_cleaning_and_ids_survive_save_load_and_state(clip_tok: TextTokenizer, tmp_path) -> None:
    expected = clip_tok.encode_batch(CORPUS, 77)
    loaded = TextTokenizer.load(clip_tok.save(tmp_path / "tok"))
    assert loaded.clean == "lower" and loaded.special_ids == clip_tok.special_ids
    np.testing.assert_array_equal(loaded.encode_batch(CORPUS, 77), expected)
    np.testing.assert_array_equal(
        TextTokenizer.from_state(clip_tok.to_state()).encode_batch(CORPUS, 77), expected
    )
    assert clip_tok.decode(expected[0]) == "a photo of a dog & a cat"


def _mask(tok: TextTokenizer, ids: np.ndarray, ratio: float, seed: int) -> np.ndarray:
    """The training collate's call (training/train/loop.py): the start token is protected like pad and end."""
    return mask_text_tokens(
        ids, tok.pad_id, tok.end_id, tok.mask_id, ratio, rng=seed, protected_ids=(tok.start_id,)
    )


def test_masking_keeps_start_end_and_padding(clip_tok: TextTokenizer) -> None:
    ids = clip_tok.encode_batch(CORPUS, 77)
    masked = _mask(clip_tok, ids, 0.75, seed=0)
    special = np.isin(ids, [clip_tok.pad_id, clip_tok.end_id, clip_tok.start_id])
    np.testing.assert_array_equal(masked[special], ids[special])
    changed = masked != ids
    assert changed.any() and (masked[changed] == clip_tok.mask_id).all()


def _siglip_style_file(path) -> str:
    """A small SentencePiece-style Unigram ``tokenizer.json`` with SigLIP's special tokens (pad 0, eos 1)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    words = ["▁a", "▁photo", "▁of", "▁dog", "▁cat", "▁the", "▁red", "▁car", "▁and"]
    pieces += [(w, -float(i + 1)) for i, w in enumerate(words)]
    pieces += [(c, -20.0) for c in "abcdefghijklmnopqrstuvwxyz▁"]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Replace(" ", "▁"), normalizers.Prepend("▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    tokenizer.add_special_tokens(["<pad>", "</s>", "<unk>"])
    tokenizer.save(str(path))
    return str(path)


def test_siglip_style_file_with_canonicalize(tmp_path, reference) -> None:
    path = _siglip_style_file(tmp_path / "tokenizer.json")
    tok = TextTokenizer.from_file(path, clean="canonicalize")
    assert (tok.pad_id, tok.end_id, tok.start_id) == (0, 1, None) and tok.mask_id == tok.vocab_size - 1
    ids = tok.encode_batch(["A Photo, of the RED car!", "the_dog &amp; cat " * 30], 64)
    assert ids.shape == (2, 64) and ids[1, -1] == tok.end_id
    assert tok.decode(ids[0]).replace("▁", " ").split() == ["a", "photo", "of", "the", "red", "car"]
    # The cleanings are open_clip's 'canonicalize' (SigLIP's) and 'lower' (CLIP's), checked against its own.
    for text in CORPUS:
        assert CLEANERS["canonicalize"](text) == reference._clean_canonicalize(text)
        assert CLEANERS["lower"](text) == reference._clean_lower(text)


def test_spec_resolution_and_one_tokenizer_per_track(clip_tok: TextTokenizer, tmp_path) -> None:
    from jobs.track.config import TRACK_PRESETS, train_config
    from pipeline.common.config import ConfigError, merge
    from pipeline.ingest.tokenizer import tokenizer_from_spec

    assert tokenizer_from_spec("clip").to_state() == clip_tok.to_state()
    from pipeline.ingest.tokenizer import clip_vocab_path

    assert tokenizer_from_spec(f"clip:{clip_vocab_path()}").to_state() == clip_tok.to_state()
    assert tokenizer_from_spec(str(clip_tok.save(tmp_path / "saved"))).to_state() == clip_tok.to_state()
    siglip = tokenizer_from_spec(_siglip_style_file(tmp_path / "tokenizer.json"), clean="canonicalize")
    assert siglip.clean == "canonicalize"

    dc = TRACK_PRESETS["datacomp-small"]
    assert dc.scorer.tokenizer == dc.train.tokenizer == "clip"
    for preset in TRACK_PRESETS.values():  # every model of every track preset reads one tokenizer
        models = [
            train_config(preset, base, "m", "shards", 0).tokenizer for base in (preset.scorer, preset.train)
        ]
        assert len(set(models)) == 1 and models[0]
    with pytest.raises(ConfigError, match="same tokenizer"):
        merge(dc, {"train": {"tokenizer": ""}})
    with pytest.raises(ConfigError, match="same tokenizer"):
        merge(TRACK_PRESETS["demo"], {"share_tokenizer": False})
    with pytest.raises(ConfigError, match="tokenizer_clean"):
        merge(dc, {"train": {"tokenizer_clean": "upper"}})


def test_masked_clip_tokens_run_through_a_prolip_text_tower(clip_tok: TextTokenizer) -> None:
    """The model built from the tokenizer (vocab 49,410, pad 49,408) encodes masked CLIP rows: finite μ and
    log σ² from the UNC token, and padding does not change the result (pad keys are masked)."""
    import torch

    from training.model.config import model_config
    from training.model.two_tower import ProLIP

    cfg = model_config("tiny", vocab_size=clip_tok.vocab_size, pad_id=clip_tok.pad_id, context_length=77)
    model = ProLIP(cfg).eval()
    ids = clip_tok.encode_batch(CORPUS[:4], 77)
    masked = _mask(clip_tok, ids, 0.5, seed=1)
    with torch.no_grad():
        mu, logvar = model.encode_text(torch.from_numpy(masked))
        width = int((masked != clip_tok.pad_id).sum(1).max())
        mu_trim, _ = model.encode_text(torch.from_numpy(masked[:, :width]))
    assert torch.isfinite(mu).all() and logvar is not None and torch.isfinite(logvar).all()
    assert (mu - mu_trim).abs().max() < 1e-5
