"""Context-parallel GDN and KDA, forward and forward+backward, at 64K tokens on two GPUs.

One command (NCCL, one process per GPU):

    torchrun --nproc-per-node 2 benchmarks/cp.py --out benchmarks/results/cp_h200.jsonl

For each op (GDN, KDA) and token layout (one 64K sequence; several sequences, one crossing the
rank boundary), side by side:

  1gpu-hc        hccompile's op on all tokens on rank 0 alone
  cp2-hc-<s>     hccompile under context_parallel on both ranks, exchange strategy s
                 (all_gather, scan, ring)
  cp2-hc-<s>-walk-again
                 the same with middle segments (CP4 and more) walked again after the merge
                 instead of from their summary walk's stored chunks (cp.MIDDLE_WALK_STORES_CHUNKS),
                 for --strategies entries spelled `<s>:walk-again`
  cp2-hc-<s>-summary16
                 the same with the summary sweeps' value tiles narrowed down to 16 columns
                 (cp.SUMMARY_MIN_TILE is 32), for entries spelled `<s>:summary16`; targets.py
                 reads only cp2-hc-all_gather
  1gpu-fla       FLA's op on all tokens on rank 0 alone             (if `fla` imports)
  cp2-fla        FLA's CP (fla.ops.cp.build_cp_context) on both ranks (if `fla` imports)

Times are medians of CUDA-event timings over --iters iterations after --warmup (each iteration
starts after a barrier; a CP time is the slowest rank's median). Every CP row also reports its
relative RMS error against the 1-GPU run of the same implementation (output and dq), so a fast
wrong answer shows. Writes one JSON line per row to --out and the markdown table to --out with
the suffix .md (and prints it). A variant that fails (e.g. FLA 0.6.0's GDN backward refuses Triton
3.4-3.7 on Hopper) is a row with its error, not a crash.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import statistics
import time
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _fla import FLA_GDN_TIMING_ONLY, unlock_fla_gdn_backward  # this script's directory

SEVERAL = [8192, 20000, 3000, 12000, 16000, 6344]  # 65536 tokens; the 4th sequence crosses the CP2 boundary


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON lines file (appended); the table goes to <out>.md")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ops", default="gdn,kda")
    parser.add_argument("--layouts", default="one,several")
    parser.add_argument("--strategies", default="all_gather,scan,ring",
                        help="exchange strategies; `<s>:walk-again` times strategy s with middle segments walked "
                             "again after the merge, `<s>:summary16` with the summary sweeps' tiles down to 16")
    parser.add_argument("--layers", type=int, default=1,
                        help="a step runs this many ops in a chain (each layer's v is the previous layer's o), as "
                             "a model's layers do: rank 1 then trails rank 0 by one sweep once, not per layer "
                             "(variants get a -<N>layers suffix, which benchmarks/targets.py does not read)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-fla", action="store_true", help="skip FLA even if it imports")
    parser.add_argument("--impls", default="hc,fla",
                        help="implementations to run: hc, fla or both (e.g. only FLA's rows in a short device slot)")
    parser.add_argument("--skip-one-gpu", action="store_true",
                        help="run only the CP rows (their error columns then stay empty): for a short slot "
                             "after the one-GPU rows were measured")
    parser.add_argument("--stack-dump-every", type=float, default=0,
                        help="seconds: every rank prints all its threads' stacks to stderr this often (0: never), "
                             "to tell a hang in a collective from a slow first call in a short device slot")
    parser.add_argument("--profile", default=None,
                        help="directory: after the timed cp rows of our default strategy, every rank profiles three "
                             "forward+backward steps and writes its CUDA-kernel table and its chrome trace there "
                             "(where the time goes, and which rank waits for which)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: gloo and wall-clock timing, for a smoke run of this script under "
                             "TRITON_INTERPRET=1 at tiny sizes (no meaningful times)")
    return parser.parse_args()


def seqlens_of(layout: str, tokens: int) -> list[int]:
    if layout == "one":
        return [tokens]
    scale = tokens / sum(SEVERAL)
    lengths = [max(1, int(n * scale)) for n in SEVERAL]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def make_inputs(op: str, tokens: int, heads: int, dim: int, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)  # same inputs on every rank

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k, v = (randn(1, tokens, heads, dim).to(dtype) for _ in range(3))
    beta = torch.rand(1, tokens, heads, generator=gen, device=device).to(dtype)
    gate_shape = (1, tokens, heads) if op == "gdn" else (1, tokens, heads, dim)
    g = F.logsigmoid(randn(*gate_shape) + 4).to(dtype)  # weak decay: state crosses the boundary
    do = randn(1, tokens, heads, dim).to(dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta), do


# ----------------------------------------------------------------------------------------
# Implementations: each returns a function (tensors, cu_seqlens) -> o


def hc_function(op: str):
    import hccompile

    function = hccompile.chunk_gated_delta_rule if op == "gdn" else hccompile.chunk_kda

    def run(t, cu_seqlens):
        o, _ = function(t["q"], t["k"], t["v"], t["g"], t["beta"], cu_seqlens=cu_seqlens,
                        use_qk_l2norm_in_kernel=True)
        return o

    return run


def fla_function(op: str, cp_context=None):
    if op == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as function
    else:
        from fla.ops.kda import chunk_kda as function

    def run(t, cu_seqlens):
        kwargs = dict(cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        if cp_context is not None:
            kwargs.update(cu_seqlens=cp_context.cu_seqlens, cp_context=cp_context)
        o, _ = function(q=t["q"], k=t["k"], v=t["v"], g=t["g"], beta=t["beta"], **kwargs)
        return o

    return run


def fla_available() -> str | None:
    try:
        import fla  # noqa: F401
        from fla.ops.cp import build_cp_context  # noqa: F401
    except Exception as error:  # noqa: BLE001 (any import failure means: skip with a note)
        return f"fla not importable: {type(error).__name__}: {error}"
    return None


def stacked(run, layers: int):
    """`run` as `layers` layers in a chain: each layer's v is the previous layer's output."""
    if layers == 1:
        return run

    def run_layers(t, cu_seqlens):
        o = None
        for _ in range(layers):
            o = run(t if o is None else {**t, "v": o}, cu_seqlens)
        return o

    return run_layers


# ----------------------------------------------------------------------------------------
# Timing


def _elapsed_ms(step, device) -> float:
    if device.type != "cuda":
        begin = time.perf_counter()
        step()
        return (time.perf_counter() - begin) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def median_ms(step, iters: int, warmup: int, group_wide: bool, device) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if group_wide:
            dist.barrier()
        times.append(_elapsed_ms(step, device))
    result = torch.tensor([statistics.median(times)], device=device)
    if group_wide:
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return float(result.item())


def first_call(step, label: str, device) -> None:
    """Runs `step` once and prints its time to stderr: the first call compiles and autotunes, and its
    time says where a slow variant spends a short device slot."""
    begin = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"{label} {time.perf_counter() - begin:.1f} s", file=sys.stderr, flush=True)


def measure(run, tensors, cu_seqlens, do, iters, warmup, group_wide, context=contextlib.nullcontext):
    """(fwd ms, fwd+bwd ms, o, dq); `context()` is entered around each forward and backward."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in tensors.items()}

    def forward():
        with torch.no_grad(), context():
            return run(leaves, cu_seqlens)

    device = leaves["q"].device
    rank = dist.get_rank() if group_wide else 0
    first_call(forward, f"rank {rank}: first forward", device)
    fwd = median_ms(forward, iters, warmup, group_wide, device)

    def step():
        with context():
            o = run(leaves, cu_seqlens)
            return o, torch.autograd.grad(o, [leaves["q"]], do)[0]

    first_call(step, f"rank {rank}: first forward+backward", device)
    both = median_ms(step, iters, warmup, group_wide, device)
    o, dq = step()
    return fwd, both, o.detach(), dq.detach()


