"""Eager launches of our @triton.jit kernels without JITFunction.run's per-call work (issues 20, 24).

`kernel[grid](*args)` costs about 51 µs of host time for a kernel of 51 arguments on the H200, of which
Triton's compiled launcher (the C function that packs the arguments and calls cuLaunchKernel) takes
15 µs; the rest is JITFunction.run's bookkeeping: the knobs read, the string of the options dict made
into a cache key, a launch-metadata dict for hooks nobody set, the globals check (host_split.py's
rows, session 38). An eager lightning fwd+bwd makes 6 launches and a GDN one 10, on a step that is
host-bound below B4 T4096.

`Launcher` keeps Triton's own specialization, the part that decides which compiled kernel a call
needs: the kernel's binder (the native function JITFunction.run calls) turns the arguments into
their specialization (dtypes, 16-byte alignment of each pointer, divisibility of each int, the
constexprs), which with the launch options and the device keys a table of compiled kernels. A
miss goes through JITFunction.run (which compiles if it must) and records the kernel it returns;
a hit calls that kernel's launcher directly. So a hit launches exactly what run would have.

run is still taken whenever something could observe the difference: launch hooks set (profilers
such as proton read the launch metadata), pre-run hooks on the kernel, a grid given as a function.
The one check skipped is run's test that no global the kernel reads has changed since it was
compiled; our kernels read no mutable globals. HCCOMPILE_PLAIN_TRITON_LAUNCH=1 (read at import)
launches through JITFunction.run always; so does `enabled = False` (launch_recorder.py, which records
launches by replacing JITFunction.run, and benchmarks comparing both paths in one process).
"""
from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
except ImportError:  # the PyTorch references still work without Triton
    triton = None

enabled = os.environ.get("HCCOMPILE_PLAIN_TRITON_LAUNCH") != "1"

__all__ = ["Launcher", "enabled", "launcher"]


def _hooks_idle(runtime: Any) -> bool:
    """Whether no launch hook is set: None (older Triton) or an empty HookChain (3.6 on)."""
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class Launcher:
    """`Launcher(kernel)[grid](*args, **kwargs)` launches as `kernel[grid](*args, **kwargs)` does."""

    __slots__ = ("kernel", "compiled", "misses")

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # (device, specialization, launch options) -> (launcher, CUfunction, packed metadata)
        self.compiled: dict[tuple, tuple[Any, Any, Any]] = {}
        self.misses = 0  # launches that went through JITFunction.run (the tests read it)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        kernel = self.kernel
        device = torch._C._cuda_getDevice()  # CUDA is initialised: the arguments live there
        bound, specialization, options = kernel.device_caches[device][4](*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        hit = self.compiled.get(key)
        if hit is None or callable(grid) or kernel.pre_run_hooks or not _hooks_idle(triton.knobs.runtime):
            self.misses += 1
            compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if hit is None and compiled is not None:
                if hasattr(compiled, "result"):  # an asynchronous compile's future
                    compiled = compiled.result()
                run = compiled.run  # loads the module on first use, which sets .function
                self.compiled[key] = (run, compiled.function, compiled.packed_metadata)
            return
        run, function, packed_metadata = hit
        dims = len(grid)
        run(grid[0], grid[1] if dims > 1 else 1, grid[2] if dims > 2 else 1,
            torch._C._cuda_getCurrentRawStream(device), function, packed_metadata, None, None, None,
            *bound.values())


# id(kernel) -> (kernel, its Launcher): the kernel is kept so the id stays its own
_LAUNCHERS: dict[int, tuple[Any, Launcher]] = {}


def launcher(kernel: Any) -> Any:
    """What launches `kernel` eagerly: its Launcher for a compiled-mode JITFunction whose Triton has
    the parts Launcher uses; the kernel itself under the interpreter, for any other object (an
    Autotuner), or while not `enabled`."""
    if not enabled:
        return kernel
    entry = _LAUNCHERS.get(id(kernel))
    if entry is not None:
        return entry[1]
    usable = (triton is not None and isinstance(kernel, triton.runtime.JITFunction)
              and hasattr(kernel, "device_caches") and hasattr(kernel, "pre_run_hooks")
              and hasattr(getattr(triton, "knobs", None), "runtime"))
    if not usable:
        return kernel
    made = Launcher(kernel)
    _LAUNCHERS[id(kernel)] = (kernel, made)
    return made
