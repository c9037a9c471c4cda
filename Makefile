# The two set-up commands: `make demo` and `make test`. Each creates .venv and installs on a fresh
# machine. torch is installed first, pinned: an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
STAMP = $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: demo test test-triton-oldest test-gpu clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -c constraints-cpu.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/hccompile demo

# CPU suite: Triton kernels run in Triton's interpreter; tests marked `gpu` are skipped. One pytest
# process kept one of CI's two cores busy (the interpreter and Inductor's C++ compiles are single
# threaded): 40 min in one process at 71f34a6, CI 3095 s in all. tests/parallel.py runs CPU_WORKERS
# processes over chunks of CPU_CHUNK tests, each with one intra-op thread, the slowest files first
# (tests/cpu_durations.json, seconds per test, from .cpu-suite/durations.json of an earlier run): at
# 280e64d 1906 s on this 2-core machine (3621 worker-seconds; a 170 s tail without the ordering).
# TESTS: the paths to run; PYTEST_ARGS: options for every pytest process.
CPU_WORKERS ?= 2
CPU_CHUNK ?= 80
TESTS ?= tests
test: $(STAMP)
	rm -rf .cpu-suite  # a crashed chunk must not find an earlier run's report
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(VENV)/bin/python tests/parallel.py -n $(CPU_WORKERS) --across-files \
		--chunk $(CPU_CHUNK) --log-dir .cpu-suite --durations tests/cpu_durations.json $(TESTS) -- -m "not gpu" $(PYTEST_ARGS) \
		|| { tail -n 300 .cpu-suite/worker*.log; exit 1; }  # the failures' tracebacks

# The kernel and gloo tests in the interpreter of the oldest supported Triton (3.6, the GPU machine's);
# `make test` runs everything on the newest (constraints-cpu.txt). CI runs both. Only Triton differs:
# Triton 3.6 alone is installed (no dependencies: it has none at run time) into TRITON_OLDEST_DIR,
# which goes first on .venv's PYTHONPATH, so the same torch, NumPy and packages run both suites (a
# venv of its own, with a second torch install, took 34 s of set-up on the CI machine; this takes 4 s). HCCOMPILE_EXPECT_TRITON
# makes every pytest process check that it imported that Triton (tests/conftest.py). The NumPy
# pairing that breaks 3.6's interpreter (>= 2.4) is handled by tests/interpreter_compat.py.
# tests/distributed/test_cp_dispatch.py is left out here (it runs in `make test`): with every
# interpreter launch recorded as (kernel, its constexpr values, each argument's dtype or None), the
# 3.6 run at 4a1b6a6 launched 964 distinct ones, all 32 kernels, every @triton.jit helper, and none
# of them only from test_cp_dispatch (30 s of the run's 905 worker-seconds). The gloo tests stay:
# test_cp_gloo_2 alone launches 33 of them (_gate_backward_kernel with BK=16 among them),
# test_cp_gloo_4 four (e.g. _state_forward_kernel GATE=1 with an initial state, BT=16). The record:
# benchmarks/launch_census/ (how) and benchmarks/results/triton36-launches_2026-11-28.txt.
OLDEST_TRITON_VERSION ?= 3.6.0
TRITON_OLDEST_DIR ?= .triton-oldest

$(TRITON_OLDEST_DIR)/.installed-stamp: $(STAMP)
	rm -rf $(TRITON_OLDEST_DIR)
	$(VENV)/bin/python -m pip install -q --no-deps --target $(TRITON_OLDEST_DIR) "triton==$(OLDEST_TRITON_VERSION)"
	touch $@

