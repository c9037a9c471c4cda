"""The (gated) delta rule — plain, GDN (scalar log-gate) and KDA (per-channel log-gate) — as custom ops.

Layout and conventions are FLA's: q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H;
beta [B, T, HV]; g [B, T, HV] (GDN) or [B, T, HV, K] (KDA); states [N, HV, K, V]; variable-length
batches are B = 1 plus cu_seqlens [N + 1]. One op per direction, so AOTAutograd puts the forward op
in the forward graph and the backward op in the backward graph (both triton_ops: compiled on CUDA,
fixed-length calls are traced into their kernel launches, see _traceable):

    hccompile::chunk_delta_rule(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? g,
        Tensor? initial_state, Tensor? cu_seqlens, Tensor? A_log, Tensor? dt_bias, str gate,
        float scale, bool output_final_state, bool use_qk_l2norm_in_kernel, float? lower_bound,
        SymInt chunk_size, bool save_intermediates, bool check_gates)
        -> (Tensor o, Tensor final_state, Tensor kdot, Tensor scores, Tensor inverse, Tensor q_normed,
            Tensor k_normed, Tensor cum, Tensor w, Tensor u, Tensor h)
    hccompile::chunk_delta_rule_backward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? g,
        Tensor? initial_state, Tensor? cu_seqlens, Tensor? A_log, Tensor? dt_bias, Tensor do,
        Tensor? dht, str gate, float scale, bool use_qk_l2norm_in_kernel, float? lower_bound,
        SymInt chunk_size, Tensor? kdot, Tensor? scores, Tensor? inverse, Tensor? q_normed,
        Tensor? k_normed, Tensor? cum, Tensor? w, Tensor? u, Tensor? h)
        -> (dq, dk, dv, dbeta, dg, dinitial_state, dA_log, ddt_bias)

Custom ops cannot return None, so: the forward op's `final_state` is a zero-size tensor of shape
(0,) when output_final_state is False, and the backward op returns a zero-size (0,) tensor (q's
dtype) for every gradient whose input is absent. The public functions turn both back into None.
The final state is float32 (float64 when q is float64), as FLA's.

The public functions' log-gates must be finite and <= 0 (the state decays by exp(g) <= 1 per
step): the forward op, called by them with check_gates=True, raises a ValueError naming g
otherwise, for CPU tensors always and for CUDA tensors only with HCCOMPILE_CHECK_GATES=1 (reading
the values synchronises the GPU). Tensors in the head-first
layout [B, H, T, D] among FLA-layout ones make the shape error name them (see _layout_hint).

On CUDA, and on CPU under TRITON_INTERPRET=1, the ops run our Triton kernels
(kernels/delta_rule/chunk.py) when every floating input is float16, bfloat16 or float32; otherwise
(CPU without the interpreter, or any float64 input) they run the chunked plain-PyTorch reference,
with the backward by autograd through it: same math, documented fallback.

Usage::

    import torch
    from hccompile.lowering.delta_rule import chunk_gated_delta_rule

    B, T, H, K, V = 2, 100, 4, 64, 64
    q, k = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H))        # log-decay <= 0
    beta = torch.rand(B, T, H).sigmoid()
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    o.sum().backward()
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch import Tensor

from ..compat import autograd_recording as _autograd_recording
from ..kernels.delta_rule import (MAX_HEAD_DIM, check_delta_rule_inputs, chunk_delta_rule_bwd, chunk_delta_rule_fwd,
                                  chunk_delta_rule_ref, triton_available)
from ..kernels.delta_rule.chunk import GRADIENT_NAMES, Kept
from ..kernels.delta_rule.output import _output_kernel, _output_scores_kernel
from ..kernels.delta_rule.plan import (CHUNK_SIZES, DEFAULT_CHUNK_SIZE, SUPPORTED_DTYPES, fused_scores_forward_for,
                                       intermediate_dtype_for, inverse_dtype_for, kept_state_rows,
                                       normed_qk_dtype_for)
from ..kernels.delta_rule.dqkw import _dqkw_kernel
from ..kernels.delta_rule.local_du import _local_du_kernel
from ..kernels.delta_rule.state import _state_backward_kernel
from ..kernels.delta_rule.wy import _wy_backward_kernel
from ..kernels.delta_rule.wy_bwd import _wy_bwd_kernel
from ..kernels.delta_rule.reference import GATE_KINDS
from ..kernels.value_checks import checks_on_gpu, values_checked
from ._launch import (HEADS, call_backward_op, call_op, checked_by_forward, kernel_op, register_autograd,
                      runtime_check, wrap_triton)

__all__ = [
    "chunk_delta_rule",
    "chunk_delta_rule_backward_op",
    "chunk_delta_rule_op",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "implementation",
    "register_context_parallel",
]

class _NoContextParallel:
    """The ops' context-parallel hook until hccompile.distributed registers its own: no context is
    ever active (a context can only be made through that package)."""

    @staticmethod
    def current_context():
        return None

    @staticmethod
    def forward(*args, **kwargs):
        return None

    @staticmethod
    def backward(*args, **kwargs):
        return None


# The ops consult this hook first (forward / backward return None: run as usual); the distributed
# package fills it on import (register_context_parallel), so lowering imports nothing of it.
_context_parallel = _NoContextParallel


def register_context_parallel(hook) -> None:
    """Installs `hook` (current_context(), forward(...), backward(...): hccompile.distributed's
    dispatch module) as the ops' context-parallel dispatch."""
    global _context_parallel
    _context_parallel = hook


