"""mHC training step for n=1 (plain residual) and n=4 streams: eager, eager + block manager, Inductor,
and hc with recompute off / layer / block (hc fuses the hyper-connection subgraphs into the
kernels of hccompile/kernels/mhc unless the variant ends in "-nofuse"). One forward+backward step of
the reference GPT (hccompile.nn.MHCGPT, layout [B, S, n, C]).

Each variant runs in a fresh process of its own (measure_in_child; --in-process: all in this one).
Reports the step time (CUDA events; steps back to back, see measure()), the peak memory above parameters during the step, and
the compile time (first step minus a warm step, caches off). n=4 rows carry issue 18's floor: the
bytes the hyper-connection ops must move (floor_bytes_per_token, from the ops' contracts) over the
copy bandwidth measured in the same run; with n1-inductor and n4-hc-block in one run it prints the
excess (n4 - n1 step) and excess / floor. Results are appended as JSON lines to
--out, so a long sweep can be split across runs (--variants); benchmarks/mhc_table.py makes the
tables.

    python benchmarks/mhc.py --variants n1-eager,n1-inductor,n1-hc-block,n4-eager,n4-manager
    python benchmarks/mhc.py --variants n4-inductor,n4-hc-off,n4-hc-layer,n4-hc-block
    python benchmarks/mhc.py --layers 4 --variants n4-hc-block-nofuse     # the unfused plan
    python benchmarks/mhc.py --kernels     # each fused kernel vs its reference under Inductor
    python benchmarks/mhc.py --layers 4 --variants n1-inductor,n4-hc-block --profile  # per-kernel GPU time
    python benchmarks/mhc.py --layers 4 --variants n4-hc-block --compile-profile 40 --dump-dir /tmp/d  # compile
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # cold compiles, every variant

import torch  # noqa: E402

KINDS = ["eager", "manager", "inductor", "hc-off", "hc-layer", "hc-block"]
ALL = [f"n{n}-{k}" for n in (1, 4) for k in KINDS] + ["n4-hc-block-nofuse"]
DEFAULT = list(ALL[:-1])
# "-cg": the compiled variants with CUDA graphs (Inductor's triton.cudagraphs), which removes the
# per-kernel host cost (Python op wrappers, launches) from the step.
ALL += [f"n{n}-{k}-cg" for n in (1, 4) for k in ("inductor", "hc-block")]
ROUNDS = 5  # rounds of --iters back-to-back steps (step_ms: their median)
HC_OPTIONS: dict = {}  # --hc-option KEY=VALUE: added to every hc variant's options (rows record them)


def _option_value(text: str):
    """'true'/'false', an int, a float, else the string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def build(n: int, a) -> torch.nn.Module:
    from hccompile.nn.mhc import MHCGPT

    torch.manual_seed(0)
    return MHCGPT(a.dim, a.heads, a.layers, n=n, dropout=a.dropout, layout="bsnc",
                  sinkhorn_iters=a.sinkhorn_iters).to(a.device, getattr(torch, a.dtype))


def parse(variant: str) -> tuple[int, str, bool, bool]:
    """'n4-hc-block-nofuse' -> (4, 'hc-block', False, False); 'n4-hc-block-cg' -> (4, 'hc-block', True, True)."""
    n_part, rest = variant.split("-", 1)
    graphs = rest.endswith("-cg")
    rest = rest.removesuffix("-cg")
    fuse = not rest.endswith("-nofuse")
    return int(n_part[1:]), rest.removesuffix("-nofuse"), fuse, graphs


def step_fn(variant: str, model, dump_dir: str | None = None):
    _, kind, fuse, graphs = parse(variant)
    if kind == "eager":
        return lambda x: model(x)
    if kind == "manager":  # n=1 has no hyper-connection: the manager leaves it a plain model
        return lambda x: model(x, recompute="block")
    if kind == "inductor":
        return torch.compile(model, backend="inductor", options={"triton.cudagraphs": True} if graphs else None)
    options = {"hc_recompute": kind.split("-")[1]}
    if dump_dir:
        options.update(dump_dir=os.path.join(dump_dir, variant), depyf=False)
    if graphs:
        options["triton.cudagraphs"] = True
    if not fuse:
        options["disable_passes"] = ["hc_fuse"]
    options.update(HC_OPTIONS)
    return torch.compile(model, backend="hc", options=options)


