"""What every Triton kernel family here shares: the optional import, where kernels can run, the
interpreter checks, and two small jit helpers."""
from __future__ import annotations

import functools
import os
import warnings

import torch

from .launcher import launcher

try:
    import triton
    import triton.language as tl
except ImportError as error:  # the PyTorch references still work without Triton
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: ImportError | None = error
else:
    TRITON_IMPORT_ERROR = None


def triton_available(device: torch.device | str) -> bool:
    """Whether Triton kernels can run on `device`: CUDA, or CPU under Triton's interpreter.

    TRITON_INTERPRET=1 must be set before Python starts, because Triton decides at kernel
    definition time; this reads the variable at call time so tests can force the fallback.
    """
    if TRITON_IMPORT_ERROR is not None:
        return False
    device_type = torch.device(device).type
    if device_type == "cuda":
        return True
    if device_type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1" and interpreter_problem() is None
    return False


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels in this environment, or None.

    Every sweep kernel loops to a bound read at run time. Triton 3.6's interpreter converts such a
    bound with int() of a 1-element array, which NumPy 2.4 made an error (triton-lang/triton#9171;
    Triton 3.8 squeezes first): the kernels would fail deep inside Triton with "only 0-dimensional
    arrays can be converted to Python scalars". A tiny kernel with such a loop is run once; if it
    fails, CPU tensors use the plain-PyTorch references (the documented fallback), with one warning.
    A kernel defined without the interpreter (TRITON_INTERPRET set too late) is require_triton's
    case, not this one."""
    if triton is None or not interpreted(_runtime_loop_probe):
        return None
    try:
        # first asked while torch.compile fakes an op's inputs, the probe must still run for real:
        # its answer is cached for the process
        with _real_tensors():
            out = torch.zeros(1, dtype=torch.int32)
            _runtime_loop_probe[(1,)](out, 3)
            problem = None if int(out.item()) == 3 else f"a loop of 3 steps counted {int(out.item())}"
    except Exception as error:  # noqa: BLE001 - whatever the interpreter raises is the reason
        problem = f"{type(error).__name__}: {error}"
    if problem is not None:
        import numpy

        warnings.warn(
            f"hccompile: Triton {triton.__version__}'s interpreter cannot run the kernels with NumPy "
            f"{numpy.__version__} ({problem}); CPU tensors use the plain-PyTorch references. Triton 3.6 "
            f"needs numpy<2.4 (triton-lang/triton#9171); Triton >= 3.8 has no such limit.", stacklevel=2)
    return problem


def _real_tensors():
    """A context outside torch.compile's fake-tensor mode (the probe needs data pointers)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - present in every supported torch
        import contextlib

        return contextlib.nullcontext()
    return unset_fake_temporarily()


def direct(kernel):
    """The launchers' `wrap` default: launch the kernel eagerly, through its Launcher (launcher.py:
    Triton's specialization and compiled launcher without JITFunction.run's other per-call work).
    hccompile.lowering passes torch.library.wrap_triton instead, so that a traced op records the
    launch for Inductor."""
    return launcher(kernel)


def cdiv(x, y):
    """ceil(x / y) for host code: triton.cdiv's value without its constexpr-function wrapper, which
    costs microseconds a call (a lightning fwd+bwd made 42 such calls: about a third of its host
    time before its launches, measured on the CPU); ints and SymInts alike."""
    return (x + y - 1) // y


def next_power_of_2(n):
    """triton.next_power_of_2's value for host code (the same bit steps: 0 for 0), without its wrapper."""
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


def scratch_rows(count):
    """The leading size of a scratch buffer holding `count` rows (one per chunk or segment) that
    a kernel writes: `count`, at least 1; a symbolic count (a traced launch plan under
    torch.compile) at least 2. Why: functionalizing a traced launch clones each buffer it writes,
    and the clone's contiguity check asks whether each size is 1. For a count such as
    ceil(T / 64), which can be 1, that question becomes a guard (T <= 64 or not), and a second
    length across it compiles a second graph. A size known to be >= 2 asks nothing. Rows past
    `count` are never read or written."""
    if isinstance(count, torch.SymInt):
        return torch.sym_max(count, 2)
    return max(count, 1)