# The op's optional tensor inputs, in schema order after q, k, v, beta.
_OPTIONAL_NAMES = ("g", "initial_state", "cu_seqlens", "A_log", "dt_bias")


# ----------------------------------------------------------------------------------------
# Validation


def _require(name: str, tensor, dim: int | None = None, layout: str = "") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if dim is not None and tensor.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor {layout}, got shape {tuple(tensor.shape)}")
    if name != "cu_seqlens" and not tensor.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {tensor.dtype}")


def _check_shapes_symbolic(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound,
                           do=None, dht=None) -> None:
    """The shape contract of check_delta_rule_inputs without reading cu_seqlens values or turning a
    size into a Python int: safe on fake tensors with symbolic sizes (it only adds equality guards).
    The real ops run the kernel package's full check as well."""
    with _layout_hints(q, k, v, beta, g):
        _check_shapes(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, do, dht)


def _check_shapes(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound, do, dht) -> None:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _require(name, tensor, 4, "[batch, time, heads, head_dim]")
    _require("beta", beta, 3, "[batch, time, value_heads]")
    batch, time, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: shape {tuple(k.shape)} differs from q's shape {tuple(q.shape)}")
    if tuple(v.shape[:2]) != (batch, time):
        raise ValueError(f"v: batch, time {tuple(v.shape[:2])} differ from q's {(batch, time)}")
    if value_heads % key_heads != 0:
        raise ValueError(f"v: heads HV={value_heads} must be a multiple of q's H={key_heads}")
    if tuple(beta.shape) != (batch, time, value_heads):
        raise ValueError(f"beta: shape {tuple(beta.shape)} differs from the expected {(batch, time, value_heads)}")
    if gate not in GATE_KINDS:
        raise ValueError(f"gate: expected one of {GATE_KINDS}, got {gate!r}")
    if gate == "none":
        if g is not None:
            raise ValueError('g: must be None for gate="none"')
    else:
        expected = (batch, time, value_heads) if gate == "scalar" else (batch, time, value_heads, key_dim)
        if g is None:
            raise ValueError(f'g: required for gate="{gate}", shape {expected}')
        _require("g", g)
        if tuple(g.shape) != expected:
            raise ValueError(f'g: shape {tuple(g.shape)} differs from the expected {expected} for gate="{gate}"')
    if A_log is not None or dt_bias is not None:
        if gate != "channel":
            raise ValueError(f'A_log: the in-kernel gate needs gate="channel", got gate="{gate}"')
        if A_log is None or dt_bias is None:
            raise ValueError("A_log: the in-kernel gate needs both A_log and dt_bias")
        _require("A_log", A_log, 1, "[HV]")
        _require("dt_bias", dt_bias, 1, "[HV * K]")
        if A_log.shape[0] != value_heads:
            raise ValueError(f"A_log: shape {tuple(A_log.shape)} differs from the expected ({value_heads},)")
        if dt_bias.shape[0] != value_heads * key_dim:
            raise ValueError(f"dt_bias: shape {tuple(dt_bias.shape)} differs from the expected "
                             f"({value_heads * key_dim},)")
    elif lower_bound is not None:
        raise ValueError("lower_bound: only used by the in-kernel gate (pass A_log and dt_bias)")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound: must be negative (a log-decay), got {lower_bound}")
    if cu_seqlens is not None:
        _require("cu_seqlens", cu_seqlens, 1, "[N + 1]")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
        if batch != 1:
            raise ValueError(f"cu_seqlens: requires B == 1, got B={batch}")
    state_shape = _state_shape(q, v, cu_seqlens)
    for name, tensor in (("initial_state", initial_state), ("dht", dht)):
        if tensor is not None:
            _require(name, tensor, 4, "[N, HV, K, V]")
            if tuple(tensor.shape) != state_shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from the expected {state_shape}")
    if do is not None:
        _require("do", do, 4, "[B, T, HV, V]")
        if tuple(do.shape) != (batch, time, value_heads, value_dim):
            raise ValueError(f"do: shape {tuple(do.shape)} differs from the expected "
                             f"{(batch, time, value_heads, value_dim)}")


def _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size) -> None:
    """Dtype, device, head-dim and chunk-size limits shared by both implementations."""
    if q.dtype not in SUPPORTED_DTYPES + (torch.float64,):
        raise TypeError(f"q: dtype {q.dtype} is not supported (float16, bfloat16, float32, float64)")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {tensor.dtype} differs from q's dtype {q.dtype}")
    for name, tensor in (("k", k), ("v", v), ("beta", beta), ("g", g), ("initial_state", initial_state),
                         ("A_log", A_log), ("dt_bias", dt_bias)):
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name}: device {tensor.device} differs from q's device {q.device}")
    for name, dim in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {dim} exceeds the supported maximum {MAX_HEAD_DIM}")
    # The kernels' chunk sizes, also for the reference: the two paths must accept the same calls.
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size!r}")


# Layout guard. These ops take FLA's layout, time before heads ([B, T, H, D]); attention code
# written for F.scaled_dot_product_attention keeps heads before time ([B, H, T, D]). Passing such
# q, k, v with FLA-layout beta and g gives a shape error, which _layout_hints completes with the
# likely mistake. When every tensor is head-first the shapes agree and only a heuristic can tell:
# the public functions warn when the "heads" axis is longer than the "time" axis and longer than
# any model's head count (_PLAUSIBLE_HEADS).
_PLAUSIBLE_HEADS = 128