def measure(variant: str, a) -> dict:
    n, kind, fuse, graphs = parse(variant)
    model = build(n, a)
    fn = step_fn(variant, model, a.dump_dir)
    x = torch.randn(a.batch, a.seq, a.dim, device=a.device, dtype=getattr(torch, a.dtype))
    w = torch.randn_like(x)

    def step():
        model.zero_grad(set_to_none=True)
        (fn(x) * w).sum().backward()

    from hccompile.explain import collect_reports

    torch.cuda.synchronize()
    profiler = None
    if a.compile_profile:  # where the compile's seconds go, by function (cProfile of the first step)
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    from hccompile.compat import access_analysis_counts

    analyses = dict(access_analysis_counts)
    t0 = time.perf_counter()
    with collect_reports() as reports:  # hc's compile time per stage (its passes, AOT + Inductor)
        step()
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    # torch's analyses of our traced launches during this compile: computed, and answered from
    # compat's cache (each computed one generates a kernel's Triton IR)
    analyses = {k: access_analysis_counts[k] - analyses[k] for k in analyses}
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        for order in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(a.compile_profile)
            print(f"--- compile profile {variant} ({order})\n{text.getvalue()}", flush=True)
    stages: dict[str, float] = {}
    for graph in reports.graphs:
        for stage, seconds in graph.timings_s.items():
            stages[stage] = stages.get(stage, 0.0) + seconds
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    # step_ms: steps back to back, as a training loop runs them (the host enqueues the next step
    # while the GPU runs this one): the mean over `iters` steps between two synchronisations, the
    # median of ROUNDS such rounds. step_synced_ms: each step alone between synchronisations (the
    # method of rows before 2026-11-30), which adds the host's time to its first launch to every
    # step and varied by 2 ms between two H200 machines at one commit (11.30 / 13.49 ms).
    rounds = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iters):
            step()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / a.iters)
    times = []
    for _ in range(a.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = statistics.median(rounds)
    if a.host_profile:
        host_profile(step, a.host_profile, variant)
    if a.memory_peak:
        from _profile import memory_at_peak

        model.zero_grad(set_to_none=True)
        print(f"--- memory at the peak, {variant}\n{memory_at_peak(step, a.memory_peak)}", flush=True)
        model.zero_grad(set_to_none=True)
    if a.profile:
        from _profile import profile_step

        table, summary = profile_step(step)
        print(f"--- profile {variant}\n{table}", flush=True)
        model.zero_grad(set_to_none=True)
    compiled = kind not in ("eager", "manager")
    return {"variant": variant, "n": n, "kind": kind, "fuse": fuse if kind.startswith("hc") else None,
            "cudagraphs": graphs,
            "hc_options": dict(HC_OPTIONS) if kind.startswith("hc") else None,
            "step_ms": ms, "step_timing": "back-to-back", "step_rounds_ms": rounds,
            "step_synced_ms": statistics.median(times), "peak_gib": peak / 2**30,
            "compile_s": max(0.0, first - ms / 1e3) if compiled else 0.0,
            "launch_analyses": analyses,
            # the rest of compile_s is Dynamo's tracing (and, for Inductor, all of it)
            "compile_stages_s": stages}


def host_profile(step, top: int, variant: str, steps: int = 20) -> None:
    """--host-profile: where the host's time per step goes. The enqueue time is the time the host
    takes to issue `steps` steps, before waiting for the GPU: when it is close to the wall time per
    step, the step is host-bound and the profile below names what the host does."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    enqueue = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    print(f"--- host {variant}: enqueue {enqueue / steps * 1e3:.3f} ms/step, wall {wall / steps * 1e3:.3f} ms/step "
          f"(no profiler)", flush=True)
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        print(f"--- host profile {variant} ({order}, {steps} steps)\n{text.getvalue()}", flush=True)


def measure_in_child(variant: str) -> dict:
    """measure(variant) in a fresh Python process (this script, the same arguments): a process holds
    one model, as a training run does. Measured after another variant in one process, the same
    n4-hc-block step took 12.15 ms where a fresh process took 10.45 (H200, c0ebb6c): the host's
    time per step grows with what the process already holds (the earlier variant's compiled code)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "row.json")
        argv = [arg for arg in sys.argv[1:]]
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--variants", variant,
                        "--child-row", path], check=True)
        with open(path) as f:
            return json.load(f)


