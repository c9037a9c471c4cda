"""Whether an eager fwd+bwd is host-bound, kernel by kernel (issue 20's B1 lightning rows, issue 24): one
step timed as benchmarks/lightning.py times it (triton's do_bench: the L2 flushed before each step, so
the GPU queue is empty when the step starts), under torch.profiler. For the last step it prints every GPU
kernel with the time the host launched it, the time the GPU started it and the GPU's idle gap before it.
Where the GPU starts a kernel right after the host launched it and after a gap, the GPU was waiting for
the host: those gaps are the host's share of the step's wall time (an upper bound: the profiler's own
recording lengthens the host's side a little).

    python benchmarks/analysis/step_timeline.py --ops lightning,lightning-nodecay,fla-lightning \
        --shape B1T32768H16D128 [--trace-dir DIR]

Lightning without decay is the same kernels with zero log-decays (as benchmarks/lightning.py's rows);
fla-lightning is FLA's chunk_simple_gla with g_gamma (its peer in those rows), when FLA is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import bthd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cp_trace import gpu_events  # noqa: E402

STEPS = 3


def lightning_step(op: str, B: int, T: int, H: int, D: int):
    from hccompile.lowering.lightning import alibi_decay

    q, k, v = (torch.randn(B, T, H, D, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    do = torch.randn(B, T, H, D, device="cuda").bfloat16()
    decay = alibi_decay(H).cuda() if op != "lightning-nodecay" else torch.zeros(H, device="cuda")
    if op == "fla-lightning":
        from fla.ops.simple_gla import chunk_simple_gla

        def call():
            return chunk_simple_gla(q, k, v, g_gamma=decay, scale=D ** -0.5)[0]
    else:
        import hccompile

        def call():
            return hccompile.lightning_attn(q, k, v, decay)[0]

    def step():
        for t in (q, k, v):
            t.grad = None
        with torch.profiler.record_function("step.forward"):
            out = call()
        with torch.profiler.record_function("step.backward"):
            out.backward(do)

    return step


def launches_by_correlation(events: list[dict]) -> dict[int, float]:
    """Host launch time (us) of each kernel, by its correlation id (cudaLaunchKernel and its kin)."""
    out = {}
    for e in events:
        # Triton launches through the driver API (cuLaunchKernelEx: category cuda_driver), torch's own
        # kernels through the runtime's (cudaLaunchKernel)
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and re.search(r"Launch|cuLaunch", e.get("name", "")):
            correlation = (e.get("args") or {}).get("correlation")
            if correlation is not None:
                out[correlation] = e["ts"]
    return out


def timeline(path: Path, steps: int = STEPS) -> str:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = gpu_events(path)
    if not gpu:
        return f"{path.name}: no GPU events"
    launched = launches_by_correlation(events)
    markers = sorted((e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("step.")),
                     key=lambda e: e["ts"])
    # the last step: from its forward marker on
    last_forward = [m for m in markers if m["name"] == "step.forward"][-1]
    # the step's kernels: those the host launched after the forward's marker began (the L2 flush's
    # kernel before it may still run on the GPU after that time)
    gpu = [e for e in gpu if launched.get((e.get("args") or {}).get("correlation"), e["ts"]) >= last_forward["ts"]]
    origin = last_forward["ts"]
    lines = [f"== {path.name}: the last of {steps} steps, times in ms from its forward's start on the host",
             f"{'launched':>9} {'started':>9} {'lag':>7} {'gap':>7} {'dur':>7}  kernel"]
    previous_end, idle, waited = None, 0.0, 0.0
    for e in gpu:
        host = launched.get((e.get("args") or {}).get("correlation"))
        gap = 0.0 if previous_end is None else max(0.0, e["ts"] - previous_end)
        lag = None if host is None else e["ts"] - host
        idle += gap
        if lag is not None and gap > 0 and lag < 20:  # started within 20 us of its launch: it waited
            waited += gap
        lines.append(f"{((host or 0) - origin) / 1e3:9.3f} {(e['ts'] - origin) / 1e3:9.3f} "
                     f"{'' if lag is None else f'{lag / 1e3:7.3f}':>7} {gap / 1e3:7.3f} {e['dur'] / 1e3:7.3f}  "
                     f"{e['name'][:70]}")
        previous_end = e["ts"] + e["dur"]
    for m in markers[-2:]:
        lines.append(f"host {m['name']}: {(m['ts'] - origin) / 1e3:.3f} to {(m['ts'] + m['dur'] - origin) / 1e3:.3f} ms")
    span = (previous_end - gpu[0]["ts"]) / 1e3
    busy = sum(e["dur"] for e in gpu) / 1e3
    lines.append(f"GPU span {span:.3f} ms, busy {busy:.3f} ms, idle between kernels {idle / 1e3:.3f} ms, "
                 f"of which waiting on the host (started within 20 us of the launch) {waited / 1e3:.3f} ms")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="lightning,lightning-nodecay")
    p.add_argument("--shape", default="B1T32768H16D128")
    p.add_argument("--trace-dir", default=None)
    a = p.parse_args()
    B, T, H, D = bthd(a.shape)
    directory = Path(a.trace_dir or tempfile.mkdtemp())
    directory.mkdir(parents=True, exist_ok=True)
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # as do_bench clears the L2
    for op in a.ops.split(","):
        try:
            step = lightning_step(op, B, T, H, D)
        except ImportError as error:
            print(f"{op}: skipped ({error})")
            continue
        for _ in range(5):
            flush.zero_()
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                flush.zero_()
                step()
            torch.cuda.synchronize()
        path = directory / f"{op}_{a.shape}.trace.json"
        prof.export_chrome_trace(str(path))
        print(timeline(path), flush=True)


if __name__ == "__main__":
    main()
