"""Every difference between the torch versions we support (2.11, 2.13 and 2.15) lives here."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
MIN_TORCH = (2, 11)


def check_torch_version() -> None:
    if TORCH_VERSION < MIN_TORCH:
        raise RuntimeError(
            f"hccompile needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}"
        )


def custom_pass_hook_value(pass_obj: Any) -> Any:
    """Value for `joint_custom_pre_pass` / `post_grad_custom_pre_pass`.

    2.11 takes exactly one CustomGraphPass per hook; 2.13 and 2.15 also accept a list. We always
    install one composite pass, so a single object works on all three. (2.15's hooks are 2.13's:
    same torch/_inductor/custom_graph_pass.py, the passes run through get_custom_graph_passes() and
    each CustomGraphPass's uuid() goes into the FX-graph cache key; it has no other pass-registration
    mechanism that refuses the config hooks.)
    """
    return pass_obj


def size_hint(value: Any) -> int:
    """Concrete value of a possibly symbolic int, without adding a guard."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        node = value.node
        hint = getattr(node, "hint", None)
        if hint is not None:
            return int(hint)
        return int(node.shape_env.size_hint(node.expr))
    return int(value)


def concrete_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(size_hint(s) for s in t.shape)


# --- tensor view attributes in Dynamo graphs ---
# `x.T`, `x.mT`, `x.H`, `x.mH`: Dynamo on torch 2.11 and 2.13 records `getattr(x, "mT")`; on 2.15 it
# records a call to the aten op behind the attribute's C++ getter, `torch.ops.aten.mT(x)`
# (torch/_dynamo/variables/tensor.py, _VIEW_ATTR_TO_ATEN_OP). Both spellings are recognised on every
# version (the aten ops exist on all of them), so passes ask here instead of testing for getattr.
_VIEW_ATTR_OPS: dict[Any, str] = {}
for _attr, _op in (("T", "numpy_T"), ("mT", "mT"), ("H", "matrix_H"), ("mH", "mH")):
    _packet = getattr(torch.ops.aten, _op)
    _VIEW_ATTR_OPS[_packet] = _VIEW_ATTR_OPS[_packet.default] = _attr
del _attr, _op, _packet


def view_attribute(node: Any) -> str | None:
    """"T", "mT", "H" or "mH" when FX node `node` reads that view attribute of a tensor, in either
    spelling (getattr node on 2.11/2.13, aten op on 2.15); otherwise None."""
    if getattr(node, "op", None) != "call_function":
        return None
    if node.target is getattr:
        attr = node.args[1] if len(node.args) == 2 else None
        return attr if attr in ("T", "mT", "H", "mH") else None
    try:
        return _VIEW_ATTR_OPS.get(node.target)
    except TypeError:  # an unhashable target
        return None


def fake_mode_of(example_inputs: Any, gm: torch.fx.GraphModule | None = None):
    """The fake mode of the Dynamo graph's example values (the tracing context's), which is not
    always the one the example inputs would suggest."""
    from torch._guards import detect_fake_mode

    if gm is not None:
        for n in gm.graph.nodes:
            val = n.meta.get("example_value")
            if isinstance(val, torch.Tensor):
                mode = detect_fake_mode([val])
                if mode is not None:
                    return mode
    return detect_fake_mode(example_inputs)


def hash_files(paths: tuple[str, ...], extra: str = "") -> bytes:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files(paths, extra)


# --- recording autograd inside a custom op's implementation (private dispatcher API) ---
# The Autograd dispatch keys that a custom op's implementation runs without (it is called below
# Autograd, under the equivalent of torch._C._AutoDispatchBelowAutograd).
_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor))


@contextlib.contextmanager
def autograd_recording():
    """Lets torch.autograd.grad work inside the backward op's implementation: custom ops run below
    the Autograd dispatch key, where no graph is recorded even under enable_grad. Both backward
    paths need it: the fallback differentiates the reference, and the kernels differentiate KDA's
    gate activation by autograd. (torch.func.vjp would avoid the private guard but breaks under
    the dispatch modes of opcheck.) Only the Autograd keys are restored; autocast stays as it was."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    included = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(included, excluded - _AUTOGRAD_KEYS), torch.enable_grad():
        yield



# --- collectives ---
def all_gather_single(output, input, group=None, async_op: bool = False):
    """Every rank's `input` concatenated into `output`: torch 2.13 deprecates
    all_gather_into_tensor for all_gather_single (same arguments); 2.11 has only the former."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def has_inductor_option(name: str) -> bool:
    """Whether this torch's Inductor config has `name` (options come and go between versions)."""
    from torch._inductor import config as inductor_config

    return hasattr(inductor_config, name)


