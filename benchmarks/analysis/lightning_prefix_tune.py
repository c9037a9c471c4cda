"""The lightning segment prefix's launch options (kernels/lightning/segments.py: PREFIX_SEGMENTS,
PREFIX_TILE, PREFIX_WARPS), each against the defaults in one process (issue 20).

The prefix pass turns the segment summaries into the states the sweeps start from. Session 39 ran it
as tl.associative_scan (0.025 ms a launch at B1 T32768 H16 D128 on the H200); session 40 as its
closed form, one fp32 product per block of segments (the interpreter runs a custom-combine scan
element by element), 0.036 ms. This times the closed form's options, forward (from k, v) and reverse
(from q, do), and checks each against the defaults' states (relative RMS, fp32 throughout).

    python benchmarks/analysis/lightning_prefix_tune.py --shape B1T32768H16D128
"""
from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from hccompile.kernels.lightning import chunk, segments as seg


def parse_shape(text: str) -> tuple[int, int, int, int]:
    b, rest = text[1:].split("T")
    t, rest = rest.split("H")
    h, d = rest.split("D")
    return int(b), int(t), int(h), int(d)


def prefix_ms(summaries: torch.Tensor, plan, decay: torch.Tensor, reverse: bool) -> tuple[float, torch.Tensor]:
    """The time of one prefix launch, and its output from `summaries` (it works in place)."""
    heads, dim_b, dim_c = summaries.shape[1:]
    tile = seg.prefix_tile(dim_b, dim_c)
    table, first, time, length, per_sequence = plan.kernel_args(decay)
    grid = (plan.num_sequences * heads, -(-dim_b * dim_c // tile))
    work = summaries.clone()

    def launch():
        seg._segment_prefix_kernel[grid](
            work, decay, table, first, work, work, *work.stride(), *work.stride(), *work.stride(), decay.stride(0),
            heads, dim_b, dim_c, time, length, per_sequence, IS_VARLEN=plan.varlen, REVERSE=reverse, HAS_X0=False,
            STORE_XT=False, SEGMENTS=seg.PREFIX_SEGMENTS, TILE=tile, num_warps=seg.PREFIX_WARPS)

    launch()
    torch.cuda.synchronize()
    once = work.clone()
    # the timed launches go on rewriting `work` from their own outputs: the values grow, the time does not
    return do_bench(launch, warmup=25, rep=200), once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="B1T32768H16D128")
    parser.add_argument("--segments", default="16,32")
    parser.add_argument("--tiles", default="32,64,128,256")
    parser.add_argument("--warps", default="1,2,4,8")
    args = parser.parse_args()
    batch, time, heads, dim = parse_shape(args.shape)
    torch.manual_seed(0)
    q = torch.empty(batch, time, heads, dim, device="cuda", dtype=torch.bfloat16)
    plan = chunk._forward_segments(q, q, None, None, chunk.DEFAULT_BLOCK, chunk.DEFAULT_FORWARD_CBLOCK, None)
    decay = -torch.linspace(0.001, 0.3, heads, device="cuda")
    summaries = torch.randn(plan.count, heads, dim, dim, device="cuda")
    print(f"{args.shape}: {plan.count} segments of {plan.length} rows, {plan.per_sequence} a sequence")
    defaults = (seg.PREFIX_SEGMENTS, seg.PREFIX_TILE, seg.PREFIX_WARPS)
    for reverse in (False, True):
        seg.PREFIX_SEGMENTS, seg.PREFIX_TILE, seg.PREFIX_WARPS = defaults
        base_ms, want = prefix_ms(summaries, plan, decay, reverse)
        print(f"{'reverse' if reverse else 'forward'} defaults S{defaults[0]} TILE{defaults[1]} W{defaults[2]}: "
              f"{base_ms * 1e3:.1f} us")
        for s, t, w in itertools.product(*(map(int, a.split(",")) for a in (args.segments, args.tiles, args.warps))):
            seg.PREFIX_SEGMENTS, seg.PREFIX_TILE, seg.PREFIX_WARPS = s, t, w
            try:
                ms, got = prefix_ms(summaries, plan, decay, reverse)
            except Exception as error:  # a configuration the compiler refuses (shared memory, registers)
                print(f"  S{s} TILE{t} W{w}: refused ({type(error).__name__}: {str(error)[:120]})")
                continue
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            print(f"  S{s:<3d} TILE{t:<4d} W{w}: {ms * 1e3:7.1f} us  {ms / base_ms:5.2f}x  rel err {err:.1e}"
                  + ("  WRONG" if not err < 1e-5 else ""))
    seg.PREFIX_SEGMENTS, seg.PREFIX_TILE, seg.PREFIX_WARPS = defaults


if __name__ == "__main__":
    main()
