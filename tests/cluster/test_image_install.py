"""The cluster image's install, run for real: cluster/install.sh in a fresh venv on what cluster/Dockerfile
copies, then CLIP's BPE and one train step of datacomp-small's model on the CPU inside that venv.

The image itself is never built here (no Docker, no registry); this is the part of it that can break
without a GPU: a dependency a preset needs that the install leaves out (CLIP's vocabulary once was), a
project file the Dockerfile does not copy, an import that only the developer's venv satisfies. The pip
cache of the machine makes the install take minutes, not the download's hours: marked slow.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CAPTION = "a photo of a cat"
CLIP_IDS = [49406, 320, 1125, 539, 320, 2368, 49407]  # CLIP's BPE: <start> a photo of a cat <end>

IN_VENV = r"""
import json, sys
import numpy as np, torch
from pipeline.ingest.tokenizer import tokenizer_from_spec
from pipeline.common.config import merge
from training.config import TRAIN_PRESETS
from training.train.step import setup_state, train_step

preset = TRAIN_PRESETS["datacomp-small"]
tok = tokenizer_from_spec(preset.tokenizer)
ids = tok.encode_batch([sys.argv[1]], 77)[0]
cfg = merge(preset, {"global_batch_size": 2, "samples_seen": 20, "scaling": {"use_gpu": False, "num_workers": 1}})
state = setup_state(cfg, tok, torch.device("cpu"), 0)
rng = np.random.default_rng(0)
tokens = torch.from_numpy(tok.encode_batch([sys.argv[1], "two dogs on a beach"], 77))
batch = {"images": torch.from_numpy(rng.integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)), "tokens": tokens}
terms, _ = train_step(state, batch)
print(json.dumps({"ids": ids[ids != tok.pad_id].tolist(), "model": cfg.model, "loss": float(terms["total"]),
                  "loss_name": cfg.loss.name, "step": state.step}))
"""


def dockerfile_copies() -> list[str]:
    """The project paths cluster/Dockerfile copies into the image."""
    text = (ROOT / "cluster" / "Dockerfile").read_text()
    return [p for line in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M) for p in line.split()]


def test_the_image_installs_once_and_no_node_installs_at_boot() -> None:
    text = (ROOT / "cluster" / "Dockerfile").read_text()
    assert re.search(r"^RUN .*bash cluster/install\.sh", text, re.M)
    assert set(dockerfile_copies()) >= {
        "pyproject.toml",
        "README.md",
        "pipeline",
        "training",
        "jobs",
        "cluster",
    }
    aws = yaml.safe_load((ROOT / "cluster" / "aws.yaml").read_text())
    commands = [*aws["setup_commands"], *aws["head_setup_commands"], *aws["worker_setup_commands"]]
    commands += [
        *aws["initialization_commands"],
        *aws["head_start_ray_commands"],
        *aws["worker_start_ray_commands"],
    ]
    assert not [c for c in commands if "pip " in c or "install" in c], commands
    install = (ROOT / "cluster" / "install.sh").read_text()
    assert "open_clip_torch" in install and "torch==" in install
    # prolip-b16 names its tokenizer, and the image caches it.
    from training.config import TRAIN_PRESETS

    assert TRAIN_PRESETS["prolip-b16"].tokenizer == "hf-hub:timm/ViT-B-16-SigLIP"
    assert "PREFETCH_HUB_TOKENIZERS=1" in text and "hf-hub:timm/ViT-B-16-SigLIP" in install


@pytest.mark.slow  # a fresh venv of ~2 GB from the pip cache: 1.5–3 minutes on 2 cores
def test_the_image_install_in_a_fresh_venv_tokenizes_with_clip_and_trains_a_step(tmp_path) -> None:
    project = tmp_path / "prolip-ray"
    project.mkdir()
    for name in dockerfile_copies():  # exactly what the image gets
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, project / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, project / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
           "PIP": str(bin_dir / "pip"), "PYTHON": str(bin_dir / "python"), "PIP_CACHE_OK": "1",
           "NO_ALBUMENTATIONS_UPDATE": "1"}  # fmt: skip
    done = subprocess.run(
        ["bash", "cluster/install.sh", "."], cwd=project, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "CLIP vocabulary:" in done.stdout
    run = subprocess.run([str(bin_dir / "python"), "-c", IN_VENV, CAPTION], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ids"] == CLIP_IDS  # open_clip's ids for the caption
    assert got["model"] == "ViT-B-32" and got["loss_name"] == "prolip" and got["step"] == 1
    assert got["loss"] == got["loss"] and abs(got["loss"]) < 1e4  # finite
    # The venv is the install's own: the project resolves from the copy, not from this checkout.
    where = subprocess.run([str(bin_dir / "python"), "-c", "import pipeline; print(pipeline.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
    assert str(project) in where.stdout and sys.prefix not in where.stdout