def floor_bytes_per_token(n: int, C: int, element_size: int) -> int:
    """Bytes the hyper-connection ops of one sublayer must move per token in a training step with
    block recompute, counted from the ops' contracts (each tensor read or written once by a kernel
    that fuses everything the data flow allows; the stream x is [n, C], the sublayer's input a and
    output f are [C]; the mixing coefficients, n^2+2n per token, are not counted):
      forward   mapping + aggregate: read x, write a             nC + C
                post + residual: read x and f, write the new x   2nC + C
      backward  post: read dx_new, x, f; write dx, df            3nC + 2C
                (the sublayer's backward gives da)
                aggregate + mapping: read da, x, dx; write dx     3nC + C
      recompute mapping + aggregate again (a is rebuilt)         nC + C
    in all 10nC + 6C elements (n=4: 46C, 92C bytes in bf16). Rebuilding the stream between a
    block's two sublayers costs more; it is left out, so this stays a lower bound."""
    return (10 * n * C + 6 * C) * element_size


def copy_bandwidth(device: str, mib: int = 1024, repeats: int = 10) -> float:
    """Bytes per second of a device-to-device copy (read + write), the median of `repeats`: the
    bandwidth a memory-bound kernel can reach on this GPU now, measured in the same run."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def floor_fields(a) -> dict:
    """floor_ms of the n=4 model at this shape: all sublayers' floor bytes over the copy bandwidth."""
    element_size = torch.empty((), dtype=getattr(torch, a.dtype)).element_size()
    sublayers = 2 * a.layers  # attention and MLP, each behind a hyper-connection
    total = floor_bytes_per_token(4, a.dim, element_size) * a.batch * a.seq * sublayers
    bandwidth = copy_bandwidth(a.device)
    return {"floor_ms": total / bandwidth * 1e3, "floor_bytes": total, "copy_gbs": bandwidth / 1e9}


