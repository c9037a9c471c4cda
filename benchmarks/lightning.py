"""Lightning attention on the GPU: ours vs FLA 0.6.0 vs SDPA causal vs the plain form under Inductor
and under hc, forward and forward+backward, side by side in one process.

    python benchmarks/lightning.py --out results/lightning.jsonl

Per shape and decay setting it prints one markdown row per implementation: median ms
(triton.testing.do_bench), the achieved GB/s of the minimum traffic (fwd: q, k, v read and o
written; fwd+bwd adds q, k, v, do read and dq, dk, dv written) against the measured device copy
bandwidth, and, for ours, the error against FLA. FLA is `fla.ops.simple_gla.chunk_simple_gla` with
`g_gamma` = our decay, which is what FLA's `chunk_lightning_attn` calls. The kernels' shared memory
and registers come from the compiled kernels' metadata.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (B, T, H, D[, sequences]): a fifth number makes the batch varlen (B = 1, that many sequences of
# ragged lengths summing to T, FLA's cu_seqlens), a packed training batch
SHAPES = {"B4-T4096-H16-D128": (4, 4096, 16, 128), "B1-T32768-H16-D128": (1, 32768, 16, 128),
          "B8-T2048-H32-D64": (8, 2048, 32, 64), "B1-T16384-H16-D128-varlen8": (1, 16384, 16, 128, 8)}


def ragged_bounds(time: int, sequences: int, device) -> torch.Tensor:
    """cu_seqlens [sequences + 1] of lengths within +-50 % of time / sequences, fixed by a seed."""
    gen = torch.Generator().manual_seed(1)
    weights = 0.5 + torch.rand(sequences, generator=gen)
    lengths = (weights / weights.sum() * time).long().clamp(min=1)
    lengths[-1] += time - lengths.sum()
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(device=device, dtype=torch.int32)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    from triton.testing import do_bench

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3)


def plain_decay_attention(q, k, v, decay, scale):
    """The quadratic form as written in model code: [B, T, H, D], a decay mask per head."""
    t = q.shape[1]
    pos = torch.arange(t, device=q.device)
    dist = (pos[:, None] - pos[None, :]).to(torch.float32)
    mask = torch.exp(decay[:, None, None] * dist.clamp_min(0)) * (dist >= 0)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    return torch.einsum("bhts,bshd->bthd", (scores * mask).to(v.dtype), v)


def plain_linear_attention(q, k, v, scale):
    t = q.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    return torch.einsum("bhts,bshd->bthd", scores.masked_fill(~mask, 0), v)


def bench(fn, grad_inputs, do):
    from triton.testing import do_bench

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        for t in grad_inputs:
            t.grad = None
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out.backward(do)

    # Medians over a longer window: means of ~1 ms steps moved by up to 25 % between runs.
    return (do_bench(fwd, rep=200, return_mode="median"), do_bench(fwd_bwd, rep=200, return_mode="median"))


def add_dense_rows(add, rows, q, k, v, decay, scale, args):
    """SDPA's causal softmax attention, and the plain quadratic form under Inductor and hc (where its
    [B, H, T, T] scores fit), for rows of one sequence each."""
    b, t, h, _ = q.shape
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    add("SDPA causal (softmax)", lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2))
    quadratic_bytes = b * h * t * t * 4
    if args.skip_plain or quadratic_bytes > args.plain_limit_gb * 2**30:
        rows.append(dict(impl="plain form (Inductor / hc)", note=f"skipped: [B,H,T,T] fp32 = {quadratic_bytes / 2**30:.0f} GiB"))
        return
    plain = (lambda q, k, v: plain_decay_attention(q, k, v, decay, scale)) if decay is not None else \
        (lambda q, k, v: plain_linear_attention(q, k, v, scale))
    for backend in ("inductor", "hc"):
        torch._dynamo.reset()
        compiled = torch.compile(plain, backend=backend, fullgraph=True)
        add(f"plain form, {backend}", lambda: compiled(q, k, v))


def run_shape(name, shape, decayed, args, bandwidth):
    import hccompile

    b, t, h, d, *varlen = shape
    cu_seqlens = ragged_bounds(t, varlen[0], "cuda") if varlen else None
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=dtype, generator=gen).mul_(0.5)
               .requires_grad_() for _ in range(3))
    do = torch.randn(b, t, h, d, device="cuda", dtype=dtype, generator=gen)
    decay = hccompile.lowering.lightning.alibi_decay(h, device="cuda") if decayed else \
        torch.zeros(h, device="cuda")
    scale = d ** -0.5
    elem = q.element_size()
    fwd_bytes = 4 * b * t * h * d * elem
    bwd_bytes = fwd_bytes + 7 * b * t * h * d * elem
    rows = []

    def add(impl, fn, note=""):
        try:
            f_ms, fb_ms = bench(fn, (q, k, v), do)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            rows.append(dict(impl=impl, note="out of memory"))
            return
        except Exception as error:  # noqa: BLE001  (a peer without this form: a row that says so)
            rows.append(dict(impl=impl, note=f"failed: {type(error).__name__}: {error}"[:300]))
            return
        rows.append(dict(impl=impl, fwd_ms=f_ms, fwd_bwd_ms=fb_ms, fwd_gbs=fwd_bytes / f_ms / 1e6,
                         fwd_bwd_gbs=bwd_bytes / fb_ms / 1e6, note=note))

    from hccompile.kernels.lightning import segments, sweeps

    ours = lambda: hccompile.lightning_attn(q, k, v, decay=decay, scale=scale, cu_seqlens=cu_seqlens)[0]  # noqa: E731
    # The first forward+backward in this process at this shape, Triton's compile included (issue 20's
    # "first call beyond compile": targets.py reads first_call_s of ours' rows; the first shape of a
    # run compiles, later ones find the kernels compiled unless their specialisation differs).
    torch.cuda.synchronize()
    start = time.perf_counter()
    ours().backward(do)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start
    for x in (q, k, v):
        x.grad = None
    add("hccompile.lightning_attn", ours)
    rows[-1]["first_call_s"] = first_call_s
    # the kernels' switches set away from their defaults, side by side (each row's note names them);
    # they are read as each kernel launches, so they stay set through the backward too
    switches = {"nested sweeps": [(sweeps, "FLAT_SWEEPS", False)],
                "sequential states on": [(segments, "SEQUENTIAL_STATES", True)],
                "sequential states off": [(segments, "SEQUENTIAL_STATES", False)]}

    @contextlib.contextmanager
    def flipped(label):
        saved = [(m, a, getattr(m, a)) for m, a, _ in switches[label]]
        for m, a, value in switches[label]:
            setattr(m, a, value)
        try:
            yield ", ".join(f"{m.__name__.rsplit('.', 1)[1]}.{a}={value}" for m, a, value in switches[label])
        finally:
            for m, a, value in saved:
                setattr(m, a, value)

    if args.no_switches:
        switches = {}
    for label in switches:
        with flipped(label) as note:
            add(f"hccompile.lightning_attn, {label}", ours, note=note)

    fla_err = None
    fla = None
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as error:  # noqa: BLE001
        rows.append(dict(impl="FLA 0.6.0", note=f"not importable: {error}"))
    else:
        fla = lambda: chunk_simple_gla(q, k, v, g_gamma=decay, scale=scale,  # noqa: E731
                                       cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())[0]
        add("FLA 0.6.0 chunk_simple_gla(g_gamma)", fla)
        def outputs(f):
            for x in (q, k, v):
                x.grad = None
            o = f()
            o.backward(do)
            return [o.detach().float()] + [x.grad.detach().float() for x in (q, k, v)]

        def error(got, want):
            return {n: ((a - r).norm() / r.norm()).item() for n, a, r in zip(("o", "dq", "dk", "dv"), got, want)}

        try:
            reference = outputs(fla)
        except Exception:  # noqa: BLE001  (its row says why)
            reference = None
        fla_err = None if reference is None else error(outputs(ours), reference)
        for label in (switches if reference is not None else ()):
            with flipped(label):
                flipped_err = error(outputs(ours), reference)
            for row in rows:
                if row["impl"] == f"hccompile.lightning_attn, {label}":
                    row["error_vs_fla"] = flipped_err

    # More rounds of ours and FLA, alternating (targets.py takes each round's ratio and counts the least
    # favourable): an eager step at these shapes is host-bound, and one row is one swing of the host.
    if args.rounds > 1:
        first = [row for row in rows if row["impl"] in ("hccompile.lightning_attn", "FLA 0.6.0 chunk_simple_gla(g_gamma)")]
        for row in first:
            row["round"] = 0
        for round_ in range(1, args.rounds):
            add("hccompile.lightning_attn", ours)
            rows[-1]["round"] = round_
            if fla is not None:
                add("FLA 0.6.0 chunk_simple_gla(g_gamma)", fla)
                rows[-1]["round"] = round_

    if varlen:  # SDPA and the plain forms take one sequence per row
        rows.append(dict(impl="SDPA / plain forms", note="skipped: a varlen batch"))
    else:
        add_dense_rows(add, rows, q, k, v, decay if decayed else None, scale, args)

    for row in rows:
        row.update(shape=name, decay=decayed, dtype=args.dtype, sequences=varlen[0] if varlen else b)
        if row["impl"] == "hccompile.lightning_attn":
            row["error_vs_fla"] = fla_err
            row["floor_fwd_ms"] = fwd_bytes / bandwidth * 1e3
            row["floor_fwd_bwd_ms"] = bwd_bytes / bandwidth * 1e3
    return rows


def kernel_resources():
    from hccompile.kernels._triton import compiled_resources
    from hccompile.kernels.lightning import segments, sweeps

    return [r for module in (segments, sweeps) for name in dir(module) if name.endswith("_kernel")
            for r in compiled_resources(getattr(module, name))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip-plain", action="store_true", help="skip the plain form under Inductor/hc")
    p.add_argument("--plain-limit-gb", type=float, default=8.0, help="skip plain forms whose score matrix is larger")
    p.add_argument("--no-switches", action="store_true", help="only the defaults: no rows with a switch flipped")
    p.add_argument("--rounds", type=int, default=1,
                   help="time ours and FLA this many times, alternating (rows carry a `round` field; targets.py "
                        "counts the least favourable round)")
    p.add_argument("--decays", default="decay,none",
                   help="the decay settings in the order they run (the no-decay rows ran second and slower in two "
                        "runs of three with the same kernels: 'none,decay' tells whether the order does it)")
    p.add_argument("--out", default=None, help="append JSON lines here")
    p.add_argument("--backward-on-caller", action="store_true",
                   help="every impl's backward on the calling thread (torch.autograd.set_multithreading_enabled"
                        "(False)), not autograd's device thread: rows for diag_ files, not the targets")
    args = p.parse_args(argv)
    if args.backward_on_caller:  # thread-local: the benchmark runs on this thread
        torch.autograd.set_multithreading_enabled(False)

    import triton

    bandwidth = copy_bandwidth()
    from targets import run_stamp  # benchmarks/ is the script's directory

    # run_stamp: the date, a run id and the commit (HCCOMPILE_COMMIT on the device)
    meta = dict(**run_stamp(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, copy_gbs=bandwidth / 1e9,
                backward_thread="caller" if args.backward_on_caller else "device")
    try:
        import fla
        meta["fla"] = getattr(fla, "__version__", "?")
    except Exception:  # noqa: BLE001
        meta["fla"] = None
    print(f"# {meta}")
    for name in args.shapes.split(","):
        for decayed in [{"decay": True, "none": False}[d] for d in args.decays.split(",")]:
            rows = run_shape(name, SHAPES[name], decayed, args, bandwidth)
            if args.out:  # as measured: a run cut short keeps its finished shapes
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "a") as f:
                    for r in rows:
                        f.write(json.dumps({**meta, **r}) + "\n")
            print(f"\n## {name} {'decay' if decayed else 'no decay'} {args.dtype}")
            print("| impl | fwd ms | fwd+bwd ms | fwd GB/s | fwd+bwd GB/s | note |")
            print("|---|---|---|---|---|---|")
            for r in rows:
                if "fwd_ms" in r:
                    impl = r["impl"] + (f" (round {r['round']})" if "round" in r else "")
                    print(f"| {impl} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_gbs']:.0f} | "
                          f"{r['fwd_bwd_gbs']:.0f} | {r.get('note', '')} |")
                else:
                    print(f"| {r['impl']} | - | - | - | - | {r.get('note', '')} |")
            ours = rows[0]
            if "floor_fwd_ms" in ours:
                print(f"floor (copy bandwidth): fwd {ours['floor_fwd_ms']:.3f} ms, fwd+bwd {ours['floor_fwd_bwd_ms']:.3f} ms;"
                      f" error vs FLA: {ours.get('error_vs_fla')}")
            sys.stdout.flush()
    resources = kernel_resources()
    print("\n## kernel resources (compiled metadata)")
    for r in resources:
        print(r)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({**meta, "kernel_resources": resources}) + "\n")


if __name__ == "__main__":
    main()
