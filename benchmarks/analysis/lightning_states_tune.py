"""Launch options of lightning's two state passes (kernels/lightning/segments.py), each against the
defaults in one process (issue 20):

- the segment summaries (`--kernel summary`: rows per step, the state tile, warps, stages), forward
  (from k, v);
- the segment prefix (`--kernel prefix`: PREFIX_SEGMENTS, PREFIX_TILE, PREFIX_WARPS), forward and
  reverse. Session 39 ran it as tl.associative_scan (0.025 ms a launch at B1 T32768 H16 D128 on the
  H200); session 40 as its closed form, one fp32 product per block of segments (the interpreter runs
  a custom-combine scan element by element).

Each option's output is checked against the defaults' (relative RMS, fp32 states).

    python benchmarks/analysis/lightning_states_tune.py --kernel summary,prefix --shape B1T32768H16D128
"""
from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from hccompile.kernels.lightning import chunk, segments as seg
from hccompile.kernels.lightning.tiles import _dot_options
from shapes import bthd


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


def summary_ms(k, v, plan, decay, chunk_rows, block_b, block_c, warps, stages) -> tuple[float, torch.Tensor]:
    """The time of one summary launch at these options, and its output."""
    heads, dim_b, dim_c = k.shape[2], k.shape[3], v.shape[3]
    states = torch.zeros(plan.count, heads, dim_b, dim_c, device=k.device)
    table, first, time, length, per_sequence = plan.kernel_args(decay)
    grid = (plan.count * heads * -(-dim_b // block_b) * -(-dim_c // block_c),)

    def launch():
        seg._segment_summary_kernel[grid](
            k, v, decay, table, states, *k.stride(), *v.stride(), *states.stride(), decay.stride(0),
            heads, dim_b, dim_c, 1.0, time, length, per_sequence, IS_VARLEN=plan.varlen, REVERSE=False,
            CHUNK=chunk_rows, BLOCK_B=block_b, BLOCK_C=block_c, **_dot_options(k.dtype),
            num_warps=warps, num_stages=stages)

    launch()
    torch.cuda.synchronize()
    return do_bench(launch, warmup=25, rep=200), states.clone()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def tune_summary(k, v, plan, decay) -> None:
    default = (seg.SUMMARY_CHUNK, seg.SUMMARY_ROW_TILE, seg.SUMMARY_COLUMN_TILE, 4, 3)
    base_ms, want = summary_ms(k, v, plan, decay, *default)
    print(f"summary defaults CHUNK{default[0]} B{default[1]} C{default[2]} W4 S3: {base_ms * 1e3:.1f} us")
    options = [(c, b, cc, w, s) for c in (32, 64, 128) for b, cc in ((128, 64), (128, 128), (64, 64), (64, 128))
               for w in (4, 8) for s in (2, 3)]
    for option in options:
        try:
            ms, got = summary_ms(k, v, plan, decay, *option)
        except Exception as error:  # a configuration the compiler refuses (shared memory, registers)
            print(f"  {option}: refused ({type(error).__name__}: {str(error)[:120]})")
            continue
        err = relative_error(got, want)
        print(f"  CHUNK{option[0]:<4d} B{option[1]:<4d} C{option[2]:<4d} W{option[3]} S{option[4]}: {ms * 1e3:7.1f} us"
              f"  {ms / base_ms:5.2f}x  rel err {err:.1e}" + ("  WRONG" if not err < 1e-2 else ""))


def tune_prefix(summaries, plan, decay, args) -> None:
    defaults = (seg.PREFIX_SEGMENTS, seg.PREFIX_TILE, seg.PREFIX_WARPS)
    for reverse in (False, True):
        seg.PREFIX_SEGMENTS, seg.PREFIX_TILE, seg.PREFIX_WARPS = defaults
        base_ms, want = prefix_ms(summaries, plan, decay, reverse)
        print(f"prefix {'reverse' if reverse else 'forward'} defaults S{defaults[0]} TILE{defaults[1]} "
              f"W{defaults[2]}: {base_ms * 1e3:.1f} us")
        for s, t, w in itertools.product(*(map(int, a.split(",")) for a in (args.segments, args.tiles, args.warps))):
            seg.PREFIX_SEGMENTS, seg.PREFIX_TILE, seg.PREFIX_WARPS = s, t, w
            try:
                ms, got = prefix_ms(summaries, plan, decay, reverse)
            except Exception as error:  # a configuration the compiler refuses (shared memory, registers)
                print(f"  S{s} TILE{t} W{w}: refused ({type(error).__name__}: {str(error)[:120]})")
                continue
            err = relative_error(got, want)
            print(f"  S{s:<3d} TILE{t:<4d} W{w}: {ms * 1e3:7.1f} us  {ms / base_ms:5.2f}x  rel err {err:.1e}"
                  + ("  WRONG" if not err < 1e-5 else ""))
    seg.PREFIX_SEGMENTS, seg.PREFIX_TILE, seg.PREFIX_WARPS = defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default="summary,prefix")
    parser.add_argument("--shape", default="B1T32768H16D128")
    parser.add_argument("--segments", default="16,32", help="prefix: segments a block")
    parser.add_argument("--tiles", default="64,128,256", help="prefix: state elements a program")
    parser.add_argument("--warps", default="1,2,4", help="prefix: warps")
    args = parser.parse_args()
    batch, time, heads, dim = bthd(args.shape)
    torch.manual_seed(0)
    k = torch.randn(batch, time, heads, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, time, heads, dim, device="cuda", dtype=torch.bfloat16)
    plan = chunk._forward_segments(k, v, None, None, chunk.DEFAULT_BLOCK, chunk.DEFAULT_FORWARD_CBLOCK, None)
    decay = -torch.linspace(0.001, 0.3, heads, device="cuda")
    print(f"{args.shape}: {plan.count} segments of {plan.length} rows, {plan.per_sequence} a sequence")
    if "summary" in args.kernel:
        tune_summary(k, v, plan, decay)
    if "prefix" in args.kernel:
        tune_prefix(torch.randn(plan.count, heads, dim, dim, device="cuda"), plan, decay, args)


if __name__ == "__main__":
    main()
