"""mHC hyper-connection kernels as custom ops (what passes/hc_fuse/ lowers to).

    hccompile::mhc_post(Tensor x, Tensor h_res, Tensor h_post, Tensor f, bool transpose_res,
        int[] out_order) -> Tensor
        out[i] = Σ_j A[i, j] x[j] + H_post[i] f, A = H_resᵀ if transpose_res else H_res;
        x [T1, T2, n, C], h_res [T1, T2, n, n], h_post [T1, T2, n], f [T1, T2, C];
        out [T1, T2, n, C] in x's dtype, its memory laid out in out_order (outer to inner).
    hccompile::mhc_post_backward(x, h_res, h_post, f, dout, transpose_res, out_order, with_dx)
        -> (dx, dh_res, dh_post, df); without with_dx, dx is an empty [0] tensor: the compiled
        backward forms dx = Σ_i A[i, j]·dout_i in plain torch, which Inductor folds into the kernel
        summing the stream's gradient contributions (eager calls ask the kernel for it).
    hccompile::mhc_aggregate(Tensor x, Tensor h_pre) -> Tensor
        y = Σ_i H_pre[i] x[i], y [T1, T2, C] contiguous in x's dtype.
    hccompile::mhc_aggregate_backward(x, h_pre, dy) -> dh_pre  (dx = H_pre ⊗ dy: plain torch)
    hccompile::mhc_project(Tensor v, Tensor w) -> (Tensor proj, Tensor sq)
        proj = v·wᵀ, sq = Σ_k v² from one read of v [T1, T2, K] (the flattened stream), w [W, K]
        (F.linear's weight); proj [T1, T2, W] in v's dtype, sq [T1, T2] float32 (float64 for float64).
        A W past the kernels' (kernels/mhc/project.py: 128 for 16-bit v, 32 for float32) computes
        with the reference.
    hccompile::mhc_project_backward(v, w, dproj, dsq) -> (dv, dw)
    hccompile::mhc_mapping(Tensor proj, Tensor r, Tensor alpha_pre, Tensor alpha_post,
        Tensor alpha_res, Tensor bias_pre, Tensor bias_post, Tensor bias_res, int n, int[] offsets,
        float[] coefs, bool r_divides, float[] pre_affine, float[] post_affine, str init,
        float init_eps, int steps, bool row_first, float norm_eps, ScalarType pre_dtype,
        ScalarType post_dtype, ScalarType res_dtype) -> (Tensor h_pre, Tensor h_post, Tensor h_res)
        The formulas: kernels/mhc/reference.py (the scalars are a MappingSpec's fields).
    hccompile::mhc_mapping_backward(proj, r, α×3, bias×3, dh_pre, dh_post, dh_res, <the same
        scalars, without the dtypes>) -> (dproj, dr, dα_pre, dα_post, dα_res, dbias_pre,
        dbias_post, dbias_res)

One op per direction, so AOTAutograd puts the forward op in the forward graph (where the recompute
pass can tag it) and the backward op in the backward graph. Each op is a triton_op
(lowering/_launch.py): on CUDA, for float16/bfloat16/float32, it launches the Triton kernels of
kernels/mhc through wrap_triton, so a compiled graph holds the launches and Inductor's code makes
them; elsewhere it calls its `_host` twin (hccompile::mhc_post_host, ...), a custom op that runs
the kernels in Triton's interpreter (CPU, TRITON_INTERPRET=1) or the plain-PyTorch reference (CPU
without the interpreter, or float64), computed in at least float32 (the mapping's backward by
autograd through it): same math, documented fallback.
Every output's layout is fixed by the arguments (never by the input strides), so fake and real
outputs always agree.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import Tensor

from ..compat import autograd_recording as _autograd_recording
from ..compat import plain_eager
from ._launch import HEADS, call_op, kernel_op, references_only, register_autograd, wrap_triton
from ..kernels.mhc import _common as common
from ..kernels.mhc import aggregate as K_agg
from ..kernels.mhc import mapping as K_map
from ..kernels.mhc import post as K_post
from ..kernels.mhc import project as K_proj
from ..kernels.mhc import reference as R
from ..kernels.mhc.reference import MappingSpec

__all__ = ["implementation", "mhc_aggregate", "mhc_mapping", "mhc_post", "mhc_project", "mhc_aggregate_op",
           "mhc_aggregate_backward_op", "mhc_mapping_op", "mhc_mapping_backward_op", "mhc_post_op",
           "mhc_post_backward_op", "mhc_project_op", "mhc_project_backward_op", "spec_args"]

IDENTITY_ORDER = (0, 1, 2, 3)


def _uses_triton(t: Tensor) -> bool:
    return t.dtype in common.SUPPORTED_DTYPES and not references_only() and common.triton_available(t.device)


def _require(t: Tensor, kernel, module: str) -> None:
    """The interpreter's clear error (TRITON_INTERPRET set after import) on CPU; nothing to check
    on CUDA, where _uses_triton already said yes."""
    if t.device.type != "cuda":
        common.require(t.device, kernel, module)


def implementation(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Which implementation backs the ops: 'triton', 'triton-interpreter' or 'reference' (always
    inside _launch.references())."""
    device = torch.device(device)
    if dtype in common.SUPPORTED_DTYPES and not references_only() and common.triton_available(device):
        return "triton" if device.type == "cuda" else "triton-interpreter"
    return "reference"


