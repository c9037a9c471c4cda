"""Lightning attention — causal linear attention with a constant per-head decay — as custom ops.

Per head h with log-decay gamma_h <= 0 (0 = no decay), layout [B, T, H, D] (FLA's; lightning
attention 2, FLA's ``g_gamma``):

    o_t = scale * sum_{s <= t} exp(gamma_h (t - s)) (q_t . k_s) v_s + scale * exp(gamma_h (t + 1)) q_t S_0
    S_T = sum_s exp(gamma_h (T - 1 - s)) k_s v_s^T + exp(gamma_h T) S_0

One op per direction, so AOTAutograd puts the forward op in the forward graph and the backward op
in the backward graph (both triton_ops: compiled on CUDA, fixed-length calls are traced into their
kernel launches, lowering/_launch.py):

    hccompile::lightning_attn(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor? initial_state,
        float scale, bool output_final_state, Tensor? cu_seqlens=None, bool save_states=False)
        -> (Tensor o, Tensor final_state, Tensor states)
    hccompile::lightning_attn_backward(Tensor q, Tensor k, Tensor v, Tensor decay,
        Tensor? initial_state, Tensor do, Tensor? dht, float scale, Tensor? cu_seqlens=None,
        Tensor? states=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dinitial_state)

q, k [B, T, H, K]; v [B, T, H, V]; decay [H] (log-decays, a constant: it gets no gradient);
initial_state and dht [N, H, K, V], N = B, or for a variable-length batch (B = 1, cu_seqlens
[N + 1], FLA's convention) the number of sequences. Custom ops cannot return None, so the forward op's
`final_state` is a zero-size tensor of shape (0,) when output_final_state is False, and the backward
op's `dinitial_state` is a zero-size (0,) tensor (q's dtype) when there is no initial state. The
public function turns both back into None. Every output is contiguous; o has v's dtype; the final
state is float32 (float64 when q is float64); dq, dk, dv, dinitial_state have their inputs' dtypes.
With save_states (the public function asks for it when a gradient will be taken: KEEP_STATES) the
forward's kernels also return the segments' starting states, fp32 [rows, H, K, V], which the backward
op takes as `states` instead of recomputing them; (0,) where not kept (varlen, the reference).

On CUDA, and on CPU under TRITON_INTERPRET=1, the ops run our Triton kernels
(kernels/lightning/chunk.py) when q, k, v are float16, bfloat16 or float32; otherwise (CPU without
the interpreter, or float64) they run the quadratic plain-PyTorch reference
(kernels/lightning/decay_reference.py), with the backward by autograd through it: same math,
documented fallback.

Usage::

    import torch
    from hccompile.lowering.lightning import alibi_decay, lightning_attn

    B, T, H, K, V = 2, 100, 4, 64, 64
    q, k = (torch.randn(B, T, H, K, requires_grad=True) for _ in range(2))
    v = torch.randn(B, T, H, V, requires_grad=True)
    o, state = lightning_attn(q, k, v, decay=alibi_decay(H), output_final_state=True)
    o.sum().backward()
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ..compat import autograd_recording as _autograd_recording
from ..kernels.lightning.chunk import (MAX_HEAD_DIM, SUPPORTED_DTYPES, lightning_attn_bwd, lightning_attn_fwd,
                                       num_states, saved_states, saved_states_rows, triton_available)
from ..kernels.lightning.sweeps import (_forward_sweep_bwd_kernel, _forward_sweep_kernel,
                                        _reverse_pair_sweep_kernel, _reverse_sweep_kernel)
from ..kernels.lightning.decay_reference import check_cu_seqlens, check_decay_and_state, lightning_attn_varlen_ref
from ..kernels.lightning.reference import check_attention_shapes
from ..kernels.value_checks import checks_on_gpu
from ._launch import HEADS, call_backward_op, call_op, checked_by_forward, kernel_op, register_autograd, wrap_triton

__all__ = [
    "alibi_decay",
    "implementation",
    "lightning_attn",
    "lightning_attn_backward_op",
    "lightning_attn_op",
]


# ----------------------------------------------------------------------------------------
# Validation


def _require(name: str, tensor, dim: int, layout: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor {layout}, got shape {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {tensor.dtype}")


def _check_cu_seqlens_symbolic(q: Tensor, cu_seqlens: Tensor | None) -> None:
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: a variable-length batch needs batch size 1, got q with batch {q.shape[0]}")


def _check_shapes_symbolic(q, k, v, decay, initial_state, do=None, dht=None, cu_seqlens=None) -> None:
    """The shape contract of check_attention_shapes + check_decay_and_state without reading the
    decay's values or turning a size into a Python int: safe on fake tensors with symbolic sizes
    (it only adds equality guards). The real ops run the kernel package's full checks as well."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _require(name, tensor, 4, "[batch, time, heads, head_dim]")
    batch, time, heads, key_dim = q.shape
    value_dim = v.shape[3]
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: shape {tuple(k.shape)} differs from q's shape {tuple(q.shape)}")
    if tuple(v.shape[:3]) != (batch, time, heads):
        raise ValueError(f"v: batch, time, heads {tuple(v.shape[:3])} differ from q's {(batch, time, heads)}")
    _require("decay", decay, 1, "[heads] (one log-decay per head)")
    if tuple(decay.shape) != (heads,):
        raise ValueError(f"decay: expected shape ({heads},) (one log-decay per head), got {tuple(decay.shape)}")
    _check_cu_seqlens_symbolic(q, cu_seqlens)
    state_shape = (num_states(q, cu_seqlens), heads, key_dim, value_dim)
    for name, tensor in (("initial_state", initial_state), ("dht", dht)):
        if tensor is not None:
            _require(name, tensor, 4, "[N, heads, K, V]")
            if tuple(tensor.shape) != state_shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from the expected {state_shape}")
    if do is not None:
        _require("do", do, 4, "[batch, time, heads, V]")
        if tuple(do.shape) != (batch, time, heads, value_dim):
            raise ValueError(f"do: shape {tuple(do.shape)} differs from the expected "
                             f"{(batch, time, heads, value_dim)}")


