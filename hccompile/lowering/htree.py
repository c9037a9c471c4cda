"""htree hierarchical sparse attention (seed 003) as custom ops.

Layout is FLA's: q [B, T, H, K], k [B, T, H_kv, K], v [B, T, H_kv, V], H a multiple of H_kv
(query head h uses KV head h // (H / H_kv)); output [B, T, H, V]. Semantics, options and the
decisions on the points the seed leaves open are those of hccompile/kernels/htree/reference.py
(docs/htree.md). One op per direction, so AOTAutograd puts the forward op in the forward graph
and the backward op in the backward graph (both triton_ops: compiled on CUDA, they are traced
into their kernel launches, lowering/_launch.py, one graph for every length, see below):

    hccompile::htree_attention(Tensor q, Tensor k, Tensor v, int compression_rate, int top_k,
        int max_top_nodes, float scale, float rope_base, bool causal, str sort_mode,
        bool save_selections=False) -> (Tensor o, Tensor lse, Tensor selections)
    hccompile::htree_attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
        Tensor do, Tensor? dlse, int compression_rate, int top_k, int max_top_nodes, float scale,
        float rope_base, bool causal, str sort_mode, Tensor? selections=None) -> (Tensor dq, Tensor dk, Tensor dv)

selections: with save_selections, on the kernels' path, the forward's selected nodes [S, B, T, H_kv,
top_k] int32 (kernels/htree/forward.py; S = the tree's depth L, at least 2: tiles.selection_slots),
which the backward then reads instead of selecting again; otherwise an empty int32 tensor.
htree_attention saves them when the node-stationary backward is on
(kernels/htree/tiles.NODE_GRADIENTS) and a gradient is wanted.

o has v's dtype; lse [B, T, H] is the log of each output row's softmax normaliser, float32
(float64 for float64 inputs); it is differentiable too (a gradient into it shifts the softmax
gradient). The selection of nodes is a constant for autograd, as in the seed.

On CUDA, and on CPU under TRITON_INTERPRET=1, the ops run the Triton kernels
(kernels/htree/forward.py, backward.py) for float16, bfloat16 and float32 inputs; otherwise (CPU
without the interpreter, or float64) the vectorised PyTorch reference, with the backward by
autograd through it: same math, documented fallback. On CUDA the op bodies launch the kernels
through wrap_triton; everywhere else they call the host twins (hccompile::htree_attention_host,
hccompile::htree_attention_backward_host). The tree's depth depends on T: a call traced with a
symbolic T plans for every length (kernels/htree/tiles.make_plan: the deepest tree's layers, the
kernels reading the depth from T), so the graph holds no guard on the depth. The kernels score in
the input precision (bfloat16 dots, float32 accumulation) and may decide near-ties of the
importance differently from the float32 reference; the backward always recomputes the forward's
own selection.

Usage::

    import torch
    from hccompile.lowering.htree import htree_attention

    B, T, H, H_kv, D = 1, 300, 4, 2, 32
    q = torch.randn(B, T, H, D, requires_grad=True)
    k, v = (torch.randn(B, T, H_kv, D, requires_grad=True) for _ in range(2))
    o = htree_attention(q, k, v, compression_rate=4, top_k=4)     # max_top_nodes = 16
    o.sum().backward()
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..compat import autograd_recording as _autograd_recording
from ..kernels._triton import triton_available
from ..kernels.htree import tiles as htree_tiles
from ..kernels.htree.backward import _htree_backward_kernel, _unpool_kernel, htree_backward
from ..kernels.htree.forward import _htree_forward_kernel, htree_forward
from ..kernels.htree.node_gradients import _node_gradients_kernel, _selection_bits_kernel
from ..kernels.htree.reference import HTreeConfig, htree_attention_ref, htree_selections, resolve_htree_config
from ..kernels.htree.tiles import (MAX_HEAD_DIM, MAX_SELECT_WIDTH, SUPPORTED_DTYPES, _pool_kernel, max_layers,
                                   selection_slots)
from ._launch import HEADS, call_op, kernel_op, register_autograd, wrap_triton
from ._symbols import symbols_explained

__all__ = [
    "htree_attention",
    "htree_attention_backward_op",
    "htree_attention_op",
    "implementation",
    "saves_selections",
]

DEFAULT_COMPRESSION_RATE = 16
DEFAULT_TOP_K = 64


# ----------------------------------------------------------------------------------------
# Validation


def _config(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode) -> HTreeConfig:
    """The reference's validation (argument names and limits in every message). Reads shapes only,
    so it also runs on fake tensors. Integer options that arrive as symbols (under dynamic=True Dynamo
    makes ints read from a dict or a closure graph inputs) are fixed at their values, a guard: they
    are the model's constants, and the plan and the kernels' widths depend on them."""
    _check_dtype_kinds(q, k, v)
    compression_rate, top_k, max_top_nodes = (int(x) if isinstance(x, torch.SymInt) else x
                                              for x in (compression_rate, top_k, max_top_nodes))
    return resolve_htree_config(q, k, v, compression_rate=compression_rate, top_k=top_k,
                                max_top_nodes=max_top_nodes, scale=scale, rope_base=rope_base, causal=causal,
                                sort_mode=sort_mode)


def _check_dtype_kinds(q, k, v) -> None:
    """A wrong dtype is a TypeError, as for the other ops (the reference's resolve_htree_config,
    shared with the kernels' tests, raises ValueError for everything): checked first."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            continue  # resolve_htree_config names it
        if not tensor.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
        if isinstance(q, torch.Tensor) and tensor.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {tensor.dtype} differs from q's {q.dtype}")


def _check_dtypes(q, k, v, **others) -> None:
    if q.dtype not in SUPPORTED_DTYPES + (torch.float64,):
        raise TypeError(f"q: dtype {q.dtype} is not supported (float16, bfloat16, float32, float64)")
    for name, dim in (("q", q.shape[-1]), ("v", v.shape[-1])):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {dim} exceeds the supported maximum {MAX_HEAD_DIM}")
    for name, tensor in others.items():
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name}: device {tensor.device} differs from q's device {q.device}")


