"""Whether KDA's wy_backward pays split in two kernels, as GDN's was (dqkw.py + wy_bwd.py; issue 20: KDA B1 T32768
H16 D128 at 0.837x FLA's time, 0.8 wanted; wy_backward takes 2.17 of 9.35 ms busy, session 45's profile at
a43c424, and GDN's one-pass dqkw took its share from 1.26 to 0.84 ms in session 44).

Today per-channel gates take wy.py's single _wy_backward_kernel: one program per (chunk, value head), 8 warps,
its key loop walking the value tiles three times per key tile. The split here, learned from the GDN kernels:

    A  per (chunk, value head, key tile), one pass over the value tiles accumulating dO h^T, U dh^T, -dU h^T
       and rowsum(h o dh); then dq = scale e^G dO h^T (complete but for decayed_scores_backward's terms),
       dk's end-state term, dG's terms through q and the end state (per channel: the key tiles' columns are
       disjoint, no cross-tile sum), dW stored in the products' dtype;
    B  per (chunk, value head), as wy_bwd.py: the value loop (dP = scale dO U^T stored for
       decayed_scores_backward, dA's dU term, dv, dbeta), the key loop (dA's dW term, dk's and dG's WY
       terms and dbeta's), dL = -A^T dA A^T, dKdot = beta dL stored, dbeta's Kdot term.

Against it on paper (session 44's note): A's fp32 partial sums of dk and dG go to memory and B reads and rewrites
them, ~1.3 GB more traffic at B1 (~0.36 ms at 3.7 TB/s) than today's kernel, which stores them once. For it: A's
one pass over the value tiles and (chunks x heads x key tiles) programs, which won 0.43 ms for GDN with the same
dk round trip. The run decides.

Variants (each checked on the kernel tests' per-channel cases against float64 before it is timed):

    single            today's kernel (the reference timing)
    split-aW-sS-bV    the split with A at W warps and S stages and B at V warps (1 stage)

Compiled for sm_90 on the CPU (Triton 3.6, K = V = 128 bf16): today's kernel 255 registers, 24 bytes of spills
(8 warps); A at 4 warps 247 registers and none (2 stages; 3 stages 245), at 8 warps 122; B at 8 warps 248 and
none, at 4 warps 224 bytes of spills, at 2 warps 2128.

Then KDA's fwd+bwd (do_bench) and the WY backward kernels' GPU time (profiler) at each shape:

    python benchmarks/analysis/kda_wy_split.py [--variants single,split-a4-s2-b4,...] [--time-shapes ...]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import check_cases, check_then_time, delta_rule_step, time_step, use_kernel_tests  # noqa: E402

use_kernel_tests()

from hccompile.kernels import _triton as triton_helpers  # noqa: E402
from hccompile.kernels._triton import cdiv, tl, triton  # noqa: E402
from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule.tiles import (_chunk_end_decays, _dot, _gate_offset, _load_rows,  # noqa: E402
                                                _load_stored_rows, _row_chunk_coords, _store_rows,
                                                _varlen_chunk_coords)


@triton.jit
def _kda_dqkw_kernel(
    q_ptr, k_ptr, do_ptr, cum_ptr, u_ptr, du_ptr, h_ptr, dh_ptr, dq_ptr, dk_ptr, dw_ptr, dg_ptr,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_kb, stride_kt, stride_kh, stride_kk,
    stride_dob, stride_dot, stride_doh, stride_dov,
    chunk_table_ptr, cu_seqlens_ptr,
    T, NT, HV, GROUP, K, V, scale,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Kernel A: one program per (chunk, value head, key tile). Stores dq, dk's end-state term and dG's
    terms through q and the end state (fp32 [B, T, HV, K]), and dW (the products' dtype)."""
    scale = tl.cast(scale, tl.float32)
    pid_chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        seq = tl.load(chunk_table_ptr + 2 * pid_chunk)
        chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
        batch, start, length = _varlen_chunk_coords(chunk, tl.load(cu_seqlens_ptr + seq),
                                                    tl.load(cu_seqlens_ptr + seq + 1), BT)
    else:
        batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
    key_head = head // GROUP
    q_ptr += batch * stride_qb + key_head * stride_qh
    k_ptr += batch * stride_kb + key_head * stride_kh
    do_ptr += batch * stride_dob + head * stride_doh
    gate_offset = _gate_offset(batch, head, T, HV, K, 2)
    cum_ptr += gate_offset
    dg_ptr += gate_offset
    value_offset = (batch * T) * HV * V + head * V
    key_offset = (batch * T) * HV * K + head * K
    u_ptr += value_offset
    du_ptr += value_offset
    dq_ptr += key_offset
    dk_ptr += key_offset
    dw_ptr += key_offset
    h_ptr += (pid_chunk.to(tl.int64) * HV + head) * K * V
    dh_ptr += (pid_chunk.to(tl.int64) * HV + head) * K * V

    local = tl.arange(0, BT)
    valid = local < length
    tokens = start + local
    last = start + length - 1
    dot_dtype = h_ptr.dtype.element_ty
    kc = tl.program_id(2) * BK + tl.arange(0, BK)
    key_valid = kc < K
    dq_state = tl.zeros([BT, BK], dtype=tl.float32)
    dk_to_end = tl.zeros([BT, BK], dtype=tl.float32)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    dg_whole = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
        u = _load_stored_rows(u_ptr, tokens, vc, HV * V, 1, valid, V)
        du = _load_stored_rows(du_ptr, tokens, vc, HV * V, 1, valid, V)
        state = _load_stored_rows(h_ptr, kc, vc, V, 1, key_valid, V)
        dstate = _load_stored_rows(dh_ptr, kc, vc, V, 1, key_valid, V)
        dq_state += _dot(do_tile, tl.trans(state), dot_dtype, DOT_PRECISION)
        dk_to_end += _dot(u, tl.trans(dstate), dot_dtype, DOT_PRECISION)
        dw -= _dot(du, tl.trans(state), dot_dtype, DOT_PRECISION)
        dg_whole += tl.sum(state.to(tl.float32) * dstate.to(tl.float32), axis=1)
    _store_rows(dw_ptr, dw, tokens, kc, HV * K, 1, valid, K)
    g = _load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K)
    dq = scale * tl.exp(g) * dq_state
    _store_rows(dq_ptr, dq, tokens, kc, HV * K, 1, valid, K)
    q_tile = _load_rows(q_ptr, tokens, kc, stride_qt, stride_qk, valid, K)
    k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
    to_end, whole = _chunk_end_decays(cum_ptr, tokens, valid, last, kc, HV, K, 2)
    dk_to_end *= to_end
    k_to_end_grad = k_tile * dk_to_end
    dg = q_tile * dq - k_to_end_grad
    dg_last = tl.sum(k_to_end_grad, axis=0) + whole * dg_whole
    dg += tl.where(local[:, None] == length - 1, dg_last[None, :], 0.0)
    _store_rows(dg_ptr, dg, tokens, kc, HV * K, 1, valid, K)
    _store_rows(dk_ptr, dk_to_end, tokens, kc, HV * K, 1, valid, K)


