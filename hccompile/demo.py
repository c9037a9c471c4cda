"""The main job: compile a small model holding every pattern hccompile supports so far with
backend="hc", check it against eager, print the report and compare with backend="inductor"."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .debug.memory import SavedStorages
from .lowering.linear_attn import implementation


def saved_bytes(fn, *args: Any) -> int:
    """Run fn and count the bytes autograd keeps for backward (distinct storages). The output is
    dropped here: kept, it would hold its whole graph (21 GiB for the GPU demo's eager htree) through
    whatever runs next."""
    with SavedStorages() as saved:
        fn(*args)
    return saved.nbytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_time(fn, x: torch.Tensor, iters: int) -> float:
    """Median seconds of one forward+backward step."""
    times = []
    for _ in range(iters):
        _sync(x.device)
        t0 = time.perf_counter()
        fn(x).float().sum().backward()
        _sync(x.device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@dataclass
class Row:
    """One backend's numbers in a section."""

    ms: float                        # median forward+backward step
    saved_mib: float                 # what autograd keeps for backward
    peak_mib: float | None = None    # the step's peak allocation above what was live before it (CUDA)
    compile_s: float | None = None   # the first call, compile included


@dataclass
class Section:
    """One capability's comparison: correctness against eager and one row per backend."""

    label: str   # the capability, as the summary and the plot name it
    title: str
    ok: bool
    rows: dict[str, Row] = field(default_factory=dict)


def measure(fn, x: torch.Tensor, iters: int, compile_s: float | None = None) -> Row:
    """Saved bytes, then the timed steps, then the peak of one step."""
    nbytes = saved_bytes(fn, x)
    ms = step_time(fn, x, iters) * 1e3
    peak = None
    if x.device.type == "cuda":
        _free(x.device)
        torch.cuda.reset_peak_memory_stats(x.device)
        before = torch.cuda.memory_allocated(x.device)
        fn(x).float().sum().backward()
        torch.cuda.synchronize(x.device)
        peak = (torch.cuda.max_memory_allocated(x.device) - before) / 2**20
    return Row(ms, nbytes / 2**20, peak, compile_s)


def _loss_weight(out: torch.Tensor, seed: int) -> torch.Tensor:
    # a random projection, not .sum(): the sum of a LayerNorm output has zero gradient
    gen = torch.Generator(out.device).manual_seed(seed)
    return torch.randn(out.shape, device=out.device, generator=gen).to(out.dtype)


def _outputs_and_grads(fn, model: torch.nn.Module, x: torch.Tensor, seed: int):
    model.zero_grad(set_to_none=True)
    x.grad = None
    out = fn(x)
    (out.float() * _loss_weight(out, seed).float()).sum().backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return out.detach(), grads + ([x.grad.clone()] if x.grad is not None else [])


def _check(hc, eager, float32_run, tol: float) -> tuple[bool, float, float]:
    """hc's output and gradients against eager's in the same dtype; in half precision, where the
    two round differently, a tensor past `tol` still passes when hc is as close to the float32 model
    (float32_run(), run only then) as eager itself is (within 2x)."""
    (out, grads), (ref_out, ref_grads) = hc, eager
    worst_out, worst_grad, ok, exact = rel_err(out, ref_out), 0.0, True, None
    for i, (a, b) in enumerate(zip([out, *grads], [ref_out, *ref_grads])):
        err = rel_err(a, b)
        if i:
            worst_grad = max(worst_grad, err)
        if err > tol:
            if float32_run is None:
                ok = False
                continue
            if exact is None:
                exact_out, exact_grads = float32_run()
                exact = [exact_out, *exact_grads]
            ok = ok and rel_err(a, exact[i]) <= 2 * rel_err(b, exact[i]) + tol
    return ok, worst_out, worst_grad


def compare_backends(label: str, title: str, model: torch.nn.Module, x: torch.Tensor, iters: int,
                     inductor: bool = True, options: dict[str, Any] | None = None,
                     full_report: bool = False, seed: int = 1) -> Section:
    """Compiles `model` with hc (and Inductor), checks hc against eager and times all of them."""
    from .explain import collect_reports

    print(f"\n## {title}\n", flush=True)
    dev, dtype = x.device, next(model.parameters()).dtype
    ref = _outputs_and_grads(model, model, x, seed)

    def float32_run():
        import copy

        model32 = copy.deepcopy(model).float()
        x32 = x.detach().float().requires_grad_(x.requires_grad) if x.is_floating_point() else x
        return _outputs_and_grads(model32, model32, x32, seed)
    section = Section(label, title, True)
    section.rows["eager"] = measure(model, x, iters)
    backends = {"hc": options, **({"inductor": None} if inductor else {})}
    results = {}
    for name, backend_options in backends.items():
        # One backend at a time, compiled cold and measured before the next is compiled: a wrapper
        # called after Dynamo's cache was reset for another backend would compile again, warm.
        torch._dynamo.reset()
        _free(dev)
        fn = torch.compile(model, backend=name, options=backend_options)
        print(f"compiling with backend={name!r}...", flush=True)
        with torch._inductor.config.patch(force_disable_caches=True), collect_reports() as report:
            t0 = time.perf_counter()
            results[name] = _outputs_and_grads(fn, model, x, seed)
            _sync(dev)
            first_call = time.perf_counter() - t0
            if name == "hc":
                print(report.to_markdown() if full_report else _report_summary(report))
            section.rows[name] = measure(fn, x, iters, first_call)
        del fn
    torch._dynamo.reset()
    tol = 2e-2 if dtype != torch.float32 else 1e-4
    half = dtype != torch.float32
    section.ok, out_err, grad_err = _check(results["hc"], ref, float32_run if half else None, tol)
    print(f"correctness vs eager: output rel err {out_err:.2e}, worst gradient rel err {grad_err:.2e} "
          f"(tolerance {tol:g}{', or as close to float32 as eager' if half else ''}) "
          f"-> {'OK' if section.ok else 'MISMATCH'}")
    del ref, results
    _free(dev)
    _print_rows(section.rows)
    if dev.type == "cuda" and "inductor" in section.rows:
        ind, hc = section.rows["inductor"], section.rows["hc"]
        print(f"\nhc against inductor: step {ind.ms / hc.ms:.2f}x as fast, saved for backward "
              f"{hc.saved_mib / max(ind.saved_mib, 1e-9):.2f}x the memory, peak {hc.peak_mib / max(ind.peak_mib, 1e-9):.2f}x, "
              f"compile {hc.compile_s:.0f} s vs {ind.compile_s:.0f} s")
    elif not inductor:
        print("\n(inductor left out of this section: it compiles the plain chunk loop as written, unrolled, "
              "in minutes; --inductor includes it)")
    return section


def _print_rows(rows: dict[str, Row]) -> None:
    peak = any(r.peak_mib is not None for r in rows.values())
    print("\n| backend | fwd+bwd step (ms, median) | saved for backward (MiB) |"
          + (" peak of a step (MiB) |" if peak else "") + " first call incl. compile (s) |")
    print("|---|---|---|" + ("---|" if peak else "") + "---|")
    for name, r in rows.items():
        print(f"| {name} | {r.ms:.2f} | {r.saved_mib:.2f} |" + (f" {r.peak_mib:.0f} |" if peak else "")
              + f" {'' if r.compile_s is None else f'{r.compile_s:.1f}'} |")


def _free(dev: torch.device) -> None:
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _report_summary(report) -> str:
    lines = [f"hc report: {g.summary_line()}" for g in report.graphs]
    for r in report.refusals:
        lines.append(f"  refused `{r['pattern']}` ({r['pass']}): {r['reason']}")
    for g in report.graphs:
        for p in g.passes:
            if p.error:
                lines.append(f"  pass {p.name} failed on the {p.graph} graph, its changes undone: {p.error}")
    for g in report.graphs:
        for graph, ops in g.lowered_ops.items():
            lines.append(f"  {graph} graph runs: {', '.join(ops) if ops else 'no hccompile op'}")
    return "\n".join(lines)


class HTreeModel(torch.nn.Module):
    """Pre-norm blocks of htree sparse attention (GQA) and a GELU MLP."""

    def __init__(self, dim: int, heads: int, layers: int, compression_rate: int, top_k: int):
        from .nn import HTreeAttention

        super().__init__()
        kv_heads = max(1, heads // 4)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "norm1": torch.nn.RMSNorm(dim),
            "attn": HTreeAttention(dim, heads, kv_heads, compression_rate=compression_rate, top_k=top_k),
            "norm2": torch.nn.RMSNorm(dim),
            "mlp": torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)),
        }) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm1"](x))
            x = x + blk["mlp"](blk["norm2"](x))
        return x