def _check_backward_inputs(q, v, o, lse, do, dlse) -> None:
    batch, time, heads = q.shape[:3]
    out_shape = (batch, time, heads, v.shape[3])
    for name, tensor, shape in (("o", o, out_shape), ("do", do, out_shape), ("lse", lse, (batch, time, heads)),
                                ("dlse", dlse, (batch, time, heads))):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from the expected {tuple(shape)}")
    _check_dtypes(q, q, v, o=o, lse=lse, do=do, dlse=dlse)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------
# Dispatch


def _uses_triton(q: Tensor) -> bool:
    return q.dtype in SUPPORTED_DTYPES and triton_available(q.device)


def implementation(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Which implementation backs the ops for this device and dtype: 'triton', 'triton-interpreter'
    or 'reference'."""
    device = torch.device(device)
    if dtype in SUPPORTED_DTYPES and triton_available(device):
        return "triton" if device.type == "cuda" else "triton-interpreter"
    return "reference"


# ----------------------------------------------------------------------------------------
# Forward op


def _selections_shape(q: Tensor, k: Tensor, cfg: HTreeConfig, save_selections: bool) -> tuple:
    """The forward's selections output: [S, B, T, H_kv, top_k] when saved (S = the tree's depth L, at
    least 2: tiles.selection_slots), else empty; the same on either path (the reference computes its
    own). L depends on T: for a symbolic T it is an expression of T (no guard on the depth's
    thresholds), so one graph serves every length."""
    if not save_selections:
        return (0,)
    batch, time = q.shape[:2]
    return (selection_slots(time, cfg), batch, time, k.shape[2], cfg.top_k)


def _htree_attention_host(
    q: Tensor, k: Tensor, v: Tensor, compression_rate: int, top_k: int, max_top_nodes: int, scale: float,
    rope_base: float, causal: bool, sort_mode: str, save_selections: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    cfg = _config(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode)
    _check_dtypes(q, k, v)
    selections = torch.full(_selections_shape(q, k, cfg, save_selections), -1, dtype=torch.int32, device=q.device)
    if _uses_triton(q):
        o, lse, _ = htree_forward(q, k, v, cfg, record_selections=save_selections,
                                  record_out=selections if save_selections else None)
    else:
        with torch.no_grad():
            o, lse = htree_attention_ref(q, k, v, compression_rate=compression_rate, top_k=top_k,
                                         max_top_nodes=max_top_nodes, scale=scale, rope_base=rope_base,
                                         causal=causal, sort_mode=sort_mode, return_lse=True)
        if save_selections:
            # The reference path's selections are its own, so whichever path the backward takes reads
            # the right ones.
            layers = htree_selections(q.detach(), k.detach(), compression_rate=compression_rate, top_k=top_k,
                                      max_top_nodes=max_top_nodes, scale=scale, rope_base=rope_base, causal=causal,
                                      sort_mode=sort_mode)
            for layer in layers[1:]:
                selections[layer.layer] = layer.selected.to(torch.int32)
    return o.to(v.dtype).contiguous(), lse.to(_lse_dtype(q)).contiguous(), selections


def _htree_attention_traced(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode,
                            save_selections=False):
    """The forward op on CUDA, traced into its launches: the pooling kernel per layer, the forward
    kernel (which writes the selections when saved), for every length at once (tiles.make_plan)."""
    cfg = _config(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode)
    _check_dtypes(q, k, v)
    selections = torch.full(_selections_shape(q, k, cfg, save_selections), -1, dtype=torch.int32, device=q.device)
    o, lse, _ = htree_forward(q, k, v, cfg, record_selections=save_selections,
                              record_out=selections if save_selections else None, wrap=wrap_triton)
    return o, lse, selections


@symbols_explained
def _htree_attention_fake(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode,
                          save_selections=False):
    cfg = _config(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode)
    _check_dtypes(q, k, v)
    batch, time, heads, _ = q.shape
    return (v.new_empty((batch, time, heads, v.shape[3])), q.new_empty((batch, time, heads), dtype=_lse_dtype(q)),
            q.new_empty(_selections_shape(q, k, cfg, save_selections), dtype=torch.int32))


# ----------------------------------------------------------------------------------------
# Backward op


def _reference_backward(q, k, v, do, dlse, options):
    """(dq, dk, dv) by autograd through the reference (the fallback's backward)."""
    with _autograd_recording():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o, lse = htree_attention_ref(*leaves, return_lse=True, **options)
        outputs, cotangents = [o], [do.to(o.dtype)]
        if dlse is not None:
            outputs.append(lse)
            cotangents.append(dlse.to(lse.dtype))
        grads = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def _saved(selections: Tensor | None) -> Tensor | None:
    """The forward's selections, if it saved them (an empty tensor when it did not)."""
    return selections if selections is not None and selections.numel() > 0 else None


def _htree_attention_backward_host(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, dlse: Tensor | None, compression_rate: int,
    top_k: int, max_top_nodes: int, scale: float, rope_base: float, causal: bool, sort_mode: str,
    selections: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    cfg = _config(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode)
    _check_dtypes(q, k, v)
    _check_backward_inputs(q, v, o, lse, do, dlse)
    # Same dispatch rule as the forward op, so the backward differentiates what the forward ran.
    if _uses_triton(q):
        dq, dk, dv, _ = htree_backward(q, k, v, o.to(v.dtype), lse, do.to(v.dtype), cfg, dlse,
                                       selections=_saved(selections))
    else:
        options = dict(compression_rate=compression_rate, top_k=top_k, max_top_nodes=max_top_nodes, scale=scale,
                       rope_base=rope_base, causal=causal, sort_mode=sort_mode)
        dq, dk, dv = _reference_backward(q, k, v, do, dlse, options)
    return tuple(g.to(x.dtype).contiguous() for g, x in zip((dq, dk, dv), (q, k, v)))


def _htree_attention_backward_traced(q, k, v, o, lse, do, dlse, compression_rate, top_k, max_top_nodes, scale,
                                     rope_base, causal, sort_mode, selections=None):
    """The backward op on CUDA, traced into its launches: the pooling kernel per layer, the dq kernel
    and, node-stationary (tiles.NODE_GRADIENTS), the bitmask kernel, torch's sort of the inverted index
    and the node-gradient kernel per layer; then the unpooling kernel for dk and for dv."""
    cfg = _config(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode)
    _check_dtypes(q, k, v)
    _check_backward_inputs(q, v, o, lse, do, dlse)
    dq, dk, dv, _ = htree_backward(q, k, v, o.to(v.dtype), lse, do.to(v.dtype), cfg, dlse,
                                   selections=_saved(selections), wrap=wrap_triton)
    return tuple(g.to(x.dtype).contiguous() for g, x in zip((dq, dk, dv), (q, k, v)))


@symbols_explained
def _htree_attention_backward_fake(q, k, v, o, lse, do, dlse, compression_rate, top_k, max_top_nodes, scale,
                                   rope_base, causal, sort_mode, selections=None):
    _config(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode)
    _check_backward_inputs(q, v, o, lse, do, dlse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------------------
# The ops: traced into their launches on CUDA (lowering/_launch.py), host ops elsewhere


# Layers of the deepest tree a call with a symbolic T is traced for (the defaults plan 5, the seed's
# r 16, top_k 512, max_top_nodes 8192 plan 4). Tracing costs about 8 launches per planned layer, each
# with its own mutation analysis and guards on the layer's size expression: the node-stationary
# backward traced in 5 s at 5 layers, 13 s at 10 and 60 s at 30 (r 2, top_k 2, max_top_nodes 2) on a
# 2-core CPU; at 14 layers (r 4, top_k 4, max_top_nodes 16) its compile ran over 3 minutes on the H200
# host, 2026-11-29. Deeper trees stay host ops.
MAX_TRACED_LAYERS = 6


def _traceable(q=None, compression_rate=None, top_k=None, max_top_nodes=None, **_) -> bool:
    """Traced on CUDA, but for a symbolic T (torch.compile(dynamic=True)) whose widest possible
    selection exceeds the kernels' (a top layer of up to max_top_nodes candidates, or top_k * r per
    lower layer, above tiles.MAX_SELECT_WIDTH), or whose deepest tree has more than MAX_TRACED_LAYERS
    layers: a traced call plans for every length at once, with the widths' bounds as compile-time
    constants and a launch per layer of the deepest tree, so those calls stay host ops
    (hccompile::htree_attention_host), which check the width of the tree they get. Invalid options
    are traced: the body raises the error that names them."""
    if not isinstance(q.shape[1], torch.SymInt):
        return True
    options = (compression_rate, top_k, max_top_nodes)
    if any(isinstance(x, bool) or not isinstance(x, int) for x in options) or compression_rate < 2 or top_k < 1 \
            or max_top_nodes < 1:
        return True
    layers = max_layers(HTreeConfig(compression_rate, top_k, max_top_nodes, 1.0, 1.0, False, "exact"))
    return not ((layers > 1 and max_top_nodes > MAX_SELECT_WIDTH)
                or (layers > 2 and top_k * compression_rate > MAX_SELECT_WIDTH)
                or layers > MAX_TRACED_LAYERS)


# H (H_kv), K and V: see fix_sizes
_FIXED_DIMS = {"q": HEADS, "k": HEADS, "v": HEADS}
htree_attention_op = kernel_op("htree_attention", _htree_attention_host, _htree_attention_fake,
                               _htree_attention_traced, SUPPORTED_DTYPES, kernels=(_htree_forward_kernel, _pool_kernel),
                               traceable=_traceable, fixed_dims=_FIXED_DIMS)
htree_attention_backward_op = kernel_op(
    "htree_attention_backward", _htree_attention_backward_host, _htree_attention_backward_fake,
    _htree_attention_backward_traced, SUPPORTED_DTYPES,
    kernels=(_htree_backward_kernel, _pool_kernel, _selection_bits_kernel, _node_gradients_kernel, _unpool_kernel),
    traceable=_traceable, fixed_dims=_FIXED_DIMS)


# ----------------------------------------------------------------------------------------
# Autograd


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *options = inputs
    o, lse, selections = output
    # The backward recomputes the tree (and the selections, unless the forward saved them) from
    # q, k, v; o and lse are saved.
    ctx.save_for_backward(q, k, v, o, lse, selections)
    ctx.options = options[:7]  # without save_selections
    ctx.mark_non_differentiable(selections)


def _backward(ctx, do: Tensor | None, dlse: Tensor | None, _dselections: Tensor | None = None):
    q, k, v, o, lse, selections = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = call_op(htree_attention_backward_op, q, k, v, o, lse, do.contiguous(),
                                             None if dlse is None else dlse.contiguous(), *ctx.options,
                                             selections if selections.numel() > 0 else None)
    return dq, dk, dv, None, None, None, None, None, None, None, None


register_autograd(htree_attention_op, _backward, _setup_context)


# ----------------------------------------------------------------------------------------
# Public function


def saves_selections(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the forward op should keep its selections for the backward (save_selections): with
    the node-stationary backward (the default, tiles.NODE_GRADIENTS) and when a gradient will be
    taken. The htree pass asks it too, with the graph's example values."""
    return bool(htree_tiles.NODE_GRADIENTS) and torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v))


def htree_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    compression_rate: int = DEFAULT_COMPRESSION_RATE,
    top_k: int = DEFAULT_TOP_K,
    max_top_nodes: int | None = None,
    scale: float | None = None,
    rope_base: float = 10000.0,
    causal: bool = False,
    sort_mode: str = "exact",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """htree attention, FLA layout: q [B, T, H, K], k [B, T, H_kv, K], v [B, T, H_kv, V] -> [B, T, H, V].

    q and k enter without RoPE (the op applies half-split RoPE at candidate-local positions).
    max_top_nodes defaults to top_k * compression_rate; scale to K**-0.5. causal=False is the
    seed's selection; causal=True leaves the rightmost candidate out of the importance's
    log-sum-exp so that outputs at t depend on tokens <= t only. sort_mode: 'exact' (stable sort of
    the importance) or 'packed' (the seed's float32 key with the position in its low bits).
    return_lse: also return lse [B, T, H] (float32; float64 for float64 inputs).
    Differentiable in q, k, v (the selection is a constant); works under
    torch.compile(fullgraph=True).
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot trace every check (math.isfinite on a float it treats as symbolic); the
        # fake implementation runs them all on the traced shapes, and the real op again at run time.
        if max_top_nodes is None and isinstance(top_k, int) and isinstance(compression_rate, int):
            max_top_nodes = top_k * compression_rate
        if scale is None:
            scale = q.shape[-1] ** -0.5
        o, lse, _ = call_op(htree_attention_op, q, k, v, compression_rate, top_k, max_top_nodes, float(scale),
                            float(rope_base), causal, sort_mode, saves_selections(q, k, v))
    else:
        cfg = _config(q, k, v, compression_rate, top_k, max_top_nodes, scale, rope_base, causal, sort_mode)
        _check_dtypes(q, k, v)
        o, lse, _ = call_op(htree_attention_op, q, k, v, cfg.compression_rate, cfg.top_k, cfg.max_top_nodes,
                            cfg.scale, cfg.rope_base, cfg.causal, cfg.sort_mode, saves_selections(q, k, v))
    return (o, lse) if return_lse else o