def kernel_bench(a) -> None:
    """--kernels: each fused kernel against its PyTorch reference compiled by Inductor, one sublayer's
    worth of tokens (B·S) at n=4; effective bandwidth from the bytes each must move."""
    import triton.testing

    from hccompile.kernels.mhc import MappingSpec, mhc_aggregate_ref, mhc_mapping_ref, mhc_post_ref
    from hccompile.lowering.mhc import mhc_aggregate, mhc_mapping, mhc_post, mhc_project

    dt, dev, n, C = getattr(torch, a.dtype), a.device, 4, a.dim
    B, S = a.batch, a.seq
    x = torch.randn(B, S, n, C, device=dev, dtype=dt, requires_grad=True)
    f = torch.randn(B, S, C, device=dev, dtype=dt, requires_grad=True)
    h_res = torch.rand(B, S, n, n, device=dev, dtype=dt, requires_grad=True)
    h = torch.rand(B, S, n, device=dev, dtype=dt, requires_grad=True)
    spec = MappingSpec(n=n, steps=2 * a.sinkhorn_iters)
    proj = torch.randn(B, S, spec.width, device=dev, dtype=dt, requires_grad=True)
    r = (torch.rand(B, S, 1, device=dev, dtype=dt) + 0.5).requires_grad_()
    alphas = [torch.tensor(0.5, device=dev, dtype=dt, requires_grad=True) for _ in range(3)]
    biases = [torch.zeros(w, device=dev, dtype=dt, requires_grad=True) for w in (n, n, n * n)]
    esz = x.element_size()
    v = x.detach().reshape(B, S, n * C).requires_grad_()
    phi = (torch.randn(spec.width, n * C, device=dev, dtype=dt) * (n * C) ** -0.5).requires_grad_()

    def project_plain():  # as the graphs spell it: a linear beside the mean of squares
        return torch.nn.functional.linear(v, phi), (v * v).mean(-1)

    cases = {
        "post": (lambda: mhc_post(x, h_res, h, f, True),
                 torch.compile(lambda: mhc_post_ref(x, h_res, h, f, True)), (2 * n + 1) * C * esz,
                 (x, h_res, h, f)),
        "aggregate": (lambda: mhc_aggregate(x, h), torch.compile(lambda: mhc_aggregate_ref(x, h)),
                      (n + 1) * C * esz, (x, h)),
        "mapping": (lambda: mhc_mapping(proj, r, alphas, biases, spec),
                    torch.compile(lambda: mhc_mapping_ref(proj, r, alphas, biases, spec)),
                    (spec.width + 1 + 2 * n + n * n) * esz, (proj, r)),
        "project": (lambda: mhc_project(v, phi), torch.compile(project_plain), (n * C + spec.width) * esz,
                    (v, phi)),
    }
    tokens = B * S
    for name, (fused, ref, bytes_per_token, leaves) in cases.items():
        for label, fn in (("fused", fused), ("inductor", ref)):
            def fwd_bwd(fn=fn):
                outs = fn()
                outs = outs if isinstance(outs, tuple) else (outs,)
                torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
            fwd_ms = triton.testing.do_bench(lambda fn=fn: fn())
            both_ms = triton.testing.do_bench(fwd_bwd)
            gbs = tokens * bytes_per_token / fwd_ms / 1e6
            if a.profile and label == "fused":
                from _profile import profile_step

                print(f"--- profile {name} fused fwd+bwd\n{profile_step(fwd_bwd, top=12)[0]}", flush=True)
            print(f"{name:10s} {label:9s} fwd {fwd_ms:7.3f} ms ({gbs:6.0f} GB/s)  fwd+bwd {both_ms:7.3f} ms",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", action="store_true", help="time the fused kernels alone and stop")
    p.add_argument("--profile", action="store_true",
                   help="also print each variant's per-kernel GPU time (torch.profiler) and GPU-busy share")
    p.add_argument("--compile-profile", type=int, default=0, metavar="TOP",
                   help="also print the TOP functions of a cProfile of each variant's first (compiling) step")
    p.add_argument("--memory-peak", type=int, default=0, metavar="TOP",
                   help="print the TOP largest groups of blocks alive at one step's memory peak, by the line "
                        "that allocated them (torch.cuda.memory's recorded history)")
    p.add_argument("--host-profile", type=int, default=0, metavar="TOP",
                   help="also print the host's enqueue time per step and the TOP functions of a cProfile of 20 "
                        "warm steps")
    p.add_argument("--hc-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option for every hc variant (an hccompile option or an Inductor config key, e.g. "
                        "static_launch_user_defined_triton_kernels=true); repeatable")
    p.add_argument("--dump-dir", help="hc variants: hc's per-graph dumps here (its dump_dir option), to read the "
                                      "backward's generated code")
    p.add_argument("--variants", default=",".join(DEFAULT), help=f"comma-separated, from {ALL}")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--sinkhorn-iters", type=int, default=20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="mhc_results.jsonl")
    p.add_argument("--in-process", action="store_true",
                   help="measure every variant in this process (default: each in a fresh process of its own)")
    p.add_argument("--backward-on-caller", action="store_true",
                   help="run each backward on the calling thread (torch.autograd.set_multithreading_enabled(False)), "
                        "not on autograd's device thread: what the thread handoff costs a host-bound step")
    p.add_argument("--child-row", help=argparse.SUPPRESS)  # internal: measure one variant, write its row here
    a = p.parse_args()
    if a.backward_on_caller:  # thread-local: this process's main thread runs the steps
        torch.autograd.set_multithreading_enabled(False)
    if a.kernels:
        kernel_bench(a)
        return
    for item in a.hc_option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--hc-option {item!r}: expected KEY=VALUE")
        key, value = key.strip(), value.strip()
        HC_OPTIONS[key] = value.split(",") if key == "disable_passes" else _option_value(value)
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in ALL:
            raise SystemExit(f"unknown variant {v!r}; known: {ALL}")
    import triton

    from targets import run_stamp

    meta = {**run_stamp(), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "layers": a.layers,
            "shape": f"L{a.layers} C{a.dim} H{a.heads} B{a.batch} S{a.seq} {a.dtype} dropout "
                     f"{a.dropout} sinkhorn {a.sinkhorn_iters}"}
    if a.child_row:
        with open(a.child_row, "w") as f:
            json.dump(measure(variants[0], a), f)
        return
    floor = floor_fields(a) if any(v.startswith("n4") for v in variants) else {}
    steps = {}
    for v in variants:
        torch._dynamo.reset()
        measured = measure(v, a) if a.in_process else measure_in_child(v)
        row = {**meta, **measured, "process": "shared" if a.in_process else "own",
               "backward_thread": "caller" if a.backward_on_caller else "device",
               **(floor if v.startswith("n4") else {})}
        steps[v] = row["step_ms"]
        print(f"{v:20s} step {row['step_ms']:8.2f} ms (alone {row['step_synced_ms']:.2f})  peak {row['peak_gib']:6.2f} GiB  "
              f"compile {row['compile_s']:6.1f} s"
              + "".join(f"  {stage} {sec:.1f}" for stage, sec in row["compile_stages_s"].items()), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    if floor and "n1-inductor" in steps and "n4-hc-block" in steps:
        excess = steps["n4-hc-block"] - steps["n1-inductor"]
        print(f"floor {floor['floor_ms']:.2f} ms ({floor['floor_bytes'] / 1e9:.2f} GB at {floor['copy_gbs']:.0f} GB/s "
              f"copy bandwidth); excess n4-hc-block - n1-inductor {excess:.2f} ms = "
              f"{excess / floor['floor_ms']:.2f}x the floor", flush=True)


if __name__ == "__main__":
    main()
