"""``data.text_mask_mode="salient"`` (training/train/salient_masking.py): the model chooses which words a masked caption loses.

Checked against a one-caption-at-a-time reference on the real ``tiny`` text tower, on an encoder whose
salient words are known by construction, and through ``train_step``: the masked captions the step encodes
are those the pre-step weights choose, and the config accepts the mode.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.common.config import ConfigError
from pipeline.ingest.masking import drop_masked_tokens
from tests.training.train.test_distributed import END, MASK, PAD, global_batch, tiny_module
from training.config import DataConfig, TrainConfig
from training.train.salient_masking import SalientDrop, leave_one_out, remove_positions
from training.train.step import setup_state, train_step


def test_leave_one_out_removes_each_position_once() -> None:
    tokens = torch.tensor([[5, 6, 7, END, PAD], [9, END, PAD, PAD, PAD]])
    out = leave_one_out(tokens, PAD)
    assert out.shape == (2, 5, 5)
    for m in range(2):
        for p in range(5):
            row = tokens[m].tolist()
            expect = row[:p] + row[p + 1 :] + [PAD]
            assert out[m, p].tolist() == expect


def test_remove_positions_matches_the_collates_drop() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 50, (6, 9), generator=g)
    drop = torch.rand(6, 9, generator=g) < 0.4
    with_holes = torch.where(drop, MASK, tokens)
    expect = drop_masked_tokens(with_holes.numpy(), MASK, PAD)
    assert np.array_equal(remove_positions(tokens, drop, PAD).numpy(), expect)


def _reference(
    encode_text, tokens: torch.Tensor, rows: list[int], ratio: float, protected=()
) -> list[list[int]]:
    """One caption and one removed word at a time, in Python: the rule of training/train/salient_masking.py's docstring."""
    shifts: dict[tuple[int, int], float] = {}
    with torch.no_grad():
        for r in rows:
            row = tokens[r].tolist()
            full = encode_text(tokens[r : r + 1])[0][0]
            for p, t in enumerate(row):
                if t in (PAD, END, *protected):
                    continue
                variant = torch.tensor([row[:p] + row[p + 1 :] + [PAD]])
                shifts[(r, p)] = float(torch.linalg.vector_norm(encode_text(variant)[0][0] - full))
    threshold = float(np.median(list(shifts.values())))
    out = []
    for r in rows:
        mine = sorted(((s, p) for (rr, p), s in shifts.items() if rr == r), key=lambda x: (-x[0], x[1]))
        k = max(1, int(np.floor(ratio * len(mine) + 0.5)))
        gone = {p for s, p in mine[:k] if s > threshold}
        row = tokens[r].tolist()
        kept = [t for p, t in enumerate(row) if p not in gone]
        out.append(kept + [PAD] * (len(row) - len(kept)))
    return out


@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_salient_drop_matches_a_one_at_a_time_reference_on_the_real_text_tower(ratio: float) -> None:
    model = tiny_module("prolip").model
    tokens = global_batch()["tokens"]
    rows = [0, 1, 2, 4, 6, 7]
    got = SalientDrop(PAD, END, ratio)(model.encode_text, tokens, torch.tensor(rows))
    assert got.tolist() == _reference(model.encode_text, tokens, rows, ratio)
    assert (got != tokens[rows]).any(), "nothing was removed"


def _bag_of_words(weights: dict[int, float]):
    """μ = Σ weight(token) · e_token over the caption's tokens: removing token t moves μ by weight(t)."""
    dim = 64

    def encode_text(tokens: torch.Tensor):
        w = torch.tensor([weights.get(i, 0.0) for i in range(dim)])
        onehot = torch.nn.functional.one_hot(tokens, dim).float()  # (N, L, V)
        return (onehot * w).sum(1), None

    return encode_text


