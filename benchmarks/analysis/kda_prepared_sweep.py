"""Whether KDA's backward state sweep pays with its decayed queries and keys formed before the sweep
(issue 20: KDA B1 T32768 H16 D128 at 0.817x FLA's time at 474a18f, 0.8 wanted; state_backward is the largest
kernel, 2.18 of ~9.1 ms busy, where GDN's takes 0.85).

Per chunk step, each program of today's sweep (state.py, _state_backward_kernel with a channel gate) loads the
chunk's q and k [BT, K] and the fp32 gate tile G [BT, K], and forms Q e^G and K e^(G_last - G): 2 BT K exps.
At 16-wide value tiles a head's eight programs repeat that work for the same chunk, and none of it is on the
sweep's dependency chain, yet a step waits for it. FLA's KDA backward hands its sweep the decayed queries and
keys (qg, kg) formed chunk-parallel; the sweep then loads half-precision tiles and the chunk's end decay only.
(Session 19 tried half of this on the H100 (12b5e54): wy_solve's kg read by the sweep, which still loaded G to
form Q e^G: 44 % slower. Here the G tile leaves the loop entirely.)

Variants (the check: the kernel tests' per-channel cases against float64):

    single          today's sweep (the reference timing)
    prepared        a chunk-parallel prep kernel stores qg = Q e^G and kg = K e^(G_last - G) ([B, T, HV, K],
                    the intermediates' dtype, the products' operands rounded as today's sweep rounds them), and
                    the sweep (state.py's kernel with its channel-gate branch edited) loads them
    prepared-wN-sS  the same with the sweep at N warps and S stages (today's timed rule otherwise)

Compiled for sm_90 on the CPU (Triton 3.6, K 128, 16-wide value tiles, bf16): today's sweep at its timed 8 warps
2 stages 253 registers, no spills, 121 KiB shared (4 warps: 96-120 bytes of spills); the prepared sweep 140
registers, no spills, 128 KiB (4 warps 2 stages 145, 3 stages 155 and 194 KiB; none spill).

The prep's time is in the step's time: a port would form qg in the per-chunk score kernel (which loads q and G)
and take kg from wy_solve, which stores it for state_forward already.

    python benchmarks/analysis/kda_prepared_sweep.py [--variants single,prepared,...] [--time-shapes ...]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import (check_cases, check_then_time, delta_rule_step, edited_module, time_step,  # noqa: E402
                             use_kernel_tests)

use_kernel_tests()

import torch  # noqa: E402

from hccompile.kernels import _triton as triton_helpers  # noqa: E402
from hccompile.kernels._triton import cdiv, tl, triton  # noqa: E402
from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule import state as state_kernels  # noqa: E402
from hccompile.kernels.delta_rule.tiles import (_channel_decays, _gate_offset, _load_rows, _row_bounds,  # noqa: E402
                                                _store_rows, _varlen_bounds)


@triton.jit
def _decayed_query_key_kernel(
    q_ptr, k_ptr, cum_ptr, qg_ptr, kg_ptr,
    stride_qb, stride_qt, stride_qh, stride_qk,
    stride_kb, stride_kt, stride_kh, stride_kk,
    cu_seqlens_ptr, T, HV, GROUP, K,
    BT: tl.constexpr, BKF: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Per (sequence, chunk of it, value head): qg = Q e^G and kg = K e^(G_last - G) at the chunk's rows of
    [B, T, HV, K] tensors, each the fp32 product today's sweep forms, stored in the tensors' dtype (the
    rounding the sweep's products give them)."""
    seq = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    if IS_VARLEN:
        batch, bos, eos = _varlen_bounds(seq, tl.load(cu_seqlens_ptr + seq), tl.load(cu_seqlens_ptr + seq + 1))
    else:
        batch, bos, eos = _row_bounds(seq, T)
    start = bos + chunk * BT
    if start < eos:
        length = tl.minimum(eos - start, BT)
        local = tl.arange(0, BT)
        kc = tl.arange(0, BKF)
        tokens = start + local
        valid = local < length
        key_head = head // GROUP
        q = _load_rows(q_ptr + batch * stride_qb + key_head * stride_qh, tokens, kc, stride_qt, stride_qk, valid, K)
        k = _load_rows(k_ptr + batch * stride_kb + key_head * stride_kh, tokens, kc, stride_kt, stride_kk, valid, K)
        g, to_end, _ = _channel_decays(cum_ptr + _gate_offset(batch, head, T, HV, K, 2), tokens, valid,
                                       start + length - 1, kc, HV, K)
        offset = (batch * T) * HV * K + head * K
        _store_rows(qg_ptr + offset, q * tl.exp(g), tokens, kc, HV * K, 1, valid, K)
        _store_rows(kg_ptr + offset, k * to_end, tokens, kc, HV * K, 1, valid, K)


