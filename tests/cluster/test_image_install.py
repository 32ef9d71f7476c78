"""The cluster image's install, run for real: cluster/install.sh in a fresh venv on what cluster/Dockerfile
copies, with the extras its RUN line names, then CLIP's BPE, one train step of datacomp-small's model and
the first GPU check's CPU fallback (``bash tests/gpu_check.sh --cpu``) inside that venv; and
cluster/image.sh (``make image``), which builds, pushes and names the image in the cluster configs, run with
a stand-in docker client that records what it was asked.

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


def dockerfile_install_env() -> dict[str, str]:
    """The variables the Dockerfile's RUN line sets for cluster/install.sh (the hub prefetch left out: no hub
    here)."""
    line = re.search(
        r"^RUN (.*)bash cluster/install\.sh", (ROOT / "cluster" / "Dockerfile").read_text(), re.M
    )
    env = dict(kv.split("=", 1) for kv in line.group(1).split())
    env.pop("PREFETCH_HUB_TOKENIZERS", None)
    return env


def test_the_image_installs_once_and_no_node_installs_at_boot() -> None:
    text = (ROOT / "cluster" / "Dockerfile").read_text()
    assert re.search(r"^RUN .*bash cluster/install\.sh", text, re.M)
    # the project, and what the first GPU check runs: the tests, the benchmarks and the test extras
    assert set(dockerfile_copies()) >= {
        "pyproject.toml",
        "README.md",
        "pipeline",
        "training",
        "jobs",
        "cluster",
        "tests",
        "bench",
    }
    assert dockerfile_install_env() == {"INSTALL_EXTRAS": "test"}
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
           "NO_ALBUMENTATIONS_UPDATE": "1", **dockerfile_install_env()}  # fmt: skip
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
    # The first GPU check runs in the image as it is: its CPU fallback here, from the copied bench/ and tests/.
    check = subprocess.run(["bash", "tests/gpu_check.sh", "--cpu", "--out", str(tmp_path / "gpu_check.json")],
                           cwd=project, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert check.returncode == 0 and "all checks passed" in check.stdout, (
        check.stdout[-2000:] + check.stderr[-2000:]
    )
    tests = subprocess.run([str(bin_dir / "python"), "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                            "tests/training/train/test_gpu_step.py"], cwd=project, env=env, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert tests.returncode == 0 and "skipped" in tests.stdout, tests.stdout[-2000:] + tests.stderr[-2000:]


def test_make_image_builds_pushes_and_names_the_image_in_every_config(tmp_path) -> None:
    """cluster/image.sh on a copy of cluster/, with a docker client that records its arguments (there is no
    docker here): build from cluster/Dockerfile, push, then every image name in the configs is the new one;
    a failed push leaves the configs as they were."""
    project = tmp_path / "p"
    shutil.copytree(ROOT / "cluster", project / "cluster")
    calls = tmp_path / "docker.calls"
    docker = tmp_path / "docker"
    docker.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n[ "$1" != push ] || [ -z "$FAIL_PUSH" ]\n')
    docker.chmod(0o755)
    name = "registry.example/team/prolip-ray:0.2.0"
    env = {**os.environ, "DOCKER": str(docker)}
    failed = subprocess.run(["bash", "cluster/image.sh", name], cwd=project, env={**env, "FAIL_PUSH": "1"},
                            capture_output=True, text=True)  # fmt: skip
    assert failed.returncode != 0 and name not in (project / "cluster" / "aws.yaml").read_text()
    done = subprocess.run(
        ["bash", "cluster/image.sh", name], cwd=project, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert calls.read_text().splitlines()[-2:] == [f"build -f cluster/Dockerfile -t {name} .", f"push {name}"]
    aws = yaml.safe_load((project / "cluster" / "aws.yaml").read_text())
    assert aws["docker"]["image"] == name
    pod = yaml.safe_load((project / "cluster" / "kuberay" / "raycluster.yaml").read_text())["spec"]
    groups = [pod["headGroupSpec"], *pod["workerGroupSpecs"]]
    assert {c["image"] for g in groups for c in g["template"]["spec"]["containers"]} == {name}
    # nothing else changed: the configs equal the originals but for the image names
    before = yaml.safe_load((ROOT / "cluster" / "aws.yaml").read_text())
    assert {**aws, "docker": {**aws["docker"], "image": ""}} == {
        **before,
        "docker": {**before["docker"], "image": ""},
    }
    bad = subprocess.run(
        ["bash", "cluster/image.sh", "x y"], cwd=project, env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "not an image name" in bad.stderr
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^image:\n(\t.*\n)*\tbash cluster/image\.sh \$\(IMAGE\)", makefile, re.M)
