"""What KDA's split diagonal blocks cost, per score kernel, on the GPU (issue 20).

With FLA's KDA gate initialisation (A in [1, 16], dt in [0.001, 0.1], unit raw gates) 3.5 % of the 16-row
sub-chunks pass scores.FACTOR_SPAN_LIMIT = 40 and have their diagonal block split (9 % of the chunks), and
KDA's backward score kernel took 2.237 ms against 1.806 with precomputed logsigmoid gates at B1 T32768 H16
K128 on one H200; raising the limit to 60 (0.02 % split) took 0.41 ms off the fwd+bwd. On the H100 with
one program per sub-chunk, every block split had cost the backward kernel only +26 % (2.73 vs 2.16 ms), so
at 3.5 % the split should cost ~1 %. This profiles a kda-gate fwd+bwd (and KDA with logsigmoid gates) with
one program per chunk (plan.CHUNK_SCORE_PROGRAMS, the default) or per sub-chunk, at limits 40 (default),
60 and 0 (every block split), and prints each score kernel's GPU time.

    python benchmarks/analysis/split_cost.py [--shape B1T32768H16D128]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from _profile import profile_step  # noqa: E402
from profile_ops import parse_shape  # noqa: E402
from tune_delta_rule import step_fn  # noqa: E402

from hccompile.kernels.delta_rule import plan as kernel_plan  # noqa: E402
from hccompile.kernels.delta_rule import scores  # noqa: E402

KERNELS = ("_decayed_scores_backward_kernel", "_chunk_scores_kernel", "_decayed_scores_kernel")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="B1T32768H16D128")
    p.add_argument("--ops", default="kda-gate,kda")
    args = p.parse_args()
    shape = parse_shape(args.shape)
    saved = (kernel_plan.CHUNK_SCORE_PROGRAMS, scores.FACTOR_SPAN_LIMIT)
    for op in args.ops.split(","):
        step = step_fn(op, shape)
        for chunk_programs in (True, False):
            for limit in (40.0, 60.0, 0.0):
                kernel_plan.CHUNK_SCORE_PROGRAMS, scores.FACTOR_SPAN_LIMIT = chunk_programs, limit
                try:
                    step()
                    torch.cuda.synchronize()
                    _, summary = profile_step(step, steps=5, top=40)
                finally:
                    kernel_plan.CHUNK_SCORE_PROGRAMS, scores.FACTOR_SPAN_LIMIT = saved
                times = {name: sum(r["ms"] for r in summary["top"] if r["kernel"].startswith(name)) for name in KERNELS}
                shown = ", ".join(f"{name.strip('_').replace('_kernel', '')} {ms:.3f}" for name, ms in times.items() if ms)
                print(f"{op} {args.shape} {'chunk' if chunk_programs else 'sub-chunk'} programs, limit {limit:4.0f}: "
                      f"GPU {summary['gpu_busy_ms']:.3f} ms; {shown}", flush=True)


if __name__ == "__main__":
    main()
