"""Restoring a run from real checkpoint directories: a corrupt latest one falls back to the previous kept
one with a warning naming it; none usable is an error naming every checkpoint, never a temp copy; the copy
of a restore killed midway is removed by the next restore on the machine, a live one's never."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from pipeline.common.config import merge
from pipeline.ingest.tokenizer import train_tokenizer
from tests.fixtures.checkpoints import DEMO_CAPTIONS
from training.config import TRAIN_PRESETS
from training.model.checkpoint import CheckpointError
from training.train.checkpointing import (
    restore_scratch,
    restore_with_fallback,
    save_state,
    sweep_abandoned_scratch,
)
from training.train.loop import checkpoint_candidates
from training.train.step import setup_state

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> tuple[Path, object, object]:
    """checkpoint_00000002 and checkpoint_00000004 of one run, as the loop writes them."""
    tok = train_tokenizer(DEMO_CAPTIONS * 4, vocab_size=512)
    cfg = merge(TRAIN_PRESETS["demo"], {"model": "demo-32px", "tokenizer_vocab": 512})
    root = tmp_path_factory.mktemp("run")
    for step in (2, 4):
        state = setup_state(cfg, tok, CPU, 0)
        state.step = step
        save_state(str(root / f"checkpoint_{step:08d}"), state, tok)
    (root / "checkpoint_00000009.tmp").mkdir()  # not a checkpoint name of ours: never a candidate
    return root, cfg, tok


def _restore(root: Path, cfg, tok, latest: str, warnings: list[str]):
    cands = checkpoint_candidates(str(root / latest), pafs.LocalFileSystem())
    return restore_with_fallback(
        cands,
        lambda src, dst: shutil.copytree(src, dst, dirs_exist_ok=True),
        lambda d: setup_state(cfg, tok, CPU, 0, restore_dir=d),
        warn=warnings.append,
    )


def test_candidates_newest_first(run_dir) -> None:
    root, _, _ = run_dir
    got = checkpoint_candidates(str(root / "checkpoint_00000004"), pafs.LocalFileSystem())
    assert [Path(p).name for p in got] == ["checkpoint_00000004", "checkpoint_00000002"]


def test_intact_latest_is_restored(run_dir) -> None:
    root, cfg, tok = run_dir
    warnings: list[str] = []
    state, path = _restore(root, cfg, tok, "checkpoint_00000004", warnings)
    assert state.step == 4 and path.endswith("checkpoint_00000004") and warnings == []


def test_corrupt_latest_falls_back_naming_the_real_checkpoint(run_dir, tmp_path) -> None:
    root, cfg, tok = run_dir
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    weights = copy / "checkpoint_00000004" / "weights.pt"
    weights.write_bytes(weights.read_bytes()[:1000])  # torn write
    warnings: list[str] = []
    state, path = _restore(copy, cfg, tok, "checkpoint_00000004", warnings)
    assert state.step == 2 and state.restored and path == str(copy / "checkpoint_00000002")
    assert len(warnings) == 1 and str(copy / "checkpoint_00000004" / "weights.pt") in warnings[0]
    assert "prolip-restore-" not in warnings[0] and "falling back to" in warnings[0]


def test_no_usable_checkpoint_is_an_error_naming_each(run_dir, tmp_path) -> None:
    root, cfg, tok = run_dir
    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    (copy / "checkpoint_00000004" / "train_state.pt").write_bytes(b"not a torch file")
    (copy / "checkpoint_00000002" / "model_config.json").unlink()
    warnings: list[str] = []
    with pytest.raises(CheckpointError) as err:
        _restore(copy, cfg, tok, "checkpoint_00000004", warnings)
    msg = str(err.value)
    assert str(copy / "checkpoint_00000004") in msg and str(copy / "checkpoint_00000002") in msg
    assert "prolip-restore-" not in msg and len(warnings) == 2


_HOLD_A_COPY = """
import sys, time
from training.train.checkpointing import restore_scratch
with restore_scratch(sys.argv[1]) as d:
    open(d + "/weights.pt", "wb").write(b"w" * 4096)
    print(d, flush=True)
    time.sleep(600)
"""


def test_the_copy_of_a_killed_restore_is_removed_by_the_next_and_a_live_one_is_kept(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[3]
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _HOLD_A_COPY, name],
            cwd=root, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        for name in ("killed", "live")
    }  # fmt: skip
    try:
        dirs = {name: p.stdout.readline().strip() for name, p in procs.items()}
        assert all(os.path.isfile(d + "/weights.pt") for d in dirs.values()), dirs
        os.killpg(procs["killed"].pid, signal.SIGKILL)
        procs["killed"].wait()
        assert os.path.isdir(dirs["killed"])  # nothing ran its cleanup
        with restore_scratch("next") as d:
            assert os.path.isdir(d) and not os.path.exists(dirs["killed"])
            assert not os.path.exists(dirs["killed"] + ".lock")
            assert os.path.isfile(dirs["live"] + "/weights.pt")  # its restorer still holds the lock
        assert sorted(os.listdir(tmp_path)) == sorted(
            os.path.basename(dirs["live"]) + s for s in ("", ".lock")
        )
    finally:
        os.killpg(procs["live"].pid, signal.SIGKILL)
        procs["live"].wait()
    assert sweep_abandoned_scratch() == [dirs["live"]] and os.listdir(tmp_path) == []
