# moe_dispatch: `make demo` runs the main job, `make test` runs the test suite.
# Both build the Python 3.12 virtual environment first (reused while requirements/dev.txt
# is unchanged) and install this package into it (compiling csrc/ when nvcc is present).
# `make test` then runs `test-compat`: this package's wheel installed into a Python 3.11
# environment with megatron-core 0.16.1 and torch 2.13 (.venv-compat, requirements/compat.txt).

VENV        ?= .venv
# pyenv machines need PYENV_VERSION to expose python3.12; elsewhere it is ignored.
PYTHON312   ?= $(shell PYENV_VERSION=3.12.1 python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null || python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null)
PY          := $(VENV)/bin/python
PYTEST_ARGS ?=
# The compatibility environment: Python 3.11, requirements/compat.txt, this package from its wheel.
VENV_COMPAT ?= .venv-compat
PYTHON311   ?= $(shell PYENV_VERSION=3.11.7 python3.11 -c 'import sys; print(sys.executable)' 2>/dev/null || python3.11 -c 'import sys; print(sys.executable)' 2>/dev/null)
CPY         := $(abspath $(VENV_COMPAT))/bin/python
COMPAT_DIR  := build/compat
# What test-compat runs from the installed wheel: every Megatron test, the install guard and a core
# subset (oracle, Buffer dispatch/combine in gloo worlds, Triton kernels under the interpreter, errors);
# COMPAT_K leaves out the 8-rank dispatch worlds (the Megatron worlds and the 2- and 4-rank ones cover it).
COMPAT_TESTS ?= test_installed_wheel.py test_autoload.py test_megatron.py test_megatron_config.py test_megatron_overlap.py \
                test_megatron_matrix.py test_megatron_bridge.py \
                test_reference.py test_dispatch.py test_permute.py test_layout.py test_errors.py test_env.py
COMPAT_K    ?= not w8
COMPAT_PYTEST_ARGS ?=
# One line saying what a test run runs against (versions from the metadata: importing megatron is slow and loud).
define VERSIONS_PY
import importlib.metadata as md, platform, sys
import moe_dispatch
print(f"== {sys.argv[1]}: Python {platform.python_version()}, torch {md.version('torch')}, "
      f"megatron-core {md.version('megatron-core')}, moe_dispatch {moe_dispatch.__version__} from {moe_dispatch.__file__} ==",
      flush=True)
endef
export VERSIONS_PY
# A pytest.ini holding only the markers that pyproject.toml registers.
define MARKERS_INI_PY
import tomllib
markers = tomllib.load(open("pyproject.toml", "rb"))["tool"]["pytest"]["ini_options"]["markers"]
print("[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in markers), end="")
endef
export MARKERS_INI_PY
DEMO_ARGS   ?=
TRAIN_ARGS  ?=
SIMCLUSTER_ARGS ?=

# A virtual environment's recipe: $(call make_venv,DIR,PYTHON,VERSION,VENV_PYTHON[,NO_DEPS]) makes DIR with
# PYTHON (Python VERSION) and installs the target's first prerequisite (a requirements file) with DIR's
# VENV_PYTHON, then the requirements file NO_DEPS (if given) without dependencies.
define make_venv
	@test -n "$(2)" || { echo "error: Python $(3) not found (install python$(3), or pyenv $(3).x)"; exit 1; }
	rm -rf $(1)
	$(2) -m venv $(1)
	$(4) -m pip install -q --upgrade pip
	$(4) -m pip install -q -r $<
	$(if $(5),$(4) -m pip install -q --no-deps -r $(5))
	touch $@
endef

.PHONY: venv install lint demo test test-main test-compat venv-compat train simcluster gpu-wheels gpu-check-dry clean

# Megatron-Bridge (requirements/bridge.txt) without its dependencies: see that file.
$(VENV)/.deps: requirements/dev.txt requirements/bridge.txt
	$(call make_venv,$(VENV),$(PYTHON312),3.12,$(PY),requirements/bridge.txt)

venv: $(VENV)/.deps

# Editable install; builds moe_dispatch._C when nvcc is found (MOE_DISPATCH_REQUIRE_CUDA=1 makes that mandatory).
$(VENV)/.installed: $(VENV)/.deps setup.py pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	@# pip -q hides the build's own lines; say in one line what was installed.
	@$(PY) -c 'from moe_dispatch._ext import extension_status as s; print("moe_dispatch._C:", s())'
	touch $@

install: $(VENV)/.installed

# ruff for Python (pyproject.toml's [tool.ruff]) and clang-format for csrc/ (csrc/.clang-format), as pinned
# in requirements/dev.txt. .ci/run runs this before the tests.
CSRC_FILES = $(shell git ls-files 'csrc/*.h' 'csrc/*.cuh' 'csrc/*.cpp' 'csrc/*.cu' 2>/dev/null)
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CSRC_FILES)

