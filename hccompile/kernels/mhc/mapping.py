"""The mHC mapping kernel: from the projection p = v·φ (a cuBLAS matmul, outside) and the per-token
norm r to H_pre, H_post and H_res, every step in registers, one program per block of tokens:
α scaling, ρ = 1/r, bias, σ / a·σ + b, the Sinkhorn init (exp or row softmax + ε) and all its
normalisations. Its backward recomputes the forward in registers, keeping only the n divisors of
each normalisation (a [tokens, steps/2, n] register tile per parity), then walks the normalisations
backwards: for m_out = m_in / s (s the row or column sums of m_in, plus ε),

    dL/dm_in = (g - Σ_along g·m_out) / s,      m_in = m_out · s,

so each earlier iterate is rebuilt from the later one instead of being stored. Gradients reach the
projection, r, the three α and the three biases (the last two summed over tokens from per-program
partial sums, no atomics: deterministic).

Formulas and layouts: reference.py (MappingSpec). Outputs are contiguous: h_pre, h_post [..., n],
h_res [..., n, n], in the dtypes asked for.
"""
from __future__ import annotations

import functools

import torch

from . import _common as common
from .._triton import cdiv, next_power_of_2, scratch_rows, tl, triton
from .reference import MappingSpec

MAX_STREAMS = common.MAX_STREAMS
MAX_SINKHORN_STEPS = 256