# state.py's backward sweep with PREPARED: q_ptr and k_ptr are the value heads' qg and kg ([B, T, HV, K],
# the launcher passes their strides), loaded in their stored dtype; only e^G_last is read from the gates.
EDITS = [
    ('''        DOT_PRECISION: tl.constexpr,
    ):
        """Walks one sequence's chunks backwards''', '''        DOT_PRECISION: tl.constexpr,
        PREPARED: tl.constexpr = False,
    ):
        """Walks one sequence's chunks backwards'''),
    ('''        q_ptr += batch * stride_qb + key_head * stride_qh
        k_ptr += batch * stride_kb + key_head * stride_kh
        do_ptr += batch * stride_dob + head * stride_doh''', '''        if PREPARED:
            q_ptr += batch * stride_qb + head * stride_qh
            k_ptr += batch * stride_kb + head * stride_kh
        else:
            q_ptr += batch * stride_qb + key_head * stride_qh
            k_ptr += batch * stride_kb + key_head * stride_kh
        do_ptr += batch * stride_dob + head * stride_doh'''),
    ('''            if GATE == 2:
                k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)''',
     '''            if GATE == 2 and not PREPARED:
                k_tile = _load_rows(k_ptr, tokens, kc, stride_kt, stride_kk, valid, K)'''),
    ('''            if GATE == 2:
                g, to_end, whole = _channel_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K)
                k_tile *= to_end
                q_tile *= tl.exp(g)''', '''            if GATE == 2:
                if PREPARED:
                    whole = _chunk_end_decay(cum_ptr, start + length - 1, kc, HV, K)
                else:
                    g, to_end, whole = _channel_decays(cum_ptr, tokens, valid, start + length - 1, kc, HV, K)
                    k_tile *= to_end
                    q_tile *= tl.exp(g)'''),
]
PREPARED_KERNEL = edited_module(state_kernels, EDITS, "_state_prepared_variant")._state_backward_kernel
ORIGINAL_KERNEL = chunk_kernels._state_backward_kernel
ORIGINAL_OPTIONS = chunk_kernels.sweep_launch_options


class PreparedBackward:
    """Stands in for chunk.py's _state_backward_kernel (its positional arguments): with a channel gate the prep
    kernel, then the edited sweep on its qg and kg; other gates go to today's kernel. plan.launch hands an
    object that is not a JITFunction back as is."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs["GATE"] != 2:
                return triton_helpers.direct(ORIGINAL_KERNEL)[grid](*args, **kwargs)
            q, k, cum, w = args[:4]
            q_strides, k_strides = args[10:14], args[14:18]
            chunk_offsets, seqlens, T, NT, HV, GROUP, K = args[30:37]
            batch = q.shape[0]
            qg = torch.empty(batch, T, HV, K, dtype=w.dtype, device=w.device)
            kg = torch.empty_like(qg)
            triton_helpers.direct(_decayed_query_key_kernel)[(grid[0], cdiv(T, kwargs["BT"]), HV)](
                q, k, cum, qg, kg, *q_strides, *k_strides, seqlens, T, HV, GROUP, K,
                BT=kwargs["BT"], BKF=kwargs["BKF"], IS_VARLEN=kwargs["IS_VARLEN"], num_warps=4)
            rest = list(args)
            rest[0], rest[1] = qg, kg
            rest[10:14] = qg.stride()
            rest[14:18] = kg.stride()
            triton_helpers.direct(PREPARED_KERNEL)[grid](*rest, PREPARED=True, **kwargs)
        return launch


def apply(variant: str) -> None:
    parts = variant.split("-")
    if parts[0] not in ("single", "prepared"):
        raise ValueError(variant)
    chunk_kernels._state_backward_kernel = PreparedBackward() if parts[0] == "prepared" else ORIGINAL_KERNEL
    override = {("num_warps" if p[0] == "w" else "num_stages"): int(p[1:]) for p in parts[1:]
                if p[0] in "ws" and p[1:].isdigit()}

    def options(plan, block_k_full, dtype, direction):
        chosen = ORIGINAL_OPTIONS(plan, block_k_full, dtype, direction)
        return {**chosen, **override} if direction == "backward" else chosen

    chunk_kernels.sweep_launch_options = options


def check(repeats: int) -> list[str]:
    import test_delta_rule_chunk as t

    cases = [c for c in t.KERNEL_CASES + t.NARROW_SWEEP_CASES if c[2] == "channel"]
    return check_cases(cases, repeats)


def time_variant(shape: str) -> str:
    ms, kernels = time_step(*delta_rule_step("kda", shape), ("state_backward", "_decayed_query_key_kernel"))
    return (f"kda fwd+bwd {ms:.3f} ms, state_backward {kernels['state_backward']:.3f} ms, "
            f"prep {kernels['_decayed_query_key_kernel']:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="single,prepared,prepared-w4-s2,prepared-w8-s3,prepared-w4-s3")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--time-shapes", default="B1T32768H16D128,B4T4096H16D128")
    a = p.parse_args()
    check_then_time(a.variants.split(","), apply, lambda: check(a.repeats), time_variant, a.time_shapes.split(","),
                    reference="single")


if __name__ == "__main__":
    main()