test-triton-oldest: $(TRITON_OLDEST_DIR)/.installed-stamp
	rm -rf .cpu-suite-oldest
	PYTHONPATH=$(abspath $(TRITON_OLDEST_DIR))$${PYTHONPATH:+:$$PYTHONPATH} HCCOMPILE_EXPECT_TRITON=$(OLDEST_TRITON_VERSION) \
	TRITON_INTERPRET=1 OMP_NUM_THREADS=1 $(VENV)/bin/python tests/parallel.py -n $(CPU_WORKERS) --across-files \
		--chunk $(CPU_CHUNK) --log-dir .cpu-suite-oldest --durations tests/cpu_durations.json tests/kernels tests/distributed \
		-- -m "not gpu" --ignore=tests/distributed/test_cp_dispatch.py $(PYTEST_ARGS) \
		|| { tail -n 300 .cpu-suite-oldest/worker*.log; exit 1; }

# The whole suite on a CUDA machine (the device's command; not part of CI). Uses the machine's own
# python3 (its preinstalled torch and Triton), installs this package there without dependencies (the
# `hc` entry point), and writes benchmarks/results/gpu-suite.txt. A copied tree may have no .git:
# pass the commit, `make test-gpu COMMIT=<sha>`. GPU_MEMORY_GIB is the bound each test must fit in
# (14 workers x 4.75 GiB plus their CUDA contexts fit an 80 GB card). tests/gpu_durations.json (each
# test's seconds and each file's per test, from an earlier run; refresh it from .gpu-suite/durations.json)
# cuts the chunks to even expected times and starts the slowest first. Tests marked multi_gpu run in
# chunks that see every GPU (on a one-GPU machine they skip).
GPU_PYTHON ?= python3
# Every GPU of the machine takes 14 workers (worker i sees only GPU i mod GPU_COUNT): on two cards the
# suite compiles on twice the cores, which is most of its time.
GPU_COUNT ?= $(or $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU' | grep -v '^0$$'),1)
GPU_WORKERS ?= $(shell echo $$(( 14 * $(GPU_COUNT) )))
GPU_MEMORY_GIB ?= 4.75
GPU_REPORT ?= benchmarks/results/gpu-suite.txt
GPU_TESTS ?= tests
# A chunk still running after GPU_CHUNK_TIMEOUT seconds is killed (the longest of a green one-card run took
# 295 s): the tests its progress line shows keep their outcome, the running one is reported as the error, so
# a hung test costs minutes, not the report (session 29: an htree opcheck ran 15 minutes and the suite ended
# after the device call). A test running past GPU_TEST_STACK_S seconds has its stack written to the log:
# past every test's own time (the longest, 282 s), since the device's Python 3.12 can crash while it writes
# a stack whose top frame is a trampoline (CPython gh-123967; session 31: the dump at 240 s killed the worker
# running two hc_clients tests, reported as errors).
GPU_CHUNK_TIMEOUT ?= 600
GPU_TEST_STACK_S ?= 570
GPU_PYTEST_ARGS ?=
# Tests per pytest process, consecutive files sharing one: each process start (import torch, CUDA
# context, Dynamo and Inductor warm-up) cost ~27 s on the 4x H200 at 08794b7 (chunks' wall 20857
# worker-seconds against the tests' own 14468 over 239 chunks of 6); 30 across files makes ~60.
GPU_CHUNK ?= 30
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null)

# A COMMIT read from git is trusted only for a clean tree: the device copies the working tree over a
# .git that can be older (session 15: HEAD there was the session's first commit), so a report would
# name a commit it did not test.
GIT_TREE_CHECK = test "$(origin COMMIT)" != file || test -z "$$(git status --porcelain -- hccompile tests 2>/dev/null)" || \
	{ echo "make $@: hccompile/ or tests/ differ from git's HEAD ($(COMMIT)); pass COMMIT=<the sha of this tree>"; exit 2; }

# The device cannot download: the test dependencies it lacks (depyf, the pinned transformers,
# hyper-connections) travel as wheels in GPU_WHEELS (gitignored; carry it) and are installed into
# GPU_WHEEL_SITE, ahead of the machine's own packages. Without them six tests fail and seven skip
# (session 19), so a missing directory stops the suite.
GPU_WHEELS ?= .whl
GPU_WHEEL_SITE ?= /tmp/hccompile-gpu-wheels
GPU_WHEEL_PLATFORMS = --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
GPU_WHEEL_PACKAGES = depyf==0.20.0 astor dill transformers==5.24.0 hyper-connections==0.4.11 \
	torch-einops-utils==0.2.0 einops==0.8.2

