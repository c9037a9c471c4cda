"""What each product in the delta rule's backward state sweep costs its chunk step (issue 20, GDN B1).

GDN B1 T32768 H16 D128 is GPU-bound at 0.72x FLA's time; its largest kernel is state_backward (0.853 of 3.672 ms
busy on one H200, session 48), a chain of 512 dependent chunk steps per (head, value tile) at ~1.66 us a step
(benchmarks/analysis/gdn_traffic_2026-11-30_h200.md, section 5 item 1). Of a step's four products two lie on the
chain (K dS, then W^T dU into the next dS) and two do not (scale P^T dO into dU, scale (Q e^G)^T dO into dS).
The latter two could be formed outside the sweep, by chunk-parallel kernels (FLA forms P^T dO apart: dv_local,
~0.15 ms at B1), and read in as one tile each. This times the sweep with them taken out, as upper bounds on what
moving them out can save, each variant rebuilt from state.py's own text (kernel_variants.edited_module):

    default      the kernel as it is
    no-pdo       dU without scale P^T dO (P not loaded)                         (timing only: wrong gradients)
    du-in        dU's local part read from du itself, in place of P and the product: the sweep as it would be
                 with a dv_local kernel before it (that kernel's time not counted; du holds garbage here)
    no-qdo       dS without scale (Q e^G)^T dO                                   (timing only)
    chain-only   neither off-chain product: the chain alone                      (timing only)

A variant pays only where the step saves more than the parallel kernel costs: ~0.1 ms at B1 for dv_local (its
P, dO and dU bytes at the copy bandwidth, plus launch), ~0.2 ms for a per-chunk Q^T dO (a [chunks, HV, K, V]
tensor written and read, like h).

    python benchmarks/analysis/sweep_step_work.py [--variants default,no-pdo,du-in,no-qdo,chain-only] [--shapes B1T32768H16D128,B4T4096H16D128]
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import delta_rule_step, edited_module, time_step, use_kernel_tests  # noqa: E402

use_kernel_tests()

from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule import state as state_kernels  # noqa: E402

# the sweep's own product (its branch without LOCAL_DU: plan.LOCAL_DU_KERNEL reads the part a kernel formed)
LOCAL_DU = """                scores = _load_rows(scores_ptr, tokens, local, HV * BT, 1, valid, BT)
                scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
                du = scale * _dot(tl.trans(scores), do_tile, dot_dtype, DOT_PRECISION)
"""
QUERY_TERM = "            dstate += scale * _dot(tl.trans(q_tile), q_do, dot_dtype, DOT_PRECISION)\n"
EDITS = {
    "no-pdo": [(LOCAL_DU, "                du = tl.zeros([BT, BV], dtype=tl.float32)\n")],
    "du-in": [(LOCAL_DU, "                du = _load_stored_rows(du_ptr, tokens, vc, HV * V, 1, valid, V).to(tl.float32)\n")],
    "no-qdo": [(QUERY_TERM, "")],
    "chain-only": [(LOCAL_DU, "                du = tl.zeros([BT, BV], dtype=tl.float32)\n"), (QUERY_TERM, "")],
}
ORIGINAL_KERNEL = chunk_kernels._state_backward_kernel


def apply(variant: str) -> None:
    if variant == "default":
        chunk_kernels._state_backward_kernel = ORIGINAL_KERNEL
    else:
        name = "_state_step_" + variant.replace("-", "_")
        chunk_kernels._state_backward_kernel = edited_module(state_kernels, EDITS[variant], name)._state_backward_kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="default,no-pdo,du-in,no-qdo,chain-only")
    p.add_argument("--shapes", default="B1T32768H16D128,B4T4096H16D128")
    p.add_argument("--ops", default="gdn")
    a = p.parse_args()
    import torch

    for variant in a.variants.split(","):
        try:
            apply(variant)
        except Exception:  # noqa: BLE001 -- a variant that cannot be built is a result here
            print(f"{variant}: could not build\n{traceback.format_exc()}", flush=True)
            continue
        if not torch.cuda.is_available():
            print(f"{variant}: built (no GPU: not timed)", flush=True)
            continue
        for shape in a.shapes.split(","):
            for op in a.ops.split(","):
                try:
                    ms, kernels = time_step(*delta_rule_step(op, shape), ("state_backward",))
                    print(f"{variant:10s} {op} {shape}: fwd+bwd {ms:.3f} ms, state_backward "
                          f"{kernels['state_backward']:.3f} ms", flush=True)
                except Exception:  # noqa: BLE001
                    print(f"{variant} {op} {shape}: timing failed\n{traceback.format_exc()}", flush=True)
    apply("default")


if __name__ == "__main__":
    main()
