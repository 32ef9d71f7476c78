# Two user-facing targets: `make demo` and `make test`; both install on their own. `make image` builds,
# pushes and names the cluster image (docs/cluster.md, step 1).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
export NO_ALBUMENTATIONS_UPDATE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: install demo demo-seeds demo-selection test test-fast cluster-test lint bench image clean

# Two stamps: `make demo` installs what the track runs; `make test` adds the test and lint tools.
# pip would byte-compile every module on one core; compileall -j0 does it on every core instead (~20 s
# against ~40 s on 2 cores), skipping package test suites. As with pip, a file that does not compile on this
# Python (torch ships 3.12-only test files) is skipped, hence `|| true`.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin torch first so pip takes the CPU wheel rather than a CUDA build.
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e .
	# CLIP's BPE vocabulary ships in open_clip_torch; --no-deps keeps its torchvision/timm (CUDA builds) out.
	$(BIN)/pip install -q --no-compile --no-deps open_clip_torch==3.3.0
	$(BIN)/python -m compileall -qq -j0 -x '/tests?/' $(VENV)/lib || true
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-compile -e '.[test,dev]'
	$(BIN)/python -m compileall -qq -j0 -x '/tests?/' $(VENV)/lib || true
	touch $(TEST_STAMP)

# open_clip's own factory (create_model_and_transforms) needs torchvision, whose PyPI build does not load
# beside the CPU torch: the tests run it in a child process with torchvision 0.28.0 (torch 2.13's) from a
# directory off the venv's path (tests/fixtures/open_clip_real.py).
OC_DEPS := $(VENV)/open_clip_deps/.installed
$(OC_DEPS): $(STAMP)
	$(BIN)/pip install -q --no-compile --no-deps --target $(VENV)/open_clip_deps torchvision==0.28.0
	touch $(OC_DEPS)

install: $(TEST_STAMP) $(OC_DEPS)

demo: $(STAMP)
	$(BIN)/python -m jobs.track --preset demo

# Three scorer seeds of the demo (seed 0 is `make demo`'s run, resumed if it finished) and one table over
# them: the σ² figures move more between training seeds than within one eval set (docs/track.md, "Over seeds").
demo-seeds: $(STAMP)
	$(BIN)/python -m jobs.track --preset demo
	for k in 1 2; do \
	  $(BIN)/python -m jobs.track --preset demo --set "seeds=[$$k]" --set output=runs/demo-seed$$k || exit 1; \
	done
	$(BIN)/python -m jobs.track.seeds runs/demo runs/demo-seed1 runs/demo-seed2 --out runs/seeds.md

# The uncertainty-native selection methods against csd and a CLIP-score fraction of the same size, over
# scorer seeds 0-2 (docs/track.md, "demo-selection"; about 15 minutes a seed on 2 cores).
demo-selection: $(STAMP)
	$(BIN)/python -m jobs.track --preset demo-selection
	for k in 1 2; do \
	  $(BIN)/python -m jobs.track --preset demo-selection --set "seeds=[$$k]" --set output=runs/demo-selection-seed$$k || exit 1; \
	done
	$(BIN)/python -m jobs.track.seeds runs/demo-selection runs/demo-selection-seed1 runs/demo-selection-seed2 \
	  --out runs/selection.md

# Lint first, then every test; PROLIP_STRICT_SKIPS=1 turns a skip on a missing optional dependency into a
# failure (only the GPU tests may skip here).
test: lint $(OC_DEPS)
	PROLIP_STRICT_SKIPS=1 $(BIN)/python -m pytest -q -ra --durations=30

# The cluster tests alone: a Ray head and worker hosts in Linux namespaces on this machine, S3 the only
# shared storage; needs root (docs/cluster.md, "Try it on one machine").
cluster-test: $(TEST_STAMP)
	PROLIP_STRICT_SKIPS=1 $(BIN)/python -m pytest -q -ra -m cluster tests/cluster

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not ray and not slow"

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# `make bench` lists the benchmarks; `make bench B="NAME ARGS"` runs one and regenerates docs/benchmarks.md.
bench: $(TEST_STAMP)
	$(BIN)/python -m bench $(B)

# The cluster image: `make image IMAGE=<registry>/prolip-ray:0.1.0` (needs docker and a registry login).
image:
	@test -n "$(IMAGE)" || { echo "usage: make image IMAGE=<registry>/prolip-ray:<tag>" >&2; exit 2; }
	bash cluster/image.sh $(IMAGE)

clean:
	rm -rf $(VENV) .pytest_cache
