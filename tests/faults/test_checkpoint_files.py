"""A checkpoint's files under kills and damage, without Ray: the save and the upload Ray Train's workers
run (training/train/checkpointing.py, run_checkpoints.py), killed half-way in forked children of a fresh
interpreter (pipeline/common/faults.py), leave something the restore and the re-run's check recognise,
and the previous checkpoint stays usable; a restore killed as its download starts is redone whole by
the next process; the local directory of a killed save is removed by the host's next save. The re-run's check deregisters a corrupt newest checkpoint
from a snapshot in Ray Train's format and sets its directory aside.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from training.model.checkpoint import CheckpointError
from training.train.run_checkpoints import SNAPSHOT_FILE, fresh_name, listing_problem, preflight

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, os, shutil, signal, sys
import pyarrow.fs as pafs, torch
from pipeline.common import faults
from pipeline.common.config import merge
from pipeline.ingest.tokenizer import train_tokenizer
from tests.fixtures.checkpoints import DEMO_CAPTIONS
from training.config import TRAIN_PRESETS
from training.train.checkpointing import restore_with_fallback, save_state
from training.train.run_checkpoints import listing_problem, local_save_dir, upload_checkpoint, verify_checkpoint
from training.train.step import setup_state

root = sys.argv[1]
tok = train_tokenizer(DEMO_CAPTIONS * 4, vocab_size=512)
cfg = merge(TRAIN_PRESETS["demo"], {"model": "demo-32px", "tokenizer_vocab": 512})
state = setup_state(cfg, tok, torch.device("cpu"), 0)

def killed(point, fn):
    pid = os.fork()
    if pid == 0:
        os.environ[faults.ARM] = point
        try:
            fn()
        finally:
            os._exit(0)
    return os.WTERMSIG(os.waitpid(pid, 0)[1]) == signal.SIGKILL

out = {}
state.step = 10
save_state(f"{root}/ckpt_10", state, tok, {"step": 10})
state.step = 20
out["save_killed"] = killed("checkpoint.save", lambda: save_state(f"{root}/ckpt_20", state, tok, {"step": 20}))
out["verify_cut_save"] = verify_checkpoint(f"{root}/ckpt_20")
warnings = []
fetch = lambda src, dst: shutil.copytree(src, dst, dirs_exist_ok=True)
got, path = restore_with_fallback([f"{root}/ckpt_20", f"{root}/ckpt_10"], fetch,
                                  lambda d: setup_state(cfg, tok, torch.device("cpu"), 0, restore_dir=d), warnings.append)
out["restored_step"], out["restored_from"], out["warnings"] = got.step, path, warnings
restore = lambda: restore_with_fallback([f"{root}/ckpt_10"], fetch,
                                        lambda d: setup_state(cfg, tok, torch.device("cpu"), 0, restore_dir=d), warnings.append)
out["fetch_killed"] = killed("checkpoint.fetch", restore)
again, _ = restore()  # the next process's restore: the killed download left nothing it reads
out["restored_again"] = again.step
fs = pafs.LocalFileSystem()
out["upload_killed"] = killed("checkpoint.upload@3", lambda: upload_checkpoint(f"{root}/ckpt_10", fs, f"{root}/run/checkpoint_00000010"))
out["listing_cut_upload"] = listing_problem(fs, f"{root}/run/checkpoint_00000010")
upload_checkpoint(f"{root}/ckpt_10", fs, f"{root}/run/checkpoint_00000010.1")
out["listing_whole"] = listing_problem(fs, f"{root}/run/checkpoint_00000010.1")
saves = f"{root}/saves"
os.makedirs(f"{saves}/prolip-ckpt-1@elsewhere-x")  # another host's: not this host's to judge
out["mine"] = os.path.basename(local_save_dir(saves))  # a live process's: kept
out["local_save_killed"] = killed("checkpoint.save", lambda: save_state(local_save_dir(saves), state, tok, {}))
out["saves_after_kill"] = sorted(os.listdir(saves))
out["fresh"] = os.path.basename(local_save_dir(saves))  # the next save on this host
out["saves_after_next"] = sorted(os.listdir(saves))
print(json.dumps(out))
"""


