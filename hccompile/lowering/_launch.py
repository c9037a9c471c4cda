"""How an op's kernels reach Inductor's generated code (issue 24).

Each kernel op is a `torch.library.triton_op`: on CUDA its body allocates the outputs and launches
the Triton kernels through `wrap_triton`, so when AOTAutograd traces it (torch.compile), the graph
holds the launches themselves and Inductor's output code calls the kernels directly: no op
dispatch, no Python wrapper, no argument checks per call (the checks ran once, on the fake
tensors), outputs from Inductor's buffer planning. Everywhere else (CPU, Triton's interpreter,
float64) the body calls the op's `_host` twin, an opaque custom op as before.

Called eagerly (`call_op`), an op whose arguments are plain tensors skips the dispatcher: its host
function runs directly, under the autograd the op registered (`register_autograd`). The custom-op
layers (dispatch, schema defaults, aliasing checks, the autograd wrapper, Dynamo's disable frames)
cost more host time per call than the launches they wrap; traced graphs, fake tensors, dispatch
modes and functorch transforms still meet the op itself.

`launched_by` records which op each kernel belongs to: once traced, a graph names kernels, not
ops, and passes/op_inventory reports the op. (A kernel shared by two ops cannot say which one
launched it: node annotations do not work here, AOTAutograd copies the forward node's onto the
backward nodes, and torch 2.11 replaces theirs. Give each op a kernel of its own.)
"""
from __future__ import annotations

import contextlib
import inspect
import os
import threading
from typing import Any, Callable

import torch
from torch.library import triton_op, wrap_triton

from ..compat import cache_triton_access_analysis, plain_eager
from ._symbols import reraise_explained

__all__ = ["HEADS", "RUNTIME_CHECKS", "call_backward_op", "call_op", "checked_by_forward", "fix_sizes", "kernel_op", "launched_by", "launched_op",
           "references", "references_only", "register_autograd", "runtime_check", "traced_launch", "wrap_triton"]

cache_triton_access_analysis()  # torch's per-call-site analysis of a traced launch, once per key

# id(JITFunction) -> (kernel, op name, launches per call); the kernel is kept so the id stays its own
_KERNEL_OPS: dict[int, tuple[Any, str, int]] = {}


_REFERENCES = threading.local()


@contextlib.contextmanager
def references():
    """Within the block (this thread only), the ops that honour it (mHC's; references_only) compute
    with their plain-PyTorch references: no Triton compile, no launch. For the passes' probes, which
    prove that a matched region computes an op's contract; the kernels are tested against the same
    references apart. On a fresh machine the probes' kernels were compiled by Triton's JIT at the
    first step, and Inductor compiled them again for the graph."""
    before = getattr(_REFERENCES, "on", False)
    _REFERENCES.on = True
    try:
        yield
    finally:
        _REFERENCES.on = before


def references_only() -> bool:
    """Whether this thread is inside references()."""
    return getattr(_REFERENCES, "on", False)


def traced_launch(t: torch.Tensor, supported_dtypes) -> bool:
    """Whether the op body launches its kernels itself (wrap_triton) for input `t`: CUDA and a
    kernel dtype, outside references(). Under TRITON_INTERPRET on CPU the host op runs the kernels
    instead (Inductor's CPU code cannot launch Triton)."""
    from ..kernels._triton import triton_available

    return (t.device.type == "cuda" and t.dtype in supported_dtypes and not references_only()
            and triton_available(t.device))


def launched_by(op_name: str, *kernels: Any, per_call: int = 1) -> None:
    """Record that `op_name` ("hccompile.mhc_post.default") launches `kernels`. The first is the
    op's own, launched `per_call` times per call (a kernel shared by two ops gets a JIT handle per
    op); op_inventory counts calls by it. The others are only listed."""
    for i, k in enumerate(kernels):
        if k is None:
            continue
        known = _KERNEL_OPS.get(id(k), (None, "", 1))
        if known[1] and i == 0 and known[1] != op_name:
            raise ValueError(f"kernel {k} is already the first kernel of {known[1]}, not of {op_name}")
        _KERNEL_OPS[id(k)] = (k, op_name, per_call) if i == 0 else (k, known[1], known[2])


# ops a traced graph calls at run time beside the launches, to check what tracing cannot
# (hccompile.delta_rule_outside_context_parallel.default): not ops of their own in the report
RUNTIME_CHECKS: set[str] = set()


def runtime_check(op: Any) -> Any:
    """Marks custom op `op` as a run-time check of traced graphs (see RUNTIME_CHECKS); returns it."""
    RUNTIME_CHECKS.add(f"{op._qualname.replace('::', '.')}.default")
    return op


