"""Run pytest over several worker processes: the test ids are collected once and dealt round-robin.

On the GPU machine most of a kernel test's time is Triton compiling its specialisations (about
20 s per delta-rule case), which is CPU work: N processes compile N cases at once. Usage, from the
repository root:

    python tests/parallel.py -n 8 tests/kernels/test_delta_rule_chunk.py tests/test_delta_rule_ops.py
    python tests/parallel.py -n 4 tests/kernels -- -m gpu        # after --: options for every worker

Prints each worker's summary line and exits non-zero if any worker failed. Each worker writes its
full log to <log-dir>/worker<i>.log (default: a temporary directory, printed).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def collect(paths: list[str], extra: list[str]) -> list[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             *extra, *paths], capture_output=True, text=True)
    if result.returncode == 5:  # pytest's "no tests collected"
        return []
    if result.returncode != 0:
        raise SystemExit(f"collection failed (exit {result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return [line.strip() for line in result.stdout.splitlines() if "::" in line]


def deal(ids: list[str], workers: int) -> list[list[str]]:
    """Round-robin, so that neighbouring (often equally slow) cases land on different workers."""
    return [group for group in (ids[i::workers] for i in range(workers)) if group]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--workers", type=int, default=4)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("paths", nargs="+")
    options = parser.parse_args(argv)
    if options.workers < 1:
        parser.error(f"--workers must be >= 1, got {options.workers}")
    ids = collect(options.paths, extra)
    if not ids:
        print("no tests collected")
        return 0
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="pytest-parallel-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(ids)} tests over {min(options.workers, len(ids))} workers; logs in {log_dir}", flush=True)
    running = []
    for index, group in enumerate(deal(ids, options.workers)):
        id_file = log_dir / f"worker{index}.ids"
        id_file.write_text("\n".join(group) + "\n")
        log = open(log_dir / f"worker{index}.log", "w")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *group]
        running.append((index, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log))
    failed = 0
    for index, process, log in running:
        code = process.wait()
        log.close()
        lines = (log_dir / f"worker{index}.log").read_text().strip().splitlines()
        summary = lines[-1] if lines else "(no output)"
        print(f"worker {index}: exit {code}: {summary}", flush=True)
        if code != 0:
            failed += 1
            for line in lines:
                if line.startswith(("FAILED", "ERROR")):
                    print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