def _layout_hint(q, k, v, beta, g) -> str | None:
    """The sentence naming the tensors whose dims 1 and 2 look swapped (heads before time), when
    that swap is what makes the shapes disagree; None when the shapes cannot be explained so. The
    time length is taken from beta, or from beta with its own dims swapped; of the readings that
    explain every shape, the one with the longer time wins (sequences are longer than head counts).
    Runs on the error path only: it compares sizes, which adds guards on symbolic ones."""
    named = [("q", q, 4), ("k", k, 4), ("v", v, 4), ("beta", beta, 3)]
    if g is not None:
        named.append(("g", g, None))
    for _, tensor, dim in named:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 3 or (dim is not None and tensor.dim() != dim):
            return None

    def reads(name, tensor, time, heads, flipped):
        steps, count = (tensor.shape[2], tensor.shape[1]) if flipped else (tensor.shape[1], tensor.shape[2])
        if name in ("q", "k"):  # H key heads, a divisor of the HV value heads
            return steps == time and count > 0 and heads % count == 0
        return steps == time and count == heads

    explained = []
    for time, heads in ((beta.shape[1], beta.shape[2]), (beta.shape[2], beta.shape[1])):
        swapped = []
        for name, tensor, _ in named:
            if reads(name, tensor, time, heads, flipped=False):
                continue
            if not reads(name, tensor, time, heads, flipped=True):
                break
            swapped.append(name)
        else:
            if not swapped:
                return None  # the shapes agree on the layout: the error is something else
            explained.append((time, heads, swapped))
    if not explained:
        return None
    time, heads, swapped = max(explained, key=lambda e: e[0])
    others = [name for name, _, _ in named if name not in swapped]
    names = ", ".join(swapped)
    return (f"{names} {'looks' if len(swapped) == 1 else 'look'} head-first [B, H, T, ...] (heads before "
            f"time, as for scaled_dot_product_attention) while {', '.join(others)} "
            f"{'is' if len(others) == 1 else 'are'} time-first (T={time}, HV={heads}); these ops take FLA's "
            f"layout, time before heads: q, k [B, T, H, K], v [B, T, HV, V], beta [B, T, HV], g [B, T, HV] "
            f"or [B, T, HV, K]. Pass {', '.join(f'{n}.transpose(1, 2)' for n in swapped)}")


@contextlib.contextmanager
def _layout_hints(q, k, v, beta, g):
    """Completes a shape error with _layout_hint's sentence when it applies."""
    try:
        yield
    except ValueError as error:
        hint = _layout_hint(q, k, v, beta, g)
        if hint is None:
            raise
        raise ValueError(f"{error}. {hint}") from None


def _warn_if_head_first(q: Tensor, cu_seqlens: Tensor | None) -> None:
    """Every tensor head-first gives consistent shapes; warn when the reading is implausible."""
    if cu_seqlens is None and q.dim() == 4 and q.shape[1] < q.shape[2] and q.shape[2] > _PLAUSIBLE_HEADS:
        warnings.warn(
            f"q: shape {tuple(q.shape)} reads as T={q.shape[1]} steps of H={q.shape[2]} heads; if it is "
            f"[B, H, T, K] (heads before time), transpose dims 1 and 2 of q, k, v, beta and g: these ops "
            f"take FLA's layout [B, T, H, K]", stacklevel=4)


# Gate values. A log-gate g > 0 makes the state grow by exp(g) > 1 per step, which no GDN/KDA
# parameterisation produces (logsigmoid, -exp(A_log) * softplus(...)) and which the chunked
# kernels, built on exp of cumulative gate differences, do not support; a NaN or infinite gate
# poisons the whole chunk. Reading the values needs them on the host: free on the CPU, a
# synchronisation on a GPU. So, as lightning_attn does for its decay, CPU gates are always checked
# and CUDA gates only with HCCOMPILE_CHECK_GATES=1 (kernels/value_checks.py). The check belongs to the
# FLA-style public functions (the op's check_gates=True, also under torch.compile, where the op
# checks at run time): the delta_rule pass lowers the user's own recurrence, whose gate may be any
# finite tensor (the op's math holds for it), so the op it emits does not check.


def _check_gate_values(g: Tensor | None, gate: str, A_log: Tensor | None) -> None:
    """Raise ValueError naming g when a log-gate is positive or not finite (CPU always; CUDA with
    HCCOMPILE_CHECK_GATES=1). The in-kernel gate (A_log given) takes raw activations: unchecked."""
    if g is None or gate == "none" or A_log is not None or not isinstance(g, torch.Tensor):
        return
    if not values_checked(g.device):
        return
    g = g.detach()
    for bad, what in ((~torch.isfinite(g), "must be finite"), (g > 0, "must be <= 0 (log-decays: exp(g) <= 1)")):
        if bad.any():
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"g: log-gates {what}, got {g[index].item():g} at index {index} ({int(bad.sum())} of "
                f"{g.numel()} values); gates are usually logsigmoid(x) or -exp(A_log) * softplus(x + dt_bias)"
                + ("; chunk_kda computes the latter from raw g with use_gate_in_kernel=True" if gate == "channel"
                   else ""))


def _state_shape(q: Tensor, v: Tensor, cu_seqlens: Tensor | None):
    # N from the shape of cu_seqlens, never from its values: valid for fake tensors.
    num_sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (num_sequences, v.shape[2], q.shape[3], v.shape[3])


def _state_dtype(q: Tensor) -> torch.dtype:
    # The kernels keep the state in float32; the reference in float64 for float64 inputs.
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------
# Dispatch