.PHONY: gpu-wheels
# Downloads GPU_WHEELS (the suite's) and GPU_BENCH_WHEELS (the benchmarks' peer) here (a machine with
# network), for the device's Python 3.12.
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: $(GPU_WHEEL_PLATFORMS) -d $(GPU_WHEELS) \
		$(GPU_WHEEL_PACKAGES)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: $(GPU_WHEEL_PLATFORMS) -d $(GPU_BENCH_WHEELS) \
		$(GPU_BENCH_PACKAGES)

# Compile caches between device sessions: the suite's time is mostly compiling (Triton kernels and
# Inductor's graphs, ~14000 worker-seconds on 14 workers at 5a0f717) on a machine that starts cold
# each session. The suite compiles into GPU_CACHE_DIR (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR),
# seeded from GPU_CACHE/cache-*.tgz.* when present (gitignored; carry it like .whl), and packs it
# afterwards into GPU_CACHE_OUT: first the binaries and metadata of our own kernels' entries in Triton's
# cache, smallest first while they fit (benchmarks/gpu_cache.py: the whole cache was 1.9 GB at f2f9d4a,
# our 2660 entries whole over the budget too), then Triton's whole cache, then Inductor's, each
# archive in 15 MiB parts, each packed only while the parts so far stay within GPU_CACHE_MAX_MIB
# compressed (gzip stops at the limit, so an oversized cache costs seconds, not minutes of device
# time); test-gpu-wait returns the parts under $$OUT (a call returns at most 8 files, 64 MiB). The
# next session copies them into .gpu-cache/ and carries [".whl", ".gpu-cache"] to `make test-gpu`:
# the tree (~10 MiB), the wheels (14 MiB) and the cache must stay within a call's 64 MiB, hence 36.
# Both caches key an entry by its source and the compiler's versions: a changed kernel or graph
# compiles again. An entry packed this way has no PTX or TTGIR, so whatever reads a compiled kernel's
# .asm beyond its cubin must compile into a cache of its own (hccompile/kernels/mhc/compile_check.py).
# Measured in session 52: seeded with our 1115-1816 entries the suite ran 559 and 603 s against 543 s
# unseeded (the kernel tests' worker time fell by ~700 s; the rest is Inductor's compiling).
GPU_CACHE ?= .gpu-cache
GPU_CACHE_DIR ?= /tmp/hccompile-gpu-cache
GPU_CACHE_OUT ?= .gpu-cache-out
GPU_CACHE_MAX_MIB ?= 36