def _check_options(q, k, v, decay, initial_state, do=None, dht=None) -> None:
    """Dtype, device and head-dim limits shared by both implementations."""
    if q.dtype not in SUPPORTED_DTYPES + (torch.float64,):
        raise TypeError(f"q: dtype {q.dtype} is not supported (float16, bfloat16, float32, float64)")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {tensor.dtype} differs from q's dtype {q.dtype}")
    for name, tensor in (("k", k), ("v", v), ("decay", decay), ("initial_state", initial_state), ("do", do),
                         ("dht", dht)):
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name}: device {tensor.device} differs from q's device {q.device}")
    for name, dim in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {dim} exceeds the supported maximum {MAX_HEAD_DIM}")
        if dim < 1:
            raise ValueError(f"{name}: head dim must be at least 1, got {dim}")


def _check_eager(q, k, v, decay, initial_state, do=None, dht=None, cu_seqlens=None) -> None:
    """Everything, including the decay's and cu_seqlens' values: for real tensors only."""
    extra = {} if do is None else {"do": do}
    check_attention_shapes(q, k, v, **extra)
    _check_shapes_symbolic(q, k, v, decay, initial_state, do=do, dht=dht, cu_seqlens=cu_seqlens)
    num_states = check_cu_seqlens(q, cu_seqlens)
    check_decay_and_state(q, v, decay, num_states=num_states, initial_state=initial_state, dht=dht)
    _check_options(q, k, v, decay, initial_state, do=do, dht=dht)


def _state_dtype(q: Tensor) -> torch.dtype:
    # The kernels keep the state in float32; the reference in float64 for float64 inputs.
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------
# Dispatch


def _uses_triton(q: Tensor) -> bool:
    """Kernels when they can run on the device and q, k, v (one dtype) have a kernel dtype."""
    return q.dtype in SUPPORTED_DTYPES and triton_available(q.device)


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


# Whether a differentiable forward keeps its segments' starting states for the backward, which then
# skips recomputing them (one pass of the two summary kernels, or the sequential walk, over k and v).
# Measured on one H200 at 7999b35 (lightning-stages, backward alone): B4 T4096 H16 D128 0.538 -> 0.464 ms,
# B1 T32768 1.199 -> 0.955, B8 T2048 H32 D64 0.318 -> 0.279, varlen B1 T16384 (8 sequences) 0.752 -> 0.513.
# The cost: an fp32 [segments, H, K, V] tensor per layer until its backward (33.5 MB at B4 T4096 H16 D128,
# next to 16.8 MB for each of q, k, v). FLA recomputes them. Fixed-length rows only (a varlen batch's segment
# count depends on cu_seqlens' values, which the op's fake cannot see). HCCOMPILE_LIGHTNING_KEEP_STATES=0
# (read at import; tests set the attribute) trades the time back for the memory.
KEEP_STATES = os.environ.get("HCCOMPILE_LIGHTNING_KEEP_STATES", "1") != "0"