@triton.jit
def _kda_wy_bwd_kernel(
    k_ptr, v_ptr, beta_ptr, do_ptr, cum_ptr, inverse_ptr, kdot_ptr, u_ptr, du_ptr, dw_ptr,
    dv_ptr, dbeta_ptr, dk_ptr, dg_ptr, dkdot_ptr, dscores_ptr,
    stride_kb, stride_kt, stride_kh, stride_kk,
    stride_vb, stride_vt, stride_vh, stride_vv,
    stride_bb, stride_bt, stride_bh,
    stride_dob, stride_dot, stride_doh, stride_dov,
    stride_dvb, stride_dvt, stride_dvh, stride_dvv,
    stride_dbb, stride_dbt, stride_dbh,
    chunk_table_ptr, cu_seqlens_ptr,
    T, NT, HV, GROUP, K, V, scale,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Kernel B: one program per (chunk, value head). dv and dbeta complete; dk and dG completed from kernel
    A's partial sums; dP and dKdot stored for decayed_scores_backward."""
    scale = tl.cast(scale, tl.float32)
    pid_chunk = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        seq = tl.load(chunk_table_ptr + 2 * pid_chunk)
        chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
        batch, start, length = _varlen_chunk_coords(chunk, tl.load(cu_seqlens_ptr + seq),
                                                    tl.load(cu_seqlens_ptr + seq + 1), BT)
    else:
        batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
    key_head = head // GROUP
    k_ptr += batch * stride_kb + key_head * stride_kh
    v_ptr += batch * stride_vb + head * stride_vh
    do_ptr += batch * stride_dob + head * stride_doh
    dv_ptr += batch * stride_dvb + head * stride_dvh
    gate_offset = _gate_offset(batch, head, T, HV, K, 2)
    cum_ptr += gate_offset
    dg_ptr += gate_offset
    square_offset = (batch * T) * HV * BT + head * BT
    value_offset = (batch * T) * HV * V + head * V
    key_offset = (batch * T) * HV * K + head * K
    u_ptr += value_offset
    du_ptr += value_offset
    dw_ptr += key_offset
    dk_ptr += key_offset

    local = tl.arange(0, BT)
    valid = local < length
    tokens = start + local
    beta = tl.load(beta_ptr + batch * stride_bb + head * stride_bh + tokens * stride_bt, mask=valid,
                   other=0.0).to(tl.float32)
    dot_dtype = du_ptr.dtype.element_ty
    inverse = _load_rows(inverse_ptr + square_offset, tokens, local, HV * BT, 1, valid, BT)
    inverse = tl.where(local[:, None] >= local[None, :], inverse, 0.0).to(dot_dtype)
    d_inverse = tl.zeros([BT, BT], dtype=tl.float32)
    d_scores = tl.zeros([BT, BT], dtype=tl.float32)
    dbeta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vc = v0 + tl.arange(0, BV)
        u = _load_stored_rows(u_ptr, tokens, vc, HV * V, 1, valid, V)
        du = _load_stored_rows(du_ptr, tokens, vc, HV * V, 1, valid, V)
        do_tile = _load_stored_rows(do_ptr, tokens, vc, stride_dot, stride_dov, valid, V)
        v_tile = _load_rows(v_ptr, tokens, vc, stride_vt, stride_vv, valid, V)
        d_scores += _dot(do_tile, tl.trans(u), dot_dtype, DOT_PRECISION)
        d_inverse += _dot(du, tl.trans(v_tile * beta[:, None]), dot_dtype, DOT_PRECISION)
        inverse_t_du = _dot(tl.trans(inverse), du, dot_dtype, DOT_PRECISION)
        _store_rows(dv_ptr, inverse_t_du * beta[:, None], tokens, vc, stride_dvt, stride_dvv, valid, V)
        dbeta += tl.sum(v_tile * inverse_t_du, axis=1)
    d_scores = tl.where((local[:, None] >= local[None, :]) & valid[:, None], scale * d_scores, 0.0)
    _store_rows(dscores_ptr + square_offset, d_scores, tokens, local, HV * BT, 1, valid, BT)
    for k0 in range(0, K, BK):
        kc = k0 + tl.arange(0, BK)
        dw = _load_stored_rows(dw_ptr, tokens, kc, HV * K, 1, valid, K)
        k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)
        gamma = tl.exp(_load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K))
        d_inverse += _dot(dw, tl.trans(k_tile * gamma * beta[:, None]), dot_dtype, DOT_PRECISION)
        inverse_t_dw = _dot(tl.trans(inverse), dw, dot_dtype, DOT_PRECISION)
        dbeta += tl.sum(inverse_t_dw * gamma * k_tile, axis=1)
        dk_wy = inverse_t_dw * gamma * beta[:, None]
        dk = _load_rows(dk_ptr, tokens, kc, HV * K, 1, valid, K) + dk_wy
        _store_rows(dk_ptr, dk, tokens, kc, HV * K, 1, valid, K)
        dg = _load_rows(dg_ptr, tokens, kc, HV * K, 1, valid, K) + k_tile * dk_wy
        _store_rows(dg_ptr, dg, tokens, kc, HV * K, 1, valid, K)
    inverse_f32 = _load_rows(inverse_ptr + square_offset, tokens, local, HV * BT, 1, valid, BT)
    inverse_f32 = tl.where(local[:, None] >= local[None, :], inverse_f32, 0.0)
    d_lower = -tl.dot(tl.dot(tl.trans(inverse_f32), d_inverse, input_precision=DOT_PRECISION),
                      tl.trans(inverse_f32), input_precision=DOT_PRECISION)
    d_lower = tl.where((local[:, None] > local[None, :]) & valid[:, None], d_lower, 0.0)
    kdot = _load_rows(kdot_ptr + square_offset, tokens, local, HV * BT, 1, valid, BT)
    kdot = tl.where(local[:, None] > local[None, :], kdot, 0.0)
    dbeta += tl.sum(d_lower * kdot, axis=1)
    tl.store(dbeta_ptr + batch * stride_dbb + head * stride_dbh + tokens * stride_dbt,
             dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)
    _store_rows(dkdot_ptr + square_offset, d_lower * beta[:, None], tokens, local, HV * BT, 1, valid, BT)