def profile_steps(run, local, ctx, do, path: Path, steps: int = 3) -> None:
    """This rank's CUDA kernels over `steps` forward+backward steps under context_parallel, as a
    table sorted by total device time (per step: divide by `steps`)."""
    from torch.profiler import ProfilerActivity, profile

    from hccompile.distributed import context_parallel

    leaves = {n: t.detach().clone().requires_grad_() for n, t in local.items()}
    local_do = ctx.shard(do)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with context_parallel(ctx):
                o = run(leaves, ctx.cu_seqlens)
                torch.autograd.grad(o, [leaves["q"]], local_do)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    # The timeline too (chrome://tracing or Perfetto): which rank waits for which, and for how long.
    prof.export_chrome_trace(str(path.with_suffix(".trace.json")))
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    path.write_text(f"{steps} forward+backward steps, rank {dist.get_rank()}\n"
                    + prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60))


def relative_error(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float(((out - ref).norm() / ref.norm().clamp_min(1e-30)).item())


# ----------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    if args.stack_dump_every > 0:
        faulthandler.dump_traceback_later(args.stack_dump_every, repeat=True, file=sys.stderr)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    from hccompile.distributed import build_cp_context, context_parallel

    fla_note = "disabled (--no-fla)" if args.no_fla else fla_available()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke run)"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from targets import run_stamp

    meta = dict(**run_stamp(), device=name, world=world,
                torch=torch.__version__, tokens=args.tokens, heads=args.heads, head_dim=args.head_dim,
                dtype=args.dtype)
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    rows = []

    out = Path(args.out)

    def record(**row):  # appended as measured: a run cut by a time limit keeps its rows
        row = {**meta, **row}
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")

    for op in args.ops.split(","):
        for layout in args.layouts.split(","):
            lengths = seqlens_of(layout, args.tokens)
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            cu_global = torch.tensor(cu, dtype=torch.int64, device=device)
            tensors, do = make_inputs(op, args.tokens, args.heads, args.head_dim, dtype, device)
            common = dict(op=op, layout=layout, sequences=len(lengths), layers=args.layers)
            suffix = f"-{args.layers}layers" if args.layers > 1 else ""
            wanted = args.impls.split(",")
            implementations = [("hc", hc_function)] if "hc" in wanted else []
            if fla_note is None and "fla" in wanted:
                implementations.append(("fla", fla_function))
            for name, factory in implementations:
                single = None
                if name == "fla" and op == "gdn" and unlock_fla_gdn_backward():
                    common_fla = dict(common, note=FLA_GDN_TIMING_ONLY)
                else:
                    common_fla = common
                if rank == 0 and not args.skip_one_gpu:
                    try:
                        fwd, both, o, dq = measure(stacked(factory(op), args.layers), tensors, cu_global, do, args.iters, args.warmup,
                                                   group_wide=False)
                        single = (o, dq)
                        record(variant=f"1gpu-{name}{suffix}", fwd_ms=fwd, fwd_bwd_ms=both, **common_fla)
                    except Exception as error:  # noqa: BLE001 (a refused variant is a row, not a crash)
                        record(variant=f"1gpu-{name}{suffix}", error=f"{type(error).__name__}: {error}", **common_fla)
                        traceback.print_exc()
                dist.barrier()
                strategies = args.strategies.split(",") if name == "hc" else ["fla"]
                for entry in strategies:
                    strategy, _, mode = entry.partition(":")
                    variant = f"cp{world}-{name}" + (f"-{strategy}" if name == "hc" else "") + (
                        f"-{mode}" if mode else "") + suffix
                    try:
                        if name == "hc":
                            import hccompile.kernels.delta_rule.cp as cp_kernels

                            if mode not in ("", "walk-again", "summary16"):
                                raise ValueError(f"--strategies: unknown mode {mode!r} in {entry!r}")
                            # A failed variant must not leave the next one in its mode.
                            cp_kernels.MIDDLE_WALK_STORES_CHUNKS = mode != "walk-again"
                            summary_tile = cp_kernels.SUMMARY_MIN_TILE
                            if mode == "summary16":  # the summary sweeps' value tiles narrowed to 16 (see there)
                                cp_kernels.SUMMARY_MIN_TILE = 16
                            try:
                                ctx = build_cp_context(cu, strategy=strategy, device=device)
                                local = {n: ctx.shard(t) for n, t in tensors.items()}
                                fwd, both, o, dq = measure(stacked(factory(op), args.layers), local, ctx.cu_seqlens, ctx.shard(do),
                                                           args.iters, args.warmup, group_wide=True,
                                                           context=lambda ctx=ctx: context_parallel(ctx))
                                if args.profile and strategy == "all_gather" and not mode:
                                    profile_steps(stacked(factory(op), args.layers), local, ctx, do, Path(args.profile) /
                                                  f"cp{world}_{op}_{args.tokens}_{layout}_rank{rank}.txt")
                            finally:
                                cp_kernels.MIDDLE_WALK_STORES_CHUNKS = True
                                cp_kernels.SUMMARY_MIN_TILE = summary_tile
                            o, dq = ctx.unshard(o), ctx.unshard(dq)
                        else:
                            from fla.ops.cp import build_cp_context as fla_context

                            fctx = fla_context(cu_global, group=dist.group.WORLD)
                            per_rank = args.tokens // world
                            local = {n: t[:, rank * per_rank:(rank + 1) * per_rank].contiguous()
                                     for n, t in tensors.items()}
                            fwd, both, o, dq = measure(stacked(factory(op, fctx), args.layers), local, None,
                                                       do[:, rank * per_rank:(rank + 1) * per_rank].contiguous(),
                                                       args.iters, args.warmup, group_wide=True)
                            gathered = [torch.empty_like(o) for _ in range(world)]
                            dist.all_gather(gathered, o.contiguous())
                            o = torch.cat(gathered, dim=1)
                            gathered = [torch.empty_like(dq) for _ in range(world)]
                            dist.all_gather(gathered, dq.contiguous())
                            dq = torch.cat(gathered, dim=1)
                        checks = {}
                        if single is not None:
                            checks = dict(o_error=relative_error(o, single[0]), dq_error=relative_error(dq, single[1]))
                        record(variant=variant, fwd_ms=fwd, fwd_bwd_ms=both, **checks, **common_fla)
                    except Exception as error:  # noqa: BLE001
                        record(variant=variant, error=f"{type(error).__name__}: {error}", **common_fla)
                        if rank == 0:
                            traceback.print_exc()
                    dist.barrier()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            if fla_note is not None:
                record(variant="fla", error=f"skipped: {fla_note}", **common)

    if rank == 0:
        table = markdown(rows)
        out.with_suffix(".md").write_text(table)
        print(table)
    dist.destroy_process_group()


