"""How much of the chunk-parallel work could hide under the state sweeps (issue 20: GDN B1 T32768 H16 D128 at
0.746x FLA's time, 0.6 wanted; KDA B1 at 0.817x, 0.8 wanted).

The sweeps are chains of dependent per-chunk steps (GDN B1: state_forward 0.53 ms, state_backward 0.85) that
fill few SMs or fill them thinly, while their consumers (the output kernel after state_forward; dqkw and wy_bwd,
or KDA's wy_backward and decayed_scores_backward, after state_backward) are chunk-parallel and wait for the whole
sweep. A consumer of chunk c needs only the states up to c: a kernel that ran them as the sweep produces them
(per-chunk flags, or a pipeline of sequence segments) would hide part of the consumer under the sweep. This
measures the bound before building it: one fwd+bwd's launches are recorded (kernel, grid, arguments), then
replayed, each group alone and the sweep with its consumers on a second CUDA stream at the same time, so the
GPU runs them side by side as far as its SMs allow (no dependency honoured: the values are not used; the time is
the point). CUDA events time each replay, median of --reps.

    saved = (sweep alone + consumers alone) - (side by side)

is the most a per-chunk pipeline could save: it starts its consumers later (chunk c after its state) and its
sweep may have to leave SMs free. Rows are printed per op and shape (GDN and KDA, forward and backward groups),
with the sweeps narrowed as today (one program per SM at B1 H16) and not narrowed (fewer, wider sweep programs,
slower alone, more room beside them).

    python benchmarks/analysis/sweep_overlap.py [--shapes B1T32768H16D128,B4T4096H16D128] [--reps 20]
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import delta_rule_step, use_kernel_tests  # noqa: E402

use_kernel_tests()

import torch  # noqa: E402

from hccompile.kernels.launch_recorder import recording_launches  # noqa: E402

# (group name, producer kernel names, consumer kernel names) per op; a name matches a kernel whose __name__
# contains it.
# The first group of each op is the other way round: the chunk-parallel wy_solve feeding the forward sweep,
# which a sweep waiting per chunk on wy_solve's programs could overlap the same way.
GROUPS = {
    "gdn": [("solve-sweep", ("_wy_solve_kernel",), ("_state_forward_kernel",)),
            ("forward", ("_state_forward_kernel",), ("_output_kernel",)),
            ("backward", ("_state_backward_kernel",), ("_dqkw_kernel", "_wy_bwd_kernel"))],
    "kda": [("solve-sweep", ("_wy_solve_kernel",), ("_state_forward_kernel",)),
            ("forward", ("_state_forward_kernel",), ("_output_kernel",)),
            ("backward", ("_state_backward_kernel",), ("_wy_backward_kernel", "_decayed_scores_backward_kernel"))],
}


def record_step(op: str, shape: str):
    """The launches of one eager fwd+bwd of `op` at `shape` (kernel, grid, arguments, options), run and
    kept (launch_recorder.recording_launches with execute)."""
    step, leaves = delta_rule_step(op, shape)
    step()  # compile everything first
    for leaf in leaves:
        leaf.grad = None
    with recording_launches(execute=True) as launches:
        step()
    torch.cuda.synchronize()
    return launches


def replay(launches) -> None:
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs)


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def side_by_side(producers, consumers, side: torch.cuda.Stream):
    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        replay(producers)
        with torch.cuda.stream(side):
            replay(consumers)
        main.wait_stream(side)
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="gdn,kda")
    p.add_argument("--shapes", default="B1T32768H16D128,B4T4096H16D128")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep-min-programs", default="default,0",
                   help="plan.SWEEP_MIN_PROGRAMS per pass: default (the SM count: sweeps narrowed to fill the GPU) "
                        "or a number (0: never narrowed, fewer sweep programs and more room beside them)")
    a = p.parse_args()
    side = torch.cuda.Stream()
    from hccompile.kernels.delta_rule import plan as kernel_plan

    default_min = kernel_plan.SWEEP_MIN_PROGRAMS
    for shape, op, narrowing in itertools.product(a.shapes.split(","), a.ops.split(","),
                                                  a.sweep_min_programs.split(",")):
        kernel_plan.SWEEP_MIN_PROGRAMS = default_min if narrowing == "default" else int(narrowing)
        print(f"SWEEP_MIN_PROGRAMS {narrowing}", flush=True)
        launches = [(getattr(kernel, "__name__", None) or kernel.fn.__name__, (kernel, grid, args, kwargs))
                    for kernel, grid, args, kwargs in record_step(op, shape)]
        names = [name for name, _ in launches]
        print(f"{op} {shape}: {len(launches)} launches: {' '.join(names)}", flush=True)
        for group, producer_names, consumer_names in GROUPS[op]:
            producers = [x for name, x in launches if any(n in name for n in producer_names)]
            consumers = [x for name, x in launches if any(n in name for n in consumer_names)]
            if not producers or not consumers:
                print(f"  {group}: producers {len(producers)}, consumers {len(consumers)}: skipped", flush=True)
                continue
            alone_p = timed(lambda: replay(producers), a.reps)
            alone_c = timed(lambda: replay(consumers), a.reps)
            both = timed(side_by_side(producers, consumers, side), a.reps)
            in_order = timed(lambda: (replay(producers), replay(consumers)), a.reps)
            print(f"  {group}: producers ({len(producers)} launches) {alone_p:.3f} ms, consumers ({len(consumers)}) "
                  f"{alone_c:.3f} ms "
                  f"({'+'.join(sorted(consumer_names))}), in order {in_order:.3f}, "
                  f"side by side {both:.3f}: at most {in_order - both:.3f} ms to save", flush=True)


if __name__ == "__main__":
    main()
