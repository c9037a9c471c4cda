"""Make Triton's interpreter, a test tool here, behave like the GPU where a version of it does not.

Applied by tests/conftest.py and by the CP ranks (tests/distributed/cp_worker.py), only under
TRITON_INTERPRET=1. The package itself never touches Triton's internals; where an interpreter
cannot run the kernels at all it falls back to the references with a warning
(hccompile.kernels._triton.interpreter_problem).
"""
from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    _round_bfloat16_to_nearest()
    _scalar_loop_bounds()


def _round_bfloat16_to_nearest() -> None:
    """Cast float32 to bfloat16 as the GPU does (round to nearest even).

    The interpreter truncates (it drops the low 16 bits, and its own round-to-nearest option does
    not carry into the exponent), which about triples bfloat16 rounding errors on CPU. Tests
    then measure the interpreter's rounding instead of the kernels'."""
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl
    if getattr(original, "_hccompile_rne", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded.reshape(src.data.shape), tl.bfloat16)
        return original(self, src, dst_type)

    cast_impl._hccompile_rne = True
    builder.cast_impl = cast_impl


def _scalar_loop_bounds() -> None:
    """Triton < 3.8 turns a run-time loop bound into an int with int() of a 1-element array, an
    error since NumPy 2.4 (triton-lang/triton#9171); Triton 3.8 squeezes the array first. Do
    the same on older versions, so the kernel tests run there with any NumPy (the GPU machine's
    Triton 3.6 comes with NumPy 2.5)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_hccompile_squeeze", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._hccompile_squeeze = True
    interpreter._patch_lang_tensor = patch_lang_tensor