if triton is not None:

    @triton.jit
    def _normalise(m, ok, norm_eps, ROWS: tl.constexpr):
        """m / (its row (ROWS) or column sums + eps); padded rows/columns divide by 1.
        Returns the result and the divisors [BLOCK_T, BLOCK_N]."""
        if ROWS:
            s = tl.where(ok, tl.sum(m, axis=2) + norm_eps, 1.0)
            out = m / s[:, :, None]
        else:
            s = tl.where(ok, tl.sum(m, axis=1) + norm_eps, 1.0)
            out = m / s[:, None, :]
        return out, s

    @triton.jit
    def _normalise_bwd(g, m_out, s, ROWS: tl.constexpr):
        """Gradient through m_out = m_in / s(m_in), and m_in rebuilt from m_out; `s` the divisors
        broadcast along the summed axis ([BLOCK_T, BLOCK_N, BLOCK_N], as _load_divisors gives them)."""
        if ROWS:
            g_in = (g - tl.sum(g * m_out, axis=2)[:, :, None]) / s
        else:
            g_in = (g - tl.sum(g * m_out, axis=1)[:, None, :]) / s
        return g_in, m_out * s

    @triton.jit
    def _divisors_at(slot_ptr, i, ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        """Addresses of one normalisation's divisors [BLOCK_T, BLOCK_N] in a program's scratch,
        broadcast along the summed axis to the matrices' [BLOCK_T, BLOCK_N, BLOCK_N], and the mask
        of one writer per divisor. Stored and loaded in the matrices' own layout, the divisors never
        pass through shared memory (a [BLOCK_T, BLOCK_N] store would convert layouts every step)."""
        zero = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_N], dtype=tl.int32)
        t = tl.arange(0, BLOCK_T)[:, None, None] * BLOCK_N + zero
        if ROWS:
            return slot_ptr + t + i[None, :, None], (i[None, None, :] + zero) == 0
        else:
            return slot_ptr + t + i[None, None, :], (i[None, :, None] + zero) == 0

    @triton.jit
    def _store_divisors(slot_ptr, s, i, ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        at, first = _divisors_at(slot_ptr, i, ROWS, BLOCK_T, BLOCK_N)
        if ROWS:
            wide = tl.broadcast_to(s[:, :, None], [BLOCK_T, BLOCK_N, BLOCK_N])
        else:
            wide = tl.broadcast_to(s[:, None, :], [BLOCK_T, BLOCK_N, BLOCK_N])
        tl.store(at, wide, mask=first)

    @triton.jit
    def _load_divisors(slot_ptr, i, ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        at, _ = _divisors_at(slot_ptr, i, ROWS, BLOCK_T, BLOCK_N)
        return tl.load(at)

    @triton.jit
    def _sinkhorn_init(z, ok2, init_eps, SOFTMAX_INIT: tl.constexpr):
        """exp(z), or softmax over rows + eps; zero outside the n×n block."""
        if SOFTMAX_INIT:
            # finite fill: a padded row would otherwise be all -inf (NaN); it is masked below
            zm = tl.where(ok2, z, -1e30)
            e = tl.exp(zm - tl.max(zm, axis=2)[:, :, None])
            m0 = tl.where(ok2, e / tl.sum(e, axis=2)[:, :, None] + init_eps, 0.0)
        else:
            m0 = tl.where(ok2, tl.exp(z), 0.0)
        return m0

    @triton.jit
    def _logits(proj_ptr, tok_off, cols, mask, spk, offset, alpha_ptr, coef, rho, bias_ptr, sb, bias_cols):
        """coef·α·p·ρ + bias for one part; returns (z, p·coef) in fp32."""
        p = tl.load(proj_ptr + tok_off + (offset + cols) * spk, mask=mask, other=0.0).to(tl.float32)
        alpha = tl.load(alpha_ptr).to(tl.float32)
        bias = tl.load(bias_ptr + bias_cols * sb, mask=bias_cols >= 0, other=0.0).to(tl.float32)
        cp = coef * p
        return alpha * cp * rho + bias, cp

    @triton.jit
    def _mhc_mapping_fwd_kernel(
        proj_ptr, r_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, b_pre_ptr, b_post_ptr, b_res_ptr,
        h_pre_ptr, h_post_ptr, h_res_ptr,
        T, spt, spk, sr, sb_pre, sb_post, sb_res,
        off_pre, off_post, off_res, coef_pre, coef_post, coef_res,
        pre_scale, pre_shift, post_scale, post_shift, init_eps, norm_eps,
        N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, STEPS: tl.constexpr,
        ROW_FIRST: tl.constexpr, SOFTMAX_INIT: tl.constexpr, R_DIVIDES: tl.constexpr,
    ):
        # float32 whatever the launcher typed them: Inductor passes Python floats as fp64, which
        # would turn the arithmetic below (and its loop-carried values) into fp64
        coef_pre = tl.cast(coef_pre, tl.float32)
        coef_post = tl.cast(coef_post, tl.float32)
        coef_res = tl.cast(coef_res, tl.float32)
        pre_scale, pre_shift = tl.cast(pre_scale, tl.float32), tl.cast(pre_shift, tl.float32)
        post_scale, post_shift = tl.cast(post_scale, tl.float32), tl.cast(post_shift, tl.float32)
        init_eps, norm_eps = tl.cast(init_eps, tl.float32), tl.cast(norm_eps, tl.float32)
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tok_ok = tok < T
        i = tl.arange(0, BLOCK_N)
        n_ok = i < N
        tok64 = tok.to(tl.int64)
        r = tl.load(r_ptr + tok64 * sr, mask=tok_ok, other=1.0).to(tl.float32)
        rho = 1.0 / r if R_DIVIDES else r

        ok1 = tok_ok[:, None] & n_ok[None, :]
        tok_off1 = (tok64 * spt)[:, None]
        bias_cols1 = tl.where(n_ok, i, -1)[None, :]
        z_pre, _ = _logits(proj_ptr, tok_off1, i[None, :], ok1, spk, off_pre, a_pre_ptr, coef_pre,
                           rho[:, None], b_pre_ptr, sb_pre, bias_cols1)
        z_post, _ = _logits(proj_ptr, tok_off1, i[None, :], ok1, spk, off_post, a_post_ptr, coef_post,
                            rho[:, None], b_post_ptr, sb_post, bias_cols1)
        h_pre = pre_scale * tl.sigmoid(z_pre) + pre_shift
        h_post = post_scale * tl.sigmoid(z_post) + post_shift
        out1 = (tok64 * N)[:, None] + i[None, :]
        tl.store(h_pre_ptr + out1, h_pre.to(h_pre_ptr.dtype.element_ty), mask=ok1)
        tl.store(h_post_ptr + out1, h_post.to(h_post_ptr.dtype.element_ty), mask=ok1)

        flat = i[:, None] * N + i[None, :]                      # [BN, BN]: row-major n×n index
        ok_nn = n_ok[:, None] & n_ok[None, :]
        ok2 = tok_ok[:, None, None] & ok_nn[None, :, :]
        bias_cols2 = tl.where(ok_nn, flat, -1)[None, :, :]
        z_res, _ = _logits(proj_ptr, (tok64 * spt)[:, None, None], flat[None, :, :], ok2, spk, off_res,
                           a_res_ptr, coef_res, rho[:, None, None], b_res_ptr, sb_res, bias_cols2)
        m = _sinkhorn_init(z_res, ok2, init_eps, SOFTMAX_INIT)
        row_ok = ok1  # padded tokens too: their all-zero rows would divide 0 by 0
        for _k in range(STEPS // 2):
            m, _s = _normalise(m, row_ok, norm_eps, ROW_FIRST)
            m, _s = _normalise(m, row_ok, norm_eps, not ROW_FIRST)
        if STEPS % 2 == 1:
            m, _s = _normalise(m, row_ok, norm_eps, ROW_FIRST)
        tl.store(h_res_ptr + (tok64 * N * N)[:, None, None] + flat[None, :, :],
                 m.to(h_res_ptr.dtype.element_ty), mask=ok2)

    @triton.jit
    def _sigmoid_map_backward(proj_ptr, tok64, tok_off, i, n_ok, ok, spk, offset, alpha_ptr, coef, rho,
                              bias_ptr, bias_stride, bias_cols, dh_ptr, sdh_t, sdh_n, scale,
                              dproj_ptr, row, alpha_slot, bias_slot, N: tl.constexpr):
        """Backward of one σ map (H_pre or H_post: z = α·coef·p·ρ + b, h = scale·σ(z) + shift):
        writes its columns of dproj, its α and bias partial sums into the program's `row`, and
        returns Σ_i dz·α·cp per token (the part of dr before dρ/dr)."""
        z, cp = _logits(proj_ptr, tok_off, i[None, :], ok, spk, offset, alpha_ptr, coef,
                        rho[:, None], bias_ptr, bias_stride, bias_cols)
        sig = tl.sigmoid(z)
        dh = tl.load(dh_ptr + (tok64 * sdh_t)[:, None] + i[None, :] * sdh_n, mask=ok,
                     other=0.0).to(tl.float32)
        dz = tl.where(ok, dh * scale * sig * (1.0 - sig), 0.0)
        alpha = tl.load(alpha_ptr).to(tl.float32)
        tl.store(dproj_ptr + (tok64 * (2 * N + N * N))[:, None] + offset + i[None, :],
                 (dz * coef * alpha * rho[:, None]).to(dproj_ptr.dtype.element_ty), mask=ok)
        tl.store(row + alpha_slot, tl.sum(tl.sum(dz * cp * rho[:, None], axis=1), axis=0))
        tl.store(row + bias_slot + i, tl.sum(dz, axis=0), mask=n_ok)
        return tl.sum(dz * alpha * cp, axis=1)

    @triton.jit
    def _mhc_mapping_bwd_kernel(
        proj_ptr, r_ptr, a_pre_ptr, a_post_ptr, a_res_ptr, b_pre_ptr, b_post_ptr, b_res_ptr,
        dh_pre_ptr, dh_post_ptr, dh_res_ptr,
        dproj_ptr, dr_ptr, partial_ptr, divisors_ptr,
        T, spt, spk, sr, sb_pre, sb_post, sb_res,
        sdpre_t, sdpre_n, sdpost_t, sdpost_n, sdres_t, sdres_i, sdres_j,
        off_pre, off_post, off_res, coef_pre, coef_post, coef_res,
        pre_scale, post_scale, init_eps, norm_eps,
        N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
        STEPS: tl.constexpr, ROW_FIRST: tl.constexpr, SOFTMAX_INIT: tl.constexpr,
        R_DIVIDES: tl.constexpr,
    ):
        """dproj [T, n²+2n] and dr [T] per token; per program one row of partial sums
        [dα_pre, dα_post, dα_res, dbias_pre (n), dbias_post (n), dbias_res (n²)]. `divisors`: the
        program's own [STEPS, BLOCK_T, BLOCK_N] float32 scratch for the Sinkhorn divisors."""
        # float32 whatever the launcher typed them (Inductor: fp64), as in the forward
        coef_pre = tl.cast(coef_pre, tl.float32)
        coef_post = tl.cast(coef_post, tl.float32)
        coef_res = tl.cast(coef_res, tl.float32)
        pre_scale, post_scale = tl.cast(pre_scale, tl.float32), tl.cast(post_scale, tl.float32)
        init_eps, norm_eps = tl.cast(init_eps, tl.float32), tl.cast(norm_eps, tl.float32)
        pid = tl.program_id(0)
        tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tok_ok = tok < T
        i = tl.arange(0, BLOCK_N)
        n_ok = i < N
        tok64 = tok.to(tl.int64)
        r = tl.load(r_ptr + tok64 * sr, mask=tok_ok, other=1.0).to(tl.float32)
        rho = 1.0 / r if R_DIVIDES else r
        drho_dr = -rho * rho if R_DIVIDES else tl.full([BLOCK_T], 1.0, tl.float32)
        width = 3 + 2 * N + N * N
        row = partial_ptr + pid * width

        # H_pre and H_post: z = α·cp·ρ + b, h = a·σ(z) + b'
        ok1 = tok_ok[:, None] & n_ok[None, :]
        tok_off1 = (tok64 * spt)[:, None]
        bias_cols1 = tl.where(n_ok, i, -1)[None, :]
        dr = tl.zeros([BLOCK_T], dtype=tl.float32)

        dr += _sigmoid_map_backward(proj_ptr, tok64, tok_off1, i, n_ok, ok1, spk, off_pre, a_pre_ptr, coef_pre,
                                    rho, b_pre_ptr, sb_pre, bias_cols1, dh_pre_ptr, sdpre_t, sdpre_n, pre_scale,
                                    dproj_ptr, row, 0, 3, N) * drho_dr
        dr += _sigmoid_map_backward(proj_ptr, tok64, tok_off1, i, n_ok, ok1, spk, off_post, a_post_ptr, coef_post,
                                    rho, b_post_ptr, sb_post, bias_cols1, dh_post_ptr, sdpost_t, sdpost_n,
                                    post_scale, dproj_ptr, row, 1, 3 + N, N) * drho_dr

        # H_res: recompute the Sinkhorn forward, keeping each normalisation's divisors
        flat = i[:, None] * N + i[None, :]
        ok_nn = n_ok[:, None] & n_ok[None, :]
        ok2 = tok_ok[:, None, None] & ok_nn[None, :, :]
        bias_cols2 = tl.where(ok_nn, flat, -1)[None, :, :]
        z, cp = _logits(proj_ptr, (tok64 * spt)[:, None, None], flat[None, :, :], ok2, spk, off_res,
                        a_res_ptr, coef_res, rho[:, None, None], b_res_ptr, sb_res, bias_cols2)
        m0 = _sinkhorn_init(z, ok2, init_eps, SOFTMAX_INIT)
        row_ok = ok1  # padded tokens too: their all-zero rows would divide 0 by 0
        # Each normalisation's divisors go to the program's scratch rows and come back in reverse
        # order: held in registers instead, every step selected and reduced over a [BLOCK_T, steps,
        # BLOCK_N] tensor (layout conversions through shared memory, twice per step).
        scratch = divisors_ptr + pid.to(tl.int64) * (STEPS * BLOCK_T * BLOCK_N)
        slot = BLOCK_T * BLOCK_N
        m = m0
        for k in range(STEPS // 2):
            m, s = _normalise(m, row_ok, norm_eps, ROW_FIRST)
            _store_divisors(scratch + (2 * k) * slot, s, i, ROW_FIRST, BLOCK_T, BLOCK_N)
            m, s = _normalise(m, row_ok, norm_eps, not ROW_FIRST)
            _store_divisors(scratch + (2 * k + 1) * slot, s, i, not ROW_FIRST, BLOCK_T, BLOCK_N)
        if STEPS % 2 == 1:
            m, s = _normalise(m, row_ok, norm_eps, ROW_FIRST)
            _store_divisors(scratch + (STEPS - 1) * slot, s, i, ROW_FIRST, BLOCK_T, BLOCK_N)
        tl.debug_barrier()  # the divisors a thread stored may be loaded by another

        g = tl.load(dh_res_ptr + (tok64 * sdres_t)[:, None, None] + i[None, :, None] * sdres_i
                    + i[None, None, :] * sdres_j, mask=ok2, other=0.0).to(tl.float32)
        if STEPS % 2 == 1:
            s = _load_divisors(scratch + (STEPS - 1) * slot, i, ROW_FIRST, BLOCK_T, BLOCK_N)
            g, m = _normalise_bwd(g, m, s, ROW_FIRST)
        for kk in range(STEPS // 2):
            k = STEPS // 2 - 1 - kk
            s = _load_divisors(scratch + (2 * k + 1) * slot, i, not ROW_FIRST, BLOCK_T, BLOCK_N)
            g, m = _normalise_bwd(g, m, s, not ROW_FIRST)
            s = _load_divisors(scratch + (2 * k) * slot, i, ROW_FIRST, BLOCK_T, BLOCK_N)
            g, m = _normalise_bwd(g, m, s, ROW_FIRST)
        if SOFTMAX_INIT:
            p = tl.where(ok2, m0 - init_eps, 0.0)
            dz = p * (g - tl.sum(g * p, axis=2)[:, :, None])
        else:
            dz = g * m0
        dz = tl.where(ok2, dz, 0.0)
        alpha = tl.load(a_res_ptr).to(tl.float32)
        tl.store(dproj_ptr + (tok64 * (2 * N + N * N))[:, None, None] + off_res + flat[None, :, :],
                 (dz * coef_res * alpha * rho[:, None, None]).to(dproj_ptr.dtype.element_ty), mask=ok2)
        dr += tl.sum(tl.sum(dz * alpha * cp, axis=2), axis=1) * drho_dr
        tl.store(row + 2, tl.sum(tl.sum(tl.sum(dz * cp * rho[:, None, None], axis=2), axis=1), axis=0))
        tl.store(row + 3 + 2 * N + flat, tl.sum(dz, axis=0), mask=ok_nn)
        tl.store(dr_ptr + tok64, dr.to(dr_ptr.dtype.element_ty), mask=tok_ok)


if triton is not None:

    @triton.jit
    def _mhc_mapping_param_grads_kernel(
        partial_ptr, rows, da_pre_ptr, da_post_ptr, da_res_ptr, db_pre_ptr, db_post_ptr, db_res_ptr,
        N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        """The backward's per-program partial sums [rows, 3 + 2n + n²] summed over rows (in a fixed
        order: deterministic) and written straight into the six parameter gradients, each in its
        own dtype: no separate reduction, casts or copies."""
        width = 3 + 2 * N + N * N
        col = tl.arange(0, BLOCK_W)
        acc = tl.zeros([BLOCK_R, BLOCK_W], dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            row = r0 + tl.arange(0, BLOCK_R)
            acc += tl.load(partial_ptr + row[:, None] * width + col[None, :],
                           mask=(row < rows)[:, None] & (col < width)[None, :], other=0.0)
        total = tl.sum(acc, axis=0)
        zero = col * 0
        tl.store(da_pre_ptr + zero, total.to(da_pre_ptr.dtype.element_ty), mask=col == 0)
        tl.store(da_post_ptr + zero, total.to(da_post_ptr.dtype.element_ty), mask=col == 1)
        tl.store(da_res_ptr + zero, total.to(da_res_ptr.dtype.element_ty), mask=col == 2)
        k = col - 3
        tl.store(db_pre_ptr + k, total.to(db_pre_ptr.dtype.element_ty), mask=(k >= 0) & (k < N))
        k = col - 3 - N
        tl.store(db_post_ptr + k, total.to(db_post_ptr.dtype.element_ty), mask=(k >= 0) & (k < N))
        k = col - 3 - 2 * N
        tl.store(db_res_ptr + k, total.to(db_res_ptr.dtype.element_ty), mask=(k >= 0) & (k < N * N))


def check_mapping_inputs(proj, r, alphas, biases, spec: MappingSpec, grads=None,
                         validate_spec: bool = True) -> None:
    """Shape contract of the mapping (symbolic-size safe: equality checks only); validate_spec=False
    for a spec already validated (the ops cache theirs)."""
    if not isinstance(spec, MappingSpec):
        raise TypeError(f"spec: expected a MappingSpec, got {type(spec).__name__}")
    if validate_spec:
        spec.validate()
    n = spec.n
    if not isinstance(proj, torch.Tensor) or proj.dim() < 1:
        raise ValueError("proj: expected a tensor [..., n²+2n]")
    common.check_tensor("proj", proj, proj.dim(), "[..., n²+2n]")
    if proj.shape[-1] != spec.width:
        raise ValueError(f"proj: last dim {proj.shape[-1]} must be n²+2n = {spec.width} (n={n})")
    lead = tuple(proj.shape[:-1])
    common.check_tensor("r", r, r.dim(), "[...] or [..., 1]")
    if tuple(r.shape) not in (lead, lead + (1,)):
        raise ValueError(f"r: shape {tuple(r.shape)} must be proj's leading dims {lead} (or with a "
                         f"trailing 1)")
    if len(alphas) != 3 or len(biases) != 3:
        raise ValueError("alphas and biases: expected three each (pre, post, res)")
    for name, a in zip(("alpha_pre", "alpha_post", "alpha_res"), alphas):
        common.check_tensor(name, a, a.dim(), "(one element)")
        if a.numel() != 1:
            raise ValueError(f"{name}: expected one element, got shape {tuple(a.shape)}")
    for name, b, width in zip(("bias_pre", "bias_post", "bias_res"), biases, (n, n, n * n)):
        common.check_tensor(name, b, b.dim(), f"({width} elements)")
        if b.numel() != width:
            raise ValueError(f"{name}: expected {width} elements, got shape {tuple(b.shape)}")
    named = dict(proj=proj, r=r, alpha_pre=alphas[0], alpha_post=alphas[1], alpha_res=alphas[2],
                 bias_pre=biases[0], bias_post=biases[1], bias_res=biases[2])
    if grads is not None:
        for name, g, shape in zip(("dh_pre", "dh_post", "dh_res"), grads,
                                  (lead + (n,), lead + (n,), lead + (n, n))):
            common.check_tensor(name, g, len(shape), str(list(shape)), shape=shape)
            named[name] = g
    common.check_same_device(**named)


def _kernel_args(proj, r, alphas, biases, spec):
    n = spec.n
    proj2 = proj.reshape(-1, spec.width)
    r1 = r.reshape(-1)
    a = [t.reshape(()) for t in alphas]
    b = [t.reshape(-1) for t in biases]
    return proj2, r1, a, b


@functools.lru_cache(maxsize=256)
def _scalars(spec: MappingSpec, backward: bool = False) -> tuple:
    """The kernels' scalar arguments of `spec` (floats as floats, so that an int-valued field never
    changes the kernels' specialisation), built once per spec."""
    pre, post = [float(v) for v in spec.pre_affine], [float(v) for v in spec.post_affine]
    affine = (pre[0], post[0]) if backward else (*pre, *post)
    return (*(int(o) for o in spec.part_offsets()), *(float(c) for c in spec.coefs), *affine,
            float(spec.init_eps), float(spec.norm_eps))


def _no_float64(proj, where):
    if proj.dtype == torch.float64:
        raise TypeError(f"proj: float64 runs the reference ({where}), not the kernel")


def mhc_mapping_fwd(proj: torch.Tensor, r: torch.Tensor, alphas, biases, spec: MappingSpec,
                    out_dtypes=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h_pre [..., n], h_post [..., n], h_res [..., n, n]), contiguous, in `out_dtypes`
    (default proj's dtype each)."""
    check_mapping_inputs(proj, r, alphas, biases, spec)
    common.require(proj.device, _mhc_mapping_fwd_kernel, __name__)
    _no_float64(proj, "mhc_mapping_ref")
    return launch_mapping_fwd(proj, r, alphas, biases, spec, out_dtypes)


FORWARD_TOKENS = 32


def launch_mapping_fwd(proj, r, alphas, biases, spec: MappingSpec, out_dtypes=None, wrap=common.direct):
    """mhc_mapping_fwd without the checks (the ops check once, then call this)."""
    n = spec.n
    lead = tuple(proj.shape[:-1])
    dt = tuple(out_dtypes) if out_dtypes is not None else (proj.dtype,) * 3
    h_pre = common.new_output(lead + (n,), dt[0], proj.device)
    h_post = common.new_output(lead + (n,), dt[1], proj.device)
    h_res = common.new_output(lead + (n, n), dt[2], proj.device)
    proj2, r1, a, b = _kernel_args(proj, r, alphas, biases, spec)
    T = proj2.shape[0]
    if T == 0:
        return h_pre, h_post, h_res
    bn = common.block_n(n)
    bt = common.block_t(4 * bn * bn, limit=FORWARD_TOKENS)
    # n <= 4: a program of one warp, so that each Sinkhorn normalisation's sums stay inside the
    # warp (shuffles), where 4 warps took a barrier and a shared-memory round trip per sum (the
    # chain is latency-bound: 16 x 15 us a step at C1024 on the H200)
    warps = 1 if bn <= 4 else 4
    wrap(_mhc_mapping_fwd_kernel)[(cdiv(T, bt),)](
        proj2, r1, *a, *b, h_pre, h_post, h_res,
        T, *proj2.stride(), r1.stride(0), *(t.stride(0) for t in b),
        *_scalars(spec),
        N=n, BLOCK_N=bn, BLOCK_T=bt, STEPS=spec.steps, ROW_FIRST=spec.row_first,
        SOFTMAX_INIT=spec.init == "softmax", R_DIVIDES=spec.r_divides, num_warps=warps,
    )
    return h_pre, h_post, h_res


def mhc_mapping_bwd(proj: torch.Tensor, r: torch.Tensor, alphas, biases, dh_pre: torch.Tensor,
                    dh_post: torch.Tensor, dh_res: torch.Tensor, spec: MappingSpec):
    """(dproj, dr, (dα_pre, dα_post, dα_res), (dbias_pre, dbias_post, dbias_res)), each shaped and
    typed like its input, none sharing storage."""
    check_mapping_inputs(proj, r, alphas, biases, spec, (dh_pre, dh_post, dh_res))
    common.require(proj.device, _mhc_mapping_bwd_kernel, __name__)
    _no_float64(proj, "autograd through mhc_mapping_ref")
    return launch_mapping_bwd(proj, r, alphas, biases, dh_pre, dh_post, dh_res, spec)


def launch_mapping_bwd(proj, r, alphas, biases, dh_pre, dh_post, dh_res, spec: MappingSpec,
                       wrap=common.direct):
    """mhc_mapping_bwd without the checks (the ops check once, then call this)."""
    n = spec.n
    proj2, r1, a, b = _kernel_args(proj, r, alphas, biases, spec)
    T = proj2.shape[0]
    dproj = common.new_output(tuple(proj.shape), proj.dtype, proj.device)
    dr = common.new_output(tuple(r.shape), r.dtype, proj.device)
    bn = common.block_n(n)
    # tokens per program as when the divisors were held in registers ([tokens, steps/2, n] twice)
    bt = common.block_t(2 * next_power_of_2(max(1, spec.steps // 2)) * bn + 6 * bn * bn, limit=32)
    # a warp per 64 matrix elements: the Sinkhorn chain is latency-bound, and a program of one warp
    # reduces and converts layouts with shuffles, without shared memory or barriers (sm_90, Triton
    # 3.6, n 4: 13 barriers and 1 KiB of shared memory at 4 warps, 1 barrier and none at one)
    warps = max(1, min(4, bt * bn * bn // 64))
    grid = cdiv(T, bt)
    width = 3 + 2 * n + n * n
    # one row per program: every row is written, so no zero fill (T = 0: one all-zero row)
    # sym_max: traced for Inductor (issue 24), a Python max() would guard on the token count
    partial = common.new_output((torch.sym_max(grid, 1), width), torch.float32, proj.device)
    divisors = common.new_output((scratch_rows(grid), max(1, spec.steps) * bt * bn), torch.float32,
                                 proj.device)
    if T > 0:
        g_pre, g_post = dh_pre.reshape(T, n), dh_post.reshape(T, n)
        g_res = dh_res.reshape(T, n, n)
        wrap(_mhc_mapping_bwd_kernel)[(grid,)](
            proj2, r1, *a, *b, g_pre, g_post, g_res, dproj, dr.view(-1), partial, divisors,
            T, *proj2.stride(), r1.stride(0), *(t.stride(0) for t in b),
            *g_pre.stride(), *g_post.stride(), *g_res.stride(),
            *_scalars(spec, backward=True),
            N=n, BLOCK_N=bn, BLOCK_T=bt, STEPS=spec.steps, ROW_FIRST=spec.row_first,
            SOFTMAX_INIT=spec.init == "softmax", R_DIVIDES=spec.r_divides, num_warps=warps,
        )
    else:
        partial.zero_()
    # the kernel's α sums already carry coef (they are Σ dz·coef·p·ρ)
    dalphas, dbiases = sum_param_grads(partial, alphas, biases, n, wrap)
    return dproj, dr, dalphas, dbiases


# The parameter gradients' sum over the backward's partial rows (one per mapping program: 2048 at
# B4 S2048) is one program: [PARAM_GRADS_TILE / 32, 32] tiles on PARAM_GRADS_WARPS warps, so that
# the loop over rows is a few long iterations (27 us a launch on the H200 at 64 rows and 4 warps).
PARAM_GRADS_TILE = 8192
PARAM_GRADS_WARPS = 8


def sum_param_grads(partial: torch.Tensor, alphas, biases, n: int, wrap=common.direct):
    """((dα_pre, dα_post, dα_res), (dbias_pre, dbias_post, dbias_res)) from the backward's partial
    sums [rows, 3 + 2n + n²] (contiguous float32), each shaped and typed like its parameter."""
    width = 3 + 2 * n + n * n
    if partial.dim() != 2 or partial.shape[1] != width or not partial.is_contiguous() or \
            partial.dtype != torch.float32:
        raise ValueError(f"partial: expected contiguous float32 [rows, {width}], got "
                         f"{partial.dtype} {tuple(partial.shape)}")
    device = partial.device
    # a 0-dim α's gradient is a view of a [1] buffer: Inductor lowers a 0-dim empty() to a kernel
    # that fills it (three launches per mapping backward in the compiled mHC step on the H200)
    dalphas = tuple(common.new_output(tuple(t.shape) or (1,), t.dtype, device) for t in alphas)
    dbiases = tuple(common.new_output(tuple(t.shape), t.dtype, device) for t in biases)
    block_w = next_power_of_2(width)
    wrap(_mhc_mapping_param_grads_kernel)[(1,)](
        partial, partial.shape[0], *dalphas, *dbiases,
        N=n, BLOCK_R=max(1, PARAM_GRADS_TILE // block_w), BLOCK_W=block_w, num_warps=PARAM_GRADS_WARPS,
    )
    return tuple(d.view(t.shape) for d, t in zip(dalphas, alphas)), dbiases
