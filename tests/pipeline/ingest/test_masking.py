"""Tests for pipeline/ingest/masking.py: exact counts, reproducibility, and what may never be masked."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from pipeline.ingest.masking import (
    choose_kept_patches,
    mask_text_tokens,
    round_half_up,
    sample_hash,
    select_for_masking,
)

PAD, END, MASK = 0, 1, 2
UIDS = np.array([uuid.UUID(int=int(x)).hex for x in np.random.default_rng(0).integers(0, 2**62, 1000)])


@pytest.mark.parametrize("batch_size", [128, 100, 8, 4, 1000, None])
def test_selection_fraction_exact_per_batch(batch_size: int | None) -> None:
    selected = select_for_masking(UIDS, epoch=0, batch_size=batch_size)
    bs = batch_size or len(UIDS)
    for start in range(0, len(UIDS), bs):
        chunk = selected[start : start + bs]
        assert chunk.sum() == round_half_up(0.125 * len(chunk))


def test_selection_reproducible_and_epoch_dependent() -> None:
    a = select_for_masking(UIDS, epoch=3, batch_size=128)
    np.testing.assert_array_equal(a, select_for_masking(list(UIDS), epoch=3, batch_size=128))
    b = select_for_masking(UIDS, epoch=4, batch_size=128)
    assert a.sum() == b.sum() and (a & b).sum() < a.sum() / 2  # ≈ 1/8 overlap expected by chance
    assert (select_for_masking(UIDS, epoch=3, batch_size=128, seed=1) != a).any()


def test_selection_independent_of_row_order_within_batch() -> None:
    perm = np.random.default_rng(1).permutation(len(UIDS))
    a = select_for_masking(UIDS, epoch=0)
    b = select_for_masking(UIDS[perm], epoch=0)
    assert set(UIDS[a]) == set(UIDS[perm][b])


def test_selection_is_roughly_uniform_over_epochs() -> None:
    counts = sum(select_for_masking(UIDS[:200], epoch=e, batch_size=200).astype(int) for e in range(80))
    assert counts.sum() == 80 * 25 and counts.max() < 30 and counts.min() >= 1  # mean 10 per uid


def test_selection_key_kinds() -> None:
    ints = select_for_masking(np.arange(64), epoch=0, fraction=0.25)
    strings = select_for_masking([f"sample-{i}" for i in range(64)], epoch=0, fraction=0.25)
    assert ints.sum() == strings.sum() == 16
    upper = np.char.upper(UIDS[:50].astype(str))
    np.testing.assert_array_equal(sample_hash(upper, 0), sample_hash(UIDS[:50], 0))  # hex parse
    assert len(np.unique(sample_hash(UIDS, 0))) == len(UIDS)
    assert select_for_masking(["é" * 32, "x" * 32, "y" * 32, "z" * 32], epoch=0, fraction=0.5).sum() == 2
    assert select_for_masking([], epoch=0).shape == (0,)
    with pytest.raises(ValueError, match="fraction"):
        select_for_masking(UIDS, 0, fraction=1.5)


def _token_batch(rng: np.random.Generator, b: int = 64, length: int = 32) -> np.ndarray:
    tokens = np.full((b, length), PAD, dtype=np.int64)
    lengths = rng.integers(0, length, size=b)  # content tokens per row (END takes one slot)
    cols = np.arange(length)[None, :]
    tokens[cols < lengths[:, None]] = rng.integers(3, 500, size=int(lengths.sum()))
    tokens[np.arange(b), lengths] = END
    return tokens


def test_mask_text_exact_count_never_pad_or_end() -> None:
    tokens = _token_batch(np.random.default_rng(0))
    masked = mask_text_tokens(tokens, PAD, END, MASK, ratio=0.75, rng=np.random.default_rng(1))
    content = (tokens != PAD) & (tokens != END)
    changed = masked != tokens
    np.testing.assert_array_equal(changed.sum(1), round_half_up(0.75 * content.sum(1)))
    assert not changed[~content].any()  # PAD and END untouched
    assert (masked[changed] == MASK).all()
    assert masked.dtype == tokens.dtype and masked.shape == tokens.shape


def test_mask_text_protected_ids_and_determinism() -> None:
    tokens = _token_batch(np.random.default_rng(0))
    tokens[:, 0] = np.where(tokens[:, 0] == END, END, 499)  # a start token where the row has content
    masked = mask_text_tokens(tokens, PAD, END, MASK, rng=7, protected_ids=[499])
    assert (masked[:, 0] == tokens[:, 0]).all()
    np.testing.assert_array_equal(
        masked, mask_text_tokens(tokens, PAD, END, MASK, rng=7, protected_ids=[499])
    )
    assert (masked != mask_text_tokens(tokens, PAD, END, MASK, rng=8, protected_ids=[499])).any()


def test_choose_kept_patches() -> None:
    kept = choose_kept_patches(64, 32, keep_ratio=0.25, rng=0)
    assert kept.shape == (32, 16) and kept.dtype == np.int64
    assert (np.diff(kept, axis=1) > 0).all()  # sorted, unique
    assert kept.min() >= 0 and kept.max() < 64
    np.testing.assert_array_equal(kept, choose_kept_patches(64, 32, keep_ratio=0.25, rng=0))
    assert len({tuple(r) for r in kept}) == 32  # rows differ
    assert choose_kept_patches(196, 2, rng=np.random.default_rng(0)).shape == (2, 49)  # ViT-B/16
    np.testing.assert_array_equal(
        choose_kept_patches(10, 3, keep_ratio=1.0, rng=0), np.tile(np.arange(10), (3, 1))
    )
    with pytest.raises(ValueError, match="keep_ratio"):
        choose_kept_patches(64, 2, keep_ratio=0.0, rng=0)
