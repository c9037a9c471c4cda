"""Localise the split wy_backward's GPU-only error (bf16, chunk 64, GVA; H100, Triton 3.6): dqkw.py's
kernel alone, on the real intermediates of the two failing cases of
tests/kernels/test_delta_rule_wy_split.py (its _kernel_inputs), into NaN-poisoned outputs, against
reference.dqkw_ref in float64, over a matrix of variants; then wy_bwd.py's kernel alone, fed
dqkw_ref's outputs (as test_wy_bwd_matches_float64 does).

    python benchmarks/diag_wy_split.py            # GPU: every variant, one process, well under a minute
    TRITON_INTERPRET=1 python benchmarks/diag_wy_split.py   # CPU check: a few rows (options mean nothing there)

Variants, one factor at a time from the failing launch (bf16, BT 64, BK 32, 4 warps, 2 stages):
dS's round trip through memory (dqkw.DQKW_SCORES_VIA_MEMORY: no product takes dS from registers, no
tl.trans), 8 warps, fp16 (the bf16 case's intermediates cast to fp16: no second forward to compile),
chunk 32 (its own forward), BK 64, 2 warps, the single kernel's options (BK 64, 8 warps, 1 stage);
1 stage on request (--variants). Rows print as they finish: a run cut short still tells. Each runs three input modes that isolate dq's terms:
  all   the real inputs;
  h=0   chunk states zero: dq = dS K only, dk = dS^T Q + U dh^T, dW = 0;
  u=0   corrected values zero: dS = 0, so dq = scale e^G dO h^T only, dk = 0, dW as in `all`.
Columns: relative RMS error of dq, dk (partial), dW and dG (partial) against dqkw_ref ("abs" when
the reference is zero: the largest magnitude written), non-finite count (unwritten NaN poison),
dq's largest error at (chunk row, key column), and dq's relative error per key tile (BK columns
each) and per 16 chunk rows (one warp's share of a wgmma; "-": no chunk has those rows).

Reading it: dq wrong under h=0 but right under u=0 puts the error in dS K (dS as the register A
operand, or the k tile's shared-memory B operand), the reverse in the value pass (dO h^T), which dW
(-dU h^T, same pass) then likely shares; dk wrong with dq right points at tl.trans(dS); ds-memory
right where base is wrong clears both products' dS paths as the cause, if not the value pass; one
bad key tile (the last, K % BK != 0) a masked tail; some 16-row groups only, a warp's share. fp16
at chunk 64 still wrong: the wgmma lowering (BT 64 at 4 warps), not bf16; chunk 32 (mma.sync, no
wgmma) right as in the tests.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "kernels")]

import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    import interpreter_compat  # noqa: E402  (bf16 rounding as on the GPU, loop bounds on old Tritons)

    interpreter_compat.apply()

import triton  # noqa: E402

from hccompile.kernels.delta_rule import dqkw, wy_bwd  # noqa: E402
from hccompile.kernels.delta_rule.plan import block_size, make_plan  # noqa: E402
from hccompile.kernels.delta_rule.reference import dqkw_ref, wy_bwd_ref  # noqa: E402

from test_delta_rule_wy_split import SPLIT_CASES, _kernel_inputs  # noqa: E402

FAILING = ("gdn-T100-K60-V100-gva-h0", "plain-varlen-K100-V60-gva")
BASE = dict(dtype=torch.bfloat16, chunk=64, bk=32, warps=4, stages=2, via_memory=False)
# label, changes from BASE
VARIANTS = [
    ("base", {}),
    ("ds-memory", {"via_memory": True}),
    ("warps8", {"warps": 8}),
    ("fp16", {"dtype": torch.float16}),
    ("chunk32", {"chunk": 32}),
    ("bk64", {"bk": 64}),
    ("warps2", {"warps": 2}),
    ("single-opts", {"bk": 64, "warps": 8, "stages": 1}),
    ("stages1", {"stages": 1}),
]
# stages1 only on request: test_split_backward_is_deterministic already saw stages 1, 2 and 3 fail alike.
DEFAULT_VARIANTS = [v[0] for v in VARIANTS if v[0] != "stages1"]
MODES = ("all", "h=0", "u=0")
# wy_bwd.py's launches: label, BK, options (the default since session 24 is bk64-w4)
WY_BWD_VARIANTS = [("bk32-w4", 32, {"num_warps": 4, "num_stages": 2}),
                   ("bk32-w2", 32, {"num_warps": 2, "num_stages": 2}),
                   ("bk32-w8", 32, {"num_warps": 8, "num_stages": 2}),
                   ("bk64-w4", 64, {"num_warps": 4, "num_stages": 2}),
                   ("bk64-w8", 64, {"num_warps": 8, "num_stages": 1})]
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _error(out, ref):
    """Relative RMS error (a string), or the largest magnitude written where the reference is zero."""
    out, ref = out.double(), ref.double().to(out.device)
    bad = (~torch.isfinite(out)).sum().item()
    out = torch.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)
    norm = ref.norm().item()
    text = f"{(out - ref).norm().item() / norm:9.2e}" if norm > 0 else f"abs {out.abs().max().item():.1e}"
    return text, bad


def _cells(outs, refs):
    """(one error cell per output, "-" where there is none; the non-finite count over all)."""
    cells, nans = [], 0
    for out, ref in zip(outs, refs):
        if out is None:
            cells.append(f"{'-':>9s}")
            continue
        text, bad = _error(out, ref)
        cells.append(text)
        nans += bad
    return " ".join(cells), nans


def _locate(dq, ref, chunks, chunk, bk):
    """dq's largest error as (chunk row, key column), and its relative error per key tile and per
    16 chunk rows (over all chunks and value heads)."""
    dq, ref = dq.double().nan_to_num(), ref.double().to(dq.device)
    key_dim = dq.shape[-1]
    diff = torch.zeros(chunk, dq.shape[2], key_dim, dtype=torch.float64, device=dq.device)
    norm = torch.zeros_like(diff)
    worst, where = -1.0, None
    for b, start, length in chunks:
        d = (dq[b, start:start + length] - ref[b, start:start + length])  # [L, HV, K]
        diff[:length] += d ** 2
        norm[:length] += ref[b, start:start + length] ** 2
        value, index = d.abs().flatten().max(0)
        if value.item() > worst:
            row, head, col = torch.unravel_index(index, d.shape)
            worst, where = value.item(), (row.item(), col.item(), head.item())
    def ratio(d, n):
        return f"{(d.sum() / n.sum()).sqrt().item():.1e}" if n.sum().item() > 0 else "-"

    tiles = [ratio(diff[..., c:c + bk], norm[..., c:c + bk]) for c in range(0, key_dim, bk)]
    rows = [ratio(diff[r:r + 16], norm[r:r + 16]) for r in range(0, chunk, 16)]  # "-": no chunk has those rows
    return where, " ".join(tiles), " ".join(rows)


def _cast_inputs(x, dtype):
    """The kernel inputs with q, k, v, beta, do and the stored intermediates in `dtype`, and a plan for it."""
    plan = x["plan"]
    cast = dict(x)
    for name in ("q", "k", "v", "beta", "do", "u", "du", "h", "dh"):
        cast[name] = x[name].to(dtype)
    cast["plan"] = make_plan(plan.problem, plan.chunk_size, plan.cu_seqlens, cast["q"])
    return cast


def _set_options(bk, warps, stages, via_memory):
    dqkw.DQKW_BLOCK_K = bk
    dqkw.DQKW_SCORES_VIA_MEMORY = via_memory
    dqkw.DQKW_OPTIONS.clear()
    dqkw.DQKW_OPTIONS.update(num_warps=warps, num_stages=stages)


def run_dqkw(x, mode, device):
    plan = x["plan"]
    q, k, do, cum, u, du, h, dh = (x[n] for n in ("q", "k", "do", "cum", "u", "du", "h", "dh"))
    if mode == "h=0":
        h = torch.zeros_like(h)
    elif mode == "u=0":
        u = torch.zeros_like(u)
    batch, time_, value_heads, _ = do.shape
    key_dim = q.shape[3]

    def nan(*shape, dtype=torch.float32):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    dq, dk = nan(batch, time_, value_heads, key_dim), nan(batch, time_, value_heads, key_dim)
    dw = nan(batch, time_, value_heads, key_dim, dtype=plan.intermediate_dtype)
    dcum = nan(batch, time_, value_heads, 1) if cum is not None else plan.dummy
    table, seqlens = plan.chunk_args()
    second = dqkw.launch_dqkw(plan, q, k, do, cum if cum is not None else plan.dummy, u, du, h, dh, dq, dk, dw,
                              dcum, plan.num_chunks, table, seqlens, x["scale"])
    if device == "cuda":
        torch.cuda.synchronize()
    refs = dqkw_ref(q, k, do, cum, u, du, h, dh, x["chunks"], x["scale"])
    dg = None if cum is None else dcum[..., 0] + (second[..., 0] if second is not None else 0)
    return (dq, dk, dw, dg), refs


def run_wy_bwd(x, device):
    plan = x["plan"]
    _, dk_partial, dw, dg_partial = dqkw_ref(x["q"], x["k"], x["do"], x["cum"], x["u"], x["du"], x["h"], x["dh"],
                                             x["chunks"], x["scale"])
    dw = dw.to(device=device, dtype=plan.intermediate_dtype)
    dk = dk_partial.to(device=device, dtype=torch.float32)
    has_gate = x["cum"] is not None
    dcum = dg_partial[..., None].to(device=device, dtype=torch.float32) if has_gate else plan.dummy
    dv = torch.full_like(x["v"], float("nan"))
    dbeta = torch.full_like(x["beta"], float("nan"))
    table, seqlens = plan.chunk_args()
    wy_bwd.launch_wy_bwd(plan, x["k"], x["v"], x["beta"], x["cum"] if has_gate else plan.dummy, x["inverse"],
                         x["du"], dw, dv, dbeta, dk, dcum, plan.num_chunks, table, seqlens)
    if device == "cuda":
        torch.cuda.synchronize()
    refs = wy_bwd_ref(x["k"], x["v"], x["beta"], x["cum"], x["inverse"], x["du"], dw, dk_partial, dg_partial,
                      x["chunks"])
    return (dv, dbeta, dk, dcum[..., 0] if has_gate else None), refs


def _environment(device):
    line = f"torch {torch.__version__}, triton {triton.__version__}, device {device}"
    if device == "cuda":
        line += f" ({torch.cuda.get_device_name()})"
        try:
            from triton import knobs

            line += f", ptxas {knobs.nvidia.ptxas.path}"
        except Exception:  # noqa: BLE001 - informative only
            pass
    return line + (", TRITON_INTERPRET=1" if os.environ.get("TRITON_INTERPRET") == "1" else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(FAILING), help="names from SPLIT_CASES")
    parser.add_argument("--variants", default=None, help="comma-separated labels (default: all on CUDA, "
                        "base,fp16,chunk32,ds-memory under the interpreter)")
    parser.add_argument("--modes", default=None, help="comma-separated among all,h=0,u=0 (default: all three on "
                        "CUDA, all under the interpreter)")
    parser.add_argument("--no-wy-bwd", action="store_true", help="skip wy_bwd.py's rows")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    interpreted = device == "cpu"
    labels = args.variants.split(",") if args.variants else (
        ["base", "fp16", "chunk32", "ds-memory"] if interpreted else DEFAULT_VARIANTS)
    modes = args.modes.split(",") if args.modes else (["all"] if interpreted else list(MODES))
    cases = {c[0]: c for c in SPLIT_CASES}
    print(_environment(device))
    saved = (dqkw.DQKW_BLOCK_K, dict(dqkw.DQKW_OPTIONS), dict(wy_bwd.WY_BWD_OPTIONS), dqkw.DQKW_SCORES_VIA_MEMORY,
             wy_bwd.WY_BWD_BLOCK_K)
    started = time.perf_counter()
    header = (f"{'case':26s} {'variant':11s} {'dt':4s} {'BT':>2s} {'BK':>2s} {'w':>1s} {'s':>1s} {'mode':4s} "
              f"{'dq':>9s} {'dk part':>9s} {'dW':>9s} {'dG part':>9s} {'nan':>3s} {'dq max@(row,col,hv)':>20s}  "
              "dq by key tile | by 16 rows")
    for name in args.cases.split(","):
        _, sizes, gate, options, _, _ = cases[name]
        inputs = {}
        print(header)
        for label in labels:
            config = dict(BASE, **dict(VARIANTS)[label])
            key = (config["dtype"], config["chunk"])
            if key not in inputs:
                base_key = (BASE["dtype"], config["chunk"])
                if base_key not in inputs:
                    inputs[base_key] = _kernel_inputs(sizes, gate, options, BASE["dtype"], config["chunk"],
                                                      seed=sizes[1] + 21)
                if key != base_key:
                    inputs[key] = _cast_inputs(inputs[base_key], config["dtype"])
            x = inputs[key]
            _set_options(config["bk"], config["warps"], config["stages"], config["via_memory"])
            bk = block_size(sizes[4], config["bk"])
            for mode in modes:
                try:
                    outs, refs = run_dqkw(x, mode, device)
                except Exception as error:  # noqa: BLE001 - a failing variant (compile, launch) is a result too
                    print(f"{name:26s} {label:11s} {mode}: {type(error).__name__}: {str(error)[:200]}")
                    continue
                cells, nans = _cells(outs, refs)
                where, tiles, rows = _locate(outs[0], refs[0], x["chunks"], config["chunk"], bk)
                print(f"{name:26s} {label:11s} {DTYPE_NAMES[config['dtype']]:4s} {config['chunk']:2d} {bk:2d} "
                      f"{config['warps']:1d} {config['stages']:1d} {mode:4s} {cells} {nans:3d} "
                      f"{str(where):>20s}  {tiles} | {rows}  [{time.perf_counter() - started:.0f} s]", flush=True)
        if args.no_wy_bwd:
            continue
        print(f"{'case':26s} {'wy_bwd':11s} {'dt':4s} {'BT':>2s} {'options':24s} {'dv':>9s} {'dbeta':>9s} "
              f"{'dk':>9s} {'dG':>9s} {'nan':>3s}")
        for label, block_k, options in (WY_BWD_VARIANTS if not interpreted else WY_BWD_VARIANTS[:1]):
            wy_bwd.WY_BWD_BLOCK_K = block_k
            wy_bwd.WY_BWD_OPTIONS.clear()
            wy_bwd.WY_BWD_OPTIONS.update(options)
            x = inputs.get((BASE["dtype"], BASE["chunk"])) or _kernel_inputs(
                sizes, gate, options, BASE["dtype"], BASE["chunk"], seed=sizes[1] + 22)
            try:
                outs, refs = run_wy_bwd(x, device)
            except Exception as error:  # noqa: BLE001
                print(f"{name:26s} {label:11s}: {type(error).__name__}: {str(error)[:200]}")
                continue
            cells, nans = _cells(outs, refs)
            opts = f"BK {block_size(sizes[4], wy_bwd.WY_BWD_BLOCK_K)} {wy_bwd.WY_BWD_OPTIONS}"
            print(f"{name:26s} {label:11s} {DTYPE_NAMES[BASE['dtype']]:4s} {BASE['chunk']:2d} {opts:24s} "
                  f"{cells} {nans:3d}  [{time.perf_counter() - started:.0f} s]", flush=True)
    dqkw.DQKW_BLOCK_K, dqkw.DQKW_SCORES_VIA_MEMORY = saved[0], saved[3]
    dqkw.DQKW_OPTIONS.clear()
    dqkw.DQKW_OPTIONS.update(saved[1])
    wy_bwd.WY_BWD_OPTIONS.clear()
    wy_bwd.WY_BWD_OPTIONS.update(saved[2])
    wy_bwd.WY_BWD_BLOCK_K = saved[4]
    print(f"done in {time.perf_counter() - started:.1f} s (limits: dq/dk/dW 8e-3, dG 2e-2 relative RMS)")


if __name__ == "__main__":
    main()
