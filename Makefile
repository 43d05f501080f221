# One-command set-up: every target that needs the virtualenv depends on `install`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Pinned: the CPU build on this kind of machine. A plain `torch` pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
# Extras that work on a CPU-only machine (gds and te need CUDA; aio installs DeepSpeed, whose
# aio op builds on first use where libaio-dev is installed).
EXTRAS ?= test,megatron,aio
DEMO_DIR ?= ./ssd-offload-demo
PYTEST_ARGS ?=

.PHONY: install demo test test-all bench lint clean gpu-check

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $@

demo: install
	$(VENV)/bin/ssdtrain demo --dir $(DEMO_DIR)

test: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

test-all: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: install
	$(VENV)/bin/ssdtrain bench

# The GPU check runs on a bare GPU box: no venv, no network (see README "gpu-check").
# GPU_CHECK_DRY=1 runs only what needs no GPU. Options: GPU_CHECK_ARGS="--out DIR ...".
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHON=$(PYTHON) scripts/gpu_check.sh $(GPU_CHECK_ARGS)

lint: install
	$(PY) -m compileall -q ssdtrain_megatron tests
	$(PIP) install -q pyflakes
	$(PY) -m pyflakes ssdtrain_megatron tests

clean:
	rm -rf $(VENV) build *.egg-info $(DEMO_DIR)