def _lightning_attn_host(
    q: Tensor, k: Tensor, v: Tensor, decay: Tensor, initial_state: Tensor | None, scale: float,
    output_final_state: bool, cu_seqlens: Tensor | None = None, save_states: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(o, final state, states): with save_states (fixed-length rows, the kernels) the segments'
    starting states the backward would recompute, fp32 [saved_states_rows, H, K, V]; else (0,)."""
    _check_eager(q, k, v, decay, initial_state, cu_seqlens=cu_seqlens)
    if _uses_triton(q):
        return _forward_kernels(q, k, v, decay, initial_state, scale, output_final_state, cu_seqlens,
                                _keeps_states(q, cu_seqlens, save_states), checked=True)
    o, final_state = lightning_attn_varlen_ref(q, k, v, decay, scale, initial_state, output_final_state, cu_seqlens)
    return _forward_outputs(q, v, o, final_state)


def _forward_kernels(q, k, v, decay, initial_state, scale, output_final_state, cu_seqlens, keep: bool, **launch):
    """The forward op's outputs by the kernels; `launch`: checked (the host op) or wrap (traced)."""
    o, final_state, *saved = lightning_attn_fwd(q, k, v, decay.float().contiguous(), scale, initial_state,
                                                output_final_state, cu_seqlens=cu_seqlens, return_states=keep,
                                                **launch)
    return _forward_outputs(q, v, o, final_state, saved[0].states if keep else None)


def _keeps_states(q: Tensor, cu_seqlens: Tensor | None, save_states: bool) -> bool:
    """The one rule the op, its traced form and its fake keep states by."""
    return save_states and cu_seqlens is None and _uses_triton(q)


def _forward_outputs(q, v, o, final_state, states=None) -> tuple[Tensor, Tensor, Tensor]:
    o = o.to(v.dtype).contiguous()
    states = q.new_empty((0,), dtype=torch.float32) if states is None else states
    if final_state is None:
        return o, q.new_empty((0,), dtype=_state_dtype(q)), states
    return o, final_state.to(_state_dtype(q)).contiguous(), states


def _lightning_attn_traced(q, k, v, decay, initial_state, scale, output_final_state, cu_seqlens=None,
                           save_states=False):
    """The forward op on CUDA for fixed-length rows, traced into its launches (the decay's values
    are not checked here: on CUDA they never are, a check would synchronise)."""
    _check_shapes_symbolic(q, k, v, decay, initial_state)
    _check_options(q, k, v, decay, initial_state)
    return _forward_kernels(q, k, v, decay, initial_state, scale, output_final_state, None,
                            _keeps_states(q, cu_seqlens, save_states), wrap=wrap_triton)


def _lightning_attn_fake(q, k, v, decay, initial_state, scale, output_final_state, cu_seqlens=None,
                         save_states=False):
    _check_shapes_symbolic(q, k, v, decay, initial_state, cu_seqlens=cu_seqlens)
    _check_options(q, k, v, decay, initial_state)
    batch, time, heads, key_dim = q.shape
    value_dim = v.shape[3]
    o = v.new_empty((batch, time, heads, value_dim))
    state_shape = (num_states(q, cu_seqlens), heads, key_dim, value_dim) if output_final_state else (0,)
    kept = (saved_states_rows(q, v), heads, key_dim, value_dim) if _keeps_states(q, cu_seqlens, save_states) \
        else (0,)
    return o, q.new_empty(state_shape, dtype=_state_dtype(q)), q.new_empty(kept, dtype=torch.float32)


# ----------------------------------------------------------------------------------------
# Backward op


def _reference_backward(q, k, v, decay, initial_state, do, dht, scale, cu_seqlens):
    """(dq, dk, dv, dh0 or None) by autograd through lightning_attn_ref (the fallback's backward)."""
    with _autograd_recording():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        h0 = None if initial_state is None else initial_state.detach().requires_grad_()
        o, final_state = lightning_attn_varlen_ref(*leaves, decay.detach(), scale, h0, dht is not None, cu_seqlens)
        outputs, cotangents = [o], [do.to(o.dtype)]
        if dht is not None:
            outputs.append(final_state)
            cotangents.append(dht.to(final_state.dtype))
        inputs = leaves + ([h0] if h0 is not None else [])
        grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
    return (*grads[:3], grads[3] if h0 is not None else None)


def _lightning_attn_backward_host(
    q: Tensor, k: Tensor, v: Tensor, decay: Tensor, initial_state: Tensor | None, do: Tensor,
    dht: Tensor | None, scale: float, cu_seqlens: Tensor | None = None, states: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`states`: the forward op's kept states (its third output; None or zero-size: recomputed). Called
    by the forward's autograd (call_backward_op), it skips the checks the forward ran."""
    if not checked_by_forward():
        _check_eager(q, k, v, decay, initial_state, do=do, dht=dht, cu_seqlens=cu_seqlens)
    # Same dispatch rule as the forward op, so the backward differentiates what the forward ran.
    if _uses_triton(q):
        grads = _kernel_backward(q, k, v, decay, initial_state, do, dht, scale, states, cu_seqlens=cu_seqlens,
                                 checked=True)
    else:
        grads = _reference_backward(q, k, v, decay, initial_state, do, dht, scale, cu_seqlens)
    return _backward_outputs(q, k, v, initial_state, grads)


def _kernel_backward(q, k, v, decay, initial_state, do, dht, scale, states=None, cu_seqlens=None, **launch):
    kept = None
    if states is not None and states.numel() > 0 and cu_seqlens is None:
        kept = saved_states(q, v, states)
    return lightning_attn_bwd(q, k, v, decay.float().contiguous(), do.to(v.dtype), scale, initial_state,
                              None if dht is None else dht.to(torch.float32), cu_seqlens=cu_seqlens, states=kept,
                              **launch)


def _backward_outputs(q, k, v, initial_state, grads) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dh0 = grads
    grads = tuple(g.to(x.dtype).contiguous() for g, x in zip((dq, dk, dv), (q, k, v)))
    if initial_state is None:
        return (*grads, _absent(q))
    return (*grads, dh0.to(initial_state.dtype).contiguous())


def _lightning_attn_backward_traced(q, k, v, decay, initial_state, do, dht, scale, cu_seqlens=None, states=None):
    """The backward op on CUDA for fixed-length rows, traced into its launches."""
    _check_shapes_symbolic(q, k, v, decay, initial_state, do=do, dht=dht)
    _check_options(q, k, v, decay, initial_state, do=do, dht=dht)
    grads = _kernel_backward(q, k, v, decay, initial_state, do, dht, scale, states, wrap=wrap_triton)
    return _backward_outputs(q, k, v, initial_state, grads)


def _lightning_attn_backward_fake(q, k, v, decay, initial_state, do, dht, scale, cu_seqlens=None, states=None):
    _check_shapes_symbolic(q, k, v, decay, initial_state, do=do, dht=dht, cu_seqlens=cu_seqlens)
    _check_options(q, k, v, decay, initial_state, do=do, dht=dht)
    return tuple(_absent(q) if t is None else t.new_empty(t.shape) for t in (q, k, v, initial_state))


# ----------------------------------------------------------------------------------------
# The ops: traced into their launches on CUDA (lowering/_launch.py), host ops elsewhere


def _traceable(cu_seqlens=None, **_) -> bool:
    """Traced on CUDA for fixed-length rows; a varlen batch's segment tables are built from
    cu_seqlens' values, and checking the decay's values (HCCOMPILE_CHECK_GATES=1) reads them, so
    those calls stay host ops (hccompile::lightning_attn_host)."""
    return cu_seqlens is None and not checks_on_gpu()


lightning_attn_op = kernel_op("lightning_attn", _lightning_attn_host, _lightning_attn_fake,
                              _lightning_attn_traced, SUPPORTED_DTYPES, kernels=(_forward_sweep_kernel,),
                              traceable=_traceable, fixed_dims={"q": HEADS, "v": HEADS})
# counted by its one dq sweep per call; dk and dv come from two reverse sweeps, or one paired sweep
# (kernels/lightning/sweeps.py, PAIRED_REVERSE)
lightning_attn_backward_op = kernel_op("lightning_attn_backward", _lightning_attn_backward_host,
                                       _lightning_attn_backward_fake, _lightning_attn_backward_traced,
                                       SUPPORTED_DTYPES, kernels=(_forward_sweep_bwd_kernel, _reverse_sweep_kernel,
                                                                  _reverse_pair_sweep_kernel),
                                       per_call=1, traceable=_traceable,
                                       fixed_dims={"q": HEADS, "v": HEADS})


# ----------------------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, decay, initial_state, scale, output_final_state, cu_seqlens, save_states = inputs
    # The backward recomputes what it needs from the inputs and the kept states (if the forward kept them).
    states = output[2] if save_states else None
    # The kept states are an intermediate, not a result; unused outputs (always the states, often the
    # final state) get None, not a zero tensor each (an fp32 [segments, H, K, V] fill per backward otherwise).
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, decay, initial_state, cu_seqlens, states)
    ctx.scale = scale
    ctx.output_final_state = output_final_state


def _backward(ctx, do: Tensor | None, dfinal_state: Tensor | None, dstates: Tensor | None = None):
    q, k, v, decay, initial_state, cu_seqlens, states = ctx.saved_tensors
    if do is None:
        do = torch.zeros(q.shape[:3] + v.shape[3:], dtype=v.dtype, device=v.device)
    # Without output_final_state the second output is the zero-size placeholder: no gradient flows.
    dht = dfinal_state.contiguous() if ctx.output_final_state and dfinal_state is not None else None
    # The kept states are the forward's intermediates, not a result: a gradient reaching them is ignored.
    dq, dk, dv, dh0 = call_backward_op(lightning_attn_backward_op, q, k, v, decay, initial_state, do.contiguous(),
                                       dht, ctx.scale, cu_seqlens, states)
    # Order of the op's arguments: the decay (a constant), cu_seqlens and the options get None.
    return dq, dk, dv, None, (None if initial_state is None else dh0), None, None, None, None


register_autograd(lightning_attn_op, _backward, _setup_context)


# ----------------------------------------------------------------------------------------
# Public functions


def alibi_decay(heads: int, *, device: torch.device | str | None = None) -> Tensor:
    """ALiBi-like per-head log-decays, -2**(-8 (h + 1) / H) for h < H (lightning attention's /
    FLA's slopes for a power-of-two H), as a float32 [H] tensor."""
    exponent = -8.0 * torch.arange(1, heads + 1, dtype=torch.float64) / heads
    return (-(2.0 ** exponent)).to(torch.float32).to(device)


def lightning_attn(
    q: Tensor, k: Tensor, v: Tensor, decay: Tensor | None = None, scale: float | None = None,
    initial_state: Tensor | None = None, output_final_state: bool = False, *,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Lightning attention: causal linear attention with a constant per-head log-decay.

    q, k [B, T, H, K]; v [B, T, H, V]; decay [H] log-decays <= 0 on q's device (None: no decay,
    i.e. zeros; it is a constant and gets no gradient); initial_state [N, H, K, V] with N = B, or
    for a variable-length batch (FLA's convention: B = 1, cu_seqlens int [N + 1] of sequence
    starts) the number of sequences. Returns (o [B, T, H, V] in v's dtype, final state
    [N, H, K, V] float32 — float64 for float64 inputs — or None unless output_final_state). `scale` defaults to K**-0.5. Differentiable in q, k, v and
    initial_state; works under torch.compile(fullgraph=True, dynamic=True).
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _require(name, tensor, 4, "[batch, time, heads, head_dim]")
    if decay is None:
        decay = torch.zeros(q.shape[2], dtype=torch.float32, device=q.device)
    # The inputs are checked once, inside the op (its host function: everything, the decay's values
    # included where they are read; traced: the trace-safe subset and the kernels' checks; its fake at
    # trace time), so an eager call pays for the checks once.
    if scale is None:
        scale = q.shape[-1] ** -0.5
    o, final_state, _ = call_op(lightning_attn_op, q, k, v, decay, initial_state, float(scale),
                                bool(output_final_state), cu_seqlens, keeps_states(q, k, v, initial_state, cu_seqlens))
    return o, (final_state if output_final_state else None)


def keeps_states(q: Tensor, k: Tensor, v: Tensor, initial_state: Tensor | None, cu_seqlens: Tensor | None) -> bool:
    """Whether the forward op should keep its segments' starting states for the backward (see
    KEEP_STATES): when a gradient will be taken, for fixed-length rows."""
    return (KEEP_STATES and cu_seqlens is None and torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, initial_state)))