# --- the backend of the frame Dynamo is tracing ---
# Read at trace time by hccompile.substitutes (a constant-folded call, so no guard): Dynamo keeps the
# backend on the current InstructionTranslator's output graph (2.11-2.15), wrapped by
# WrapBackendDebug (`_torchdynamo_orig_backend`); torch.compile(backend="hc", options=...) adds a
# _TorchCompileWrapper (`compiler_fn`, `kwargs`); a functools.partial may carry keyword options.
def tracing_backend() -> tuple[Any, dict[str, Any]] | None:
    """(the innermost backend callable, the keyword arguments it will be called with) of the frame
    Dynamo is tracing now, or None outside a trace."""
    import functools

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
    except (AttributeError, ImportError):
        return None
    fn = getattr(getattr(tx, "output", None), "compiler_fn", None) if tx is not None else None
    kwargs: dict[str, Any] = {}
    for _ in range(8):
        if fn is None:
            return None
        if hasattr(fn, "_torchdynamo_orig_backend"):
            fn = fn._torchdynamo_orig_backend
        elif isinstance(fn, functools.partial):
            kwargs = {**fn.keywords, **kwargs}
            fn = fn.func
        elif hasattr(fn, "compiler_fn") and hasattr(fn, "kwargs"):  # torch's _TorchCompileWrapper
            kwargs = {**fn.kwargs, **kwargs}
            fn = fn.compiler_fn
        else:
            break
    return fn, kwargs


# --- einops: traced into its torch calls, on every supported torch ---
# torch 2.13 traces einops >= 0.8.2 into the reshapes, permutes and einsums it makes. torch 2.11 keeps
# rearrange/repeat/einsum/... as opaque nodes of the Dynamo graph: einops registers them with
# allow_in_graph because its own check compares version strings ("2.11" < "2.8"), and 2.11's Dynamo
# does not override it. No pass can read the math of an opaque einops node (the hyper-connections
# package is written in einops: on 2.11 no mHC layer was found). Where torch lacks 2.13's rule, apply
# it: after torch's lazy einops set-up (which imports einops' registration), take the functions out of
# the allowed set. Process-wide, as in torch 2.13: any backend then sees the einops calls traced.
EINOPS_TRACED_FROM = (0, 8, 2)  # torch 2.13's _EINOPS_DYNAMO_TRACING_MIN_VERSION


def trace_through_einops() -> None:
    import sys

    from torch._dynamo import decorators, trace_rules

    if hasattr(decorators, "_einops_supports_dynamo_tracing"):  # torch >= 2.13 decides itself
        return
    lazy = getattr(trace_rules, "_lazy_module_init", None)
    allowed = getattr(trace_rules, "_allowed_callable_ids", None)
    if lazy is None or allowed is None:
        return

    def untrap() -> None:
        import warnings

        try:
            import einops
        except ImportError:
            return
        try:
            version = tuple(int(p) for p in einops.__version__.split(".")[:3])
        except ValueError:
            return
        if version < EINOPS_TRACED_FROM:
            return
        # einops registers its torch backend on first use and Dynamo guards on that registry: use it
        # once now, as torch 2.13 does, or the second compiled call recompiles
        einops.rearrange(torch.empty(1), "i -> i")
        for name in ("rearrange", "reduce", "repeat", "einsum", "pack", "unpack"):
            fn = getattr(einops, name, None)
            if fn is not None:
                allowed.remove(id(fn))
        # torch 2.13 silences this warning for einops' pure recipe caches only; so do we
        warnings.filterwarnings(
            "ignore", category=UserWarning,
            message=r"Dynamo detected a call to a `functools.lru_cache`-wrapped function at 'einops\.py")

    if "einops" in lazy or "einops" not in sys.modules:
        lazy["einops"].append(untrap)  # after torch's own set-up, on the first einops lookup
    else:
        untrap()


# --- a user-defined Triton kernel launch in a traced graph ---
def launched_kernel(node: Any) -> Any:
    """The kernel a triton_kernel_wrapper_functional/_mutation node launches (torch keeps it in a
    side table, private in 2.11-2.15), or None for any other node."""
    if getattr(node, "op", None) != "call_function" or getattr(node.target, "__name__", "") not in (
            "triton_kernel_wrapper_functional", "triton_kernel_wrapper_mutation"):
        return None
    try:
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        return kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    except (ImportError, KeyError, AssertionError, IndexError):
        return None


def kernel_call_targets() -> list[Any]:
    """The FX targets that call one of our kernels in a post-grad graph: a traced launch
    (triton_kernel_wrapper_mutation / _functional, private in 2.11-2.15) or an opaque hccompile op
    (the `_host` ops on the CPU and in Triton's interpreter). Inductor realizes their inputs."""
    targets: list[Any] = []
    try:
        from torch._higher_order_ops.triton_kernel_wrap import (triton_kernel_wrapper_functional,
                                                                triton_kernel_wrapper_mutation)

        targets += [triton_kernel_wrapper_mutation, triton_kernel_wrapper_functional]
    except ImportError:
        pass
    for name in torch._C._dispatch_get_all_op_names():
        namespace, _, op = name.partition("::")
        if namespace == "hccompile":
            packet = getattr(torch.ops.hccompile, op.partition(".")[0], None)
            if packet is not None:
                targets += [getattr(packet, o) for o in packet.overloads()]
    return targets


