"""The forward's output kernel beside its state sweep (plan.PIPELINED_OUTPUT, kernels/delta_rule/pipeline.py),
on the GPU: first right, then fast (issue 20).

Right: the pipelined forward's o and final state, and the fwd+bwd's gradients, against the forward without it,
bit for bit (the kernels are deterministic, so any difference is a race: a program that read a chunk's state
before the sweep had stored it), --repeats times at each shape. Fast: GDN and KDA forward and fwd+bwd
(do_bench) both ways (and with the counters but no dependent launch: what counting costs the sweep), with
state_forward's and the output kernel's GPU time (profiler), and the pipelined forward
with the output kernel's value tile at 64 and its launch at two stages, which take less shared memory beside
the sweep's (sm_90, Triton 3.6: the sweep ~110 KiB, the output kernel at 128 wide and three stages 96 KiB: one
of each fits an SM's 227 KiB).

    python benchmarks/analysis/pipelined_output.py [--shapes B1T32768H16D128,B4T4096H16D128] [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kernel_variants import delta_rule_case, delta_rule_step, time_step, use_kernel_tests  # noqa: E402

use_kernel_tests()

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule import output as output_kernels  # noqa: E402
from hccompile.kernels.delta_rule import plan as kernel_plan  # noqa: E402
from tune_delta_rule import launch_override  # noqa: E402

# name -> (PIPELINED_OUTPUT, OUTPUT_BLOCK_V, the output kernel's launch options or None, dependent launch).
# "pipelined-after": the counters and waits without programmatic dependent launch, so the output kernel starts
# after the sweep as before: what the counting costs the sweep.
VARIANTS = {
    "after": (False, None, None, True),
    "pipelined-after": (True, None, None, False),
    "pipelined": (True, None, None, True),
    "pipelined-bv64": (True, 64, None, True),
    "pipelined-s2": (True, None, dict(num_stages=2), True),
    "pipelined-bv64-s2": (True, 64, dict(num_stages=2), True),
}


@contextlib.contextmanager
def variant(name: str):
    pipelined, block_v, options, dependent = VARIANTS[name]
    saved = (kernel_plan.PIPELINED_OUTPUT, output_kernels.OUTPUT_BLOCK_V, chunk_kernels.dependent_launch_available)
    kernel_plan.PIPELINED_OUTPUT = pipelined
    if block_v is not None:
        output_kernels.OUTPUT_BLOCK_V = block_v
    if not dependent:
        chunk_kernels.dependent_launch_available = lambda device: False
    override = launch_override(output_kernels._output_kernel, options) if options else contextlib.nullcontext()
    try:
        with override:
            yield
    finally:
        kernel_plan.PIPELINED_OUTPUT, output_kernels.OUTPUT_BLOCK_V, chunk_kernels.dependent_launch_available = saved


def results(op: str, shape: str) -> list[torch.Tensor]:
    """o, the final state and every input's gradient of one fwd+bwd."""
    f, leaves, do = delta_rule_case(op, shape, output_final_state=True)
    o, state = f(*leaves)[:2]
    o.backward(do)
    torch.cuda.synchronize()
    return [o.detach(), state] + [leaf.grad for leaf in leaves]


def forward_ms(op: str, shape: str) -> float:
    f, leaves, _ = delta_rule_case(op, shape, output_final_state=True)
    with torch.no_grad():
        return do_bench(lambda: f(*leaves))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="gdn,kda")
    p.add_argument("--shapes", default="B1T32768H16D128,B4T4096H16D128")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    names = a.variants.split(",")
    for shape in a.shapes.split(","):
        for op in a.ops.split(","):
            with variant("after"):
                reference = results(op, shape)
            for name in names:
                if name == "after":
                    continue
                with variant(name):
                    for repeat in range(a.repeats):
                        got = results(op, shape)
                        labels = ("o", "final state", "dq", "dk", "dv", "dg", "dbeta")
                        wrong = [label for label, x, y in zip(labels, got, reference) if not torch.equal(x, y)]
                        if wrong:
                            print(f"{op} {shape} {name}: repeat {repeat}: {', '.join(wrong)} differ from the "
                                  f"forward after the sweep (a race)", flush=True)
                            break
                    else:
                        print(f"{op} {shape} {name}: bit for bit equal in {a.repeats} fwd+bwd", flush=True)
            for name in names:
                with variant(name):
                    fwd = forward_ms(op, shape)
                    ms, kernels = time_step(*delta_rule_step(op, shape), ("state_forward", "_output_kernel"))
                print(f"{op} {shape} {name}: forward {fwd:.3f} ms, fwd+bwd {ms:.3f} ms, state_forward "
                      f"{kernels['state_forward']:.3f} ms, output {kernels['_output_kernel']:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
