"""Gated delta rule (GDN) and KDA: our op vs FLA 0.6.0 vs the plain-PyTorch chunked form (eager,
Inductor, and hc, which traces the chunk function as our op: hccompile.substitutes), forward and forward+backward, bf16; and the compile
time of a plain Gated DeltaNet layer under hc and under Inductor.

One command on a CUDA machine (FLA is optional: without it its rows are skipped with a note):

    python benchmarks/delta_rule.py --out benchmarks/results/delta_rule_$(date +%F).jsonl
    python benchmarks/delta_rule.py --skip-inductor-compile      # the T=8192 Inductor compile takes minutes

Every measurement is a JSON line appended to --out, and a markdown table is printed at the end.
Timings are triton.testing.do_bench medians in milliseconds. FLA's GDN backward refuses to run on
Hopper with Triton >= 3.4, < 3.7.1 (fla #640: wrong gradients); its rows bypass that refusal for
timing only and say so.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # cold compiles, every variant

import torch  # noqa: E402

# Appended, not put first: a tree named on PYTHONPATH (benchmarks/before_after.py's earlier tree)
# must win over this checkout's.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _fla import FLA_GDN_TIMING_ONLY as FLA_TIMING_ONLY, unlock_fla_gdn_backward  # noqa: E402  (this script's dir)

DEFAULT_SHAPES = "B4T4096H16D128,B1T32768H16D128,B2T2048H8D128"
DEFAULT_PLAIN_SHAPES = "B2T2048H8D128"


OURS_FP32 = "ours, fp32 intermediates"
FP32_NOTE = ("HCCOMPILE_DELTA_RULE_BF16_INTERMEDIATES=0: w, u, h in fp32 and tf32 products for bf16 inputs, "
             "about a third of the default's (and FLA's) error on ill-conditioned chunks (see plan.BF16_INTERMEDIATES)")

OURS_RECOMPUTE = "ours, states recomputed"
RECOMPUTE_NOTE = ("lowering.delta_rule.KEEP_STATES=False (HCCOMPILE_DELTA_RULE_KEEP_STATES=0): the backward "
                  "recomputes w, u and h instead of keeping them")
OURS_TWO_KERNELS = "ours, scores backward apart"
TWO_KERNELS_NOTE = ("plan.FUSED_SCORES_BACKWARD=False (HCCOMPILE_DELTA_RULE_FUSED_SCORES_BACKWARD=0): "
                    "decayed_scores_backward takes the gradients through Kdot and P, as before wy_backward did")
OURS_SINGLE_WY = "ours, single wy_backward"
SINGLE_WY_NOTE = ("plan.SPLIT_WY_BACKWARD=False (HCCOMPILE_DELTA_RULE_SPLIT_WY_BACKWARD=0): wy.py's single "
                  "wy_backward kernel instead of dqkw.py + wy_bwd.py, and so decayed_scores in the forward (the "
                  "single kernel reads Kdot): the kernels before session 24")
OURS_SCORES_KERNEL = "ours, decayed_scores forward"
SCORES_KERNEL_NOTE = ("plan.FUSED_SCORES_FORWARD=False (HCCOMPILE_DELTA_RULE_FUSED_SCORES_FORWARD=0): the forward "
                      "launches decayed_scores (Kdot and P through memory, fp32) instead of forming Kdot in wy_solve "
                      "and P in the output kernel")
OURS_FP32_KEYS = "ours, fp32 key gradients"
FP32_KEYS_NOTE = ("plan.HALF_KEY_GRADIENTS=False (HCCOMPILE_DELTA_RULE_HALF_KEY_GRADIENTS=0): the split backward's "
                  "dq heads and completed dk heads in fp32 (the default until session 47; the default stores them "
                  "in the input dtype, as FLA does)")
OURS_WIDE = "ours, widest sweep tiles"
WIDE_NOTE = ("plan.SWEEP_MIN_PROGRAMS=0: the state sweeps keep their widest value tiles even though the grid "
             "fills at most half the SMs (the default narrows them)")


def parse_shape(text: str) -> dict:
    out, key, num = {}, "", ""
    for ch in text.strip() + "#":
        if ch.isdigit():
            num += ch
        else:
            if key and num:
                out[key] = int(num)
            key, num = (ch if ch.isalpha() else ""), ""
    missing = {"B", "T", "H", "D"} - set(out)
    if missing:
        raise SystemExit(f"--shapes: {text!r} lacks {sorted(missing)} (expected e.g. B4T4096H16D128)")
    return out


def bench(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench

    try:
        return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median"))
    except TypeError:  # older Triton: no return_mode
        return float(do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none))


def kda_gate_parameters(H: int, D: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A_log [H] and dt_bias [H * D] as FLA's KDA layer initialises them: A uniform in [1, 16];
    dt_bias the inverse softplus of a step dt log-uniform in [0.001, 0.1]. The gate's strength
    matters to the timing: past a span of scores.FACTOR_SPAN_LIMIT per 16 tokens our score kernels
    split the diagonal blocks at middle rows (3.5 % of the sub-chunks, 9 % of the chunks, with these
    parameters at the limit of 40)."""
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen))
    low, high = torch.log(torch.tensor(0.001)), torch.log(torch.tensor(0.1))
    dt = torch.exp(torch.rand(H * D, device="cuda", generator=gen) * (high - low) + low).clamp_min(1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return A_log, dt_bias


def make_inputs(shape: dict, gate: str, dtype: torch.dtype, seed: int = 0) -> dict:
    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, device="cuda")

    q, k, v = randn(B, T, H, D).to(dtype), randn(B, T, H, D).to(dtype), randn(B, T, H, D).to(dtype)
    beta = torch.rand(B, T, H, generator=gen, device="cuda").to(dtype)
    g_shape = (B, T, H) if gate == "scalar" else (B, T, H, D)
    if gate == "raw":  # raw activations for the in-kernel gate, its parameters as FLA's KDA layer sets them
        A_log, dt_bias = kda_gate_parameters(H, D, gen)
        return dict(q=q, k=k, v=v, g=randn(*g_shape).to(dtype), beta=beta, A_log=A_log, dt_bias=dt_bias)
    g = torch.nn.functional.logsigmoid(randn(*g_shape)).float()  # FLA's tests: natural-log gates, fp32
    return dict(q=q, k=k, v=v, g=g, beta=beta)


