"""Compile the mHC kernels for a GPU target without a GPU (Triton -> PTX -> ptxas cubin) and read
their register, stack and shared-memory use with cuobjdump; both tools ship with Triton's NVIDIA
backend.

The interpreter runs the kernels' Python, not the GPU compiler: this catches what only the GPU
compiler rejects, and register spills, on a CPU machine. The kernels are compiled as a real launch
specialises them: each launcher runs on small CPU tensors of the benchmark's per-token shape with
its launches recorded (launch_recorder), and every recorded launch is compiled with the signature Triton's
JIT would give it (integer arguments equal to 1 become constants, 16-divisible ones and aligned
pointers get divisibility hints), so unit strides vectorise as on the GPU. It needs kernels defined
without TRITON_INTERPRET, so run it in a process without that variable:

    python -m hccompile.kernels.mhc.compile_check            # prints one line per kernel launch
    python -m hccompile.kernels.mhc.compile_check --streams 3 9 16 --launches post_bwd
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

import torch

from .._triton import triton
from ..launch_recorder import recording_launches

ARCH = 90  # H100


def recorded_launches(n: int = 4, C: int = 1024, steps: int = 40, dtype=torch.bfloat16,
                      tokens: tuple[int, int] = (2, 64)):
    """[(name, kernel, args, kwargs)] of every kernel launch of the post, aggregate, mapping and
    projection launchers (forward and backward) at n streams, C channels, `dtype`; `tokens` = (T1, T2), small:
    the per-token strides, hence the specialisation, do not depend on the token count."""
    from . import aggregate, mapping, post, project
    from .reference import MappingSpec

    T1, T2 = tokens
    x = torch.randn(T1, T2, n, C, dtype=dtype)
    h_res, h = torch.rand(T1, T2, n, n, dtype=dtype), torch.rand(T1, T2, n, dtype=dtype)
    f = torch.randn(T1, T2, C, dtype=dtype)
    spec = MappingSpec(n=n, steps=steps)
    proj, r = torch.randn(T1, T2, spec.width, dtype=dtype), torch.rand(T1, T2, 1, dtype=dtype) + 1
    alphas = [torch.ones((), dtype=dtype) for _ in range(3)]
    biases = [torch.zeros(w, dtype=dtype) for w in (n, n, n * n)]
    runs = [
        ("post_fwd", lambda: post.mhc_post_fwd(x, h_res, h, f, True)),
        ("post_bwd", lambda: post.mhc_post_bwd(x, h_res, h, f, x, True)),
        ("post_bwd_nodx", lambda: post.mhc_post_bwd(x, h_res, h, f, x, True, with_dx=False)),
        ("aggregate_fwd", lambda: aggregate.mhc_aggregate_fwd(x, h)),
        ("aggregate_bwd", lambda: aggregate.mhc_aggregate_bwd(x, h, f)),
        ("mapping_fwd", lambda: mapping.mhc_mapping_fwd(proj, r, alphas, biases, spec)),
        ("mapping_bwd", lambda: mapping.mhc_mapping_bwd(proj, r, alphas, biases, h, h, h_res, spec)),
    ]
    if project.kernel_width(spec.width, dtype):  # wider projections compute with the reference
        v, phi = x.reshape(T1, T2, n * C), torch.randn(spec.width, n * C, dtype=dtype)
        runs += [("project_fwd", lambda: project.mhc_project_fwd(v, phi)),
                 ("project_bwd", lambda: project.mhc_project_bwd(v, phi, proj, r[..., 0].float()))]
    out = []
    for name, run in runs:
        with recording_launches() as calls:
            run()
        for i, (kernel, _grid, args, kwargs) in enumerate(calls):
            out.append((name if i == 0 else f"{name}.{i}", kernel, args, kwargs))
    return out


@contextlib.contextmanager
def private_triton_cache():
    """Compile into a fresh Triton cache for the duration: a shared cache entry may hold the cubin
    alone (the GPU suite's packed caches, benchmarks/gpu_cache.py), and resources() reads the PTX
    and TTGIR. TRITON_CACHE_DIR is restored afterwards."""
    before = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="hccompile-compile-check-") as cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
        try:
            yield cache_dir
        finally:
            if before is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = before


def compile_launch(kernel, args, kwargs, arch: int = ARCH):
    """The compiled kernel (CompiledKernel: .asm['ttgir'|'ptx'|'cubin'], .metadata) of one launch
    as Triton's JIT would specialise it."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    constexprs, signature, attrs = {}, {}, {}
    values = dict(zip(kernel.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in options})
    for idx, param in enumerate(kernel.params):
        # a parameter the launch leaves at its default (SOLVE: tl.constexpr = True) takes it
        name, value = param.name, values.get(param.name, param.default)
        if value is inspect.Parameter.empty:
            raise KeyError(f"{kernel.fn.__name__}: the launch gives no {name} and it has no default")
        if param.is_constexpr:
            signature[name], constexprs[(idx,)] = "constexpr", value
            continue
        ty, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(idx,)] = value
        elif attr:
            attrs[(idx,)] = BaseBackend.parse_attr(attr)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def resources(compiled) -> dict[str, int]:
    """{'REG': registers per thread, 'STACK': bytes of stack (spills), 'SHARED': ..., plus PTX
    counts: 'BAR' barriers, 'SHFL' warp shuffles, 'CVT' layout conversions in the TTGIR, 'LOOPCVT'
    those inside a loop}."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True,
                              check=True).stdout
    line = next(l for l in text.splitlines() if "REG:" in l)
    usage = {k: int(v) for k, v in (item.split(":") for item in line.split()) if v.isdigit()}
    ptx = compiled.asm["ptx"]
    usage["BAR"] = len(re.findall(r"\bbar\.sync\b|\bbarrier\.sync\b", ptx))
    usage["SHFL"] = len(re.findall(r"\bshfl\.sync", ptx))
    usage["CVT"] = compiled.asm["ttgir"].count("ttg.convert_layout")
    usage["LOOPCVT"] = loop_conversions(compiled.asm["ttgir"])
    return usage


def loop_conversions(ttgir: str) -> int:
    """Layout conversions (shared-memory round trips with barriers) inside any scf.for body of a
    TTGIR module: what a sweep kernel must not have; those after the loop run once per program."""
    depth, inside, count = 0, [], 0
    for line in ttgir.splitlines():
        opens = line.count("{") - line.count("}")
        if "scf.for" in line:
            inside.append(depth)
        elif inside and "ttg.convert_layout" in line:
            count += 1
        depth += opens
        while inside and depth <= inside[-1]:
            inside.pop()
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compile the mHC kernels' launches for sm_90")
    parser.add_argument("--streams", type=int, nargs="+", default=[4], help="stream counts n")
    parser.add_argument("--launches", nargs="+", default=None,
                        help="only these launchers' launches (post_bwd, mapping_fwd, ...)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile kernels", file=sys.stderr)
        return 2
    with private_triton_cache():
        return _report(args)


def _report(args) -> int:
    worst = 0
    for dtype in (torch.bfloat16, torch.float32):
        for n in args.streams:
            for name, kernel, largs, kwargs in recorded_launches(n=n, dtype=dtype):
                if args.launches is not None and name.split(".")[0] not in args.launches:
                    continue
                usage = resources(compile_launch(kernel, largs, kwargs))
                worst = max(worst, usage.get("STACK", 0))
                consts = {k: v for k, v in kwargs.items()}
                print(f"{name:16s} {str(dtype)[6:]:8s} {consts} REG {usage['REG']} STACK {usage.get('STACK', 0)}"
                      f" SHARED {usage.get('SHARED', 0)} BAR {usage['BAR']} SHFL {usage['SHFL']}"
                      f" CVT {usage['CVT']} LOOPCVT {usage['LOOPCVT']}")
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