ORIGINAL_KERNEL = chunk_kernels._wy_backward_kernel


class SplitWyBackward:
    """Stands in for chunk.py's _wy_backward_kernel: with per-channel gates its launch runs kernels A and B
    (chunk.py's positional arguments), else today's kernel. plan.launch hands any object that is not a
    JITFunction back as is (launcher.py)."""

    def __init__(self, a_warps: int, a_stages: int, b_warps: int):
        self.a_options = dict(num_warps=a_warps, num_stages=a_stages)
        self.b_options = dict(num_warps=b_warps, num_stages=1)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs.get("GATE") != 2:
                return ORIGINAL_KERNEL[grid](*args, **kwargs)
            (q, k, v, beta, do, cum, inverse, kdot, u, du, h, dh, dv, dbeta, dq, dk, dg, dkdot, dscores) = args[:19]
            strides = args[19:45]
            q_s, k_s, v_s, beta_s, do_s, dv_s, dbeta_s = (strides[0:4], strides[4:8], strides[8:12], strides[12:15],
                                                          strides[15:19], strides[19:23], strides[23:26])
            table, seqlens, T, NT, HV, GROUP, K, V, scale = args[45:54]
            BT, is_varlen, precision = kwargs["BT"], kwargs["IS_VARLEN"], kwargs["DOT_PRECISION"]
            chunks = grid[0]
            block_k = min(64, triton.next_power_of_2(K))
            block_v = min(64, triton.next_power_of_2(V))
            dw = torch.empty(dk.shape, dtype=h.dtype, device=dk.device)
            triton_helpers.direct(_kda_dqkw_kernel)[(chunks, HV, cdiv(K, block_k))](
                q, k, do, cum, u, du, h, dh, dq, dk, dw, dg, *q_s, *k_s, *do_s, table, seqlens, T, NT, HV, GROUP,
                K, V, scale, BT=BT, BK=block_k, BV=block_v, IS_VARLEN=is_varlen, DOT_PRECISION=precision,
                **self.a_options)
            triton_helpers.direct(_kda_wy_bwd_kernel)[(chunks, HV)](
                k, v, beta, do, cum, inverse, kdot, u, du, dw, dv, dbeta, dk, dg, dkdot, dscores, *k_s, *v_s,
                *beta_s, *do_s, *dv_s, *dbeta_s, table, seqlens, T, NT, HV, GROUP, K, V, scale, BT=BT,
                BK=block_k, BV=block_v, IS_VARLEN=is_varlen, DOT_PRECISION=precision, **self.b_options)
        return launch


