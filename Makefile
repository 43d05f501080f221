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
# (`make venv-mcore-0.19`, `make test-mcore-0.19`). It holds torch, megatron-core and what the
# tests import, not this package: the tests import it from this source tree (PYTHONPATH), so a
# venv can live outside the work tree and outlive it (CI: MCORE_VENVS=~/.cache/...), and it is
# rebuilt only when what it should hold (MCORE_SPEC, kept in its .installed) changes.
# The 0.17+ wheels declare Requires-Python >=3.12 but install and import on 3.11: only
# megatron-core itself is installed with --ignore-requires-python; its dependencies resolve
# normally, so pip picks releases with 3.11 wheels (ignoring it everywhere builds numpy 2.5 from
# source and fails). 0.18+ import triton (CPU wheel, no CUDA) at module level from their
# pipeline schedules. six and regex: what Megatron-LM's training code imports.
MCORE_MINORS := 0.16 0.17 0.18 0.19
MCORE_PIN_0.16 := 0.16.1
MCORE_PIN_0.17 := 0.17.1
MCORE_PIN_0.18 := 0.18.2
MCORE_PIN_0.19 := 0.19.2
MCORE_EXTRA_0.18 := triton
MCORE_EXTRA_0.19 := triton
MCORE_VENVS ?= .
MCORE_VENV = $(MCORE_VENVS)/.venv-mcore-$*
MCORE_SPEC = $(strip $(TORCH) megatron-core==$(MCORE_PIN_$*) pytest pyyaml numpy six regex $(MCORE_EXTRA_$*))
# The megatron tests that need no checkout: install() on every layout, the CPU runtime, the
# release table, and Megatron-LM's own training loop from the wheel (0.17+), also preempted
# (SIGTERM with --exit-signal-handler: 3 of its 10 timings; the other 7 with PYTEST_ARGS='-m slow').
MCORE_TESTS ?= tests/test_megatron_integration.py tests/test_megatron_cpu.py \
	tests/test_megatron_versions.py tests/test_megatron_training_loop.py tests/test_megatron_moe.py \
	tests/test_args_launcher.py::test_the_stand_in_has_the_shape_of_the_real_megatron_training \
	tests/test_megatron_preemption.py tests/test_megatron_loop_errors.py

# (venv-mcore-% and test-mcore-% are pattern rules: make skips implicit rules for .PHONY names.)
.PHONY: install demo test test-all bench lint clean gpu-check gpu-perf gpu-bundle venv-megatron-deepspeed test-megatron-deepspeed test-megatron-main

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
	$(PY) -m pytest -q -m "not slow" --durations=25 $(PYTEST_ARGS) tests

test-all: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: install
	$(VENV)/bin/ssdtrain bench

# The GPU check runs on a bare GPU box: no venv, no network, the wheels of `make gpu-bundle` in
# .whl/ (see docs/gpu-check.md). Exit status 0 only when every target passed. GPU_CHECK_DRY=1
# prints the time plan only. Options: GPU_CHECK_ARGS="--out DIR --scratch DIR ...";
# ONLY=steps (comma-separated) or ONLY=after-perf (every step but measure: the second GPU call
# after `make gpu-perf`, docs/gpu-check.md). The run leaves one archive under --out.
GPU_CHECK_ARGS ?=
ONLY ?=
gpu-check:
	PYTHON=$(PYTHON) scripts/gpu_check.sh $(if $(ONLY),--only $(ONLY)) $(GPU_CHECK_ARGS)

# Where the GPU's time goes, on the same box in at most 198 s: the measure step alone at an
# IO-bound and a compute-bound shape, every strategy, a Chrome trace of every point and its
# excess over the bound split by cause (docs/gpu-check.md). GPU_CHECK_DRY=1 prints the time plan
# only. Options: GPU_PERF_ARGS="--out DIR ...".
GPU_PERF_ARGS ?=
gpu-perf:
	PYTHON=$(PYTHON) GPU_SCRIPT=gpu_perf scripts/gpu_check.sh $(GPU_PERF_ARGS)

# The wheels gpu-check needs on that box (cp312, manylinux x86_64; not torch, which the box has),
# into .whl/, proven complete by an offline resolve and kept under 60 MiB (ssdtrain_megatron/tools/gpucheck/gpu_bundle.py).
# Needs network and pip >= 22.2; no GPU.
GPU_BUNDLE_DEST ?= .whl
gpu-bundle:
	$(PYTHON) -m ssdtrain_megatron.tools.gpucheck.gpu_bundle --dest $(GPU_BUNDLE_DEST)

lint: install
	$(PY) -m compileall -q ssdtrain_megatron tests
	$(PIP) install -q pyflakes
	$(PY) -m pyflakes ssdtrain_megatron tests

