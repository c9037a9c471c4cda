"""Registers, spills and shared memory of the delta-rule's chunk-parallel kernels compiled for
sm_90, on the CPU: no GPU needed (Triton's bundled ptxas and cuobjdump). Each launch is specialized as
at B1 T32768 H16 D128 bf16 (unit strides and GROUP = 1 constant, 16-divisible sizes and pointers).

    python benchmarks/sm90_registers.py --kernels dqkw,wy_bwd,wy_backward --configs 32,64,4,2 64,64,4,2
    python benchmarks/sm90_registers.py --kernels wy_solve,wy_solve_kdot --configs 64,64,2,3
    python benchmarks/sm90_registers.py --kernels output,output_store,output_scores,output_read --configs 64,64,4,3

A config is BK,BV,num_warps,num_stages. dqkw_fastest is dqkw with dqkw.DQKW_KEY_TILES_FASTEST's grid. The kernels (plan.FUSED_SCORES_FORWARD's pairs): wy_solve forms
Kdot's blocks from the keys, wy_solve_kdot reads decayed_scores' Kdot; output forms P, output_store
also stores it (bf16), output_scores is the P-only mode, output_read reads decayed_scores' fp32 P.
TRITON_INTERPRET must be unset (it is cleared here).
"""
from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hccompile.kernels.delta_rule import dqkw, output, wy, wy_bwd  # noqa: E402

T, H, D = 32768, 16, 128
VALUES = dict(T=T, NT=T // 64, HV=H, GROUP=1, K=D, V=D)
for prefix, width in (("q", D), ("k", D), ("v", D), ("do", D), ("dv", D), ("o", D), ("b", 1), ("db", 1), ("g", 1)):
    last = {"q": "k", "k": "k", "v": "v", "do": "v", "dv": "v", "o": "v", "b": "h", "db": "h", "g": "h"}[prefix]
    VALUES.update({f"stride_{prefix}b": T * H * width, f"stride_{prefix}t": H * width,
                   f"stride_{prefix}{last}": 1})
    if width > 1:
        VALUES[f"stride_{prefix}h"] = width
BF16_POINTERS = {"q_ptr", "k_ptr", "v_ptr", "beta_ptr", "do_ptr", "u_ptr", "du_ptr", "h_ptr", "dh_ptr", "dw_ptr",
                 "dv_ptr", "dbeta_ptr", "w_ptr", "kg_ptr", "o_ptr"}
# name: (kernel, constexprs beyond the common ones, pointers whose dtype differs from BF16_POINTERS')
OUTPUT = {"FORM_SCORES": False, "STORE_SCORES": False, "SCORES_ONLY": False}
KERNELS = {"dqkw": (dqkw._dqkw_kernel, {"SCORES_VIA_MEMORY": False, "KEY_TILES_FASTEST": False}, {}),
           "dqkw_fastest": (dqkw._dqkw_kernel, {"SCORES_VIA_MEMORY": False, "KEY_TILES_FASTEST": True}, {}),
           "wy_bwd": (wy_bwd._wy_bwd_kernel, {"DG_PARTS": 2, "HALF_DL": True, "REVERSE_DG": True}, {"inverse_ptr": "*bf16"}),
           "wy_bwd_dg": (wy_bwd._wy_bwd_kernel, {"DG_PARTS": 2, "HALF_DL": True, "REVERSE_DG": False}, {}),
           "wy_backward": (wy._wy_backward_kernel, {"FUSE_SCORES": True}, {}),
           "wy_solve": (wy._wy_solve_kernel, {"BC": 16, "SOLVE": True, "FORM_KDOT": True, "REGISTER_DIAGONAL": True,
                                              "FORM_CUM": False, "FORM_WU": True}, {}),
           # W and U~ from a stored A alone (a kept A, or plan.SPLIT_WY_SOLVE's second launch)
           "wy_form": (wy._wy_solve_kernel, {"BC": 16, "SOLVE": False, "FORM_KDOT": False, "REGISTER_DIAGONAL": True,
                                             "FORM_CUM": False, "FORM_WU": True}, {"a_ptr": "*bf16"}),
           # G formed in the kernel (plan.FOLDED_GATE_SUMS; --gate 1 only)
           "wy_solve_cum": (wy._wy_solve_kernel, {"BC": 16, "SOLVE": True, "FORM_KDOT": True,
                                                  "REGISTER_DIAGONAL": True, "FORM_CUM": True, "FORM_WU": True},
                            {"a_ptr": "*bf16"}),
           "wy_solve_kdot": (wy._wy_solve_kernel, {"BC": 16, "SOLVE": True, "FORM_KDOT": False,
                                                   "REGISTER_DIAGONAL": True, "FORM_CUM": False, "FORM_WU": True}, {}),
           "output": (output._output_kernel, {**OUTPUT, "FORM_SCORES": True}, {}),
           "output_store": (output._output_kernel, {**OUTPUT, "FORM_SCORES": True, "STORE_SCORES": True},
                            {"scores_ptr": "*bf16"}),
           "output_scores": (output._output_kernel, {**OUTPUT, "FORM_SCORES": True, "SCORES_ONLY": True},
                             {"scores_ptr": "*bf16"}),
           "output_read": (output._output_kernel, OUTPUT, {})}


def specialize(kernel, constexprs, pointers=None):
    """(signature, constexprs, attrs) of a launch at VALUES."""
    signature, constants, attrs = {}, dict(constexprs), {}
    for index, name in enumerate(kernel.arg_names):
        param = kernel.params[index]
        if name not in constexprs and param.is_constexpr and param.default is not inspect.Parameter.empty:
            constants[name] = param.default  # a constexpr left at its default
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = (pointers or {}).get(name, "*bf16" if name in BF16_POINTERS else "*fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name == "scale":
            signature[name] = "fp32"
        elif VALUES[name] == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if VALUES[name] % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs


def resource_usage(kernel, constexprs, warps: int, stages: int, pointers=None) -> str:
    signature, constants, attrs = specialize(kernel, constexprs, pointers)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    usage = next(line for line in out.stdout.splitlines() if "REG:" in line).split()
    fields = dict(item.split(":", 1) for item in usage if ":" in item)
    return f"registers {fields['REG']} spill stack {fields['STACK']} B, shared {compiled.metadata.shared} B"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default="dqkw,wy_bwd,wy_backward")
    p.add_argument("--gate", type=int, default=1, help="0 none, 1 scalar")
    p.add_argument("--configs", nargs="+", default=["32,64,4,2", "64,64,4,2", "64,64,8,1"],
                   help="BK,BV,num_warps,num_stages")
    args = p.parse_args()
    for name in args.kernels.split(","):
        kernel, extra, pointers = KERNELS[name]
        for config in args.configs:
            bk, bv, warps, stages = (int(x) for x in config.split(","))
            constexprs = dict(GATE=args.gate, BT=64, BK=bk, BV=bv, IS_VARLEN=False, DOT_PRECISION="tf32", **extra)
            print(f"{name:12s} BK {bk:3d} BV {bv:3d} warps {warps} stages {stages}: "
                  f"{resource_usage(kernel, constexprs, warps, stages, pointers)}", flush=True)


if __name__ == "__main__":
    main()
