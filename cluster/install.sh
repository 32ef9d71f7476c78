#!/usr/bin/env bash
# The install every cluster node runs, once, when its image is built (cluster/Dockerfile), never at boot:
# this project and every dependency its presets need, with CLIP's BPE vocabulary; INSTALL_EXTRAS=test adds
# the test extras (pytest and what the tests use), which the first GPU check runs (tests/gpu_check.sh).
#   bash cluster/install.sh [PROJECT_DIR]        (pip and python: the environment's own, or $PIP / $PYTHON)
# tests/cluster/test_image_install.py runs this same file in a fresh venv on a CPU machine.
set -euo pipefail
PROJECT="${1:-.}"
PIP="${PIP:-pip}"
PYTHON="${PYTHON:-python}"
OPTS=(--no-cache-dir --disable-pip-version-check)
[ -n "${PIP_CACHE_OK:-}" ] && OPTS=(--disable-pip-version-check)  # tests reuse the machine's wheel cache
# torch first, pinned: on a GPU image PyPI's wheel is the CUDA build; on a CPU machine the CPU wheel on disk
# (a bare requirement there would pull the newest CUDA build and several GB of CUDA packages).
"$PIP" install "${OPTS[@]}" --no-compile "torch==${TORCH_VERSION:-2.13.0}"
"$PIP" install "${OPTS[@]}" --no-compile -e "$PROJECT${INSTALL_EXTRAS:+[$INSTALL_EXTRAS]}"
# CLIP's BPE vocabulary (datacomp-small's tokenizer) ships in open_clip_torch; --no-deps keeps its
# torchvision/timm out (they are not needed, and torchvision's wheel must match torch exactly).
"$PIP" install "${OPTS[@]}" --no-compile --no-deps "open_clip_torch==3.3.0"
# Fail the build now, not a job later: every preset's tokenizer must load here.
"$PYTHON" -c "from pipeline.ingest.tokenizer import clip_vocab_path; print('CLIP vocabulary:', clip_vocab_path())"
if [ -n "${PREFETCH_HUB_TOKENIZERS:-}" ]; then  # the image build sets it: prolip-b16's SigLIP vocabulary
  "$PYTHON" -c "from pipeline.ingest.tokenizer import tokenizer_from_spec as t; print(t('hf-hub:timm/ViT-B-16-SigLIP').vocab_size)"
fi
