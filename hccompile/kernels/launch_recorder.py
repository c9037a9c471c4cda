"""Kernel launches recorded instead of run, so that a family's launchers run on small CPU tensors
with no GPU and no interpreter: the compile checks (each family's compile_check.py) compile what was
recorded for an H100 target, and tests/kernels/test_launch_writes.py reads what each launch writes.
The kernels must be defined without TRITON_INTERPRET (the interpreter's are not JITFunctions)."""
from __future__ import annotations

import contextlib
import sys

from . import launcher
from ._triton import triton

# the kernel modules' "Triton, or the interpreter for CPU tensors" checks, which CPU tensors would fail
_CHECKS = ("require_triton", "_require_triton", "require")


@contextlib.contextmanager
def recording_launches(execute: bool = False):
    """Yields a list to which every `kernel[grid](*args, **kwargs)` appends (kernel, grid, args,
    kwargs) instead of launching; the kernel modules' device checks pass meanwhile. With `execute`
    each launch also runs, as it would have (the device checks stay): a GPU benchmark replays what it
    recorded (benchmarks/analysis/sweep_overlap.py)."""
    calls: list = []
    run = triton.runtime.JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, grid, args, kwargs))
        if execute:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    # the eager Launcher calls a kernel's compiled launcher without run: launches go through run meanwhile
    patches = [(triton.runtime.JITFunction, "run", record), (launcher, "enabled", False)]
    for name, module in list(sys.modules.items()):
        if name.startswith("hccompile.kernels.") and module is not None and not execute:
            patches += [(module, check, lambda *a, **k: None) for check in _CHECKS
                        if callable(getattr(module, check, None))]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patches]
    try:
        for owner, attr, value in patches:
            setattr(owner, attr, value)
        yield calls
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)