def _kernels(module, *names) -> tuple:
    """The named kernels of a kernel module (None where Triton is absent)."""
    return tuple(getattr(module, n, None) for n in names)


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _alloc(shape, dtype, device, order=None) -> Tensor:
    """Fake-side twin of kernels.mhc._common.new_output (same layout rule, never poisoned)."""
    if order is None:
        return torch.empty(shape, dtype=dtype, device=device)
    order = list(order)
    return torch.empty([shape[d] for d in order], dtype=dtype, device=device).permute(
        *[order.index(d) for d in range(len(shape))])


def _into(value: Tensor, shape, dtype, device, order=None) -> Tensor:
    """Copy a reference result into an output of the ops' fixed layout."""
    out = common.new_output(tuple(shape), dtype, device, order)
    out.copy_(value)
    return out


# ----------------------------------------------------------------------------------------
# post


def _mhc_post_host(x: Tensor, h_res: Tensor, h_post: Tensor, f: Tensor, transpose_res: bool,
                out_order: Sequence[int]) -> Tensor:
    K_post.check_post_inputs(x, h_res, h_post, f)
    order = common.check_order(out_order, 4)
    if _uses_triton(x):
        _require(x, K_post._mhc_post_fwd_kernel, K_post.__name__)
        return K_post.launch_post_fwd(x, h_res, h_post, f, transpose_res, order)
    ct = _compute_dtype(x)
    out = R.mhc_post_ref(x.to(ct), h_res.to(ct), h_post.to(ct), f.to(ct), transpose_res)
    return _into(out, x.shape, x.dtype, x.device, order)


def _mhc_post_fake(x, h_res, h_post, f, transpose_res, out_order):
    K_post.check_post_inputs(x, h_res, h_post, f)
    return _alloc(x.shape, x.dtype, x.device, common.check_order(out_order, 4))