def apply(variant: str) -> None:
    if variant == "single":
        chunk_kernels._wy_backward_kernel = ORIGINAL_KERNEL
        return
    parts = variant.split("-")
    if parts[0] != "split":
        raise ValueError(variant)
    options = {p[0]: int(p[1:]) for p in parts[1:]}
    chunk_kernels._wy_backward_kernel = SplitWyBackward(options.get("a", 4), options.get("s", 2), options.get("b", 4))


def check(repeats: int) -> list[str]:
    import test_delta_rule_chunk as t

    cases = [c for c in t.KERNEL_CASES + t.NARROW_SWEEP_CASES if c[2] == "channel"]
    return check_cases(cases, repeats)


def time_variant(shape: str) -> str:
    ms, kernels = time_step(*delta_rule_step("kda", shape),
                            ("_wy_backward_kernel", "_kda_dqkw_kernel", "_kda_wy_bwd_kernel"))
    return f"kda fwd+bwd {ms:.3f} ms; " + ", ".join(f"{n} {t:.3f}" for n, t in kernels.items() if t)

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="single,split-a4-s2-b8,split-a4-s3-b8,split-a4-s2-b4")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--time-shapes", default="B1T32768H16D128,B4T4096H16D128")
    a = p.parse_args()
    check_then_time(a.variants.split(","), apply, lambda: check(a.repeats), time_variant, a.time_shapes.split(","),
                    reference="single")

if __name__ == "__main__":
    main()
