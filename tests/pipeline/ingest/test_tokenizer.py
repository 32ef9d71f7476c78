"""Tests for pipeline/ingest/tokenizer.py: training, encoding layout, save/load, wrapping foreign tokenizer.json."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pipeline.ingest.tokenizer import TextTokenizer, train_tokenizer

CAPTIONS = [
    f"a {size} {colour} {shape} on a {bg} background"
    for size in ("small", "large", "tiny")
    for colour in ("red", "green", "blue", "yellow")
    for shape in ("circle", "square", "triangle", "star")
    for bg in ("white", "black")
]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return train_tokenizer(CAPTIONS, vocab_size=400)


def test_special_ids_and_vocab(tok: TextTokenizer) -> None:
    assert (tok.pad_id, tok.end_id, tok.mask_id, tok.start_id) == (0, 1, 2, None)
    assert 256 < tok.vocab_size <= 400


def test_encode_layout_end_always_present(tok: TextTokenizer) -> None:
    texts = ["a red circle", "", "a large yellow star on a black background " * 10]
    ids = tok.encode_batch(texts, context_length=16)
    assert ids.dtype == np.int64 and ids.shape == (3, 16)
    assert ((ids == tok.end_id).sum(axis=1) == 1).all()
    assert ids[1, 0] == tok.end_id and (ids[1, 1:] == tok.pad_id).all()
    assert ids[2, -1] == tok.end_id and (ids[2, :-1] != tok.pad_id).all()  # truncated, END still fits
    n = int(np.argmax(ids[0] == tok.end_id))
    assert (ids[0, n + 1 :] == tok.pad_id).all() and (ids[0, :n] > 2).all()
    assert tok.decode(ids[0]) == "a red circle"


def test_encode_matches_per_row_encoding(tok: TextTokenizer) -> None:
    ids = tok.encode_batch(CAPTIONS[:10], context_length=32)
    for row, text in zip(ids, CAPTIONS[:10], strict=True):
        expected = tok._tokenizer.encode(text, add_special_tokens=False).ids
        assert row[: len(expected)].tolist() == expected


def test_lowercase_and_special_spellings_are_plain_text(tok: TextTokenizer) -> None:
    a, b = tok.encode_batch(["A RED Circle", "a red circle"], 16)
    assert (a == b).all()
    (row,) = tok.encode_batch(["<pad> <mask> <end> red"], 16)
    n = int(np.argmax(row == tok.end_id))
    assert not np.isin(row[:n], [tok.pad_id, tok.mask_id, tok.end_id]).any()


def test_save_load_round_trip(tok: TextTokenizer, tmp_path) -> None:
    tok.save(tmp_path / "t")
    assert (tmp_path / "t" / "tokenizer.json").is_file() and (
        tmp_path / "t" / "special_tokens.json"
    ).is_file()
    loaded = TextTokenizer.load(tmp_path / "t")
    assert loaded.special_ids == tok.special_ids and loaded.vocab_size == tok.vocab_size
    texts = CAPTIONS[::7] + ["unseen words: zebra!"]
    np.testing.assert_array_equal(loaded.encode_batch(texts, 24), tok.encode_batch(texts, 24))
    # from_file on our own tokenizer.json detects the same ids.
    assert TextTokenizer.from_file(tmp_path / "t" / "tokenizer.json").special_ids == tok.special_ids


def test_load_missing_or_corrupt_names_file(tok: TextTokenizer, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TextTokenizer.load(tmp_path)
    tok.save(tmp_path)
    (tmp_path / "special_tokens.json").unlink()
    with pytest.raises(FileNotFoundError, match="special_tokens.json"):
        TextTokenizer.load(tmp_path)
    tok.save(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer.json"):
        TextTokenizer.load(tmp_path)


def _clip_like_tokenizer_json(path) -> str:
    """A BPE saved with CLIP's special tokens and no pad/mask, like CLIP's tokenizer.json."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|startoftext|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator(CAPTIONS, trainer=trainer)
    t.save(str(path))
    return str(path)


def test_from_file_detects_end_and_adds_pad_and_mask(tmp_path) -> None:
    path = _clip_like_tokenizer_json(tmp_path / "clip.json")
    base = Tokenizer.from_file(path).get_vocab_size()
    tok = TextTokenizer.from_file(path, start_token="<|startoftext|>")
    assert tok.end_id == Tokenizer.from_file(path).token_to_id("<|endoftext|>")
    assert tok.vocab_size == base + 2 and {tok.pad_id, tok.mask_id} == {base, base + 1}
    (row,) = tok.encode_batch(["a red star"], 16)
    assert row[0] == tok.start_id and (row == tok.end_id).sum() == 1 and row[-1] == tok.pad_id
    tok.save(tmp_path / "saved")
    assert TextTokenizer.load(tmp_path / "saved").special_ids == tok.special_ids


def test_from_file_explicit_names(tmp_path) -> None:
    path = _clip_like_tokenizer_json(tmp_path / "clip.json")
    with pytest.raises(ValueError, match="<nope>"):
        TextTokenizer.from_file(path, mask_token="<nope>")
    with pytest.raises(FileNotFoundError, match="missing.json"):
        TextTokenizer.from_file(tmp_path / "missing.json")


def test_context_too_small_raises(tok: TextTokenizer) -> None:
    with pytest.raises(ValueError, match="context_length"):
        tok.encode_batch(["a"], 0)


def test_a_tokenizer_on_s3_loads_like_the_local_one(tok: TextTokenizer, tmp_path, s3_server) -> None:
    """A build on S3 saves its BPE beside the shards; a training submitted from anywhere reads it there."""
    from pipeline.common.storage import Storage
    from pipeline.ingest.tokenizer import TOKENIZER_FILE, tokenizer_from_spec

    store = Storage.from_env(s3_server.endpoint)
    local = tok.save(tmp_path / "saved")
    for f in sorted(local.iterdir()):
        store.write_bytes(f.read_bytes(), s3_server.url("tok", "saved", f.name))
    assert tokenizer_from_spec(s3_server.url("tok", "saved"), store=store).to_state() == tok.to_state()
    # a bare tokenizer.json on S3 is wrapped the way a local one is
    bare = tokenizer_from_spec(s3_server.url("tok", "saved", TOKENIZER_FILE), store=store)
    assert bare.encode_batch(["a red circle"], 8).tolist() == tok.encode_batch(["a red circle"], 8).tolist()
    with pytest.raises(FileNotFoundError, match="tokenizer file missing: s3://"):
        tokenizer_from_spec(s3_server.url("tok", "nothing-here.json"), store=store)
