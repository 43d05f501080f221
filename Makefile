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

# One virtualenv per supported megatron-core minor version, for the megatron integration tests
# (`make venv-mcore-0.19`, `make test-mcore-0.19`). The 0.17+ wheels declare Requires-Python
# >=3.12 but install and import on 3.11: hence --ignore-requires-python. 0.18+ import triton
# (CPU wheel, no CUDA) at module level from their pipeline schedules. six and regex: what the
# shipped megatron.training (0.17+) imports. Each venv is reused until setup.py or this file
# changes (CI on one machine keeps them between runs). Only megatron-core itself is installed
# past its Requires-Python: its dependencies resolve normally, so pip picks releases that have
# 3.11 wheels (with --ignore-requires-python everywhere it would build numpy 2.5 from source).
MCORE_MINORS := 0.16 0.17 0.18 0.19
MCORE_PIN_0.16 := 0.16.1
MCORE_PIN_0.17 := 0.17.1
MCORE_PIN_0.18 := 0.18.2
MCORE_PIN_0.19 := 0.19.2
MCORE_EXTRA_0.18 := triton
MCORE_EXTRA_0.19 := triton
# The megatron tests that need no checkout: install(), the CPU training runs, and Megatron-LM's
# own training loop from the wheel (0.17+).
MCORE_TESTS ?= tests/test_megatron_integration.py tests/test_megatron_cpu.py \
	tests/test_megatron_versions.py tests/test_megatron_training_loop.py

# (venv-mcore-% and test-mcore-% are pattern rules: make skips implicit rules for .PHONY names.)
.PHONY: install demo test test-all bench lint clean

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

lint: install
	$(PY) -m compileall -q ssdtrain_megatron tests
	$(PIP) install -q pyflakes
	$(PY) -m pyflakes ssdtrain_megatron tests

# The stamp holds the pin: a venv of another patch release is rebuilt.
venv-mcore-%:
	@test -n "$(MCORE_PIN_$*)" || { echo "no megatron-core pin for '$*' (have: $(MCORE_MINORS))"; exit 2; }
	@grep -qx "$(MCORE_PIN_$*)" .venv-mcore-$*/.installed 2>/dev/null || rm -f .venv-mcore-$*/.installed
	@$(MAKE) --no-print-directory .venv-mcore-$*/.installed

.venv-mcore-%/.installed: setup.py
	$(PYTHON) -m venv .venv-mcore-$*
	.venv-mcore-$*/bin/python -m pip install -q "$(TORCH)"
	.venv-mcore-$*/bin/python -m pip install -q --ignore-requires-python --no-deps \
		"megatron-core==$(MCORE_PIN_$*)"
	.venv-mcore-$*/bin/python -c "from importlib.metadata import requires; \
		print('\n'.join(r for r in requires('megatron-core') or [] if 'extra ==' not in r))" \
		> .venv-mcore-$*/megatron-core-requires.txt
	.venv-mcore-$*/bin/python -m pip install -q -r .venv-mcore-$*/megatron-core-requires.txt \
		six regex $(MCORE_EXTRA_$*)
	.venv-mcore-$*/bin/python -m pip install -q -e ".[test]"
	echo "$(MCORE_PIN_$*)" > $@

test-mcore-%: venv-mcore-%
	.venv-mcore-$*/bin/python -m pytest -q -m "not slow" $(PYTEST_ARGS) $(MCORE_TESTS)

clean:
	rm -rf $(VENV) $(addprefix .venv-mcore-,$(MCORE_MINORS)) build *.egg-info $(DEMO_DIR)
