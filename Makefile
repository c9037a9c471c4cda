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

clean:
	rm -rf $(VENV) build *.egg-info
