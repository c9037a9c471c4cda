"""Would the delta rule's state sweeps pay to run segment-parallel on one GPU? (issue 20 at B1, issue 22's
waiting rank.) A measurement of the design's parts before any of it is built.

At B1 T32768 H16 the two sweeps (state_forward, state_backward) walk 512 chunks one after another in
16 x (V / BV) programs: a chain of dependent steps on a GPU with 132 SMs, latency-bound (GDN: 1.5 of
4.7 ms, diag_delta-profile_…45a2b89.txt). Lightning met its B1 row by cutting the sequence into
segments whose summaries are formed in parallel, then a prefix, then the sweeps per segment. The delta
rule's chunk transition is a dense K x K matrix, so a segment's summary is the walk of [H | M] (K + V
columns; cp.summary_forward / summary_backward, which CP already has) from a zero state. The design:

    1. every segment's [H | M] (forward) / [dH | M^T] (backward) at once     walk of T/G chunks, K + V columns
    2. the chain S_in(s+1) = M_s S_in(s) + H_s over the G segments             tiny (cp.merge_chains)
    3. every segment's ordinary sweep from its S_in (dS_out), at once           walk of T/G chunks, V columns

This script times what that would cost with today's kernels: the op over the sequence cut into G
independent pieces (B = 1, cu_seqlens: step 3's sweeps and everything chunk-parallel), plus the summary
kernels over the same pieces (step 1; the summaries' chunk-parallel set-up is not counted: the op
already runs it), against the op on the whole sequence, per kernel from torch.profiler. Projected
segment-parallel fwd+bwd = pieces' fwd+bwd + summary kernels; the merge is G tiny matrix products.

It first checks the design's algebra with the public pieces (the interpreter on a CPU, or the GPU):
folding the pieces' forward summaries over the chain gives the whole sequence's final state.

    python benchmarks/analysis/delta_segment_parallel_proto.py [--ops gdn,kda] [--pieces 4,8,16]
    TRITON_INTERPRET=1 python benchmarks/analysis/delta_segment_parallel_proto.py --check-only
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

SWEEPS = ("_state_forward_kernel", "_state_backward_kernel")
SUMMARIES = ("_summary_forward_kernel", "_summary_backward_kernel")


def inputs(op: str, T: int, H: int, D: int, dtype, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    q, k, v = randn(1, T, H, D), randn(1, T, H, D), randn(1, T, H, D)
    beta = torch.rand(1, T, H, generator=gen, device=device).to(dtype)
    g_shape = (1, T, H) if op == "gdn" else (1, T, H, D)
    g = torch.nn.functional.logsigmoid(torch.randn(*g_shape, generator=gen, device=device)).float()
    return q, k, v, g, beta


def op_fn(op: str):
    import hccompile

    return hccompile.chunk_gated_delta_rule if op == "gdn" else hccompile.chunk_kda


def bounds(T: int, pieces: int) -> list[int]:
    return [T * i // pieces for i in range(pieces + 1)]


def check(op: str, device: str, T: int = 200, H: int = 2, D: int = 32, pieces: int = 3) -> float:
    """Relative error of the whole sequence's final state against the fold of the pieces' [H | M]."""
    from hccompile.kernels.delta_rule import cp

    q, k, v, g, beta = (t.float() for t in inputs(op, T, H, D, torch.float32, device, seed=1))
    _, final = op_fn(op)(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)
    gate = "scalar" if op == "gdn" else "channel"
    summaries = cp.summary_forward(q, k, v, beta, g, gate=gate, cu_seqlens=bounds(T, pieces),
                                   use_qk_l2norm_in_kernel=True)  # [pieces, H, K, V + K]
    state = torch.zeros(H, D, D, dtype=torch.float64, device=device)
    for s in range(pieces):
        h, m = summaries[s, ..., :D].double(), summaries[s, ..., D:].double()
        state = h + m @ state
    return float((state - final[0].double()).norm() / final[0].double().norm())


def kernel_ms(step, steps: int = 5) -> tuple[float, dict[str, float]]:
    from _profile import profile_step

    for _ in range(2):
        step()
    _, summary = profile_step(step, steps=steps, top=60)
    return summary["gpu_busy_ms"], {row["kernel"]: row["ms"] for row in summary["top"]}


def measure(op: str, T: int, H: int, D: int, pieces_list: list[int]) -> None:
    from hccompile.kernels.delta_rule import cp

    device = "cuda"
    q, k, v, g, beta = inputs(op, T, H, D, torch.bfloat16, device)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    do = torch.randn_like(v)
    f = op_fn(op)
    gate = "scalar" if op == "gdn" else "channel"

    def fwd_bwd(cu):
        def step():
            for t in leaves:
                t.grad = None
            o, _ = f(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                     cu_seqlens=None if cu is None else torch.tensor(cu, device=device))
            o.backward(do)
        return step

    whole_busy, whole = kernel_ms(fwd_bwd(None))
    sweeps = " + ".join(f"{whole.get(name, 0):.3f}" for name in SWEEPS)
    print(f"{op} B1 T{T} H{H} D{D}, whole sequence: GPU busy {whole_busy:.3f} ms fwd+bwd; sweeps {sweeps} ms")
    for pieces in pieces_list:
        cu = bounds(T, pieces)
        busy, kernels = kernel_ms(fwd_bwd(cu))
        detached = [t.detach() for t in (q, k, v, g, beta)]

        def summaries():
            cp.summary_forward(detached[0], detached[1], detached[2], detached[4], detached[3], gate=gate,
                               cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
            cp.summary_backward(detached[0], detached[1], detached[2], detached[4], detached[3], gate=gate,
                                cu_seqlens=cu, use_qk_l2norm_in_kernel=True, do=do)

        _, summary_kernels = kernel_ms(summaries)
        walk = sum(summary_kernels.get(name, 0.0) for name in SUMMARIES)
        sweeps = " + ".join(f"{kernels.get(name, 0):.3f}" for name in SWEEPS)
        print(f"  {pieces:3d} pieces: op {busy:.3f} ms (sweeps {sweeps}); summary walks "
              f"{' + '.join(f'{summary_kernels.get(n, 0):.3f}' for n in SUMMARIES)} ms; "
              f"projected {busy + walk:.3f} ms = {(busy + walk) / whole_busy:.3f}x the whole sequence's", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="gdn,kda")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--pieces", default="2,4,8,16")
    p.add_argument("--check-only", action="store_true")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for op in a.ops.split(","):
        error = check(op, device)
        print(f"check {op}: final state from the pieces' folded summaries, relative error {error:.2e}", flush=True)
        if not error < 1e-4:
            raise SystemExit(f"{op}: the pieces' summaries do not compose to the whole sequence's state")
    if a.check_only:
        return
    for op in a.ops.split(","):
        measure(op, a.T, a.H, a.D, [int(x) for x in a.pieces.split(",")])


if __name__ == "__main__":
    main()