def _mhc_post_backward_host(x: Tensor, h_res: Tensor, h_post: Tensor, f: Tensor, dout: Tensor,
                         transpose_res: bool, out_order: Sequence[int], with_dx: bool
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    K_post.check_post_inputs(x, h_res, h_post, f, dout)
    order = common.check_order(out_order, 4)
    if _uses_triton(x):
        _require(x, K_post._mhc_post_bwd_kernel, K_post.__name__)
        return K_post.launch_post_bwd(x, h_res, h_post, f, dout, transpose_res, order, with_dx=with_dx)
    ct = _compute_dtype(x)
    grads = R.mhc_post_bwd_ref(*(t.to(ct) for t in (x, h_res, h_post, f, dout)), transpose_res)
    dx = _into(grads[0], x.shape, x.dtype, x.device, order) if with_dx else _no_dx(x)
    return (dx, *(_into(g, t.shape, t.dtype, t.device) for g, t in zip(grads[1:], (h_res, h_post, f))))


def _no_dx(x: Tensor) -> Tensor:
    return _alloc((0,), x.dtype, x.device)


def _mhc_post_backward_fake(x, h_res, h_post, f, dout, transpose_res, out_order, with_dx):
    K_post.check_post_inputs(x, h_res, h_post, f, dout)
    order = common.check_order(out_order, 4)
    dx = _alloc(x.shape, x.dtype, x.device, order) if with_dx else _no_dx(x)
    return (dx, _alloc(h_res.shape, h_res.dtype, x.device),
            _alloc(h_post.shape, h_post.dtype, x.device), _alloc(f.shape, f.dtype, x.device))


def _mhc_post_traced(x, h_res, h_post, f, transpose_res, out_order):
    K_post.check_post_inputs(x, h_res, h_post, f)
    return K_post.launch_post_fwd(x, h_res, h_post, f, transpose_res, common.check_order(out_order, 4),
                                  wrap=wrap_triton)


def _mhc_post_backward_traced(x, h_res, h_post, f, dout, transpose_res, out_order, with_dx):
    K_post.check_post_inputs(x, h_res, h_post, f, dout)
    return K_post.launch_post_bwd(x, h_res, h_post, f, dout, transpose_res,
                                  common.check_order(out_order, 4), wrap=wrap_triton, with_dx=with_dx)


# x [T1, T2, n, C]: the stream count and channels, fixed like a head count and head dim (fix_sizes)
_STREAMS_AND_CHANNELS = {"x": HEADS}
mhc_post_op = kernel_op("mhc_post", _mhc_post_host, _mhc_post_fake, _mhc_post_traced,
                        common.SUPPORTED_DTYPES, _kernels(K_post, "_mhc_post_fwd_kernel"),
                        fixed_dims=_STREAMS_AND_CHANNELS)
mhc_post_backward_op = kernel_op("mhc_post_backward", _mhc_post_backward_host, _mhc_post_backward_fake,
                                 _mhc_post_backward_traced, common.SUPPORTED_DTYPES,
                                 _kernels(K_post, "_mhc_post_bwd_kernel", "_mhc_post_bwd_sums_kernel"),
                                 fixed_dims=_STREAMS_AND_CHANNELS)


def _post_setup(ctx, inputs, output) -> None:
    x, h_res, h_post, f, transpose_res, out_order = inputs
    ctx.save_for_backward(x, h_res, h_post, f)
    ctx.transpose_res, ctx.out_order = transpose_res, list(out_order)


def _post_backward(ctx, dout: Tensor):
    x, h_res, h_post, f = ctx.saved_tensors
    # Traced (torch.compile), dx = Σ_i A[i, j]·dout_i stays plain torch: Inductor folds it (the sum
    # over n unrolled) into the kernel summing the stream's gradient contributions, so the kernel
    # does not write an n·C-sized dx for that kernel to read back. Eager, the kernel writes it.
    with_dx = plain_eager()
    dx, dh_res, dh_post, df = call_op(mhc_post_backward_op, x, h_res, h_post, f, dout, ctx.transpose_res,
                                      ctx.out_order, with_dx)
    if not with_dx:
        a = h_res.transpose(-1, -2) if ctx.transpose_res else h_res
        # float32 products summed, rounded once, as the kernel does
        dx = (a.float().unsqueeze(-1) * dout.float().unsqueeze(-2)).sum(-3).to(x.dtype)
    return dx, dh_res, dh_post, df, None, None


register_autograd(mhc_post_op, _post_backward, _post_setup)


def mhc_post(x: Tensor, h_res: Tensor, h_post: Tensor, f: Tensor, transpose_res: bool = False,
             out_order: Sequence[int] | None = None) -> Tensor:
    """x_next[i] = Σ_j A[i, j] x[j] + H_post[i] f (A = H_res, or H_resᵀ); differentiable."""
    return call_op(mhc_post_op, x, h_res, h_post, f, bool(transpose_res),
                   list(out_order if out_order is not None else IDENTITY_ORDER))


# ----------------------------------------------------------------------------------------
# aggregate


def _mhc_aggregate_host(x: Tensor, h_pre: Tensor) -> Tensor:
    K_agg.check_aggregate_inputs(x, h_pre)
    if _uses_triton(x):
        _require(x, K_agg._mhc_aggregate_fwd_kernel, K_agg.__name__)
        return K_agg.launch_aggregate_fwd(x, h_pre)
    ct = _compute_dtype(x)
    T1, T2, _, C = x.shape
    return _into(R.mhc_aggregate_ref(x.to(ct), h_pre.to(ct)), (T1, T2, C), x.dtype, x.device)


def _mhc_aggregate_fake(x, h_pre):
    K_agg.check_aggregate_inputs(x, h_pre)
    T1, T2, _, C = x.shape
    return _alloc((T1, T2, C), x.dtype, x.device)


def _mhc_aggregate_backward_host(x: Tensor, h_pre: Tensor, dy: Tensor) -> Tensor:
    K_agg.check_aggregate_inputs(x, h_pre, dy)
    if _uses_triton(x):
        _require(x, K_agg._mhc_aggregate_bwd_kernel, K_agg.__name__)
        return K_agg.launch_aggregate_bwd(x, h_pre, dy)
    ct = _compute_dtype(x)
    _, dh = R.mhc_aggregate_bwd_ref(x.to(ct), h_pre.to(ct), dy.to(ct))
    return _into(dh, h_pre.shape, h_pre.dtype, x.device)


def _mhc_aggregate_backward_fake(x, h_pre, dy):
    K_agg.check_aggregate_inputs(x, h_pre, dy)
    return _alloc(h_pre.shape, h_pre.dtype, x.device)


def _mhc_aggregate_traced(x, h_pre):
    K_agg.check_aggregate_inputs(x, h_pre)
    return K_agg.launch_aggregate_fwd(x, h_pre, wrap=wrap_triton)


def _mhc_aggregate_backward_traced(x, h_pre, dy):
    K_agg.check_aggregate_inputs(x, h_pre, dy)
    return K_agg.launch_aggregate_bwd(x, h_pre, dy, wrap=wrap_triton)


mhc_aggregate_op = kernel_op("mhc_aggregate", _mhc_aggregate_host, _mhc_aggregate_fake,
                             _mhc_aggregate_traced, common.SUPPORTED_DTYPES,
                             _kernels(K_agg, "_mhc_aggregate_fwd_kernel"), fixed_dims=_STREAMS_AND_CHANNELS)
mhc_aggregate_backward_op = kernel_op("mhc_aggregate_backward", _mhc_aggregate_backward_host,
                                      _mhc_aggregate_backward_fake, _mhc_aggregate_backward_traced,
                                      common.SUPPORTED_DTYPES, _kernels(K_agg, "_mhc_aggregate_bwd_kernel"),
                                      fixed_dims=_STREAMS_AND_CHANNELS)


def _aggregate_setup(ctx, inputs, output) -> None:
    x, h_pre = inputs
    ctx.save_for_backward(x, h_pre)


def _aggregate_backward(ctx, dy: Tensor):
    x, h_pre = ctx.saved_tensors
    dh = call_op(mhc_aggregate_backward_op, x, h_pre, dy)
    # dx = H_pre ⊗ dy, a broadcast product (one rounding of the float32 product, as the kernels
    # round): compiled, Inductor folds it into the kernel that sums the stream's gradient
    # contributions, so no n·C-sized dx is written here and read back there
    dx = h_pre.unsqueeze(-1) * dy.unsqueeze(-2)
    return dx.to(x.dtype), dh


register_autograd(mhc_aggregate_op, _aggregate_backward, _aggregate_setup)


def mhc_aggregate(x: Tensor, h_pre: Tensor) -> Tensor:
    """y = Σ_i H_pre[i] x[i]; x [T1, T2, n, C], h_pre [T1, T2, n]; differentiable."""
    return call_op(mhc_aggregate_op, x, h_pre)


# ----------------------------------------------------------------------------------------
# project


def _project_on_kernels(v: Tensor, w: Tensor) -> bool:
    return _uses_triton(v) and K_proj.kernel_width(w.shape[0], v.dtype)


def _mhc_project_host(v: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    K_proj.check_project_inputs(v, w)
    if _project_on_kernels(v, w):
        _require(v, K_proj._mhc_project_fwd_kernel, K_proj.__name__)
        return K_proj.launch_project_fwd(v, w)
    ct = _compute_dtype(v)
    proj, sq = R.mhc_project_ref(v.to(ct), w.to(ct))
    return _into(proj, proj.shape, v.dtype, v.device), _into(sq, sq.shape, K_proj.sq_dtype(v), v.device)


def _mhc_project_fake(v, w):
    K_proj.check_project_inputs(v, w)
    T1, T2, _ = v.shape
    return _alloc((T1, T2, w.shape[0]), v.dtype, v.device), _alloc((T1, T2), K_proj.sq_dtype(v), v.device)


def _mhc_project_backward_host(v: Tensor, w: Tensor, dproj: Tensor, dsq: Tensor) -> tuple[Tensor, Tensor]:
    K_proj.check_project_inputs(v, w, dproj, dsq)
    if _project_on_kernels(v, w):
        _require(v, K_proj._mhc_project_bwd_kernel, K_proj.__name__)
        return K_proj.launch_project_bwd(v, w, dproj, dsq)
    ct = _compute_dtype(v)
    dv, dw = R.mhc_project_bwd_ref(v.to(ct), w.to(ct), dproj.to(ct), dsq.to(ct))
    return _into(dv, v.shape, v.dtype, v.device), _into(dw, w.shape, w.dtype, v.device)


def _mhc_project_backward_fake(v, w, dproj, dsq):
    K_proj.check_project_inputs(v, w, dproj, dsq)
    return _alloc(v.shape, v.dtype, v.device), _alloc(w.shape, w.dtype, v.device)


def _mhc_project_traced(v, w):
    K_proj.check_project_inputs(v, w)
    return K_proj.launch_project_fwd(v, w, wrap=wrap_triton)


def _mhc_project_backward_traced(v, w, dproj, dsq):
    K_proj.check_project_inputs(v, w, dproj, dsq)
    return K_proj.launch_project_bwd(v, w, dproj, dsq, wrap=wrap_triton)


def _project_traceable(v, w, **_) -> bool:
    return K_proj.kernel_width(w.shape[0], v.dtype)


# v [T1, T2, K]: the stream's width n·C, fixed like a head dim (fix_sizes)
_STREAM_WIDTH = {"v": (2,)}
mhc_project_op = kernel_op("mhc_project", _mhc_project_host, _mhc_project_fake, _mhc_project_traced,
                           common.SUPPORTED_DTYPES, _kernels(K_proj, "_mhc_project_fwd_kernel"),
                           traceable=_project_traceable, fixed_dims=_STREAM_WIDTH)
mhc_project_backward_op = kernel_op("mhc_project_backward", _mhc_project_backward_host,
                                    _mhc_project_backward_fake, _mhc_project_backward_traced,
                                    common.SUPPORTED_DTYPES, _kernels(K_proj, "_mhc_project_bwd_kernel"),
                                    traceable=_project_traceable, fixed_dims=_STREAM_WIDTH)


def _project_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _project_backward(ctx, dproj: Tensor, dsq: Tensor):
    v, w = ctx.saved_tensors
    return call_op(mhc_project_backward_op, v, w, dproj, dsq)


register_autograd(mhc_project_op, _project_backward, _project_setup)


def mhc_project(v: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(proj, sq) = (v·wᵀ, Σ_k v²) for v [T1, T2, K], w [W, K], from one read of v; differentiable."""
    return call_op(mhc_project_op, v, w)


# ----------------------------------------------------------------------------------------
# mapping


def spec_args(spec: MappingSpec) -> tuple:
    """The ops' scalar arguments for `spec`, in schema order (without the output dtypes)."""
    return (spec.n, list(spec.part_offsets()), [float(c) for c in spec.coefs], bool(spec.r_divides),
            [float(v) for v in spec.pre_affine], [float(v) for v in spec.post_affine], spec.init,
            float(spec.init_eps), int(spec.steps), bool(spec.row_first), float(spec.norm_eps))


def _spec(n, offsets, coefs, r_divides, pre_affine, post_affine, init, init_eps, steps, row_first,
          norm_eps) -> MappingSpec:
    """The MappingSpec of the ops' scalar arguments, built and validated once per distinct set
    (every call of an op in a model passes the same ones)."""
    return _cached_spec(n, tuple(offsets), tuple(coefs), r_divides, tuple(pre_affine),
                        tuple(post_affine), init, init_eps, steps, row_first, norm_eps)


@functools.lru_cache(maxsize=256)
def _cached_spec(n, offsets, coefs, r_divides, pre_affine, post_affine, init, init_eps, steps,
                 row_first, norm_eps) -> MappingSpec:
    spec = MappingSpec(n=n, offsets=offsets, coefs=coefs, r_divides=r_divides,
                       pre_affine=pre_affine, post_affine=post_affine, init=init,
                       init_eps=init_eps, steps=steps, row_first=row_first, norm_eps=norm_eps)
    if len(spec.coefs) != 3 or len(spec.pre_affine) != 2 or len(spec.post_affine) != 2 or \
            len(spec.offsets) != 3:
        raise ValueError("offsets and coefs take 3 values, pre_affine and post_affine 2")
    spec.validate()
    return spec


def _reference_mapping(proj, r, alphas, biases, spec):
    ct = _compute_dtype(proj)
    return R.mhc_mapping_ref(proj.to(ct), r.to(ct), tuple(a.to(ct) for a in alphas),
                             tuple(b.to(ct) for b in biases), spec)


def _mhc_mapping_host(proj: Tensor, r: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                   alpha_res: Tensor, bias_pre: Tensor, bias_post: Tensor, bias_res: Tensor, n: int,
                   offsets: Sequence[int], coefs: Sequence[float], r_divides: bool,
                   pre_affine: Sequence[float], post_affine: Sequence[float], init: str,
                   init_eps: float, steps: int, row_first: bool, norm_eps: float,
                   pre_dtype: torch.dtype, post_dtype: torch.dtype, res_dtype: torch.dtype
                   ) -> tuple[Tensor, Tensor, Tensor]:
    spec = _spec(n, offsets, coefs, r_divides, pre_affine, post_affine, init, init_eps, steps,
                 row_first, norm_eps)
    alphas, biases = (alpha_pre, alpha_post, alpha_res), (bias_pre, bias_post, bias_res)
    K_map.check_mapping_inputs(proj, r, alphas, biases, spec, validate_spec=False)
    dtypes = (pre_dtype, post_dtype, res_dtype)
    if _uses_triton(proj):
        _require(proj, K_map._mhc_mapping_fwd_kernel, K_map.__name__)
        return K_map.launch_mapping_fwd(proj, r, alphas, biases, spec, dtypes)
    outs = _reference_mapping(proj, r, alphas, biases, spec)
    return tuple(_into(o, o.shape, dt, proj.device) for o, dt in zip(outs, dtypes))


def _mhc_mapping_fake(proj, r, alpha_pre, alpha_post, alpha_res, bias_pre, bias_post, bias_res, n,
                      offsets, coefs, r_divides, pre_affine, post_affine, init, init_eps, steps,
                      row_first, norm_eps, pre_dtype, post_dtype, res_dtype):
    spec = _spec(n, offsets, coefs, r_divides, pre_affine, post_affine, init, init_eps, steps,
                 row_first, norm_eps)
    K_map.check_mapping_inputs(proj, r, (alpha_pre, alpha_post, alpha_res),
                               (bias_pre, bias_post, bias_res), spec)
    lead = tuple(proj.shape[:-1])
    return (_alloc(lead + (n,), pre_dtype, proj.device), _alloc(lead + (n,), post_dtype, proj.device),
            _alloc(lead + (n, n), res_dtype, proj.device))


def _mhc_mapping_backward_host(proj: Tensor, r: Tensor, alpha_pre: Tensor, alpha_post: Tensor,
                            alpha_res: Tensor, bias_pre: Tensor, bias_post: Tensor, bias_res: Tensor,
                            dh_pre: Tensor, dh_post: Tensor, dh_res: Tensor, n: int,
                            offsets: Sequence[int], coefs: Sequence[float], r_divides: bool,
                            pre_affine: Sequence[float], post_affine: Sequence[float], init: str,
                            init_eps: float, steps: int, row_first: bool, norm_eps: float
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    spec = _spec(n, offsets, coefs, r_divides, pre_affine, post_affine, init, init_eps, steps,
                 row_first, norm_eps)
    alphas, biases = (alpha_pre, alpha_post, alpha_res), (bias_pre, bias_post, bias_res)
    grads = (dh_pre, dh_post, dh_res)
    K_map.check_mapping_inputs(proj, r, alphas, biases, spec, grads, validate_spec=False)
    if _uses_triton(proj):
        _require(proj, K_map._mhc_mapping_bwd_kernel, K_map.__name__)
        dproj, dr, dalphas, dbiases = K_map.launch_mapping_bwd(proj, r, alphas, biases, *grads, spec)
        return (dproj, dr, *dalphas, *dbiases)
    inputs = (proj, r, *alphas, *biases)
    with _autograd_recording():
        leaves = [t.detach().to(_compute_dtype(proj)).requires_grad_() for t in inputs]
        outs = R.mhc_mapping_ref(leaves[0], leaves[1], tuple(leaves[2:5]), tuple(leaves[5:8]), spec)
        got = torch.autograd.grad(outs, leaves, [g.to(o.dtype) for g, o in zip(grads, outs)],
                                  allow_unused=True)
    return tuple(_into(torch.zeros_like(leaf) if g is None else g, t.shape, t.dtype, t.device)
                 for g, leaf, t in zip(got, leaves, inputs))


def _mhc_mapping_backward_fake(proj, r, alpha_pre, alpha_post, alpha_res, bias_pre, bias_post,
                               bias_res, dh_pre, dh_post, dh_res, n, offsets, coefs, r_divides,
                               pre_affine, post_affine, init, init_eps, steps, row_first, norm_eps):
    spec = _spec(n, offsets, coefs, r_divides, pre_affine, post_affine, init, init_eps, steps,
                 row_first, norm_eps)
    inputs = (proj, r, alpha_pre, alpha_post, alpha_res, bias_pre, bias_post, bias_res)
    K_map.check_mapping_inputs(proj, r, inputs[2:5], inputs[5:8], spec, (dh_pre, dh_post, dh_res))
    return tuple(_alloc(t.shape, t.dtype, t.device) for t in inputs)


_MAPPING_TENSORS = 8


def _mhc_mapping_traced(proj, r, *rest):
    tensors, scalars, dtypes = (proj, r, *rest[:6]), rest[6:17], rest[17:]
    spec = _spec(*scalars)
    alphas, biases = tensors[2:5], tensors[5:8]
    K_map.check_mapping_inputs(proj, r, alphas, biases, spec, validate_spec=False)
    return K_map.launch_mapping_fwd(proj, r, alphas, biases, spec, dtypes, wrap=wrap_triton)


def _mhc_mapping_backward_traced(proj, r, *rest):
    tensors, grads, scalars = (proj, r, *rest[:6]), rest[6:9], rest[9:]
    spec = _spec(*scalars)
    alphas, biases = tensors[2:5], tensors[5:8]
    K_map.check_mapping_inputs(proj, r, alphas, biases, spec, grads, validate_spec=False)
    dproj, dr, dalphas, dbiases = K_map.launch_mapping_bwd(proj, r, alphas, biases, *grads, spec,
                                                           wrap=wrap_triton)
    return (dproj, dr, *dalphas, *dbiases)


mhc_mapping_op = kernel_op("mhc_mapping", _mhc_mapping_host, _mhc_mapping_fake, _mhc_mapping_traced,
                           common.SUPPORTED_DTYPES, _kernels(K_map, "_mhc_mapping_fwd_kernel"))
mhc_mapping_backward_op = kernel_op("mhc_mapping_backward", _mhc_mapping_backward_host,
                                    _mhc_mapping_backward_fake, _mhc_mapping_backward_traced,
                                    common.SUPPORTED_DTYPES,
                                    _kernels(K_map, "_mhc_mapping_bwd_kernel",
                                             "_mhc_mapping_param_grads_kernel"))


def _mapping_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:_MAPPING_TENSORS])
    ctx.spec_args = tuple(inputs[_MAPPING_TENSORS:_MAPPING_TENSORS + 11])
    ctx.num_scalars = len(inputs) - _MAPPING_TENSORS


def _mapping_backward(ctx, dh_pre, dh_post, dh_res):
    saved = ctx.saved_tensors
    proj = saved[0]
    lead = tuple(proj.shape[:-1])
    n = ctx.spec_args[0]
    # an unused output gets no gradient; the op needs a tensor
    dh_pre = dh_pre if dh_pre is not None else proj.new_zeros(lead + (n,))
    dh_post = dh_post if dh_post is not None else proj.new_zeros(lead + (n,))
    dh_res = dh_res if dh_res is not None else proj.new_zeros(lead + (n, n))
    grads = call_op(mhc_mapping_backward_op, *saved, dh_pre, dh_post, dh_res, *ctx.spec_args)
    return (*grads, *([None] * ctx.num_scalars))


register_autograd(mhc_mapping_op, _mapping_backward, _mapping_setup)


def mhc_mapping(proj: Tensor, r: Tensor, alphas: Sequence[Tensor], biases: Sequence[Tensor],
                spec: MappingSpec, out_dtypes: Sequence[torch.dtype] | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(H_pre, H_post, H_res) from the projection [..., n²+2n] and the norm r; differentiable in
    proj, r, the α (one element each) and the biases ([n], [n], [n²])."""
    spec.validate()
    dtypes = tuple(out_dtypes) if out_dtypes is not None else (proj.dtype,) * 3
    return call_op(mhc_mapping_op, proj, r, *alphas, *biases, *spec_args(spec), *dtypes)
