"""Starts N ranks of tests/distributed/cp_worker.py as separate processes on CPU (gloo) and returns
rank 0's results. TRITON_INTERPRET=1 goes into each child's environment before its Python starts,
so the Triton kernels run in the interpreter there. The ranks meet through a file store, not a TCP
store: a TCP store lives in rank 0, and when rank 0 finished first and exited, rank 1's store
connection died under it in CI ("terminate called without an active exception", exit -6)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("cp_worker.py")
ROOT = Path(__file__).parents[2]


def run_ranks(world_size: int, suite: str, results: Path, timeout: float = 600) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", HCCOMPILE_CP_POISON="1", CP_INIT_FILE=str(results.with_name("rendezvous")),
               WORLD_SIZE=str(world_size), CP_SUITE=suite, CP_RESULTS=str(results),
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    processes = []
    for rank in range(world_size):
        processes.append(subprocess.Popen([sys.executable, str(WORKER)], env=dict(env, RANK=str(rank)), cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    failed = [rank for rank, p in enumerate(processes) if p.returncode != 0]
    if os.environ.get("CP_HARNESS_VERBOSE"):
        print(outputs[0])
    if failed:
        logs = "\n".join(f"--- rank {rank} (exit {processes[rank].returncode}) ---\n{outputs[rank][-6000:]}"
                         for rank in failed)
        raise RuntimeError(f"CP ranks {failed} failed:\n{logs}")
    return json.loads(results.read_text())


TOLERANCE = 1e-5  # fp32: the CP run and the single-process run use the same kernels
GATE_PARAMETER_TOLERANCE = 1e-4  # dA_log, ddt_bias: sums over every token of every rank


def assert_matches_single_process(name: str, errors: dict) -> None:
    """`errors` (relative RMS per quantity, from cp_worker) are within the kernels' tolerance."""
    assert "o" in errors and "final_state" in errors and "dq" in errors, errors
    for quantity, error in errors.items():
        limit = GATE_PARAMETER_TOLERANCE if quantity in ("dA_log", "ddt_bias") else TOLERANCE
        assert error < limit, (name, quantity, error)
