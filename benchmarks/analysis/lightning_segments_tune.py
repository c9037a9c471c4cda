"""Lightning's segment length, never tuned (issue 20): segments.SWEEP_WAVES (sweep programs per SM the auto
length aims at, 8 since 3ac50f7) and segments.MIN_SEGMENT (256). Shorter segments mean more sweep and summary
programs, each with a shorter chain of dependent chunk steps (the B1 T32768 summary kernel runs 528 programs
walking 16 chunks each: 84 us for 67 MB read, session 42's timeline), and more fp32 states to write, scan and
keep for the backward.

For each (SWEEP_WAVES, MIN_SEGMENT) and shape: the segment length it picks, forward and fwd+bwd (do_bench,
bf16, ALiBi decays), and the kernels' GPU time per fwd+bwd by name (profiler). Both passes plan with the same
values (the forward's kept states and the backward's plan agree).

    python benchmarks/analysis/lightning_segments_tune.py [--shapes B1T32768H16D128,B4T4096H16D128]
        [--waves 4,8,16,32] [--min-segments 256,128]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import bthd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> None:
    from triton.testing import do_bench
    from torch.profiler import ProfilerActivity, profile

    import hccompile
    from hccompile.kernels.lightning import segments
    from hccompile.kernels.lightning.chunk import _forward_segments, DEFAULT_BLOCK, DEFAULT_FORWARD_CBLOCK
    from hccompile.lowering.lightning import alibi_decay

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="B1T32768H16D128,B4T4096H16D128")
    p.add_argument("--waves", default="4,8,16,32")
    p.add_argument("--min-segments", default="256,128")
    a = p.parse_args()
    defaults = (segments.SWEEP_WAVES, segments.MIN_SEGMENT)
    for shape in a.shapes.split(","):
        B, T, H, D = bthd(shape)
        q, k, v, do = (torch.randn(B, T, H, D, device="cuda").bfloat16() for _ in range(4))
        decay = alibi_decay(H, device="cuda")
        leaves = [t.requires_grad_() for t in (q, k, v)]

        def fwd():
            with torch.no_grad():
                hccompile.lightning_attn(q, k, v, decay)

        def step():
            hccompile.lightning_attn(q, k, v, decay)[0].backward(do)

        print(f"== {shape} bf16, decay", flush=True)
        for waves, least in itertools.product([int(w) for w in a.waves.split(",")],
                                              [int(m) for m in a.min_segments.split(",")]):
            segments.SWEEP_WAVES, segments.MIN_SEGMENT = waves, least
            try:
                plan = _forward_segments(q, v, None, None, DEFAULT_BLOCK, DEFAULT_FORWARD_CBLOCK, None)
                step()
                f = do_bench(fwd)
                fb = do_bench(step, grad_to_none=leaves)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step()
                        for leaf in leaves:  # else each step adds into .grad: a 0.28 ms kernel at B1 (2bb0177's run)
                            leaf.grad = None
                    torch.cuda.synchronize()
                kernels = defaultdict(float)
                for e in prof.key_averages():
                    if e.device_time_total > 0:
                        kernels[e.key.split("(")[0][:40]] += e.device_time_total / 3 / 1e3
                top = ", ".join(f"{n} {ms:.3f}" for n, ms in sorted(kernels.items(), key=lambda x: -x[1])[:6])
            except Exception as error:  # noqa: BLE001 -- a failed configuration is a result here
                print(f"waves {waves:2d} min {least:3d}: {type(error).__name__}: {str(error)[:160]}", flush=True)
                continue
            mark = "  (defaults)" if (waves, least) == defaults else ""
            print(f"waves {waves:2d} min {least:3d}: segment {plan.length} x {plan.per_sequence}, fwd {f:.3f} ms, "
                  f"fwd+bwd {fb:.3f} ms{mark}\n    {top}", flush=True)
        segments.SWEEP_WAVES, segments.MIN_SEGMENT = defaults


if __name__ == "__main__":
    main()
