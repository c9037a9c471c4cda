"""Where an eager backward's host time goes when autograd runs it on its CUDA device thread (issues 20, 24).

host_split.py measured lightning's backward through the engine at 0.49 ms of host time against 0.24 ms for
the same host function called on the main thread (B4 T4096 H16 D128, one H200, session 48), and the engine's
own floor (a Python autograd Function) at ~0.11 ms: about 0.15-0.25 ms is neither the engine's hand-off nor
our launches. This splits one `loss.backward()` into clocks read on each side of the hand-off:

    in     backward() called -> our backward's first line (the op's registered autograd, call_backward_op)
    ours   our backward's first line -> its return (the kernels' orchestration and launches), on whichever
           thread the engine picked
    out    our backward's return -> backward() returns (the engine, the leaf gradients, the hand-back)

for the engine's device thread (the default) and with torch.autograd.set_multithreading_enabled(False) (the
calling thread), each step behind a long GPU sleep so that the clocks read the CPU alone. Also the thread the
backward ran on, and `ours` split at each launch (the Launcher's, kernels/launcher.py).

    python benchmarks/analysis/backward_thread.py --ops lightning,gdn --shape B4T4096H16D128 [--profile]

--profile: after the clocks, more steps with our backward under cProfile on whichever thread runs it (one
profile per thread: cProfile follows the thread that enables it), and the top of each by own time: which of
our calls the device thread pays more for.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shapes import bthd  # noqa: E402

CLOCK = time.perf_counter
# Without a GPU (a smoke test: TRITON_INTERPRET=1, a small --shape) the step runs on CPU tensors in Triton's
# interpreter, the backward on the calling thread either way, with no launches through the Launcher.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Marks:
    """Clock readings of one step: (label, time, thread name)."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float, str]] = []

    def mark(self, label: str) -> None:
        self.marks.append((label, CLOCK(), threading.current_thread().name))


MARKS = Marks()
# --profile: the thread name -> the cProfile.Profile our backward ran under there (None: not profiling)
PROFILES: dict[str, cProfile.Profile] | None = None


def instrument(op: str) -> None:
    """Wraps the op's call_backward_op (its registered backward's call into the backward op) and the
    Launcher's launches, so that each step records when our backward starts and ends and each launch."""
    from hccompile.kernels import launcher as launcher_module
    from hccompile.lowering import delta_rule as delta_lowering
    from hccompile.lowering import lightning as lightning_lowering

    module = lightning_lowering if op == "lightning" else delta_lowering
    inner = module.call_backward_op

    def timed_backward_op(*args, **kwargs):
        MARKS.mark("ours start")
        profile = None
        if PROFILES is not None:
            profile = PROFILES.setdefault(threading.current_thread().name, cProfile.Profile())
            profile.enable()
        try:
            return inner(*args, **kwargs)
        finally:
            if profile is not None:
                profile.disable()
            MARKS.mark("ours end")

    module.call_backward_op = timed_backward_op
    launch = launcher_module.Launcher.launch

    def timed_launch(self, grid, args, kwargs):
        launch(self, grid, args, kwargs)
        MARKS.mark("launch")

    launcher_module.Launcher.launch = timed_launch


def make_step(op: str, shape: tuple[int, int, int, int]):
    import hccompile

    b, t, h, d = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, device=DEVICE, dtype=torch.bfloat16, generator=gen).mul_(0.5)
               .requires_grad_() for _ in range(3))
    do = torch.randn(b, t, h, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    if op == "lightning":
        decay = hccompile.lowering.lightning.alibi_decay(h, device=DEVICE)

        def forward():
            return hccompile.lightning_attn(q, k, v, decay=decay, scale=d ** -0.5)[0]
    else:
        beta = torch.rand(b, t, h, device=DEVICE, generator=gen).bfloat16().requires_grad_()
        g = torch.nn.functional.logsigmoid(torch.randn(b, t, h, device=DEVICE, generator=gen)).requires_grad_()

        def forward():
            return hccompile.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

    def step() -> dict[str, float]:
        o = forward()
        MARKS.marks.clear()
        MARKS.mark("backward called")
        o.backward(do)
        MARKS.mark("backward returned")
        marks = MARKS.marks
        at = {label: when for label, when, _ in marks if label != "launch"}
        thread = next(name for label, _, name in marks if label == "ours start")
        launches = [when for label, when, _ in marks if label == "launch"]
        split = {"in": at["ours start"] - at["backward called"], "ours": at["ours end"] - at["ours start"],
                 "out": at["backward returned"] - at["ours end"],
                 "first launch": (launches[0] - at["ours start"]) if launches else float("nan"),
                 "launches": len(launches), "thread": thread}
        return split
    return step


def measure(step, steps: int) -> dict:
    cuda = DEVICE == "cuda"
    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    rows = []
    for _ in range(steps):
        if cuda:
            torch.cuda._sleep(int(2e8))  # keeps the queue from draining: the clocks read the CPU alone
        rows.append(step())
    if cuda:
        torch.cuda.synchronize()
    summary = {key: statistics.median(r[key] for r in rows) * (1e3 if key not in ("launches",) else 1)
               for key in ("in", "ours", "out", "first launch", "launches")}
    summary["thread"] = rows[-1]["thread"]
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="lightning,gdn")
    p.add_argument("--shape", default="B4T4096H16D128")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--profile", action="store_true", help="then cProfile our backward on each thread (see above)")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    shape = bthd(args.shape)
    for op in args.ops.split(","):
        instrument(op)
        step = make_step(op, shape)
        for caller in (False, True):
            torch.autograd.set_multithreading_enabled(not caller)
            try:
                s = measure(step, args.steps)
            finally:
                torch.autograd.set_multithreading_enabled(True)
            where = "calling thread" if caller else "engine's device thread"
            print(f"{op:9s} {args.shape} backward on the {where:22s} (ran on {s['thread']}): in {s['in']:.3f} ms, "
                  f"ours {s['ours']:.3f} (first launch after {s['first launch']:.3f}, {s['launches']:.0f} launches), "
                  f"out {s['out']:.3f}", flush=True)
        if args.profile:
            profile_threads(op, step, args)


def profile_threads(op: str, step, args) -> None:
    """Our backward under cProfile on the device thread and on the calling thread, `args.steps` steps each."""
    global PROFILES
    PROFILES = {}
    try:
        for caller in (False, True):
            torch.autograd.set_multithreading_enabled(not caller)
            try:
                measure(step, args.steps)
            finally:
                torch.autograd.set_multithreading_enabled(True)
        for thread, profile in PROFILES.items():
            out = io.StringIO()
            stats = pstats.Stats(profile, stream=out)
            total_ms = stats.total_tt / (args.steps + 3) * 1e3
            stats.sort_stats("tottime").print_stats(args.top)
            print(f"--- {op} {args.shape}: our backward on {thread}, cProfile, {total_ms:.3f} ms a step (profiled)\n"
                  + out.getvalue().split("\n", 4)[-1], flush=True)
    finally:
        PROFILES = None


if __name__ == "__main__":
    main()
