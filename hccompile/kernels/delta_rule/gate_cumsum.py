"""Step 1 of the forward (gate_cumsum): the chunk-local cumulative log-gate G_t, the sum of g over
the chunk's tokens up to t, fp32 per value head and (KDA) key channel; with KDA's in-kernel gate, of
the gate activation of the raw g. Every later kernel reads its decays from G.

Run in reverse, the same kernel is the backward's last step: the gradient of g_t is the sum of dG
over the rest of t's chunk. The activation's own backward (to the raw g, A_log and dt_bias) is
elementwise and cheap, so autograd does it (gate_activation_backward).
"""

from __future__ import annotations

import torch

from .plan import Plan, block_size
from .reference import kda_gate

from .._triton import tl, triton

# Gate activations of gate_cumsum: none, KDA's softplus form, KDA's lower-bound form.
ACTIVATION_NONE, ACTIVATION_SOFTPLUS, ACTIVATION_SIGMOID = 0, 1, 2


if triton is not None:
    from .tiles import _load_rows, _row_chunk_coords, _store_rows, _varlen_chunk_coords

    @triton.jit
    def _gate_cumsum_kernel(
        g_ptr, out_ptr, A_log_ptr, dt_bias_ptr,
        stride_gb, stride_gt, stride_gh, stride_gk,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GK, lower_bound,
        ACTIVATION: tl.constexpr,
        REVERSE: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        IS_VARLEN: tl.constexpr,
    ):
        """out = chunk-local (reverse) cumulative sum over time of act(g); out is fp32 [B, T, HV, GK].

        GK is K for per-channel gates and 1 for scalar ones. The reverse sum is the
        backward of the forward one: dg_t = sum over t' >= t in the chunk of dG_t'.
        """
        # float32 whatever the launcher typed it (Inductor passes Python floats as fp64)
        lower_bound = tl.cast(lower_bound, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_k = tl.program_id(2)
        if IS_VARLEN:
            batch, start, length = _varlen_chunk_coords(pid_chunk, chunk_table_ptr, cu_seqlens_ptr, BT)
        else:
            batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
        local = tl.arange(0, BT)
        cols = pid_k * BK + tl.arange(0, BK)
        valid = local < length
        g = _load_rows(g_ptr + batch * stride_gb + head * stride_gh, start + local, cols,
                       stride_gt, stride_gk, valid, GK)
        if ACTIVATION != 0:
            rate = tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
            bias = tl.load(dt_bias_ptr + head * GK + cols, mask=cols < GK, other=0.0).to(tl.float32)
            x = g + bias[None, :]
            if ACTIVATION == 1:
                # Linear above 20, as torch's softplus; the clamp keeps exp finite there.
                softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
                g = -rate * softplus
            else:
                g = lower_bound * tl.sigmoid(rate * x)
            g = tl.where(valid[:, None], g, 0.0)
        total = tl.cumsum(g, axis=0)
        if REVERSE:
            total = tl.sum(g, axis=0)[None, :] - total + g
        out_row = HV * GK
        _store_rows(out_ptr + (batch * T) * out_row + head * GK, total, start + local, cols,
                    out_row, 1, valid, GK)


def launch_gate_cumsum(plan: Plan, g: torch.Tensor, activation: int, A_log, dt_bias, lower_bound, reverse: bool,
                       out: torch.Tensor | None = None):
    """The chunk-local (reverse) cumulative sum, fp32 [B, T, HV, K or 1], into `out` when given."""
    problem = plan.problem
    width = problem.key_dim if problem.gate == "channel" else 1
    if out is None:
        out = torch.empty(problem.batch, problem.time, problem.value_heads, width, dtype=torch.float32,
                          device=g.device)
    strides = g.stride() if g.dim() == 4 else (*g.stride(), 0)
    block_k = block_size(width)
    table, seqlens = plan.chunk_args()
    dummy = plan.dummy
    plan.launch(_gate_cumsum_kernel)[(plan.num_chunks, problem.value_heads, triton.cdiv(width, block_k))](
        g, out, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        *strides, table, seqlens,
        problem.time, plan.chunks_per_row, problem.value_heads, width,
        float(lower_bound) if lower_bound is not None else 0.0,
        ACTIVATION=activation, REVERSE=reverse, BT=plan.chunk_size, BK=block_k, IS_VARLEN=plan.varlen,
    )
    return out


def gate_activation_backward(g_raw, dg, A_log, dt_bias, lower_bound):
    """(dg_raw, dA_log, ddt_bias) through kda_gate by autograd: it is elementwise and cheap."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (g_raw, A_log, dt_bias)]
        gate = kda_gate(*leaves, lower_bound=lower_bound)
        return torch.autograd.grad(gate, leaves, dg)
