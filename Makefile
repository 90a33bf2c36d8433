# Two entry points: `make build` (set up + run the default pipeline) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: build test test-all setup clean

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

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf .store engines/*/ triton_repo/*/ bundles reports
