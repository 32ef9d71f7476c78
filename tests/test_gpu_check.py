"""tests/gpu_check.sh --cpu: the GPU check script's CPU fallback runs every check on the CPU, so it cannot rot.

The same functions the CUDA run calls (the trainer's step for both presets with bf16 autocast, the host-sync
check, σ² and loss finiteness, a checkpoint saved and resumed, the ingest rates, the results file), with the
``demo-32px`` model and small batches.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_fallback_passes_and_writes_its_results(tmp_path) -> None:
    import sys

    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(["bash", "tests/gpu_check.sh", "--cpu", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "all checks passed" in done.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["failed"] == []
    assert [s["preset"] for s in report["steps"]] == ["datacomp-small", "prolip-b16"]
    for s in report["steps"]:
        assert s["loss_finite"] and s["logvar_ok"] and s["host_syncs"] == [] and s["fused_adamw"]
        assert s["resume_equal_weights"] and s["samples_per_s"] > 0 and s["gflop_per_sample"] > 0
    assert report["ingest"]["per_core_samples_per_s"] > 0 and report["ingest"]["cores"] >= 1