def markdown(rows) -> str:
    """One table: fwd and fwd+bwd ms, speedup over the same implementation on one GPU, errors."""
    meta = rows[0] if rows else {}
    lines = [f"{meta.get('device', '?')} x{meta.get('world', '?')}, torch {meta.get('torch', '?')}, "
             f"triton {meta.get('triton', '?')}, {meta.get('tokens')} tokens, H{meta.get('heads')} "
             f"D{meta.get('head_dim')} {meta.get('dtype')}, median ms", "",
             "| op | sequences | variant | fwd | fwd+bwd | speedup fwd / fwd+bwd | o err | dq err | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    singles = {(r["op"], r["layout"], r["variant"].split("-")[1]): r for r in rows
               if r["variant"].startswith("1gpu") and "fwd_ms" in r}
    for r in rows:
        if "fwd_ms" not in r:
            lines.append(f"| {r['op']} | {r['sequences']} | {r['variant']} | | | | | | {r.get('error', '')[:120]} |")
            continue
        base = singles.get((r["op"], r["layout"], r["variant"].split("-")[1]))
        speed = ""
        if base is not None and not r["variant"].startswith("1gpu"):
            speed = f"{base['fwd_ms'] / r['fwd_ms']:.2f}x / {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x"
        err = lambda key: f"{r[key]:.1e}" if key in r else ""  # noqa: E731
        lines.append(f"| {r['op']} | {r['sequences']} | {r['variant']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} "
                     f"| {speed} | {err('o_error')} | {err('dq_error')} | {r.get('note', '')[:60]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