def _uses_triton(*tensors: Tensor | None) -> bool:
    """Kernels when they can run on the device and every floating input has a kernel dtype."""
    present = [t for t in tensors if t is not None]
    return triton_available(present[0].device) and all(t.dtype in SUPPORTED_DTYPES for t in present)


def implementation(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Which implementation backs the ops for this device and dtype: 'triton', 'triton-interpreter'
    or 'reference'."""
    device = torch.device(device)
    if dtype in SUPPORTED_DTYPES and triton_available(device):
        return "triton" if device.type == "cuda" else "triton-interpreter"
    return "reference"


def _absent(q: Tensor) -> Tensor:
    """What the ops return in place of a missing tensor (custom ops cannot return None)."""
    return q.new_empty((0,))


# ----------------------------------------------------------------------------------------
# Forward op

# Whether a forward that keeps its intermediates (keeps_intermediates) also keeps the state sweep's
# w, u and chunk states h, so that the backward runs neither the WY solve nor the forward sweep
# again. FLA recomputes them; keeping them costs, per layer until its backward, 2 (2 + K / 64) T HV K
# bytes per batch row at bf16 and chunk 64 with K = V (at T 32768, H16, K128: 268 MB for h and 134 MB
# each for w and u). Their recomputation took 2.5 ms of KDA's 14.3 ms step and ~1.3 ms of GDN's
# 7.8 ms on the H100 (B1 T32768 H16 K128, session 17's profiles in BENCHMARKS.md). HCCOMPILE_DELTA_RULE_KEEP_STATES=0 (read at import;
# tests and benchmarks set the attribute) trades that time back for the memory.
KEEP_STATES = os.environ.get("HCCOMPILE_DELTA_RULE_KEEP_STATES", "1") != "0"


def _chunk_delta_rule_host(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None, gate: str, scale: float,
    output_final_state: bool, use_qk_l2norm_in_kernel: bool, lower_bound: float | None, chunk_size: int,
    save_intermediates: bool = False, check_gates: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(o, final state, kdot, scores, inverse, q_normed, k_normed, cum, w, u, h). With
    save_intermediates the last nine are kept for the backward so that it does not recompute them:
    the kernels' intra-chunk matrices [B, T, HV, chunk_size] (see _kept_layout: without per-channel
    gates and with plan.FUSED_SCORES_FORWARD no kdot, and scores in the intermediates' dtype); with
    use_qk_l2norm_in_kernel the l2-normed q and k ([B, T, H, K] in normed_qk_dtype_for(q.dtype)); with a gate its
    chunk-local cumulative sum (fp32 [B, T, HV, K or 1]); with KEEP_STATES the state sweep's w
    [B, T, HV, K], u [B, T, HV, V] and chunk states h [kept_state_rows, HV, K, V] in
    intermediate_dtype_for(q.dtype); zeros where the reference or CP path ran (their backwards
    recompute); zero-size placeholders for what is not kept. check_gates: raise unless the log-gates are finite and <= 0
    (_check_gate_values); the public functions ask for it, the delta_rule pass does not (the math
    it lowers is the user's own, any finite gate included)."""
    if check_gates:
        _check_gate_values(g, gate, A_log)
    # Context parallelism (hccompile.distributed.context_parallel) when a CP context is active.
    layout = _kept_layout(q, v, gate, chunk_size, save_intermediates, use_qk_l2norm_in_kernel, cu_seqlens)
    keep_rows = layout[-1][0][0] if save_intermediates and KEEP_STATES else None
    parallel = _context_parallel.forward(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, gate, scale,
                                         output_final_state, use_qk_l2norm_in_kernel, lower_bound, chunk_size,
                                         keep_state_rows=keep_rows)
    if parallel is not None:
        o, final_state, kept = parallel
        return o, final_state, *_cp_kept_outputs(q, kept, layout)
    _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
    args = dict(g=g, gate=gate, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log,
                dt_bias=dt_bias, lower_bound=lower_bound, chunk_size=chunk_size)
    if _uses_triton(q, k, v, beta, g, initial_state, A_log, dt_bias):
        return _forward_kernels(q, k, v, beta, args, save_intermediates)
    o, final_state = chunk_delta_rule_ref(q, k, v, beta, **args)
    return _forward_outputs(q, v, o, final_state,
                            _kept_placeholders(q, v, gate, chunk_size, save_intermediates, use_qk_l2norm_in_kernel,
                                               cu_seqlens))


def _forward_kernels(q, k, v, beta, args: dict, save_intermediates: bool, **launch) -> tuple[Tensor, ...]:
    """The forward op's outputs by the kernels; `launch`: wrap and dummy when traced."""
    layout = _kept_layout(q, v, args["gate"], args["chunk_size"], save_intermediates, args["use_qk_l2norm_in_kernel"],
                          args["cu_seqlens"])
    if save_intermediates:
        o, final_state, kept = chunk_delta_rule_fwd(q, k, v, beta, **args, return_intermediates=True, **launch)
        if not KEEP_STATES:
            kept = kept._replace(w=None, u=None, h=None)
        # What the kernels did not keep (no l2norm, no gate, no chunk to sum over, states not kept)
        # as placeholders.
        kept = tuple(q.new_zeros(shape, dtype=dtype) if t is None else t for t, (shape, dtype) in zip(kept, layout))
    else:
        o, final_state = chunk_delta_rule_fwd(q, k, v, beta, **args, **launch)
        kept = tuple(q.new_zeros(shape, dtype=dtype) for shape, dtype in layout)
    return _forward_outputs(q, v, o, final_state, kept)


def _forward_outputs(q, v, o, final_state, kept) -> tuple[Tensor, ...]:
    if final_state is None:
        return o, q.new_empty((0,), dtype=_state_dtype(q)), *kept
    return o, final_state.to(_state_dtype(q)).contiguous(), *kept


def _chunk_delta_rule_traced(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, gate, scale,
                             output_final_state, use_qk_l2norm_in_kernel, lower_bound, chunk_size,
                             save_intermediates=False, check_gates=False):
    """The forward op on CUDA, traced into its launches (see _traceable)."""
    _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
    args = dict(g=g, gate=gate, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=None, dt_bias=None,
                lower_bound=lower_bound, chunk_size=chunk_size)
    return _forward_kernels(q, k, v, beta, args, save_intermediates, wrap=wrap_triton, dummy=_scratch(q))


def _kept_layout(q: Tensor, v: Tensor, gate: str, chunk_size: int, save_intermediates: bool, l2norm: bool,
                 cu_seqlens: Tensor | None) -> list[tuple[tuple, torch.dtype]]:
    """Shape and dtype of each kept output (kdot, scores, inverse, q_normed, k_normed, cum, w, u, h),
    the op's and its fake's, when asked for: the matrices [B, T, HV, chunk_size] fp32 (the inverse in
    plan.inverse_dtype_for's dtype), the normed q
    and k [B, T, H, K] with l2norm, the gate's cumulative sum [B, T, HV, K or 1] fp32 with a gate, w,
    u, h (see Kept) with KEEP_STATES; (0,) otherwise. Where the forward forms Kdot and P inside
    wy_solve and the output kernel (plan.FUSED_SCORES_FORWARD, read now, as the kernels' plan reads
    it; no per-channel gate) kdot is (0,) and scores take the intermediates' dtype."""
    batch, time, value_heads = q.shape[0], q.shape[1], v.shape[2]
    key_dim, value_dim = q.shape[3], v.shape[3]
    square = (batch, time, value_heads, chunk_size) if save_intermediates else (0,)
    fused = fused_scores_forward_for(gate)
    normed = tuple(q.shape) if save_intermediates and l2norm else (0,)
    width = key_dim if gate == "channel" else 1
    cum = (batch, time, value_heads, width) if save_intermediates and gate != "none" else (0,)
    states = [(0,)] * 3
    if save_intermediates and KEEP_STATES:
        sequences = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
        rows = kept_state_rows(batch, time, chunk_size, sequences)
        states = [(batch, time, value_heads, key_dim), (batch, time, value_heads, value_dim),
                  (rows, value_heads, key_dim, value_dim)]
    stored = intermediate_dtype_for(q.dtype)
    matrices = [((0,) if fused else square, torch.float32), (square, stored if fused else torch.float32),
                (square, inverse_dtype_for(gate, q.dtype))]
    return (matrices + [(normed, normed_qk_dtype_for(q.dtype))] * 2 + [(cum, torch.float32)]
            + [(shape, stored) for shape in states])


def _cp_kept_outputs(q: Tensor, kept, layout) -> tuple[Tensor, ...]:
    """The kept outputs of a CP forward: what it kept (chunk.Kept, or None: zero placeholders), each
    checked against the op's layout, which the fake promised."""
    if kept is None:
        return tuple(q.new_zeros(shape, dtype=dtype) for shape, dtype in layout)
    outputs = []
    for name, t, (shape, dtype) in zip(Kept._fields, kept, layout):
        if t is None:
            t = q.new_zeros(shape, dtype=dtype)
        elif tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise RuntimeError(f"hccompile internal error: the CP forward kept {name} {tuple(t.shape)} {t.dtype}, "
                               f"the op's layout says {tuple(shape)} {dtype}")
        outputs.append(t)
    return tuple(outputs)


def _kept_placeholders(q: Tensor, v: Tensor, gate: str, chunk_size: int, save_intermediates: bool, l2norm: bool,
                       cu_seqlens: Tensor | None) -> tuple[Tensor, ...]:
    """The kept outputs where no kernel fills them (zeros, so that they are deterministic)."""
    return tuple(q.new_zeros(shape, dtype=dtype)
                 for shape, dtype in _kept_layout(q, v, gate, chunk_size, save_intermediates, l2norm, cu_seqlens))


def _chunk_delta_rule_fake(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, gate, scale,
                           output_final_state, use_qk_l2norm_in_kernel, lower_bound, chunk_size,
                           save_intermediates=False, check_gates=False):
    _check_shapes_symbolic(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound)
    _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
    batch, time, value_heads, value_dim = q.shape[0], q.shape[1], v.shape[2], v.shape[3]
    o = v.new_empty((batch, time, value_heads, value_dim))
    state_shape = _state_shape(q, v, cu_seqlens) if output_final_state else (0,)
    kept = _kept_layout(q, v, gate, chunk_size, save_intermediates, use_qk_l2norm_in_kernel, cu_seqlens)
    return (o, q.new_empty(state_shape, dtype=_state_dtype(q)),
            *(q.new_empty(shape, dtype=dtype) for shape, dtype in kept))


# ----------------------------------------------------------------------------------------
# Backward op




def _reference_backward(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, do, dht, gate, scale,
                        use_qk_l2norm_in_kernel, lower_bound, chunk_size) -> dict[str, Tensor | None]:
    """Gradients by autograd through chunk_delta_rule_ref (the fallback's backward)."""
    inputs = dict(zip(GRADIENT_NAMES, (q, k, v, beta, g, initial_state, A_log, dt_bias)))
    with _autograd_recording():
        leaves = {name: t.detach().requires_grad_() for name, t in inputs.items() if t is not None}
        o, final_state = chunk_delta_rule_ref(
            gate=gate, scale=scale, output_final_state=dht is not None, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lower_bound=lower_bound, chunk_size=chunk_size,
            **leaves,
        )
        outputs, cotangents = [o], [do.to(o.dtype)]
        if dht is not None:
            outputs.append(final_state)
            cotangents.append(dht.to(final_state.dtype))
        grads = torch.autograd.grad(outputs, list(leaves.values()), cotangents, allow_unused=True)
    result: dict[str, Tensor | None] = dict.fromkeys(GRADIENT_NAMES)
    for (name, leaf), grad in zip(leaves.items(), grads):
        result[name] = torch.zeros_like(leaf) if grad is None else grad
    return result


def _kernel_backward(q, k, v, beta, do, dht, intermediates=None, checked=False, **args) -> dict[str, Tensor | None]:
    """Gradients by the Triton backward kernels; `checked`: as chunk_delta_rule_bwd's."""
    with _autograd_recording():
        return chunk_delta_rule_bwd(q, k, v, beta, **args, do=do.to(v.dtype),
                                    dht=None if dht is None else dht.to(torch.float32), intermediates=intermediates,
                                    checked=checked)


def _chunk_delta_rule_backward_host(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, initial_state: Tensor | None,
    cu_seqlens: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None, do: Tensor, dht: Tensor | None,
    gate: str, scale: float, use_qk_l2norm_in_kernel: bool, lower_bound: float | None, chunk_size: int,
    kdot: Tensor | None = None, scores: Tensor | None = None, inverse: Tensor | None = None,
    q_normed: Tensor | None = None, k_normed: Tensor | None = None, cum: Tensor | None = None,
    w: Tensor | None = None, u: Tensor | None = None, h: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the forward op's inputs; kdot, scores, inverse are its kept matrices (scores and
    inverse or none; kdot zero-size where the forward formed it in wy_solve), q_normed and k_normed its
    kept l2-normed q and k (both or none), cum its gate's kept cumulative sum, w, u, h its kept state
    sweep (all three or none); reused by the kernel backward instead of recomputed. Called by the
    forward's autograd (call_backward_op), it skips the argument checks the forward ran."""
    checked = checked_by_forward()
    intermediates = _kept_intermediates(kdot, scores, inverse, q_normed, k_normed, cum, w, u, h)
    parallel = _context_parallel.backward(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, do, dht, gate,
                                          scale, use_qk_l2norm_in_kernel, lower_bound, chunk_size,
                                          intermediates=intermediates)
    if parallel is not None:
        return parallel
    if not checked:
        _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
    args = dict(g=g, gate=gate, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=A_log, dt_bias=dt_bias,
                lower_bound=lower_bound, chunk_size=chunk_size)
    # Same dispatch rule as the forward op, so the backward differentiates what the forward ran.
    if _uses_triton(q, k, v, beta, g, initial_state, A_log, dt_bias):
        grads = _kernel_backward(q, k, v, beta, do=do, dht=dht, intermediates=intermediates, checked=checked, **args)
    else:
        grads = _reference_backward(q, k, v, beta, do=do, dht=dht, **args)
    return _backward_outputs(q, k, v, beta, g, initial_state, A_log, dt_bias, grads)


def _kept_intermediates(kdot, scores, inverse, q_normed, k_normed, cum, w, u, h) -> Kept | None:
    """The backward kernels' `intermediates` from the kept outputs the backward op was given: the
    matrices when scores and inverse are real (kdot when it is: a forward that formed Kdot in wy_solve
    kept none), then the normed q and k when both are, the gate's sum when it is and w, u, h when all
    three are (zero-size placeholders stand for what the forward did not keep)."""
    def real(*tensors):
        return all(t is not None and t.numel() for t in tensors)

    if not real(scores, inverse):
        return None
    normed = (q_normed, k_normed) if real(q_normed, k_normed) else (None, None)
    states = (w, u, h) if real(w, u, h) else (None, None, None)
    return Kept(kdot if real(kdot) else None, scores, inverse, *normed, cum if real(cum) else None, *states)


def _backward_outputs(q, k, v, beta, g, initial_state, A_log, dt_bias, grads) -> tuple[Tensor, ...]:
    inputs = dict(zip(GRADIENT_NAMES, (q, k, v, beta, g, initial_state, A_log, dt_bias)))
    return tuple(
        _absent(q) if inputs[name] is None else grads[name].to(inputs[name].dtype).contiguous()
        for name in GRADIENT_NAMES
    )


def _chunk_delta_rule_backward_traced(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, do, dht, gate,
                                      scale, use_qk_l2norm_in_kernel, lower_bound, chunk_size, kdot=None,
                                      scores=None, inverse=None, q_normed=None, k_normed=None, cum=None, w=None,
                                      u=None, h=None):
    """The backward op on CUDA, traced into its launches (see _traceable)."""
    _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
    intermediates = _kept_intermediates(kdot, scores, inverse, q_normed, k_normed, cum, w, u, h)
    grads = chunk_delta_rule_bwd(q, k, v, beta, g=g, gate=gate, scale=scale, initial_state=initial_state,
                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, lower_bound=lower_bound,
                                 chunk_size=chunk_size, do=do.to(v.dtype),
                                 dht=None if dht is None else dht.to(torch.float32), intermediates=intermediates,
                                 wrap=wrap_triton, dummy=_scratch(q))
    return _backward_outputs(q, k, v, beta, g, initial_state, A_log, dt_bias, grads)


def _chunk_delta_rule_backward_fake(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, do, dht, gate,
                                    scale, use_qk_l2norm_in_kernel, lower_bound, chunk_size, kdot=None, scores=None,
                                    inverse=None, q_normed=None, k_normed=None, cum=None, w=None, u=None, h=None):
    _check_shapes_symbolic(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound,
                           do=do, dht=dht)
    _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
    return tuple(_absent(q) if t is None else t.new_empty(t.shape)
                 for t in (q, k, v, beta, g, initial_state, A_log, dt_bias))


# ----------------------------------------------------------------------------------------
# The ops: traced into their launches on CUDA (lowering/_launch.py), host ops elsewhere


def _traceable(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, check_gates=False, **_) -> bool:
    """Whether an op call on CUDA (its arguments by name) is traced into its kernel launches. Not
    for varlen batches (the chunk tables are built from cu_seqlens' values), KDA's in-kernel gate
    (its backward runs autograd through the activation), gate checks on CUDA (they read values)
    or under an active context_parallel block: those calls stay host ops
    (hccompile::chunk_delta_rule_host and ..._backward_host in the graph)."""
    return (cu_seqlens is None and A_log is None and dt_bias is None
            and not (check_gates and checks_on_gpu())
            and _context_parallel.current_context() is None
            and all(t is None or t.dtype in SUPPORTED_DTYPES for t in (q, k, v, beta, g, initial_state)))


@torch.library.custom_op("hccompile::delta_rule_outside_context_parallel", mutates_args=())
def outside_context_parallel_op(q: Tensor) -> Tensor:
    """A traced delta-rule op's first step at every run: a graph traced outside context_parallel()
    runs the single-device kernels, so inside such a block it must stop, not run them on the
    rank-local tensors. Returns the float32 scratch tensor the kernels take for absent inputs
    (so that the step is not dropped as unused)."""
    if _context_parallel.current_context() is not None:
        raise RuntimeError(
            "hccompile: a delta-rule graph compiled outside context_parallel() runs inside it; its "
            "kernels would treat the rank-local tensors as whole sequences. Run the first call of the "
            "compiled model inside the block (it then compiles the context-parallel op), or call "
            "torch._dynamo.reset() before entering it.")
    return torch.empty(2, dtype=torch.float32, device=q.device)


@outside_context_parallel_op.register_fake
def _outside_context_parallel_fake(q):
    return torch.empty(2, dtype=torch.float32, device=q.device)


runtime_check(outside_context_parallel_op)


def _scratch(q: Tensor) -> Tensor:
    """The float32 scratch tensor the kernels take for absent inputs. Traced, it comes from the
    run-time check above, so that every run of the compiled graph checks it is outside
    context_parallel(). Called eagerly, the body runs only where _traceable saw no active block
    (inside one the call is a host op), so it skips the check op's dispatch."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if is_fake(q) or get_proxy_mode() is not None:
        return outside_context_parallel_op(q)
    return torch.empty(2, dtype=torch.float32, device=q.device)


_FIXED_DIMS = {"q": HEADS, "v": HEADS}  # H, K and HV, V: see fix_sizes
chunk_delta_rule_op = kernel_op("chunk_delta_rule", _chunk_delta_rule_host, _chunk_delta_rule_fake,
                                _chunk_delta_rule_traced, SUPPORTED_DTYPES, kernels=(_output_kernel,),
                                traceable=_traceable, fixed_dims=_FIXED_DIMS)
chunk_delta_rule_backward_op = kernel_op("chunk_delta_rule_backward", _chunk_delta_rule_backward_host,
                                         _chunk_delta_rule_backward_fake, _chunk_delta_rule_backward_traced,
                                         SUPPORTED_DTYPES,
                                         # the sweep first: launched once per call whether wy_backward is
                                         # split (plan.SPLIT_WY_BACKWARD) or not
                                         kernels=(_state_backward_kernel, _wy_backward_kernel, _dqkw_kernel,
                                                  _wy_bwd_kernel, _output_scores_kernel, _local_du_kernel),
                                         traceable=_traceable,
                                         fixed_dims=_FIXED_DIMS)


# ----------------------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, gate, scale, output_final_state,
     use_qk_l2norm_in_kernel, lower_bound, chunk_size, *_flags) = inputs  # save_intermediates, check_gates
    # The backward recomputes the forward's intermediates from its inputs, except the intra-chunk
    # matrices, l2-normed q and k and gate sum the forward kept (save_intermediates): saved as they are.
    kept = output[2:]
    ctx.mark_non_differentiable(*kept)
    # Unused outputs (always the kept matrices, often the final state) get None, not a zero tensor
    # each: up to three [B, T, HV, chunk] fills per backward otherwise.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, *kept)
    ctx.options = (gate, scale, use_qk_l2norm_in_kernel, lower_bound, chunk_size)
    ctx.output_final_state = output_final_state


def _backward(ctx, do: Tensor | None, dfinal_state: Tensor | None, *kept_grads):
    q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, *kept = ctx.saved_tensors
    gate, scale, use_qk_l2norm_in_kernel, lower_bound, chunk_size = ctx.options
    if do is None:
        do = torch.zeros(q.shape[:2] + v.shape[2:], dtype=v.dtype, device=v.device)
    # Without output_final_state the second output is the zero-size placeholder: no gradient flows.
    dht = dfinal_state.contiguous() if ctx.output_final_state and dfinal_state is not None else None
    grads = call_backward_op(chunk_delta_rule_backward_op, q, k, v, beta, g, initial_state, cu_seqlens, A_log,
                             dt_bias, do.contiguous(), dht, gate, scale, use_qk_l2norm_in_kernel, lower_bound,
                             chunk_size, *kept)
    dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias = (
        None if x is None else grad for x, grad in zip((q, k, v, beta, g, initial_state, A_log, dt_bias), grads)
    )
    # Order of the op's arguments; cu_seqlens and the non-tensor options get None.
    return dq, dk, dv, dbeta, dg, dh0, None, dA_log, ddt_bias, None, None, None, None, None, None, None, None


register_autograd(chunk_delta_rule_op, _backward, _setup_context)


# ----------------------------------------------------------------------------------------
# Public functions (FLA's names and argument names)


def _run(q, k, v, beta, g, gate, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
         A_log=None, dt_bias=None, lower_bound=None, chunk_size=DEFAULT_CHUNK_SIZE):
    if not torch.compiler.is_compiling():
        # The kernel package's full check (it reads cu_seqlens, so eager only); under torch.compile
        # the fake runs the trace-safe subset, and the real op the full check at run time.
        with _layout_hints(q, k, v, beta, g):
            check_delta_rule_inputs(q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound)
        _check_options(q, k, v, beta, g, initial_state, A_log, dt_bias, chunk_size)
        _warn_if_head_first(q, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final_state, *_ = call_op(
        chunk_delta_rule_op, q, k, v, beta, g, initial_state, cu_seqlens, A_log, dt_bias, gate, float(scale),
        bool(output_final_state), bool(use_qk_l2norm_in_kernel),
        None if lower_bound is None else float(lower_bound), int(chunk_size),
        keeps_intermediates(q, k, v, beta, g, initial_state, A_log, dt_bias), True,
    )
    return o, (final_state if output_final_state else None)


def keeps_intermediates(*inputs: Tensor | None) -> bool:
    """Whether the forward op should keep its intra-chunk matrices (and l2-normed q and k) for the
    backward: when a gradient will be taken, under a CP context only where its plan keeps them (no
    sequence across a whole rank: hccompile.distributed's keeps_intermediates) and with KEEP_STATES
    (CP keeps all or nothing). It costs up to three fp32 [B, T, HV, chunk_size] tensors per call until the backward (without
    per-channel gates and with plan.FUSED_SCORES_FORWARD: A in fp32 and P in the intermediates' dtype), as FLA's kept
    score matrices and solved A do, plus with use_qk_l2norm_in_kernel two [B, T, H, K] in the normed
    dtype (bf16 for bf16 inputs) and with a gate its fp32 cumulative sum [B, T, HV, K or 1] (FLA keeps
    both too), and saves the backward their recomputation. With KEEP_STATES (the default) the state
    sweep's w, u and h are kept too (see KEEP_STATES)."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
        return False
    context = _context_parallel.current_context()
    return context is None or (KEEP_STATES and _context_parallel.keeps_intermediates(context, inputs[0]))


def chunk_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False, *,
    cu_seqlens: Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The delta rule without decay: S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T, o_t = scale S_t^T q_t.

    q, k [B, T, H, K]; v [B, T, HV, V]; beta [B, T, HV]; initial_state [N, HV, K, V]. Returns
    (o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] float32, or None unless
    output_final_state). `scale` defaults to K**-0.5. Differentiable in q, k, v, beta and
    initial_state; works under torch.compile(fullgraph=True, dynamic=True).
    """
    return _run(q, k, v, beta, None, "none", scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel)


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False, *,
    cu_seqlens: Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Gated DeltaNet: the delta rule with a scalar log-decay per token and value head, g [B, T, HV]
    (natural log, finite and <= 0: a ValueError otherwise, checked for CPU tensors, and for CUDA
    ones with HCCOMPILE_CHECK_GATES=1), applied to the state before the delta correction as in FLA.

    Arguments and results as chunk_delta_rule; also differentiable in g. The arguments after
    output_final_state are keyword-only because FLA's releases order them differently.
    """
    return _run(q, k, v, beta, g, "scalar", scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel)


def chunk_kda(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False, *,
    cu_seqlens: Tensor | None = None, use_qk_l2norm_in_kernel: bool = False, A_log: Tensor | None = None,
    dt_bias: Tensor | None = None, lower_bound: float | None = None, use_gate_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Kimi Delta Attention: the delta rule with a per-channel log-decay g [B, T, HV, K] (finite and
    <= 0, checked as for chunk_gated_delta_rule).

    With use_gate_in_kernel=True, g holds raw activations and the log-decay is computed in the
    kernel (FLA's names; there A_log and dt_bias travel in **kwargs):
    g = -exp(A_log) * softplus(g + dt_bias), or with lower_bound b < 0,
    g = b * sigmoid(exp(A_log) * (g + dt_bias)); A_log [HV], dt_bias [HV * K] (None: zeros, as FLA's
    optional bias). Arguments and results otherwise as chunk_gated_delta_rule; also
    differentiable in A_log and dt_bias.
    """
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log: required when use_gate_in_kernel=True, shape [HV]")
        if dt_bias is None:
            value_heads, key_dim = v.shape[2], q.shape[3]
            dt_bias = torch.zeros(value_heads * key_dim, dtype=A_log.dtype, device=A_log.device)
    else:
        for name, given in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
            if given is not None:
                raise ValueError(f"{name}: only used with use_gate_in_kernel=True")
    return _run(q, k, v, beta, g, "channel", scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel, A_log, dt_bias, lower_bound)
