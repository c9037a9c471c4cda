"""Sweep the lightning kernels' exact tuning knobs (block, micro-chunk, column tile, warps,
segment, the flat loop, the paired reverse sweep) on the GPU and print the time of each forward
and backward configuration, so the
defaults in kernels/lightning/chunk.py and sweeps.py are chosen by measurement.

    python benchmarks/lightning_tune.py [--shapes B4-T4096-H16-D128,...] [--out tune.jsonl]
    python benchmarks/lightning_tune.py --around-defaults   # the defaults and their neighbours, with
                                                            # sequential states on and off (D 128 and 64)
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from lightning import SHAPES, ragged_bounds  # noqa: E402  (benchmarks/ is the script's directory)


def main(argv=None):
    from triton.testing import do_bench

    from hccompile.kernels._triton import compiled_resources
    from hccompile.kernels.lightning import chunk, sweeps
    from hccompile.lowering.lightning import alibi_decay

    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="B4-T4096-H16-D128,B1-T32768-H16-D128")
    p.add_argument("--out", default=None)
    p.add_argument("--flat-only", action="store_true",
                   help="only the flat-loop configs (sweeps.FLAT_SWEEPS) and the nested ones at block 64, cblock 64, tile 128")
    p.add_argument("--around-defaults", action="store_true",
                   help="the flat loop at 64 columns / 4 warps (the defaults) and its neighbours: paired reverse, "
                        "8 warps, 128 columns with 512-row segments, the nested loops; each with segments.SEQUENTIAL_STATES "
                        "True and False; shapes default to all three of benchmarks/lightning.py")
    p.add_argument("--defaults-only", action="store_true",
                   help="with --around-defaults: only the defaults (sequential states chosen per launch)")
    p.add_argument("--stage-budgets", default=str(96 * 1024),
                   help="comma-separated sweeps.PIPELINE_SHARED_MEMORY_BUDGET values (bytes) to run every config at: "
                        "the flat forward sweep spills 208/80/16 B a thread at 1/2/3 stages (sm_90, Triton 3.6), "
                        "and 3 stages (120 KiB) leave one program per SM")
    p.add_argument("--saved-states", action="store_true",
                   help="also the backward from the forward's saved segment states (lightning_attn_bwd(states=)): "
                        "bwd_saved_states_ms")
    args = p.parse_args(argv)
    import triton

    from hccompile.kernels.lightning import segments

    from targets import run_stamp

    stamp = run_stamp()
    rows = []
    if args.around_defaults and args.shapes == p.get_default("shapes"):
        args.shapes = ",".join(SHAPES)
    for name in args.shapes.split(","):
        b, t, h, d, *varlen = SHAPES[name]
        cu_seqlens = ragged_bounds(t, varlen[0], "cuda") if varlen else None
        q, k, v, do = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16) * 0.5 for _ in range(4))
        decay = alibi_decay(h, device="cuda")
        configs = list(itertools.product((64,), (32, 64), (64, 128), (4, 8), (None, 512)))
        configs += [(128, 32, 64, 8, None), (128, 64, 64, 8, None), (64, 16, 64, 4, None)]
        # cblock == block configs run three times: the nested micro-chunk loops, the flat loop, and
        # the flat loop with dk and dv from one paired reverse sweep (sweeps.PAIRED_REVERSE)
        configs = ([(*c, False, False) for c in configs]
                   + [(*c, True, paired) for c in configs if c[0] == c[1] for paired in (False, True)])
        configs = [(*c, None) for c in configs]  # the last field: segments.SEQUENTIAL_STATES
        if args.flat_only:
            configs = [c for c in configs if c[-3]] + [c for c in configs if c[:3] == (64, 64, 128) and not c[-3]]
        if args.around_defaults:
            around = [(64, 64, 64, 4, None, True, False), (64, 64, 64, 4, None, True, True),
                      (64, 64, 64, 8, None, True, True), (64, 64, 128, 4, 512, True, False),
                      (64, 64, 128, 8, None, False, False)]
            configs = [(*c, sequential) for c in around for sequential in (True, False)]
            if args.defaults_only:
                configs = [(*around[0], None)]
        configs = [(*c, budget) for c in configs for budget in map(int, args.stage_budgets.split(","))]
        for block, cblock, tile, warps, seg, flat, paired, sequential, budget in configs:
            sweeps.FLAT_SWEEPS, sweeps.PAIRED_REVERSE, segments.SEQUENTIAL_STATES = flat, paired, sequential
            sweeps.PIPELINE_SHARED_MEMORY_BUDGET = budget
            knobs = dict(block=block, cblock=cblock, column_tile=tile, num_warps=warps, segment=seg,
                         cu_seqlens=cu_seqlens)
            try:
                # medians: means of sub-millisecond launches moved by up to 40 % (session 31's forward rows)
                f = do_bench(lambda: chunk.lightning_attn_fwd(q, k, v, decay, None, **knobs), return_mode="median")
                bw = do_bench(lambda: chunk.lightning_attn_bwd(q, k, v, decay, do, None, **knobs),
                              return_mode="median")
                saved_bw = None
                if args.saved_states:
                    saved = chunk.lightning_attn_fwd(q, k, v, decay, None, **knobs, return_states=True)[2]
                    saved_bw = do_bench(lambda: chunk.lightning_attn_bwd(q, k, v, decay, do, None, **knobs,
                                                                         states=saved), return_mode="median")
            except Exception as error:  # noqa: BLE001  (out of resources for a config)
                print(name, knobs, "failed:", str(error).splitlines()[0][:120])
                continue
            res = compiled_resources(sweeps._reverse_sweep_kernel)
            shared = max((r["shared_bytes"] or 0) for r in res) if res else None
            row = dict(**stamp, device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, shape=name, **{n: x for n, x in knobs.items() if n != "cu_seqlens"},
                       sequences=varlen[0] if varlen else b, flat=flat, paired=paired, sequential=sequential,
                       stage_budget=budget, fwd_ms=f, bwd_ms=bw, bwd_saved_states_ms=saved_bw,
                       max_reverse_shared=shared)
            rows.append(row)
            if args.out:  # as measured: a run cut short keeps its rows
                with open(args.out, "a") as sink:
                    sink.write(json.dumps(row) + "\n")
            print(f"{name} block={block} cblock={cblock} tile={tile} warps={warps} seg={seg} flat={flat} paired={paired} "
                  f"sequential={sequential} stage budget={budget}: "
                  f"fwd {f:.3f} bwd {bw:.3f} ms", flush=True)
        best_f = min((r for r in rows if r["shape"] == name), key=lambda r: r["fwd_ms"])
        best_b = min((r for r in rows if r["shape"] == name), key=lambda r: r["bwd_ms"])
        print("best fwd", best_f, "\nbest bwd", best_b, flush=True)
    for r in compiled_resources(sweeps._reverse_sweep_kernel) + compiled_resources(sweeps._forward_sweep_kernel):
        print(r)


if __name__ == "__main__":
    main()