def test_a_cut_save_and_a_cut_upload_are_recognised_and_the_previous_checkpoint_restores(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["save_killed"] and "no checksums.json" in out["verify_cut_save"]
    assert out["restored_step"] == 10 and out["restored_from"].endswith("ckpt_10")
    assert len(out["warnings"]) == 1 and "ckpt_20" in out["warnings"][0]
    assert out["fetch_killed"] and out["restored_again"] == 10
    assert out["upload_killed"] and "no checksums.json" in out["listing_cut_upload"]
    assert out["listing_whole"] is None
    # a worker killed mid-save leaves its local directory; the next save on the host removes it, no other
    assert out["local_save_killed"] and len(out["saves_after_kill"]) == 3, out["saves_after_kill"]
    assert out["saves_after_next"] == sorted([out["mine"], out["fresh"], "prolip-ckpt-1@elsewhere-x"])
    assert fresh_name(pafs.LocalFileSystem(), str(tmp_path / "run"), 10) == "checkpoint_00000010.2"


def _snapshot(run: Path, names: list[str]) -> None:
    """A Ray Train V2 checkpoint manager snapshot listing ``names`` in report order."""
    results = [{"checkpoint_dir_name": n, "metrics": {"step": i}} for i, n in enumerate(names)]
    snap = {"ray_version": "2.60.0", "checkpoint_results": results, "checkpoint_report_indices": list(range(len(names))),
            "latest_checkpoint_result": results[-1], "pending_training_results": [], "pending_validation_specs": [],
            "current_report_index": len(names), "validated_checkpoint_dir_names": [],
            "timed_out_validation_checkpoint_dir_names": [], "failed_validation_checkpoint_dir_names": []}  # fmt: skip
    (run / SNAPSHOT_FILE).write_text(json.dumps(snap))


def _checkpoint(run: Path, name: str, weights: bytes = b"w" * 100) -> None:
    d = run / name
    d.mkdir(parents=True)
    (d / "weights.pt").write_bytes(weights)
    (d / "extra.json").write_text(json.dumps({"checksummed": True}))
    sums = {n: {"size": (d / n).stat().st_size, "sha256": "x"} for n in ("weights.pt", "extra.json")}
    sums["weights.pt"]["size"] = 100
    (d / "checksums.json").write_text(json.dumps(sums))


def test_the_rerun_check_deregisters_and_sets_aside_a_corrupt_latest(tmp_path) -> None:
    run, fs = tmp_path / "run", pafs.LocalFileSystem()
    _checkpoint(run, "checkpoint_00000010")
    _checkpoint(run, "checkpoint_00000020", weights=b"w" * 40)  # cut short
    _snapshot(run, ["checkpoint_00000010", "checkpoint_00000020"])
    said: list[str] = []
    warnings = preflight(fs, str(run), said.append)
    assert warnings == said and len(said) == 1 and "checkpoint_00000020" in said[0] and "40 of 100" in said[0]
    snap = json.loads((run / SNAPSHOT_FILE).read_text())
    assert [r["checkpoint_dir_name"] for r in snap["checkpoint_results"]] == ["checkpoint_00000010"]
    assert snap["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_00000010"
    assert snap["checkpoint_report_indices"] == [0]
    assert (
        not (run / "checkpoint_00000020").exists()
        and len(list(run.glob("corrupt-checkpoint_00000020-*"))) == 1
    )
    assert preflight(fs, str(run), said.append) == []  # nothing left to do
    assert listing_problem(fs, str(run / "checkpoint_00000010")) is None

    (run / "checkpoint_00000010" / "weights.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        preflight(fs, str(run), said.append)
