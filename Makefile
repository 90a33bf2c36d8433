# Two entry points: `make build` (set up + run the default pipeline) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: build test test-fast test-slow setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on CPU machines this is the local CPU build (no multi-GB CUDA download)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(STAMP)

build: $(STAMP)
	$(PY) -m pipeline build

# Two steps: the default run (`not slow`, ~6 min on 2 cores), then the slow tests (the SmolLM2 default build,
# kill -9 injection, the soak run, server faults; ~6 min). `make test` runs both, as CI does.
test: test-fast test-slow

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf .store engines/*/ triton_repo/*/ bundles reports