SECTIONS = ("linear", "gdn", "kda", "htree", "mhc")


def run(device: str | None = None, batch: int = 2, seq: int = 128, dim: int = 64, heads: int = 4,
        layers: int = 2, iters: int = 5, dump_dir: str | None = None, sections: tuple[str, ...] = SECTIONS,
        inductor_sections: tuple[str, ...] = SECTIONS, delta_seq: int | None = None,
        plot: str | None = None) -> dict[str, Any]:
    from .nn import TinyDeltaNetModel, TinyLinearTransformer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    impl = implementation(dev, dtype)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"hccompile demo: device={dev} ({name}) dtype={dtype} torch={torch.__version__} kernels={impl}")
    if dev.type == "cpu":
        print("On the CPU the kernels run in Triton's interpreter or as the PyTorch reference: the timings "
              "below only show that the pipeline works. On a CUDA GPU the demo runs the Triton kernels at "
              "B4 T4096 C1024, where they matter.")
    options = {"dump_dir": dump_dir} if dump_dir else None  # every section's hc compile is dumped there
    done: list[Section] = []
    if "linear" in sections:
        torch.manual_seed(0)
        model = TinyLinearTransformer(dim, heads, layers).to(dev, dtype)
        x = torch.randn(batch, seq, dim, device=dev, dtype=dtype, requires_grad=True)
        title = (f"Linear attention: TinyLinearTransformer(dim={dim}, heads={heads}, layers={layers}), "
                 f"input [B={batch}, T={seq}, C={dim}]")
        done.append(compare_backends("Linear attention", title, model, x, iters, "linear" in inductor_sections, options,
                                     full_report=True))
    t_delta = delta_seq or seq
    delta_heads = max(1, heads // 2)
    for kind, label in (("gdn", "Gated DeltaNet"), ("kda", "Kimi Delta Attention")):
        if kind not in sections:
            continue
        torch.manual_seed(0)
        model = TinyDeltaNetModel(vocab=256, hidden_size=dim, layers=layers, kind=kind, num_heads=delta_heads,
                                  head_dim=dim // delta_heads).to(dev, dtype)
        tokens = torch.randint(0, 256, (batch, t_delta), device=dev)
        title = (f"{label} ({kind.upper()}): TinyDeltaNetModel(hidden={dim}, {delta_heads} heads of "
                 f"{dim // delta_heads}, layers={layers}), tokens [B={batch}, T={t_delta}]")
        done.append(compare_backends(kind.upper(), title, model, tokens, iters, kind in inductor_sections, options))
        if dev.type == "cuda":
            _op_against_fla(kind, batch, t_delta, delta_heads, dim // delta_heads, dtype, dev, iters)
    if "htree" in sections:
        torch.manual_seed(0)
        # The plain form eager gathers [B, KV heads, T, candidates, D] tensors: at B4 T4096 C1024 it
        # ran out of the H100's 80 GB, so the GPU demo gives htree one sequence. A sequence no longer
        # than top_k * rate is one tree level, plain attention, which hc leaves to Inductor: short
        # sequences get a smaller tree.
        htree_batch = 1 if dev.type == "cuda" else batch
        rate, top_k = (16, 64) if seq > 2 * 16 * 64 else (4, 8)
        model = HTreeModel(dim, heads, layers, rate, top_k).to(dev, dtype)
        x = torch.randn(htree_batch, seq, dim, device=dev, dtype=dtype, requires_grad=True)
        title = (f"htree sparse attention: {layers} blocks, {heads} heads ({max(1, heads // 4)} KV heads), "
                 f"compression {rate}, top_k {top_k}, input [B={htree_batch}, T={seq}, C={dim}]")
        done.append(compare_backends("htree", title, model, x, iters, "htree" in inductor_sections, options))
    if "mhc" in sections:
        done.append(run_mhc(dev, dtype, batch, seq, dim, heads, iters))
    ok = all(s.ok for s in done)
    _summary(done, dev)
    if plot and done:
        write_plot(plot, done, f"hccompile demo, {name}, {dtype}".replace("torch.", ""))
        print(f"\nplot: {plot}")
    return {"ok": ok, "sections": done}


def _summary(done: list[Section], dev: torch.device) -> None:
    print("\n## Summary\n\n| capability | correct | hc step (ms) | inductor step (ms) | hc saved (MiB) | "
          "inductor saved (MiB) |\n|---|---|---|---|---|---|")
    for s in done:
        hc, ind = s.rows.get("hc"), s.rows.get("inductor")
        print(f"| {s.label} | {'OK' if s.ok else 'MISMATCH'} | {hc.ms:.2f} | "
              f"{'' if ind is None else f'{ind.ms:.2f}'} | {hc.saved_mib:.1f} | "
              f"{'' if ind is None else f'{ind.saved_mib:.1f}'} |")
    if dev.type == "cpu":
        print("\n(CPU: the kernels run as the reference or in the interpreter; performance claims come "
              "from benchmarks/ on the GPU.)")


def write_plot(path: str, done: list[Section], title: str) -> None:
    import os

    from .debug.plot import Panel, bar_chart_png

    series = ["eager", "inductor", "hc"]

    panels = [Panel("fwd+bwd step", [(s.label, {k: s.rows[k].ms for k in series if k in s.rows}) for s in done], "ms"),
              Panel("saved for backward", [(s.label, {k: s.rows[k].saved_mib for k in series if k in s.rows})
                                           for s in done], "MiB")]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    bar_chart_png(path, title, panels, series)


def _op_against_fla(kind: str, B: int, T: int, H: int, D: int, dtype: torch.dtype, dev: torch.device,
                    iters: int) -> None:
    """The delta-rule op alone, hccompile's kernels against FLA's (when FLA is installed)."""
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        print("(FLA not installed: pip install flash-linear-attention to see its kernels beside ours)")
        return
    from . import chunk_gated_delta_rule, chunk_kda

    gen = torch.Generator(dev).manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device=dev, generator=gen).to(dtype) for _ in range(3))
    beta = torch.rand(B, T, H, device=dev, generator=gen).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(*((B, T, H) if kind == "gdn" else (B, T, H, D)), device=dev,
                                                   generator=gen))
    try:
        if kind == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
            ours = chunk_gated_delta_rule
        else:
            from fla.ops.kda import chunk_kda as fla_op
            ours = chunk_kda
    except Exception as e:  # noqa: BLE001 - FLA's import failing is a line, not a crash
        print(f"(FLA did not import: {type(e).__name__}: {e})")
        return
    print(f"(the {kind.upper()} op alone beside FLA's: FLA autotunes its kernels on their first call, "
          "a minute or more)", flush=True)
    times = {}
    for name, op in (("hccompile", ours), ("FLA", fla_op)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, g, beta)]

        def step():
            op(*leaves, use_qk_l2norm_in_kernel=True)[0].float().sum().backward()

        try:
            step()
            samples = []
            for _ in range(max(iters, 5)):
                _sync(dev)
                t0 = time.perf_counter()
                step()
                _sync(dev)
                samples.append(time.perf_counter() - t0)
            times[name] = sorted(samples)[len(samples) // 2] * 1e3
        except Exception as e:  # noqa: BLE001 - e.g. FLA refusing its GDN backward on this Triton
            times[name] = None
            print(f"({name} {kind.upper()} op: {type(e).__name__}: {str(e)[:200]})")
    shown = ", ".join(f"{n} {t:.2f} ms" for n, t in times.items() if t is not None)
    print(f"\nthe {kind.upper()} op alone, fwd+bwd [B={B}, T={T}, H={H}, D={D}] {dtype}: {shown}")


def run_mhc(dev: torch.device, dtype: torch.dtype, batch: int, seq: int, dim: int, heads: int,
            iters: int = 5) -> Section:
    """mHC (n=4 streams, dropout 0.1): hc's block recompute against Inductor's own plan."""
    from .nn import MHCGPT

    _free(dev)

    torch.manual_seed(0)
    model = MHCGPT(dim, heads, layers=2, n=4, dropout=0.1, sinkhorn_iters=8).to(dev, dtype)
    x = torch.randn(batch, seq, dim, device=dev, dtype=dtype)
    w = torch.randn(batch, seq, dim, device=dev, generator=torch.Generator(dev).manual_seed(2)).to(dtype)
    title = f"mHC hyper-connections: MHCGPT(n=4, 2 layers, dropout 0.1), input [B={batch}, T={seq}, C={dim}]"
    print(f"\n## {title}\n", flush=True)
    rows, grads = {"eager": measure(model, x, iters)}, {}
    for name, kwargs in (("inductor", {"backend": "inductor"}),
                         ("hc (hc_recompute=off)", {"backend": "hc", "options": {"hc_recompute": "off"}}),
                         ("hc (block recompute)", {"backend": "hc"})):
        torch._dynamo.reset()
        _free(dev)
        fn = torch.compile(model, **kwargs)
        torch.manual_seed(1)
        t0 = time.perf_counter()
        fn(x)  # compile
        _sync(dev)
        first_call = time.perf_counter() - t0
        torch.manual_seed(1)  # same dropout masks in every run
        model.zero_grad(set_to_none=True)
        (fn(x).float() * w.float()).sum().backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        rows[name] = measure(fn, x, iters, first_call)
        del fn
    torch._dynamo.reset()
    g_off = grads["hc (hc_recompute=off)"]
    g_blk = grads["hc (block recompute)"]
    exact = all(torch.equal(a, b) for a, b in zip(g_off, g_blk))
    # Bit-identical at small sizes; at B4 T4096 C1024 on the H100 the step itself is not (the same
    # plan twice differs by 7e-5 relative: reductions by atomics) and the recompute graph rounds
    # differently (9e-4). The bound tests/test_hc_passes.py uses: 2% of a gradient's norm plus 1e-4
    # of the largest; a dropout mask replayed wrong puts the gradients ~50% off.
    largest = max(g.float().norm().item() for g in g_off)
    worst = max((a.float() - b.float()).norm().item() / (2e-2 * b.float().norm().item() + 1e-4 * largest)
                for a, b in zip(g_blk, g_off))
    ok = exact or worst <= 1
    _print_rows(rows)
    how = "identical" if exact else f"within rounding ({worst:.2f} of the bound)"
    print(f"\nblock recompute gradients against no recompute (dropout on): {how} -> {'OK' if ok else 'MISMATCH'}")
    section = Section("mHC", title, ok, {"eager": rows["eager"], "inductor": rows["inductor"],
                                         "hc": rows["hc (block recompute)"]})
    del grads, g_off, g_blk
    _free(dev)
    return section


# option -> (CUDA default, CPU default): on the GPU a size where the kernels matter (the quadratic
# attention Inductor compiles from the plain model holds B*H*T^2 scores); on the CPU, where the
# kernels run in Triton's interpreter or as the reference, a size that finishes in minutes
SIZES = {"batch": (4, 2), "seq": (4096, 128), "dim": (1024, 64), "heads": (16, 4), "iters": (10, 5),
         "delta_seq": (2048, 128)}
# Inductor compiles the plain chunked delta rule as written, its loops unrolled: 201 s for the GPU
# demo's 2-layer GDN model on the H100 (hc: 31 s), about 2 min per model on two CPU cores. Left out
# by default; `--inductor linear,gdn,kda,htree,mhc` includes it.
INDUCTOR_SECTIONS = ("linear,htree,mhc", "linear,htree,mhc")


def _sections(text: str) -> tuple[str, ...]:
    import argparse

    names = tuple(n for n in text.split(",") if n) if text not in ("none", "") else ()
    bad = [n for n in names if n not in SECTIONS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown section {bad[0]!r}; expected a comma-separated subset of "
                                         f"{','.join(SECTIONS)} (or none)")
    return names


def main(argv: list[str] | None = None) -> int:
    import os

    from .cli_args import Parser, device_arg, positive_int

    p = Parser(prog="hccompile demo", description=__doc__)
    p.add_argument("--device", type=device_arg, default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--seq", type=positive_int, default=None,
                   help="sequence length T (default: 4096 on CUDA, 128 on the CPU)")
    p.add_argument("--delta-seq", type=positive_int, default=None, metavar="T",
                   help="sequence length of the GDN and KDA models (default: 2048 on CUDA, 128 on the CPU)")
    p.add_argument("--batch", type=positive_int, default=None, help="batch size B (default: 4 on CUDA, 2 on the CPU)")
    p.add_argument("--dim", type=positive_int, default=None,
                   help="model width C, a multiple of --heads (default: 1024 on CUDA, 64 on the CPU)")
    p.add_argument("--heads", type=positive_int, default=None,
                   help="attention heads (default: 16 on CUDA, 4 on the CPU; GDN/KDA use half as many, twice as wide)")
    p.add_argument("--layers", type=positive_int, default=2,
                   help="blocks of the linear-attention, delta-rule and htree models (default: 2; the mHC model has 2)")
    p.add_argument("--iters", type=positive_int, default=None,
                   help="timed steps per backend; the table shows their median (default: 10 on CUDA, 5 on the CPU)")
    p.add_argument("--sections", type=_sections, default=SECTIONS, metavar="LIST",
                   help=f"which capabilities to show, comma-separated (default: {','.join(SECTIONS)})")
    p.add_argument("--inductor", type=_sections, default=None, metavar="LIST",
                   help=f"the sections also compiled with backend='inductor' (default: {INDUCTOR_SECTIONS[0]}: "
                        "Inductor takes minutes to compile the plain delta-rule chunk loop; 'none' for none)")
    p.add_argument("--dump-dir", default=None, help="also write the dumps (docs/dumps.md) here")
    p.add_argument("--plot", default=None,
                   help="PNG of step time and memory per backend (default: demo.png in --dump-dir, else hc_dump/demo.png)")
    a = p.parse_args(argv)
    on_gpu = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    for name, (gpu, cpu) in SIZES.items():
        if getattr(a, name) is None:
            setattr(a, name, gpu if on_gpu else cpu)
    if a.inductor is None:
        a.inductor = _sections(INDUCTOR_SECTIONS[0 if on_gpu else 1])
    if a.dim % a.heads:
        p.error(f"--dim {a.dim} is not a multiple of --heads {a.heads}")
    if a.dump_dir and os.path.exists(a.dump_dir) and not os.path.isdir(a.dump_dir):
        p.error(f"--dump-dir: {a.dump_dir} exists and is not a directory")
    plot = a.plot or os.path.join(a.dump_dir or "hc_dump", "demo.png")
    result = run(a.device, a.batch, a.seq, a.dim, a.heads, a.layers, a.iters, a.dump_dir, a.sections,
                 a.inductor, a.delta_seq, plot)
    return 0 if result["ok"] else 1
