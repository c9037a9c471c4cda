import os

import pytest
import torch

import hccompile  # noqa: F401  (registers ops)


def _interpreter_rounds_bfloat16_to_nearest() -> None:
    """Make Triton's interpreter cast float32 to bfloat16 as the GPU does (round to nearest even).

    The interpreter truncates (it drops the low 16 bits, and its own round-to-nearest option does
    not carry into the exponent), which about triples bfloat16 rounding errors on CPU. Tests
    then measure the interpreter's rounding instead of the kernels'. Only the test run is
    patched: the package never touches Triton's internals."""
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


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_rounds_bfloat16_to_nearest()


def _bound_gpu_memory() -> None:
    """Cap this process's CUDA allocator (tests/parallel.py --gpu-memory-gib): workers share one GPU,
    and a test that needs more than its share fails with an out-of-memory error naming the bound
    instead of starving its neighbours."""
    gib = os.environ.get("HCCOMPILE_TEST_GPU_MEMORY_GIB")
    if gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(gib) * 2**30 / total))


_bound_gpu_memory()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
