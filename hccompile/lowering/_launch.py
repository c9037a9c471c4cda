"""How an op's kernels reach Inductor's generated code (issue 24).

Each kernel op is a `torch.library.triton_op`: on CUDA its body allocates the outputs and launches
the Triton kernels through `wrap_triton`, so when AOTAutograd traces it (torch.compile), the graph
holds the launches themselves and Inductor's output code calls the kernels directly: no op
dispatch, no Python wrapper, no argument checks per call (the checks ran once, on the fake
tensors), outputs from Inductor's buffer planning. Everywhere else (CPU, Triton's interpreter,
float64) the body calls the op's `_host` twin, an opaque custom op as before.

`launched_by` records which op each kernel belongs to: once traced, a graph names kernels, not
ops, and passes/op_inventory reports the op.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.library import triton_op, wrap_triton

__all__ = ["triton_op", "wrap_triton", "traced_launch", "launched_by", "kernel_op_names"]

# id(JITFunction) -> (kernel, op name); the kernel is kept so the id stays its own
_KERNEL_OPS: dict[int, tuple[Any, str]] = {}


def traced_launch(t: torch.Tensor, supported_dtypes) -> bool:
    """Whether the op body launches its kernels itself (wrap_triton) for input `t`: CUDA and a
    kernel dtype. Under TRITON_INTERPRET on CPU the host op runs the kernels instead (Inductor's
    CPU code cannot launch Triton)."""
    from ..kernels._triton import triton_available

    return t.device.type == "cuda" and t.dtype in supported_dtypes and triton_available(t.device)


def launched_by(op_name: str, *kernels: Any) -> None:
    """Record that `op_name` ("hccompile.mhc_post.default") launches `kernels`; the first is the
    one op_inventory counts (one launch per op call)."""
    for i, k in enumerate(kernels):
        if k is not None:
            _KERNEL_OPS[id(k)] = (k, op_name if i == 0 else "")


def kernel_op_names() -> dict[int, str]:
    """id(kernel) -> the op it stands for ("" for a kernel that is not the op's first)."""
    return {key: name for key, (_, name) in _KERNEL_OPS.items()}