def test_salient_drop_removes_the_heaviest_words_and_never_pad_end_or_protected() -> None:
    # Words 10–13 carry content (weights 5–8), 20–23 are filler (1/8 each; dyadic, so every shift is exact);
    # 3 is a protected start token.
    weights = {10: 5.0, 11: 6.0, 12: 7.0, 13: 8.0, 20: 0.125, 21: 0.125, 22: 0.125, 23: 0.125, 3: 100.0}
    tokens = torch.tensor(
        [
            [3, 20, 10, 21, 11, END, PAD, PAD],  # two content words, both above the median: both go
            [3, 20, 21, 22, 23, 13, 12, END],  # 6 words, k = 3; only the two content words are above it
            [3, 20, 21, 22, 23, 20, 21, END],  # filler only: at the median, kept whole
        ]
    )
    out = SalientDrop(PAD, END, 0.5, protected_ids=(3,))(_bag_of_words(weights), tokens, torch.arange(3))
    assert out.tolist() == [
        [3, 20, 21, END, PAD, PAD, PAD, PAD],
        [3, 20, 21, 22, 23, END, PAD, PAD],
        [3, 20, 21, 22, 23, 20, 21, END],
    ]
    # The ratio caps how many go, heaviest first.
    out = SalientDrop(PAD, END, 0.2, (3,))(_bag_of_words(weights), tokens[1:2], torch.tensor([0]))
    assert out.tolist() == [[3, 20, 21, 22, 23, 12, END, PAD]]


def test_salient_drop_of_no_rows_is_empty() -> None:
    model = tiny_module("prolip").model
    out = SalientDrop(PAD, END, 0.5)(
        model.encode_text, global_batch()["tokens"], torch.tensor([], dtype=torch.long)
    )
    assert out.shape == (0, 8)


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_train_step_encodes_the_captions_the_pre_step_weights_choose(share: float) -> None:
    cfg = TrainConfig(
        model="tiny",
        global_batch_size=8,
        samples_seen=16,
        data=DataConfig(text_mask_mode="salient", text_mask_ratio=0.5, salient_share=share),
    )
    state = setup_state(cfg, SimpleNamespace(vocab_size=64, pad_id=PAD, end_id=END), torch.device("cpu"), 0)
    assert state.salient is not None
    g = torch.Generator().manual_seed(2)
    small = global_batch()
    masked_index = torch.tensor([0, 2, 4, 6])
    batch = {
        "images": torch.randn(8, 3, 64, 64, generator=g),
        "tokens": small["tokens"],
        "masked_tokens": small["masked_tokens"],
        "keep_idx": torch.stack([torch.randperm(64, generator=g)[:16].sort().values for _ in range(8)]),
        "masked_index": masked_index,
    }
    model = state.module.model
    # share 1: every masked caption is the model's choice; share ½: the first two, the others as collated.
    chosen_rows = [0, 2, 4, 6] if share == 1.0 else [0, 2]
    chosen = torch.tensor(_reference(model.encode_text, small["tokens"], chosen_rows, 0.5))
    expect_tokens = torch.cat([chosen, small["masked_tokens"][[4, 6]]]) if share < 1 else chosen
    with torch.no_grad():
        expect_mu = model.encode_text(expect_tokens)[0]
    _, feats = train_step(state, batch)
    assert torch.allclose(feats["mu_t_masked"].detach(), expect_mu, atol=1e-5)
    assert (batch["masked_tokens"] == small["masked_tokens"]).all(), "the caller's batch was modified"


def test_config_accepts_salient_and_names_the_field_otherwise() -> None:
    assert TrainConfig(data=DataConfig(text_mask_mode="salient")).data.text_mask_mode == "salient"
    with pytest.raises(ConfigError, match=r"DataConfig\.text_mask_mode"):
        TrainConfig(data=DataConfig(text_mask_mode="important"))
    with pytest.raises(
        ConfigError, match=r"DataConfig\.salient_share: input should be less than or equal to 1"
    ):
        TrainConfig(data=DataConfig(text_mask_mode="salient", salient_share=1.5))
    with pytest.raises(ConfigError, match=r"DataConfig\.salient_share needs text_mask_mode"):
        TrainConfig(data=DataConfig(text_mask_mode="drop", salient_share=0.5))
