"""Small checkpoints built in code (random init), for tests that need a model but not a trained one.

- ``tiny_checkpoint``: the ``tiny`` ProLIP preset (probabilistic), tokenizer trained on the captions of
  ``tests/fixtures_train.py`` (every "a photo of a {colour} {shape}"), saved with ``save_checkpoint``.
- ``clip_checkpoint``: the same with ``probabilistic=False`` (a deterministic CLIP; loss "clip").

Both are session-scoped directories; ``make_checkpoint(dir, probabilistic)`` builds one anywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.tokenizer import train_tokenizer
from tests.fixtures_train import COLOURS, SHAPES
from training.model import ProLIP, model_config, save_checkpoint

DEMO_CAPTIONS = [f"a photo of a {c} {s}" for c in COLOURS for s in SHAPES]


def make_checkpoint(directory: str | Path, probabilistic: bool = True, seed: int = 0) -> str:
    """A random-init ``tiny`` checkpoint in ``directory``; the same seed gives the same weights."""
    tok = train_tokenizer(DEMO_CAPTIONS * 4, vocab_size=512)
    cfg = model_config("tiny", vocab_size=tok.vocab_size, pad_id=tok.pad_id, probabilistic=probabilistic)
    torch.manual_seed(seed)
    extra = {"loss": "prolip" if probabilistic else "clip"}
    return str(save_checkpoint(directory, ProLIP(cfg).eval(), cfg, tok, extra))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt_prolip"), probabilistic=True)


@pytest.fixture(scope="session")
def clip_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt_clip"), probabilistic=False)