demo: install
	$(VENV)/bin/moe-dispatch-bench $(DEMO_ARGS)

# Both parts; `make test-main` / `make test-compat` run one. PYTEST_ARGS goes to the main part only,
# COMPAT_PYTEST_ARGS to the compatibility part.
test: test-main test-compat

test-main: install
	@$(PY) -c "$$VERSIONS_PY" "make test-main: the whole suite, moe_dispatch editable from the source tree"
	$(PY) -m pytest python_tests -rs $(PYTEST_ARGS)

$(VENV_COMPAT)/.deps: requirements/compat.txt
	$(call make_venv,$(VENV_COMPAT),$(PYTHON311),3.11,$(CPY))

venv-compat: $(VENV_COMPAT)/.deps

# The wheel is built by the compatibility environment's Python (the extension is per Python version) and
# installed like a user's (not editable) each run; the tests run from a copy of python_tests/ outside the
# source tree, so `import moe_dispatch` can only find the installed wheel (MOE_DISPATCH_EXPECT_INSTALLED=1
# makes python_tests/conftest.py check that).
test-compat: venv-compat
	rm -rf $(COMPAT_DIR)
	mkdir -p $(COMPAT_DIR)/stage
	@# setuptools' staging folders under build/compat (not the build/ that other builds share); CMake's tree stays
	@# in build/cmake-<python>-<key>, so rebuilds of csrc/ are incremental
	printf '[build]\nbuild_base = %s\n[egg_info]\negg_base = %s\n' $(abspath $(COMPAT_DIR)/stage) \
	    $(abspath $(COMPAT_DIR)/stage) > $(COMPAT_DIR)/staging.cfg
	DIST_EXTRA_CONFIG=$(abspath $(COMPAT_DIR)/staging.cfg) \
	    $(CPY) -m pip wheel -q --no-deps --no-build-isolation -w $(COMPAT_DIR)/wheel .
	$(CPY) -m pip install -q --no-deps --force-reinstall $(COMPAT_DIR)/wheel/moe_dispatch-*.whl
	mkdir -p $(COMPAT_DIR)/tests
	cp -r python_tests $(COMPAT_DIR)/tests/
	find $(COMPAT_DIR)/tests -name __pycache__ -prune -exec rm -rf {} +
	@# its own rootdir: no settings from the source tree but the markers of pyproject.toml
	$(CPY) -c "$$MARKERS_INI_PY" > $(COMPAT_DIR)/tests/pytest.ini
	@cd $(COMPAT_DIR)/tests && $(CPY) -c "$$VERSIONS_PY" "make test-compat: Megatron tests and a core subset, moe_dispatch from its wheel"
	cd $(COMPAT_DIR)/tests && $(CPY) -m moe_dispatch.env
	cd $(COMPAT_DIR)/tests && MOE_DISPATCH_EXPECT_INSTALLED=1 $(CPY) -m pytest -rs -p no:cacheprovider \
	    $(addprefix python_tests/,$(COMPAT_TESTS)) -k "$(COMPAT_K)" $(COMPAT_PYTEST_ARGS)

# Megatron-Core GPT with MoE layers on CPU (2 nodes x 2): alltoall vs custom from one seed.
train: install
	$(PY) benchmarks/train_megatron_moe.py $(TRAIN_ARGS)

# Simulated multi-node cluster (network namespaces + tc; needs root and iproute2): benchmark on 2 and
# 4 nodes, then the fault drills. E.g. make simcluster SIMCLUSTER_ARGS="--models deepseek-v3 --ratio 40"
simcluster: install
	$(PY) -m benchmarks.simcluster bench $(SIMCLUSTER_ARGS)
	$(PY) -m benchmarks.simcluster faults

# Wheels a GPU machine without network lacks (megatron-core), into .whl, which gpu_check.sh installs from.
gpu-wheels: venv
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform any \
	    -d .whl megatron-core==$$(sed -n 's/^megatron-core==//p' requirements/dev.txt)

# The one-shot GPU script, build + quick CPU tests only: proves it works before a GPU is at hand.
gpu-check-dry: install
	benchmarks/gpu_check.sh --dry-run --out bench_results/gpu_check_dry

clean:
	rm -rf build dist *.egg-info $(VENV) $(VENV_COMPAT) moe_dispatch/_C*.so

# The wheel into dist/, built with the dev environment's tools (no build isolation), so the CMake tree
# under build/ is reused and rebuilds are incremental. MOE_DISPATCH_SKIP_CUDA=1 makes it pure Python.
.PHONY: wheel
wheel: venv
	$(PY) -m pip wheel -q --no-build-isolation --no-deps -w dist .
	@ls -t dist/moe_dispatch-*.whl | head -n 1