def launched_op(kernel: Any) -> tuple[str, int]:
    """(the op whose first kernel `kernel` is, its launches per op call); ("", 1) if none. Launch
    options (num_warps, num_stages) make torch wrap a kernel in a one-config Autotuner: its `fn`
    is ours."""
    for k in (kernel, getattr(kernel, "fn", None)):
        name, per_call = _KERNEL_OPS.get(id(k), (None, "", 1))[1:] if k is not None else ("", 1)
        if name:
            return name, per_call
    return "", 1


# the dims of a [B, T, H, D] tensor that a model never varies: its head count and head dim
HEADS = (2, 3)


def _symbols(size) -> set:
    return set(size.node.expr.free_symbols) if isinstance(size, torch.SymInt) else set()


def fix_sizes(arguments: dict[str, Any], fixed_dims: dict[str, tuple[int, ...]]) -> None:
    """Fixes the sizes `fixed_dims` names (argument -> dims) at their traced values: a guard, so
    another value compiles a new graph; the other dims of those arguments stay symbolic.

    Why: Triton's launcher marks every integer argument that is a multiple of 16 (strides, head
    dims) so the compiler can vectorise loads; Inductor, compiling a traced kernel, marks only
    those it can prove so. Under dynamic=True a symbolic head dim leaves every row stride
    unprovable and the kernels 1.6-12x slower (GDN fwd+bwd 12.0 ms against 3.6 ms eager on the
    H100, 2026-11-26). Head counts and head dims do not vary within a model. A size whose symbol
    a kept dim shares (dynamic=True gives equal sizes one symbol: T == D) stays symbolic: one
    graph for every length comes first."""
    fixed, kept = [], []
    for name, dims in fixed_dims.items():
        tensor = arguments.get(name)
        if not isinstance(tensor, torch.Tensor):
            continue
        wanted = {d % tensor.dim() for d in dims}
        for d, size in enumerate(tensor.shape):
            (fixed if d in wanted else kept).append(size)
    kept_symbols = set().union(*map(_symbols, kept))
    for size in fixed:
        symbols = _symbols(size)
        if symbols and not symbols & kept_symbols:
            int(size)  # guard_int: the shape environment replaces the symbol by its value


def kernel_op(name: str, host_fn: Callable, host_fake: Callable, traced_fn: Callable,
              dtypes, kernels=(), per_call: int = 1, traceable: Callable[..., bool] | None = None,
              fixed_dims: dict[str, tuple[int, ...]] | None = None) -> Any:
    """`hccompile::<name>`, a triton_op, and its host twin `hccompile::<name>_host`, a custom op.

    host_fn (with host_fake) is the op everywhere but CUDA: Triton's interpreter or the reference.
    traced_fn has the same signature; on CUDA, for a first argument in `dtypes`, it checks the
    inputs and launches the kernels through `wrap_triton`; `kernels` are those it launches, the
    first `per_call` times per call (see launched_by). `traceable`, given the call's arguments by
    name (defaults filled in), may keep a CUDA call on the host op (say for inputs whose launch
    plan needs tensor values). `fixed_dims` (argument name -> dims, usually HEADS) are the sizes
    a traced call fixes at their traced values (fix_sizes: Inductor must see the strides' factors
    of 16). Returns the triton_op (register its autograd on it)."""
    host = torch.library.custom_op(f"hccompile::{name}_host", host_fn, mutates_args=())
    host.register_fake(host_fake)

    launched_by(f"hccompile.{name}.default", *kernels, per_call=per_call)

    signature = inspect.signature(host_fn, eval_str=True)

    def traced(args, kwargs) -> bool:
        if not traced_launch(args[0], dtypes):
            return False
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if traceable is not None and not traceable(**bound.arguments):
            return False
        if fixed_dims:
            fix_sizes(bound.arguments, fixed_dims)
        return True

    def body(*args, **kwargs):
        try:
            if traced(args, kwargs):
                return traced_fn(*args, **kwargs)
            return host(*args, **kwargs)
        except (ValueError, TypeError) as error:  # under torch.compile: name the symbols' values
            reraise_explained(error, signature, args, kwargs)

    # the schema is inferred from host_fn's signature, its string annotations resolved in host_fn's
    # module (torch 2.11 and 2.13 ignore triton_op's schema= argument)
    body.__signature__ = signature
    body.__name__, body.__qualname__, body.__doc__ = name, name, host_fn.__doc__

    op = triton_op(f"hccompile::{name}", body, mutates_args=())
    _DIRECT[op] = _DirectCall(host_fn, signature)
    return op


# ----------------------------------------------------------------------------------------
# Eager calls without the dispatcher