test-gpu:
	@test -n "$(COMMIT)" || { echo "make test-gpu: no .git here; pass COMMIT=<sha>"; exit 2; }
	@$(GIT_TREE_CHECK)
	@ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1 || { echo "make test-gpu: no wheels in $(GPU_WHEELS): carry it"; exit 2; }
	rm -rf $(GPU_WHEEL_SITE)
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target $(GPU_WHEEL_SITE) $(GPU_WHEELS)/*.whl
	$(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation --no-index -e .
	rm -rf $(GPU_CACHE_DIR) && mkdir -p $(GPU_CACHE_DIR)
	@for archive in $$(ls $(GPU_CACHE)/cache-*.tgz.* 2>/dev/null | sed 's/\.[0-9]*$$//' | sort -u); do \
		cat $$archive.* | tar xzf - -C $(GPU_CACHE_DIR) && echo "compile cache $$archive unpacked"; done; \
		echo "compile caches seeded: $$(du -sh $(GPU_CACHE_DIR) | cut -f1)"
	PYTHONPATH=$(GPU_WHEEL_SITE)$${PYTHONPATH:+:$$PYTHONPATH} \
	TRITON_CACHE_DIR=$(GPU_CACHE_DIR)/triton TORCHINDUCTOR_CACHE_DIR=$(GPU_CACHE_DIR)/inductor \
	$(GPU_PYTHON) tests/parallel.py -n $(GPU_WORKERS) --gpus $(GPU_COUNT) --gpu-memory-gib $(GPU_MEMORY_GIB) \
		--report $(GPU_REPORT) --commit $(COMMIT) --log-dir .gpu-suite \
		--durations tests/gpu_durations.json --chunk $(GPU_CHUNK) --across-files --chunk-timeout $(GPU_CHUNK_TIMEOUT) \
		$(GPU_TESTS) -- -o faulthandler_timeout=$(GPU_TEST_STACK_S) $(GPU_PYTEST_ARGS); status=$$?; \
	rm -rf $(GPU_CACHE_OUT) && mkdir -p $(GPU_CACHE_OUT) && du -sh $(GPU_CACHE_DIR)/* > $(GPU_CACHE_OUT)/sizes.txt; \
	budget=$$(( $(GPU_CACHE_MAX_MIB) * 1048576 )); \
	for part in triton-ours triton inductor; do \
		if test $$part = triton-ours; then \
			packed=$$($(GPU_PYTHON) benchmarks/gpu_cache.py $(GPU_CACHE_DIR) $(GPU_CACHE_OUT) $$(( budget / 1048576 ))); \
			echo "$$packed" | head -n 1 >> $(GPU_CACHE_OUT)/sizes.txt; \
			size=$$(echo "$$packed" | tail -n 1 | grep -x '[0-9][0-9]*' || echo 0); \
			budget=$$(( budget - size )); continue; fi; \
		test -d $(GPU_CACHE_DIR)/$$part || continue; \
		tar czf - -C $(GPU_CACHE_DIR) $$part 2>/dev/null | head -c $$(( budget + 1 )) > $(GPU_CACHE_OUT)/pack.tgz; \
		size=$$(stat -c %s $(GPU_CACHE_OUT)/pack.tgz); \
		if test $$size -gt $$budget; then echo "$$part: not packed (over the $$(( budget / 1048576 )) MiB left)" \
			>> $(GPU_CACHE_OUT)/sizes.txt; \
		else budget=$$(( budget - size )); split -b 15m -d $(GPU_CACHE_OUT)/pack.tgz $(GPU_CACHE_OUT)/cache-$$part.tgz.; fi; \
		rm -f $(GPU_CACHE_OUT)/pack.tgz; done; \
	du -sh $(GPU_CACHE_OUT) >> $(GPU_CACHE_OUT)/sizes.txt; cat $(GPU_CACHE_OUT)/sizes.txt; exit $$status

# The GPU suite over more than one device call (a call may run 10 minutes). Compiling is most of the
# suite's time, so the machine's cores decide it: 626 s on four cards and 64 cores (56 workers, session
# 27), 1063 s on two (session 26); on one H200's 16 cores, 14 workers, 760 s since GPU_CHUNK's 30 tests per
# process across files (session 28; with 6 per process one card ran 159 of 1217 tests in 523 s). `make test-gpu-start COMMIT=<sha>` copies the tree to GPU_COPY (the next call re-copies the
# working tree under running workers) and starts `make test-gpu` there in its own session; each
# following call runs `make test-gpu-wait`, which waits up to GPU_WAIT_S seconds for the suite to end
# (GPU_COPY/exit-status) and copies the report to benchmarks/results/gpu-suite.txt (and to $$OUT when
# set) with the logs; a suite that ended without a report says so. Issue the next call at once: the
# machine is given back after 30 s idle. Size GPU_WAIT_S to the call's limit: the report may land
# seconds after a shorter wait gave up (session 12 lost a report so).
GPU_COPY ?= /tmp/hccompile-gpu-suite
GPU_WAIT_S ?= 540

# The device's benchmark runs (benchmarks/device_runs.sh names them): `make bench-gpu RUNS="delta host"
# COMMIT=<sha>` with .whl and GPU_BENCH_WHEELS (FLA 0.6.0's wheels, the peer in every table) carried.
# `make gpu-wheels` downloads both here.
GPU_BENCH_WHEELS ?= .whl-fla
GPU_BENCH_PACKAGES = flash-linear-attention==0.6.0 fla-core==0.6.0
# FLA goes into a directory of its own: in the suite's, it made transformers run FLA's kernels in the
# layers the HF tests compile as plain PyTorch (six failures at f082924, a suite run after a benchmark
# call on the same machine). test-gpu also recreates its directory, and tests/conftest.py refuses to run
# with FLA importable.
GPU_BENCH_WHEEL_SITE ?= /tmp/hccompile-gpu-bench-wheels
RUNS ?= delta host
BENCH_PATH = PYTHONPATH=$(GPU_WHEEL_SITE):$(GPU_BENCH_WHEEL_SITE)$${PYTHONPATH:+:$$PYTHONPATH}
.PHONY: bench-gpu bench-gpu-install
# The carried wheels (the suite's and FLA's) and hccompile, installed for the benchmark runs.
bench-gpu-install:
	@test -n "$(COMMIT)" || { echo "make bench-gpu: no .git here; pass COMMIT=<sha>"; exit 2; }
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target $(GPU_WHEEL_SITE) $(GPU_WHEELS)/*.whl
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target $(GPU_BENCH_WHEEL_SITE) $(GPU_BENCH_WHEELS)/*.whl
	$(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation --no-index -e .

bench-gpu: bench-gpu-install
	$(BENCH_PATH) RUNS="$(RUNS)" COMMIT=$(COMMIT) sh benchmarks/device_runs.sh

# Two run lists at once, one per card of a two-GPU machine (single-GPU runs only): `make bench-gpu-split
# RUNS_GPU0="dqkw-split" RUNS_GPU1="gdn-tune kda-solve" COMMIT=<sha>`; each card's rows and logs go to
# $$OUT/gpu0.tgz and $$OUT/gpu1.tgz (device_runs.sh names them x1; packed because a call returns only
# so many files: session 44 lost gdn-tune's rows so).
RUNS_GPU0 ?=
RUNS_GPU1 ?=
# each card's per-run limit (device_runs.sh's RUN_LIMIT_S; default RUN_LIMIT_S, else 240 s)
RUN_LIMIT_S_GPU0 ?=
RUN_LIMIT_S_GPU1 ?=
.PHONY: bench-gpu-split
bench-gpu-split: bench-gpu-install
	out=$${OUT:-benchmarks/results}; mkdir -p $$out/gpu0 $$out/gpu1; \
	for g in 0 1; do \
		if test $$g = 0; then runs="$(RUNS_GPU0)"; else runs="$(RUNS_GPU1)"; fi; \
		test -n "$$runs" || continue; \
		if test $$g = 0; then limit="$(RUN_LIMIT_S_GPU0)"; else limit="$(RUN_LIMIT_S_GPU1)"; fi; \
		( CUDA_VISIBLE_DEVICES=$$g OUT=$$out/gpu$$g RUNS="$$runs" COMMIT=$(COMMIT) $(BENCH_PATH) \
		  RUN_LIMIT_S=$${limit:-$${RUN_LIMIT_S:-240}} \
		  sh benchmarks/device_runs.sh > $$out/gpu$$g/log.txt 2>&1; echo "gpu$$g: exit $$?" ) & \
	done; wait; tail -n 5 $$out/gpu0/log.txt $$out/gpu1/log.txt; \
	for g in 0 1; do test -d $$out/gpu$$g && tar czf $$out/gpu$$g.tgz -C $$out gpu$$g && rm -rf $$out/gpu$$g; done; true

.PHONY: test-gpu-start test-gpu-wait before-tree
# hccompile of an earlier commit under .before/ (gitignored: pass carry [".before"] to the device), for
# benchmarks/before_after.py: `make before-tree REF=<commit>`.
before-tree:
	@test -n "$(REF)" || { echo "make before-tree: pass REF=<commit>"; exit 2; }
	rm -rf .before && mkdir -p .before && git archive $(REF) hccompile | tar -x -C .before
	git rev-parse $(REF) > .before/COMMIT

test-gpu-start:
	@test -n "$(COMMIT)" || { echo "make test-gpu-start: no .git here; pass COMMIT=<sha>"; exit 2; }
	@$(GIT_TREE_CHECK)
	rm -rf $(GPU_COPY) && mkdir -p $(GPU_COPY) && cp -a . $(GPU_COPY)/
	cd $(GPU_COPY) && setsid nohup sh -c '$(MAKE) test-gpu COMMIT=$(COMMIT) GPU_REPORT=$(GPU_COPY)/gpu-suite.txt; \
		echo $$? > $(GPU_COPY)/exit-status' > $(GPU_COPY)/suite.log 2>&1 < /dev/null &
	@echo "started in $(GPU_COPY); follow with: make test-gpu-wait"

test-gpu-wait:
	@for i in $$(seq $(GPU_WAIT_S)); do test -e $(GPU_COPY)/exit-status && break; sleep 1; done; \
	tail -3 $(GPU_COPY)/suite.log; \
	if test -e $(GPU_COPY)/exit-status && ! test -s $(GPU_COPY)/gpu-suite.txt; then \
		echo "make test-gpu ended (exit $$(cat $(GPU_COPY)/exit-status)) without a report: see suite.log"; exit 4; fi; \
	if test -s $(GPU_COPY)/gpu-suite.txt; then \
		cp $(GPU_COPY)/gpu-suite.txt benchmarks/results/gpu-suite.txt; \
		if test -n "$$OUT"; then cp $(GPU_COPY)/gpu-suite.txt $(GPU_COPY)/suite.log "$$OUT"/; \
			tar czf "$$OUT"/gpu-suite-logs.tar.gz -C $(GPU_COPY) .gpu-suite 2>/dev/null || true; \
			parts=$(GPU_COPY)/$(GPU_CACHE_OUT); cat $$parts/sizes.txt 2>/dev/null; \
			if test -n "$$(ls $$parts/cache-*.tgz.* 2>/dev/null)" && \
				test "$$(ls $$parts/cache-*.tgz.* | wc -l)" -le 5; then \
				mkdir -p "$$OUT"/gpu-cache && cp $$parts/cache-*.tgz.* "$$OUT"/gpu-cache/ && \
				echo "compile caches returned under \$$OUT/gpu-cache"; \
			else echo "compile caches not returned (none packed, or over 5 parts)"; fi; fi; \
		echo "report written"; \
	else echo "still running: call make test-gpu-wait again"; exit 3; fi

# The CPU suite on torch 2.15 (the current release), in a venv of its own so that .venv (torch 2.13)
# stays as it is; constraints-cpu.txt's Triton 3.9 is also 2.15's. On a CPU machine torch 2.15 is its
# CUDA build (~540 MB plus ~5 GB of CUDA packages from PyPI). Where the global pip configuration caps
# torch below 2.15 (these machines: torch<=2.14.1), lift it for this command only:
# `PIP_CONSTRAINT=/dev/null make test-2.15`.
# Being a CUDA build, it also runs the tests that trace our ops on fake CUDA tensors, which the CPU
# build skips: before a device suite, `make test-2.15 TESTS="tests/test_traced_launch.py"` checks on
# this machine what made the suite at 680ba4e fail (a launch counted as writing an input or a table).
.PHONY: test-2.15
test-2.15:
	$(MAKE) test VENV=.venv-2.15 TORCH_SPEC=torch==2.15.0

clean:
	rm -rf $(VENV) .venv-2.15 .venv-triton-oldest $(TRITON_OLDEST_DIR) build *.egg-info
