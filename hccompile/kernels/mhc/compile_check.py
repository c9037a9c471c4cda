"""Compile the mHC kernels for a GPU target without a GPU (Triton -> PTX -> ptxas cubin) and read
their register and stack use with cuobjdump; both tools ship with Triton's NVIDIA backend.

The interpreter runs the kernels' Python, not the GPU compiler: this catches what only the GPU
compiler rejects, and register spills, on a CPU machine. It needs kernels defined without
TRITON_INTERPRET, so run it in a process without that variable:

    python -m hccompile.kernels.mhc.compile_check            # prints one line per kernel
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from .._triton import triton

ARCH = 90  # H100

_FLOATS = ("coef_pre", "coef_post", "coef_res", "pre_scale", "pre_shift", "post_scale", "post_shift",
           "init_eps", "norm_eps")


def resource_usage(kernel, constexprs: dict, pointer_dtype: str = "bf16", num_warps: int = 4,
                   arch: int = ARCH) -> dict[str, int]:
    """{'REG': registers per thread, 'STACK': bytes of stack (spills), ...} of one specialisation."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "partial_ptr":
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = f"*{pointer_dtype}"
        elif name in _FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True,
                              check=True).stdout
    line = next(l for l in text.splitlines() if "REG:" in l)
    return {k: int(v) for k, v in (item.split(":") for item in line.split()) if v.isdigit()}


def benchmark_configs(n: int = 4, C: int = 1024, steps: int = 40):
    """(name, kernel, constexprs) as the launchers specialise them for n streams and C channels."""
    from . import _common as common
    from . import aggregate, mapping, post

    out = []
    for name, kernel, backward in (("post_fwd", post._mhc_post_fwd_kernel, False),
                                   ("post_bwd", post._mhc_post_bwd_kernel, True),
                                   ("aggregate_fwd", aggregate._mhc_aggregate_fwd_kernel, False),
                                   ("aggregate_bwd", aggregate._mhc_aggregate_bwd_kernel, True)):
        bn, bc, bt = common.stream_blocks(n, C, backward)
        out.append((name, kernel, dict(N=n, BLOCK_N=bn, BLOCK_T=bt, BLOCK_C=bc)))
    bn = common.block_n(n)
    flags = dict(N=n, BLOCK_N=bn, STEPS=steps, ROW_FIRST=True, SOFTMAX_INIT=False, R_DIVIDES=True)
    out.append(("mapping_fwd", mapping._mhc_mapping_fwd_kernel,
                dict(flags, BLOCK_T=common.block_t(4 * bn * bn, limit=32))))
    bk = triton.next_power_of_2(max(1, steps // 2))
    out.append(("mapping_bwd", mapping._mhc_mapping_bwd_kernel,
                dict(flags, BLOCK_T=common.block_t(2 * bk * bn + 6 * bn * bn, limit=32), BLOCK_K=bk)))
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile kernels", file=sys.stderr)
        return 2
    worst = 0
    for dtype in ("bf16", "fp32"):
        for name, kernel, constexprs in benchmark_configs():
            usage = resource_usage(kernel, constexprs, dtype)
            worst = max(worst, usage.get("STACK", 0))
            print(f"{name:14s} {dtype} {constexprs} REG {usage['REG']} STACK {usage.get('STACK', 0)}")
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