def run_variant(fn, inputs: dict) -> tuple[dict, dict]:
    """Forward and forward+backward medians, and the first backward's gradients w.r.t. every input
    for one seeded output gradient (the same for every variant of a shape: a wrong backward shows
    in the row's bwd_rel_err_vs_ours, not only a wrong forward)."""
    with torch.no_grad():
        fn(**inputs)
        fwd = bench(lambda: fn(**inputs))
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    out = fn(**leaves)
    do = torch.randn(out.shape, generator=torch.Generator(device=out.device).manual_seed(1), device=out.device,
                     dtype=out.dtype)
    out.backward(do)  # compiles the backward of compiled variants
    grads = {k: v.grad.detach().clone() for k, v in leaves.items() if v.grad is not None}

    def step():
        fn(**leaves).backward(do)

    fwd_bwd = bench(step, grad_to_none=list(leaves.values()))
    # Peak memory of one forward+backward above what is already held (inputs, their gradients, do):
    # what the op's saved tensors and its backward's temporaries cost.
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - held) / 2**20
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "fwd_bwd_peak_mib": peak_mib}, grads


def ours(gate: str):
    import hccompile

    if gate == "scalar":
        return lambda q, k, v, g, beta: hccompile.chunk_gated_delta_rule(q, k, v, g, beta,
                                                                        use_qk_l2norm_in_kernel=True)[0]
    if gate == "raw":  # KDA's gate activation in the kernel: g raw, A_log [H], dt_bias [H * K]
        return lambda q, k, v, g, beta, A_log, dt_bias: hccompile.chunk_kda(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
            dt_bias=dt_bias)[0]
    return lambda q, k, v, g, beta: hccompile.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def fla_op(gate: str):
    if gate == "scalar":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as f
    else:
        from fla.ops.kda import chunk_kda as f
    if gate == "raw":
        return lambda q, k, v, g, beta, A_log, dt_bias: f(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                          use_gate_in_kernel=True, A_log=A_log,
                                                          dt_bias=dt_bias)[0]
    return lambda q, k, v, g, beta: f(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


def plain(gate: str, how: str):
    from hccompile.nn.delta_net import plain_chunk_gated_delta_rule, plain_chunk_kda

    base = plain_chunk_gated_delta_rule if gate == "scalar" else plain_chunk_kda

    def fn(q, k, v, g, beta):
        return base(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=64)[0]

    if how == "eager":
        return fn
    if how == "hc":
        import hccompile.passes.delta_rule  # noqa: F401  (registers the pass; redundant once in PASS_MODULES)
    torch._dynamo.reset()
    return torch.compile(fn, backend=how, fullgraph=True)


def emit(rows: list, row: dict, out: str | None) -> None:
    """Keeps, prints and appends a row as soon as it is measured, so a run cut by a time limit
    keeps what it measured."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def kernel_rows(args, meta) -> list[dict]:
    from hccompile.kernels.delta_rule import plan as kernel_plan
    from hccompile.lowering import delta_rule as lowering_delta_rule

    rows = []
    dtype = getattr(torch, args.dtype)
    # The one switch each variant of ours turns, set for its row only and restored after it.
    switches = {OURS_FP32: (kernel_plan, "BF16_INTERMEDIATES", False),
                OURS_WIDE: (kernel_plan, "SWEEP_MIN_PROGRAMS", 0),
                OURS_RECOMPUTE: (lowering_delta_rule, "KEEP_STATES", False),
                OURS_TWO_KERNELS: (kernel_plan, "FUSED_SCORES_BACKWARD", False),
                OURS_SINGLE_WY: (kernel_plan, "SPLIT_WY_BACKWARD", False),
                OURS_SCORES_KERNEL: (kernel_plan, "FUSED_SCORES_FORWARD", False),
                OURS_FP32_KEYS: (kernel_plan, "HALF_KEY_GRADIENTS", False)}
    have_fla, fla_note = True, ""
    try:
        import fla

        fla_version = getattr(fla, "__version__", "?")
        if fla_version != "0.6.0":
            fla_note = f"FLA {fla_version} (the reference figures are for 0.6.0)"
    except ImportError as e:
        have_fla, fla_version, fla_note = False, None, f"FLA not installed ({e}); FLA rows skipped"
        print(f"note: {fla_note}", flush=True)
    plain_shapes = {s for s in args.plain_shapes.split(",") if s}
    for shape_text in [s for s in args.shapes.split(",") if s]:
        shape = parse_shape(shape_text)
        label = f"B{shape['B']} T{shape['T']} H{shape['H']} D{shape['D']}"
        for gate, op, name in (("scalar", "GDN", "gdn"), ("channel", "KDA", "kda"), ("raw", "KDA", "kda-gate")):
            if name not in args.ops.split(","):
                continue
            inputs = make_inputs(shape, gate, dtype)
            variants = [("ours", ours(gate), "")]
            variants.append((OURS_RECOMPUTE, ours(gate), RECOMPUTE_NOTE))
            if gate == "scalar":  # KDA's per-channel gates always take the two kernels
                variants.append((OURS_TWO_KERNELS, ours(gate), TWO_KERNELS_NOTE))
                variants.append((OURS_SINGLE_WY, ours(gate), SINGLE_WY_NOTE))
                variants.append((OURS_SCORES_KERNEL, ours(gate), SCORES_KERNEL_NOTE))
                variants.append((OURS_FP32_KEYS, ours(gate), FP32_KEYS_NOTE))
            if dtype == torch.bfloat16:
                variants.append((OURS_FP32, ours(gate), FP32_NOTE))
            if 2 * shape["B"] * shape["H"] * -(-shape["D"] // 32) <= torch.cuda.get_device_properties(0).multi_processor_count:
                variants.append((OURS_WIDE, ours(gate), WIDE_NOTE))  # the same op before the sweep narrowing
            if have_fla:
                note = fla_note
                if gate == "scalar":
                    note = "; ".join(x for x in (fla_note, "forward exact; " + FLA_TIMING_ONLY) if x)
                variants.append(("FLA", fla_op(gate), note))
            if shape_text in plain_shapes:
                for how in ("eager", "inductor", "hc"):
                    variants.append((f"plain {how}", plain(gate, how), ""))
            kinds = {"ours": "ours", OURS_RECOMPUTE: "recompute", OURS_TWO_KERNELS: "unfused",
                     OURS_SINGLE_WY: "single-wy", OURS_SCORES_KERNEL: "scores-kernel", OURS_FP32: "fp32",
                     OURS_WIDE: "wide", OURS_FP32_KEYS: "fp32-keys", "FLA": "fla"}
            wanted = set(args.impls.split(","))
            if "plain" in wanted:
                wanted |= {"plain-eager", "plain-inductor", "plain-hc"}
            variants = [v for v in variants if kinds.get(v[0], v[0].replace(" ", "-")) in wanted]
            reference = reference_grads = None  # the first variant's: ours unless --impls leaves it out
            # --rounds N times the variants N times in turn (ours, FLA, ours, FLA, ...): a difference that
            # follows the order rather than the variant shows up as a round-to-round change.
            for round_index, (name, fn, note) in enumerate(variants * args.rounds):
                row = {**meta, "bench": "kernel", "op": op, "impl": name, "shape": label, "dtype": args.dtype,
                       "fla": fla_version, "note": note}
                if args.rounds > 1:
                    row["round"] = round_index // len(variants)
                if gate == "raw":
                    row["gate_in_kernel"] = True
                module, switch, value = switches.get(name, (None, None, None))
                if module is not None:
                    default = getattr(module, switch)
                    setattr(module, switch, value)
                try:
                    if name == "FLA" and gate == "scalar":
                        locked = unlock_fla_gdn_backward()
                        if not locked:
                            row["note"] = fla_note  # no refusal in force on this machine: a normal run
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        out = fn(**inputs)
                    torch.cuda.synchronize()
                    row["first_call_s"] = time.perf_counter() - t0
                    if reference is None:
                        reference = out
                    else:
                        row["fwd_rel_err_vs_ours"] = rel_err(out, reference)
                    timings, grads = run_variant(fn, inputs)
                    row.update(timings)
                    if reference_grads is None:
                        reference_grads = grads
                    elif grads.keys() == reference_grads.keys():
                        # the worst input's gradient error against the first variant's
                        row["bwd_rel_err_vs_ours"] = max(rel_err(grads[n], reference_grads[n]) for n in grads)
                    del grads
                except Exception as e:  # noqa: BLE001 - a failing variant is a row with its error
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                finally:
                    if module is not None:
                        setattr(module, switch, default)
                emit(rows, row, args.out)
                torch.cuda.empty_cache()
    return rows


def compile_rows(args, meta) -> list[dict]:
    """First call (forward+backward) minus a warm call, for a plain GDN layer compiled cold."""
    from hccompile.nn.delta_net import GatedDeltaNet

    import hccompile.passes.delta_rule  # noqa: F401  (registers the pass; redundant once in PASS_MODULES)

    rows = []
    dtype = getattr(torch, args.dtype)
    for T in [int(t) for t in args.compile_lengths.split(",") if t]:
        for backend in args.compile_backends.split(","):
            if backend == "inductor" and args.skip_inductor_compile:
                continue
            torch._dynamo.reset()
            torch.manual_seed(0)
            layer = GatedDeltaNet(hidden_size=args.compile_hidden, num_heads=args.compile_heads, head_dim=128,
                                  mode="plain").to("cuda", dtype)
            x = torch.randn(1, T, args.compile_hidden, device="cuda", dtype=dtype, requires_grad=True)
            if backend == "hc-unrolled":  # the chunk loop unrolled by Dynamo, lowered by the delta_rule pass
                fn = torch.compile(layer, backend="hc", fullgraph=True, options={"disable_passes": ["substitutes"]})
            else:  # "hc": the chunk function traced as the op (hccompile.substitutes)
                fn = torch.compile(layer, backend=backend, fullgraph=True)
            row = {**meta, "bench": "compile", "model": f"GatedDeltaNet(hidden {args.compile_hidden}, "
                   f"{args.compile_heads} heads of 128) plain, fwd+bwd", "backend": backend, "T": T,
                   "dtype": args.dtype}
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(x).sum().backward()
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                fn(x).sum().backward()
                torch.cuda.synchronize()
                warm = time.perf_counter() - t0
                row.update(compile_s=first - warm, warm_step_ms=warm * 1e3)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            emit(rows, row, args.out)
    return rows


def markdown(rows: list[dict]) -> str:
    out = []
    kernel = [r for r in rows if r["bench"] == "kernel"]
    if kernel:
        out += ["| op | shape | impl | fwd ms | fwd+bwd ms | fwd+bwd peak MiB | fwd rel err vs ours | "
                "worst grad rel err vs ours | note |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in kernel:
            fmt = (lambda x: f"{x:.3f}" if isinstance(x, float) else "—")
            err, grad_err = r.get("fwd_rel_err_vs_ours"), r.get("bwd_rel_err_vs_ours")
            note = r.get("error") or r.get("note", "")
            out.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {fmt(r.get('fwd_ms'))} | "
                       f"{fmt(r.get('fwd_bwd_ms'))} | {fmt(r.get('fwd_bwd_peak_mib'))} | {'' if err is None else f'{err:.1e}'} | "
                       f"{'' if grad_err is None else f'{grad_err:.1e}'} | {note} |")
    comp = [r for r in rows if r["bench"] == "compile"]
    if comp:
        out += ["", "| model | backend | T | compile s | warm fwd+bwd ms |", "|---|---|---|---|---|"]
        for r in comp:
            if "error" in r:
                out.append(f"| {r['model']} | {r['backend']} | {r['T']} | error: {r['error']} | |")
            else:
                out.append(f"| {r['model']} | {r['backend']} | {r['T']} | {r['compile_s']:.1f} | "
                           f"{r['warm_step_ms']:.2f} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated, e.g. B4T4096H16D128")
    p.add_argument("--plain-shapes", default=DEFAULT_PLAIN_SHAPES,
                   help="shapes at which the plain forms (eager, Inductor, hc) also run; '' for none")
    p.add_argument("--ops", default="gdn,kda", help="comma-separated: gdn, kda (precomputed gate), kda-gate "
                   "(KDA's gate activation in the kernel)")
    p.add_argument("--rounds", type=int, default=1, help="time the variants this many times in turn")
    p.add_argument("--impls", default="ours,fp32,wide,fla,plain",
                   help="kernel rows to run: ours, recompute (w, u, h recomputed in the backward, not kept), "
                        "unfused (GDN: decayed_scores_backward apart from wy_backward), single-wy (GDN: wy.py's single "
                        "wy_backward instead of the split dqkw + wy_bwd), scores-kernel (GDN: the forward's "
                        "decayed_scores launch instead of Kdot formed in wy_solve and P in the output kernel), "
                        "fp32-keys (GDN: the split backward's dq and dk heads in fp32, the default until session 47), "
                        "fp32 (fp32 intermediates "
                        "for bf16 inputs), wide (widest sweep "
                        "tiles, where ours narrows them), fla, plain (eager, Inductor and hc, at --plain-shapes) "
                        "or one of plain-eager, plain-inductor, plain-hc")
    p.add_argument("--what", default="kernels,compile", help="kernels, compile or both")
    p.add_argument("--compile-lengths", default="2048,8192")
    p.add_argument("--compile-hidden", type=int, default=1024)
    p.add_argument("--compile-heads", type=int, default=8)
    p.add_argument("--compile-backends", default="hc,inductor",
                   help="backends of the compile rows; hc-unrolled: hc with substitutes off (the delta_rule "
                        "pass on the unrolled loop, what 'hc' measured before 2026-11-26)")
    p.add_argument("--skip-inductor-compile", action="store_true",
                   help="skip the Inductor compile of the plain layer (minutes at T=8192)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/delta_rule.py needs a CUDA GPU")
    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from targets import run_stamp

    # run_stamp: the date, the commit (HCCOMPILE_COMMIT on the device, whose .git can be older) and a run id
    meta = {**run_stamp(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}
    rows = []
    if "kernels" in args.what:
        rows += kernel_rows(args, meta)
    if "compile" in args.what:
        rows += compile_rows(args, meta)
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