venv-mcore-%:
	@test -n "$(MCORE_PIN_$*)" || { echo "no megatron-core pin for '$*' (have: $(MCORE_MINORS))"; exit 2; }
	@if grep -qxF "$(MCORE_SPEC)" "$(MCORE_VENV)/.installed" 2>/dev/null; then \
		echo "$(MCORE_VENV): megatron-core $(MCORE_PIN_$*) ready"; \
	else \
		set -e; rm -rf "$(MCORE_VENV)"; \
		echo "$(MCORE_VENV): installing $(MCORE_SPEC)"; \
		$(PYTHON) -m venv "$(MCORE_VENV)"; \
		"$(MCORE_VENV)/bin/python" -m pip install -q "$(TORCH)"; \
		"$(MCORE_VENV)/bin/python" -m pip install -q --ignore-requires-python --no-deps \
			"megatron-core==$(MCORE_PIN_$*)"; \
		"$(MCORE_VENV)/bin/python" -c "from importlib.metadata import requires; \
			print('\n'.join(r for r in requires('megatron-core') or [] if 'extra ==' not in r))" \
			> "$(MCORE_VENV)/megatron-core-requires.txt"; \
		"$(MCORE_VENV)/bin/python" -m pip install -q -r "$(MCORE_VENV)/megatron-core-requires.txt" \
			$(filter-out $(TORCH) megatron-core==%,$(MCORE_SPEC)); \
		echo "$(MCORE_SPEC)" > "$(MCORE_VENV)/.installed"; \
	fi

test-mcore-%: venv-mcore-%
	PYTHONPATH="$(CURDIR)" "$(MCORE_VENV)/bin/python" -m pytest -q -m "not slow" $(PYTEST_ARGS) $(MCORE_TESTS)

# Megatron-LM main (megatron-core 0.20, no wheel yet; docs/megatron.md): its own pretrain_gpt.py
# with its checkout's megatron/core first on the path, in the 0.19 venv, whose wheel supplies
# triton and the compiled dataset helpers (built from the same helpers.cpp: the test checks).
# First the release table against the checkout's megatron/core imported in-process (its 0.20
# entry, and a faked newer minor run with --ssd-offload-allow-untested-megatron).
# MEGATRON_LM_DIR: a Megatron-LM main checkout (CI cannot fetch one). About 15 minutes on 2 cores.
test-megatron-main: venv-mcore-0.19
	@test -n "$(MEGATRON_LM_DIR)" || { echo "set MEGATRON_LM_DIR to a Megatron-LM main checkout"; exit 2; }
	PYTHONPATH="$(MEGATRON_LM_DIR):$(CURDIR)" "$(MCORE_VENVS)/.venv-mcore-0.19/bin/python" \
		-m pytest -q $(PYTEST_ARGS) tests/test_megatron_versions.py
	MEGATRON_LM_DIR="$(MEGATRON_LM_DIR)" PYTHONPATH="$(CURDIR)" "$(MCORE_VENVS)/.venv-mcore-0.19/bin/python" \
		-m pytest -q -rs $(PYTEST_ARGS) tests/test_pretrain_gpt.py tests/test_patches.py

# Megatron-DeepSpeed (deepspeedai/Megatron-DeepSpeed master, 4efb479d) imports
# deepspeed.compression.compress, which DeepSpeed 0.19.8 removed: its opt-in test
# (MEGATRON_DEEPSPEED_DIR) runs in a venv with DeepSpeed 0.19.0. pybind11: the checkout builds
# its C++ dataset helpers with it on first use; its tokenizer module imports transformers.
MDS_DEEPSPEED ?= deepspeed==0.19.0
MDS_VENV ?= .venv-megatron-deepspeed
MDS_SPEC = $(strip $(TORCH) $(MDS_DEEPSPEED) pybind11 transformers pytest pyyaml numpy six regex)

venv-megatron-deepspeed:
	@if grep -qxF "$(MDS_SPEC)" "$(MDS_VENV)/.installed" 2>/dev/null; then \
		echo "$(MDS_VENV): $(MDS_DEEPSPEED) ready"; \
	else \
		set -e; rm -rf "$(MDS_VENV)"; \
		$(PYTHON) -m venv "$(MDS_VENV)"; \
		"$(MDS_VENV)/bin/python" -m pip install -q "$(TORCH)"; \
		"$(MDS_VENV)/bin/python" -m pip install -q $(filter-out $(TORCH),$(MDS_SPEC)); \
		echo "$(MDS_SPEC)" > "$(MDS_VENV)/.installed"; \
	fi

test-megatron-deepspeed: venv-megatron-deepspeed
	@test -n "$(MEGATRON_DEEPSPEED_DIR)" || { echo "set MEGATRON_DEEPSPEED_DIR to a Megatron-DeepSpeed checkout"; exit 2; }
	PYTHONPATH="$(CURDIR)" "$(MDS_VENV)/bin/python" -m pytest -q $(PYTEST_ARGS) \
		tests/test_megatron_deepspeed_pretrain.py tests/test_patches.py

clean:
	rm -rf $(VENV) $(MDS_VENV) $(addprefix .venv-mcore-,$(MCORE_MINORS)) build *.egg-info $(DEMO_DIR)