class _DirectCall:
    """What call_op needs of an op: its host function, the defaults of its trailing arguments (the
    setup_context functions unpack every argument) and the autograd register_autograd gave it."""

    def __init__(self, host_fn: Callable, signature: inspect.Signature):
        self.host_fn = host_fn
        self.parameters = len(signature.parameters)
        self.defaults = tuple(p.default for p in signature.parameters.values())
        self.autograd: tuple[Callable, Callable] | None = None  # (setup_context, backward)

    def filled(self, args: tuple) -> tuple:
        if len(args) >= self.parameters:
            return args
        missing = self.defaults[len(args):]
        if any(d is inspect.Parameter.empty for d in missing):
            raise TypeError(f"{self.host_fn.__name__}: {self.parameters} arguments expected, got {len(args)}")
        return (*args, *missing)


_DIRECT: dict[Any, _DirectCall] = {}

# HCCOMPILE_DIRECT_CALLS=0 (read at import; benchmarks set the attribute) sends every eager call through
# the op, as before call_op: the before/after of its host time in one process (benchmarks/host_overhead.py).
DIRECT_CALLS = os.environ.get("HCCOMPILE_DIRECT_CALLS", "1") != "0"


def register_autograd(op: Any, backward: Callable, setup_context: Callable) -> None:
    """op.register_autograd(backward, setup_context=setup_context), and the same autograd for the
    op's direct eager calls (call_op)."""
    op.register_autograd(backward, setup_context=setup_context)
    _DIRECT[op].autograd = (setup_context, backward)


class _DirectFunction(torch.autograd.Function):
    """An op's registered autograd around its host function (what torch's custom-op autograd does,
    without the dispatch): the last argument is the op's _DirectCall."""

    @staticmethod
    def forward(ctx, *args):
        *inputs, direct = args
        output = direct.host_fn(*inputs)
        setup_context, ctx.direct_backward = direct.autograd
        setup_context(ctx, tuple(inputs), output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[:-1]
        try:
            result = ctx.direct_backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (*result, None) if isinstance(result, tuple) else (result, None)


def _plain_tensors(args: tuple) -> tuple[bool, bool]:
    """(every tensor argument is a plain tensor or parameter on the CPU or a GPU, some tensor
    requires grad); a list of tensors counts as not plain (torch's custom-op autograd unpacks those),
    and so does a meta tensor (the op's fake computes its shapes; the host function would run the
    reference on it)."""
    grad = False
    for a in args:
        if isinstance(a, torch.Tensor):
            if (type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter) or a.device.type == "meta":
                return False, grad
            grad = grad or a.requires_grad
        elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return False, grad
    return True, grad


def call_op(op: Any, *args: Any) -> Any:
    """op(*args) (positional arguments). In plain eager mode on plain tensors, the op's host function
    directly, differentiable by the op's registered autograd: the same kernels or reference without
    the dispatcher's host time. An op without autograd meets a differentiable call as itself (its
    error, not a silent non-differentiable result)."""
    direct = _DIRECT.get(op)
    if direct is None or not DIRECT_CALLS or not plain_eager():
        return op(*args)
    plain, requires_grad = _plain_tensors(args)
    if not plain:
        return op(*args)
    args = direct.filled(args)
    if not (requires_grad and torch.is_grad_enabled()):
        return direct.host_fn(*args)
    if direct.autograd is None:
        return op(*args)
    return _DirectFunction.apply(*args, direct)


# An eager backward's host work before its first launch is time the GPU sits idle: after autograd
# hands the backward to its device thread (0.3-0.6 ms of host on the H200's host, BENCHMARKS.md
# session 38) the GPU has only the forward's tail queued. Re-checking arguments there is waste when
# the backward op was called by its own forward's autograd: the forward checked the same tensors
# (autograd's version counters refuse them if changed since), and the engine gives the incoming
# gradients the forward outputs' shapes, dtypes and device.
_BACKWARD_OF_CHECKED_FORWARD = threading.local()


def call_backward_op(op: Any, *args: Any) -> Any:
    """call_op(op, *args) from an op's registered autograd backward: the backward op's eager host
    function may skip the checks its forward ran (checked_by_forward)."""
    _BACKWARD_OF_CHECKED_FORWARD.on = True
    try:
        return call_op(op, *args)
    finally:
        _BACKWARD_OF_CHECKED_FORWARD.on = False


def checked_by_forward() -> bool:
    """In a backward op's eager host function: whether it was called by call_backward_op, i.e. its
    inputs are its forward's, checked there. Read once: the mark is cleared, so that nothing the
    host function calls in turn sees it."""
    on = getattr(_BACKWARD_OF_CHECKED_FORWARD, "on", False)
    _BACKWARD_OF_CHECKED_FORWARD.on = False
    return on