@contextlib.contextmanager
def inputs_realized_for(targets: list[Any]):
    """Inside: a value with several users, one of whose targets is in `targets`, is stored once where
    it is computed (Inductor's `needs_realized_inputs`, which holds mm and convolution), so that its
    other users read it instead of computing it again from its inputs. Taken back on exit."""
    try:
        from torch._inductor.lowering import needs_realized_inputs
    except ImportError:
        yield
        return
    added = [t for t in dict.fromkeys(targets) if t not in needs_realized_inputs]
    needs_realized_inputs.update(added)
    try:
        yield
    finally:
        for target in added:
            needs_realized_inputs.discard(target)


@contextlib.contextmanager
def quiet_fake_tensor_errors():
    """Inside: torch's fake-tensor module does not log the failures it then raises. torch 2.15 logs
    an op's failure on fake tensors, with its traceback, at ERROR level before raising it (2.11 and
    2.13 raise only), so a one-line error of ours would come after a raw traceback."""
    import logging

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def plain_eager() -> bool:
    """Whether a call runs in plain eager mode: not traced by Dynamo or export, no Python dispatch
    or function mode (fake tensors, make_fx, FlopCounter, `with torch.device(...)`) and no functorch
    transform (vmap, grad). Private torch APIs present from 2.11 to 2.15."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled()
                or torch._C._functorch.peek_interpreter_stack() is not None)


# --- torch's analysis of what a traced Triton launch reads and writes ---
# torch generates a kernel's Triton IR to find the tensors a wrap_triton launch writes, at every call
# site and several times per site (functionalization, Inductor's graph and its IR node): 13-124 ms a
# time for the mHC kernels on a CPU, and an mHC step has about 90 call sites per compile. The result
# depends only on the kernel and the values torch substitutes before generating the IR (a fake tensor
# becomes its dtype, a symbolic size the number 2, anything else stays itself), so for our kernels it
# is computed once per such key. torch calls the analysis through its module attribute, named
# `identify_accessed_tensors` in 2.13 and 2.15 and `identify_mutated_tensors` in older torches: the
# cache wraps whichever this torch has.
_ACCESS_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_access_cache: dict[tuple, Any] = {}
access_analysis_counts = {"computed": 0, "reused": 0}


def _access_key(kernel: Any, kwargs: dict[str, Any], tma_descriptor_metadata: Any) -> tuple | None:
    """The cache key of one analysis, or None where it must not be cached: a kernel not ours, TMA
    descriptors, a real (not fake) tensor, an unhashable value."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensor

    configs = getattr(kernel, "configs", None)
    if configs is not None:  # an Autotuner: torch analyses its first config's kernel (launch options
        # make torch wrap a kernel in a fresh one-config Autotuner per call site)
        kwargs = {**kwargs, **configs[0].kwargs} if configs else kwargs
        kernel = kernel.fn
    fn = kernel
    while hasattr(fn, "fn"):  # a one-config Autotuner wraps a JITFunction, which wraps a function
        fn = fn.fn
    if not getattr(fn, "__module__", "").startswith("hccompile.") or tma_descriptor_metadata:
        return None
    try:
        from torch._inductor.ir import TensorBox
    except ImportError:  # pragma: no cover - Inductor ships with every supported torch
        TensorBox = FakeTensor
    parts = []
    for name in sorted(kwargs):
        value = kwargs[name]
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
            part = ("sym",)
        elif isinstance(value, (FakeTensor, TensorBox)):
            part = ("tensor", value.get_dtype() if isinstance(value, TensorBox) else value.dtype)
        elif isinstance(value, torch.Tensor):
            return None  # a real tensor: Triton specializes on its address
        else:
            try:
                hash(value)
            except TypeError:
                return None
            part = ("value", type(value), value)
        parts.append((name, part))
    return (kernel, tuple(parts))


def cache_triton_access_analysis() -> Any:
    """Installs the per-key cache on torch's launch analysis (above); idempotent. Returns the
    analysis function torch calls (for tests to compare with its `__wrapped__`), or None."""
    import copy

    try:
        import torch._higher_order_ops.triton_kernel_wrap as wrap
    except ImportError:  # pragma: no cover
        return
    for attr in _ACCESS_ANALYSES:
        analysis = getattr(wrap, attr, None)
        if analysis is None or getattr(analysis, "_hccompile_cached", False):
            continue

        def cached(kernel, kwargs, *rest, _analysis=analysis, **more):
            # (kernel, kwargs, tma_descriptor_metadata); older torches lacked the third
            tma = rest[0] if len(rest) == 1 and not more else more.get("tma_descriptor_metadata")
            simple = len(rest) + len(more) <= 1 and set(more) <= {"tma_descriptor_metadata"}
            key = _access_key(kernel, kwargs, tma) if simple else None
            if key is None:
                return _analysis(kernel, kwargs, *rest, **more)
            hit = _access_cache.get(key)
            if hit is None:
                access_analysis_counts["computed"] += 1
                hit = _access_cache[key] = _analysis(kernel, kwargs, *rest, **more)
            else:
                access_analysis_counts["reused"] += 1
            return copy.deepcopy(hit)

        cached._hccompile_cached = True
        cached.__wrapped__ = analysis
        setattr(wrap, attr, cached)
    return next((getattr(wrap, attr) for attr in _ACCESS_ANALYSES if hasattr(wrap, attr)), None)
