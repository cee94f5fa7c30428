# moe_dispatch: `make demo` runs the main job, `make test` runs the test suite.
# Both build the Python 3.12 virtual environment first (reused while requirements/dev.txt
# is unchanged) and install this package into it (compiling csrc/ when nvcc is present).

VENV        ?= .venv
# pyenv machines need PYENV_VERSION to expose python3.12; elsewhere it is ignored.
PYTHON312   ?= $(shell PYENV_VERSION=3.12.1 python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null)
PY          := $(VENV)/bin/python
PYTEST_ARGS ?=
DEMO_ARGS   ?=
TRAIN_ARGS  ?=
SIMCLUSTER_ARGS ?=

.PHONY: venv install demo test train simcluster gpu-wheels gpu-check-dry clean

$(VENV)/.deps: requirements/dev.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (install python3.12, or pyenv 3.12.x)"; exit 1; }
	rm -rf $(VENV)
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/dev.txt
	touch $@

venv: $(VENV)/.deps

# Editable install; builds moe_dispatch._C when nvcc is found (MOE_DISPATCH_REQUIRE_CUDA=1 makes that mandatory).
$(VENV)/.installed: $(VENV)/.deps setup.py pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	@# pip -q hides the build's own lines; say in one line what was installed.
	@$(PY) -c 'from moe_dispatch._ext import extension_status as s; print("moe_dispatch._C:", s())'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/moe-dispatch-bench $(DEMO_ARGS)

test: install
	$(PY) -m pytest python_tests -rs $(PYTEST_ARGS)

# Megatron-Core GPT with MoE layers on CPU (2 nodes x 2): alltoall vs custom from one seed.
train: install
	$(PY) benchmarks/train_megatron_moe.py $(TRAIN_ARGS)

# Simulated multi-node cluster (network namespaces + tc; needs root and iproute2): benchmark on 2 and
# 4 nodes, then the fault drills. E.g. make simcluster SIMCLUSTER_ARGS="--models deepseek-v3 --ratio 40"
simcluster: install
	$(PY) -m benchmarks.simcluster bench $(SIMCLUSTER_ARGS)
	$(PY) -m benchmarks.simcluster faults

# Wheels the lent GPU machine lacks (it has no package index): carried as .whl by the device tool.
gpu-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform any \
	    -d .whl megatron-core==$$(sed -n 's/^megatron-core==//p' requirements/dev.txt)

# The one-shot GPU script, build + quick CPU tests only: proves it works before a GPU is at hand.
gpu-check-dry: install
	benchmarks/gpu_check.sh --dry-run --out bench_results/gpu_check_dry

clean:
	rm -rf build dist *.egg-info $(VENV) moe_dispatch/_C*.so
