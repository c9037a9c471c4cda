"""Prototype (issue 20, GDN B1): the backward state sweep with one off-chain product a chunk step instead of two.

sweep_step_work.py (session 48, one H200) timed GDN B1 T32768 H16 D128's state_backward at 0.853 ms, 0.479 with the
chain alone: its two off-chain products (scale P^T dO into dU, scale (Q e^G)^T dO into dS) cost 0.37 ms, since
every product in the step waits for the one before. Substituting dU = scale P^T dO + dU_chain into the state update,

    dS_start = e^G_last dS - W^T dU_chain + scale M^T dO,   M = e^G Q - P W   (rows of the chunk, [BT, K])

so the chain keeps K dS and W^T dU_chain, and one off-chain product remains (M^T dO, in place of Q^T dO). M and dU's
local part scale P^T dO are formed before the sweep by a chunk-parallel kernel (here `_m_form_prepare_kernel`: one
program per chunk and value head, P W and P^T dO as two products), which writes M (W's shape and dtype) and the local
part (dU's shape, a buffer of its own); the sweep reads it, adds its chain part and stores dU whole, as the consumers
want it.

The sweep variant is state.py's kernel rebuilt from its own text (kernel_variants.edited_module); chunk.py launches
it through a stand-in for its `direct` launcher for fixed-length rows (with per-channel gates, KDA, only with
plan.PREPARED_CHANNEL_SWEEP: M is then formed from decayed_keys.py's Q e^G); everything else runs as in hccompile. Checked against float64 on the kernel tests' cases, then timed:

    python benchmarks/analysis/m_form_sweep.py [--shapes B1T32768H16D128,B4T4096H16D128] [--ops gdn,kda] [--check-only]

Expected on the H200 from sweep_step_work.py: the sweep near its no-pdo time (0.649 ms at B1), the prepare kernel
~0.1 ms (q, P, W, dO read; M, dU written).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import check_cases, delta_rule_step, edited_module, time_step, use_kernel_tests  # noqa: E402

use_kernel_tests()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule import state as state_kernels  # noqa: E402
from hccompile.kernels.delta_rule.plan import block_size  # noqa: E402
from hccompile.kernels.delta_rule.tiles import _dot, _load_rows, _load_stored_rows, _store_rows  # noqa: E402

from sweep_step_work import LOCAL_DU, QUERY_TERM  # noqa: E402  (state.py's lines both prototypes edit)

CHAIN_DU = "            du += k_dstate\n"
NUM_CHUNKS = "        num_chunks = tl.cdiv(eos - bos, BT)\n"
SIGNATURE_END = "        qg_ptr,\n        kg_ptr,\n        PREPARED: tl.constexpr,\n        LOCAL_DU: tl.constexpr,\n    ):\n"
LAST_UPDATE = "            dstate -= _dot(tl.trans(w), du, dot_dtype, DOT_PRECISION)\n"
EDITS = [
    (SIGNATURE_END, SIGNATURE_END.replace("    ):\n", "        m_ptr,\n        local_du_ptr,\n    ):\n")),
    # dU's local part from a buffer of its own (local_du_ptr, a parameter the variant adds), loaded one chunk
    # ahead and carried: a tile that feeds no product is not software-pipelined (a plain ld.global a step in the
    # PTX, where the tiles that feed products arrive by cp.async), and the first timing (1.096 ms against 0.846,
    # session 48) read it in the step that used it
    (NUM_CHUNKS, NUM_CHUNKS + "        du_next = _load_rows(local_du_ptr + (batch * T) * HV * V + head * V, "
                 "bos + tl.maximum(num_chunks - 1, 0) * BT + local, vc, HV * V, 1, "
                 "local < tl.minimum(eos - (bos + tl.maximum(num_chunks - 1, 0) * BT), BT), V)\n"),
    (LOCAL_DU, "                du = du_next\n"
               "                du_next = _load_rows(local_du_ptr + (batch * T) * HV * V + head * V, "
               "bos + tl.maximum(chunk - 1, 0) * BT + local, vc, HV * V, 1, "
               "local < tl.minimum(eos - (bos + tl.maximum(chunk - 1, 0) * BT), BT), V)\n"),
    (CHAIN_DU, "            du = du + k_dstate\n"),
    (QUERY_TERM, "            m_tile = _load_stored_rows(m_ptr + (batch * T) * HV * K + head * K, tokens, kc, "
                 "HV * K, 1, valid, K)\n"
                 "            dstate += scale * _dot(tl.trans(m_tile), do_tile, dot_dtype, DOT_PRECISION)\n"),
    (LAST_UPDATE, "            dstate -= _dot(tl.trans(w), k_dstate, dot_dtype, DOT_PRECISION)\n"),
]


@triton.jit
def _m_form_prepare_kernel(q_ptr, cum_ptr, scores_ptr, w_ptr, do_ptr, m_ptr, du_ptr,
                           stride_qb, stride_qt, stride_qh, stride_qk,
                           stride_dob, stride_dot, stride_doh, stride_dov,
                           T, NT, HV, GROUP, K, V, scale,
                           GATE: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           DOT_PRECISION: tl.constexpr):
    """One chunk of one value head: M = e^G Q - P W into m ([B, T, HV, K], W's dtype) and scale P^T dO into du."""
    scale = tl.cast(scale, tl.float32)
    pid = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    batch = pid // NT
    chunk = pid % NT
    local = tl.arange(0, BT)
    tokens = chunk * BT + local
    valid = tokens < T
    kc = tl.arange(0, BK)
    vc = tl.arange(0, BV)
    dot_dtype = w_ptr.dtype.element_ty
    row = (batch * T) * HV + head
    scores = _load_rows(scores_ptr + row * BT, tokens, local, HV * BT, 1, valid, BT)
    scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
    w = _load_stored_rows(w_ptr + row * K, tokens, kc, HV * K, 1, valid, K)
    q = _load_rows(q_ptr + batch * stride_qb + (head // GROUP) * stride_qh, tokens, kc, stride_qt, stride_qk,
                   valid, K)
    if GATE == 1:
        q *= tl.exp(tl.load(cum_ptr + row + tokens * HV, mask=valid, other=0.0))[:, None]
    m = q - _dot(scores, w, dot_dtype, DOT_PRECISION)
    _store_rows(m_ptr + row * K, m, tokens, kc, HV * K, 1, valid, K)
    do_tile = _load_stored_rows(do_ptr + batch * stride_dob + head * stride_doh, tokens, vc, stride_dot, stride_dov,
                                valid, V)
    local_du = scale * _dot(tl.trans(scores), do_tile, dot_dtype, DOT_PRECISION)
    _store_rows(du_ptr + row * V, local_du, tokens, vc, HV * V, 1, valid, V)


PREPARE_WARPS = [4]  # the prepare kernel's num_warps (main's --prepare-warps times each)
ORIGINAL_DIRECT = chunk_kernels.direct
ORIGINAL_SWEEP = chunk_kernels._state_backward_kernel
_VARIANT = {}


def variant_sweep():
    if "sweep" not in _VARIANT:
        _VARIANT["sweep"] = edited_module(state_kernels, EDITS, "_state_m_form")._state_backward_kernel
    return _VARIANT["sweep"]


class MFormLaunch:
    """Stands for chunk.py's launch of _state_backward_kernel: the prepare kernel, then the sweep variant."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    @staticmethod
    def launch(grid, args, kwargs):
        if kwargs["IS_VARLEN"] or (kwargs["GATE"] == 2 and not kwargs["PREPARED"]):
            return ORIGINAL_DIRECT(ORIGINAL_SWEEP)[grid](*args, **kwargs)
        q, k, cum, w, scores, do, dht, dh, du, dh0 = args[:10]
        strides = args[10:30]
        q_strides, do_strides = strides[0:4], strides[8:12]
        T, NT, HV, GROUP, K, V, scale = args[32:39]
        gate = kwargs["GATE"]
        if gate == 2:  # per-channel gates: M from decayed_keys.py's Q e^G ([B, T, HV, K], one per value head)
            q, gate, GROUP = kwargs["qg_ptr"], 0, 1
            q_strides = q.stride()
        batch = q.shape[0]
        m, local_du = torch.empty_like(w), torch.empty_like(du)
        ORIGINAL_DIRECT(_m_form_prepare_kernel)[(batch * NT, HV)](
            q, cum, scores, w, do, m, local_du, *q_strides, *do_strides, T, NT, HV, GROUP, K, V, scale,
            GATE=gate, BT=kwargs["BT"], BK=block_size(K, 256), BV=block_size(V, 256),
            DOT_PRECISION=kwargs["DOT_PRECISION"], num_warps=PREPARE_WARPS[0])
        ORIGINAL_DIRECT(variant_sweep())[grid](*args, **kwargs, m_ptr=m, local_du_ptr=local_du)


def apply(variant: str) -> None:
    if variant == "default":
        chunk_kernels.direct = ORIGINAL_DIRECT
    else:
        chunk_kernels.direct = lambda kernel: MFormLaunch() if kernel is ORIGINAL_SWEEP else ORIGINAL_DIRECT(kernel)


def check(repeats: int) -> list[str]:
    import test_delta_rule_chunk as t

    return check_cases(t.KERNEL_CASES, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="B1T32768H16D128,B4T4096H16D128")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ops", default="gdn,kda")
    p.add_argument("--prepare-warps", default="4,8", help="the prepare kernel's num_warps to time, comma-separated")
    p.add_argument("--check-only", action="store_true")
    a = p.parse_args()
    if torch.cuda.is_available() and not a.check_only:
        for variant in ["default"] + [f"m-form-w{w}" for w in a.prepare_warps.split(",")]:
            apply(variant)
            if variant != "default":
                PREPARE_WARPS[0] = int(variant.rsplit("-w", 1)[1])
            for shape in a.shapes.split(","):
                for op in a.ops.split(","):
                    try:
                        ms, kernels = time_step(*delta_rule_step(op, shape), ("state_backward", "m_form"))
                        print(f"{variant:11s} {op} {shape}: fwd+bwd {ms:.3f} ms, state_backward "
                              f"{kernels['state_backward']:.3f} ms, prepare {kernels['m_form']:.3f} ms", flush=True)
                    except Exception:  # noqa: BLE001
                        print(f"{variant} {op} {shape}: timing failed\n{traceback.format_exc()}", flush=True)
    apply("m-form")
    failures = check(a.repeats)
    print(f"m-form: {'all cases right' if not failures else f'{len(failures)} wrong'}", flush=True)
    for line in failures[:12]:
        print(f"    {line}", flush=True)
    apply("default")


if __name__ == "__main__":
    main()
