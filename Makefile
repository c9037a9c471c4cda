# The two set-up commands: `make demo` and `make test`. Each creates .venv and installs on a fresh
# machine. torch is installed first, pinned: an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: demo test test-gpu clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hccompile demo

# CPU suite: Triton kernels run in Triton's interpreter; tests marked `gpu` are skipped.
test: $(STAMP)
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest -q -m "not gpu" --durations=15 $(PYTEST_ARGS)

# The whole suite on a CUDA machine (the device's command; not part of CI). Uses the machine's own
# python3 (its preinstalled torch and Triton), installs this package there without dependencies (the
# `hc` entry point), and writes benchmarks/results/gpu-suite.txt. A copied tree may have no .git:
# pass the commit, `make test-gpu COMMIT=<sha>`. GPU_MEMORY_GIB is the bound each test must fit in
# (14 workers x 4.75 GiB plus their CUDA contexts fit an 80 GB card). tests/gpu_durations.json (seconds
# per test, per file, from an earlier run; refresh it from .gpu-suite/durations.json) starts the
# slowest chunks first.
GPU_PYTHON ?= python3
GPU_WORKERS ?= 14
GPU_MEMORY_GIB ?= 4.75
GPU_REPORT ?= benchmarks/results/gpu-suite.txt
GPU_TESTS ?= tests
GPU_PYTEST_ARGS ?=
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null)

test-gpu:
	@test -n "$(COMMIT)" || { echo "make test-gpu: no .git here; pass COMMIT=<sha>"; exit 2; }
	$(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation --no-index -e .
	$(GPU_PYTHON) tests/parallel.py -n $(GPU_WORKERS) --gpu-memory-gib $(GPU_MEMORY_GIB) \
		--report $(GPU_REPORT) --commit $(COMMIT) --log-dir .gpu-suite \
		--durations tests/gpu_durations.json \
		$(GPU_TESTS) -- $(GPU_PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