def kept_rows(count):
    """The leading size of a buffer of `count` rows that an op returns (states kept for its
    backward): at least 2 whether `count` is symbolic or not, so that the eager op, its traced
    form and its fake agree on the output's shape (scratch_rows alone gives 1 eagerly and 2 traced
    for a count of 1). Rows past `count` are never read or written."""
    if isinstance(count, torch.SymInt):
        return torch.sym_max(count, 2)
    return max(count, 2)


def zero_padding_rows(states: torch.Tensor, count) -> None:
    """Zeros the rows of `states` past `count` (kept_rows' minimum of 2, a varlen bound), so that
    an op's output is deterministic, eager or traced alike. Traced (a symbolic count), slicing at
    the count would guard on it and compile a second graph for one-chunk lengths; the last row is
    zeroed instead, before the kernels write: it is the padding row at a count of 1, else a real
    row they overwrite."""
    if isinstance(count, torch.SymInt):
        states[-1].zero_()
    elif count < states.shape[0]:
        states[count:].zero_()


def interpreted(kernel) -> bool:
    """Whether `kernel` was defined under the interpreter (Triton picks at definition time)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def require_triton(device: torch.device, kernel, module: str, fallback: str) -> None:
    """Clear errors for launching `kernel` where it cannot run."""
    if triton_available(device):
        if device.type == "cpu" and not interpreted(kernel):
            raise RuntimeError(
                f"TRITON_INTERPRET=1 was set after {module} was imported; "
                "set it before Python starts to run the kernels on CPU tensors"
            )
        return
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"Triton could not be imported: {TRITON_IMPORT_ERROR}")
    raise RuntimeError(
        f"Triton kernels cannot run on device {device}: CPU tensors need TRITON_INTERPRET=1 "
        f"set before Python starts; use {fallback} as the fallback"
    )


if triton is not None:

    @triton.jit
    def load_tile(base_ptr, rows, cols, stride_row, stride_col, n_rows, n_cols):
        """Loads base[rows, cols] with zeros outside [0, n_rows) x [0, n_cols)."""
        ptrs = base_ptr + rows[:, None] * stride_row + cols[None, :] * stride_col
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_OPERANDS: tl.constexpr):
        """tl.dot with fp32 accumulation; UPCAST_OPERANDS for the interpreter, which multiplies
        bfloat16 bit patterns as integers (products of bf16 values are exact in fp32, as on the
        tensor cores)."""
        if UPCAST_OPERANDS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, input_precision=DOT_PRECISION)

    @triton.jit
    def _runtime_loop_probe(out_ptr, n):
        """Counts a loop whose bound is a run-time argument (see interpreter_problem)."""
        count = 0
        for _ in range(0, n):
            count += 1
        tl.store(out_ptr, count)

else:
    load_tile = dot = _runtime_loop_probe = None


def compiled_resources(kernel) -> list[dict]:
    """Shared memory, registers and spills of every compiled variant of a @triton.jit kernel, read
    off the compiled kernels' metadata (empty under the interpreter or before the first launch)."""
    if triton is None or interpreted(kernel):
        return []
    rows = []
    caches = getattr(kernel, "device_caches", None) or {}
    for device_cache in caches.values():
        compiled = device_cache[0] if isinstance(device_cache, tuple) else device_cache
        for variant in compiled.values():
            meta = getattr(variant, "metadata", None)
            rows.append({
                "kernel": getattr(meta, "name", kernel.__name__),
                "shared_bytes": getattr(meta, "shared", None),
                "registers": getattr(variant, "n_regs", None),
                "spills": getattr(variant, "n_spills", None),
                "num_warps": getattr(meta, "num_warps", None),
                "num_stages": getattr(meta, "num_stages", None),
            })
    return rows
