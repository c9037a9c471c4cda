"""htree attention: our Triton kernels vs dense causal SDPA vs the PyTorch reference, forward and
forward+backward, with peak memory.

Defaults: B=1, HQ=32, H_kv=4, D=128, bfloat16, T in 8K, 32K, 128K; htree with compression rate
16 and top_k 64 (max_top_nodes 1024: about 2 x 1024 candidates per query and layer). `--config
seed` uses the public code's regime instead (top_k 512, max_top_nodes 8192). Timings are
triton.testing.do_bench medians in milliseconds; memory is the peak allocated during one call
above what was allocated before it. The reference is skipped above --reference-max-t (it gathers
[B, H_kv, chunk, candidates, D] tensors and is slow), and any run that runs out of memory is
reported as OOM. Prints a markdown table and appends JSON lines to --out.

    python benchmarks/htree.py --out benchmarks/results/htree_h100.jsonl
    python benchmarks/htree.py --config seed --seq 8192,32768 --out benchmarks/results/htree_seed.jsonl
"""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.nn.functional as F

CONFIGS = {
    "default": dict(compression_rate=16, top_k=64, max_top_nodes=None),
    "seed": dict(compression_rate=16, top_k=512, max_top_nodes=8192),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", default="8192,32768,131072", help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="default")
    parser.add_argument("--causal", action="store_true", help="htree's causal selection variant")
    parser.add_argument("--reference-max-t", type=int, default=8192)
    parser.add_argument("--impls", default="htree,sdpa,reference",
                        help="from htree (the library's defaults), htree-atomics (node gradients by float32 atomics), "
                             "htree-nodes (node-stationary node gradients), sdpa, reference")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    parser.add_argument("--block-c", type=int, default=None, help="tuning: kernels' candidate tile (power of 2)")
    parser.add_argument("--num-warps", type=int, default=None, help="tuning: kernels' warps per program")
    parser.add_argument("--programs-per-sm", type=int, default=None,
                        help="tuning: persistent programs per SM (each walks one query at a time, so this is "
                             "how many walks an SM keeps in flight)")
    parser.add_argument("--node-warps", type=int, default=None,
                        help="tuning (htree-nodes): warps of the node-gradient programs")
    parser.add_argument("--node-rows", type=int, default=None,
                        help="tuning (htree-nodes): (query, head) rows per node-gradient tile")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    return parser.parse_args()


def make_inputs(a, T: int, layout: str):
    dtype = getattr(torch, a.dtype)
    generator = torch.Generator(device="cuda").manual_seed(T)
    shapes = [(a.batch, T, a.heads, a.dim), (a.batch, T, a.kv_heads, a.dim), (a.batch, T, a.kv_heads, a.dim)]
    tensors = [torch.randn(s, device="cuda", generator=generator, dtype=dtype) for s in shapes]
    if layout == "bhtd":  # SDPA's layout, prepared outside the timed region
        tensors = [t.transpose(1, 2).contiguous() for t in tensors]
    return [t.requires_grad_() for t in tensors]


def _library_node_gradients() -> bool:
    from hccompile.kernels.htree import tiles

    return tiles.NODE_GRADIENTS


# The library's default, read before any run sets tiles.NODE_GRADIENTS for its own calls.
LIBRARY_NODE_GRADIENTS = _library_node_gradients()


def node_gradients_of(name: str) -> bool:
    """tiles.NODE_GRADIENTS for an htree implementation name (profile_ops.py uses it too): node-
    stationary (htree-nodes, kernels/htree/node_gradients.py), float32 atomics (htree-atomics), or
    the library's default (htree). Set on each call: the implementations share one process."""
    return {"htree": LIBRARY_NODE_GRADIENTS, "htree-nodes": True, "htree-atomics": False}[name]


def implementation(name: str, a):
    from hccompile.kernels.htree.reference import htree_attention_ref
    from hccompile.lowering.htree import htree_attention

    from hccompile.kernels.htree import tiles

    options = dict(CONFIGS[a.config], causal=a.causal)
    if name in ("htree", "htree-nodes", "htree-atomics"):
        nodes = node_gradients_of(name)

        def run(q, k, v):
            tiles.NODE_GRADIENTS = nodes
            return htree_attention(q, k, v, **options)
        return "bthd", run
    if name == "reference":
        return "bthd", lambda q, k, v: htree_attention_ref(q, k, v, **options)
    if name == "sdpa":
        return "bhtd", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    raise ValueError(f"--impls: unknown implementation {name!r}")


def _node_knobs() -> dict:
    from hccompile.kernels.htree import node_gradients

    return dict(node_warps=node_gradients.NODE_WARPS, node_rows=node_gradients.TILE_ROWS)


def _walk_knobs(a, T: int) -> dict:
    """The walks' tile, warps and programs per SM as make_plan gives them (tiles' defaults, or the flags')."""
    from hccompile.kernels.htree import tiles
    from hccompile.kernels.htree.reference import resolve_htree_config

    q = torch.empty((a.batch, T, a.heads, a.dim), device="meta", dtype=getattr(torch, a.dtype))
    kv = torch.empty((a.batch, T, a.kv_heads, a.dim), device="meta", dtype=q.dtype)
    cfg = resolve_htree_config(q, kv, kv, **CONFIGS[a.config], causal=a.causal)
    plan = tiles.make_plan(T, a.heads // a.kv_heads, a.dim, a.dim, cfg, "cpu")
    return dict(block_c=plan.block_c, num_warps=plan.num_warps, programs_per_sm=plan.programs_per_sm)


def run_one(a, name: str, T: int, mode: str) -> dict:
    from triton.testing import do_bench

    row = dict(impl=name, T=T, mode=mode, B=a.batch, HQ=a.heads, H_kv=a.kv_heads, D=a.dim, dtype=a.dtype,
               config=a.config, causal=a.causal, **_walk_knobs(a, T), **_node_knobs(),
               **{k: v for k, v in CONFIGS[a.config].items()})
    if name == "reference" and T > a.reference_max_t:
        return dict(row, ms=None, peak_mib=None, note=f"skipped: T > --reference-max-t={a.reference_max_t}")
    layout, fn = implementation(name, a)
    try:
        q, k, v = make_inputs(a, T, layout)
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    return fn(q, k, v)
        else:
            grad = torch.randn_like(q[..., : v.shape[-1]] if layout == "bthd" else q)

            def call():
                out = fn(q, k, v)
                return torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        ms = do_bench(call, rep=a.rep, return_mode="median")
        return dict(row, ms=ms, peak_mib=peak, note="")
    except torch.cuda.OutOfMemoryError:
        return dict(row, ms=None, peak_mib=None, note="OOM")
    finally:
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> str:
    lines = ["| T | mode | impl | ms | peak MiB | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        ms = "" if r["ms"] is None else f"{r['ms']:.3f}"
        mem = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"| {r['T']} | {r['mode']} | {r['impl']} | {ms} | {mem} | {r['note']} |")
    return "\n".join(lines)


def main() -> None:
    a = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/htree.py needs a CUDA GPU")
    from hccompile.kernels.htree import tiles

    if a.block_c is not None:
        tiles.DEFAULT_BLOCK_C = a.block_c
    if a.num_warps is not None:
        tiles.DEFAULT_NUM_WARPS = a.num_warps
    if a.programs_per_sm is not None:
        tiles.PROGRAMS_PER_SM = a.programs_per_sm
    from hccompile.kernels.htree import node_gradients

    if a.node_warps is not None:
        node_gradients.NODE_WARPS = a.node_warps
    if a.node_rows is not None:
        node_gradients.TILE_ROWS = a.node_rows
    config = CONFIGS[a.config]
    top_nodes = config["max_top_nodes"] or config["top_k"] * config["compression_rate"]
    device = torch.cuda.get_device_name()
    print(f"# htree on {device}: B={a.batch} HQ={a.heads} H_kv={a.kv_heads} D={a.dim} {a.dtype}; "
          f"r={config['compression_rate']} top_k={config['top_k']} max_top_nodes={top_nodes} "
          f"causal={a.causal}; walks {_walk_knobs(a, int(a.seq.split(',')[0]))} ; do_bench median ms\n")
    rows = []
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    for T in (int(t) for t in a.seq.split(",")):
        for mode in a.modes.split(","):
            for name in a.impls.split(","):
                row = run_one(a, name, T, mode)
                row.update(device=device, torch=torch.__version__, time=stamp,
                           commit=os.environ.get("HCCOMPILE_COMMIT", "?"))
                rows.append(row)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                shown = "" if row["ms"] is None else f"{row['ms']:.3f} ms"
                print(f"  T={T} {mode} {name}: {shown} {row['note']}", flush=True)
    print()
    print(table(rows))
    speedups = {(r["T"], r["mode"]): r for r in rows if r["impl"] == "sdpa" and r["ms"]}
    for r in rows:
        dense = speedups.get((r["T"], r["mode"]))
        if r["impl"].startswith("htree") and r["ms"] and dense:
            print(f"T={r['T']} {r['mode']}: {r['impl']} / dense SDPA time = {r['ms'] / dense['ms']:.2f}")


if __name__ == "__main__":
    main()
