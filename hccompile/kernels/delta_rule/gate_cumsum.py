"""Step 1 of the forward (gate_cumsum): the chunk-local cumulative log-gate G_t, the sum of g over
the chunk's tokens up to t, fp32 per value head and (KDA) key channel; with KDA's in-kernel gate, of
the gate activation of the raw g. Every later kernel reads its decays from G.

Run in reverse, the same kernel is the backward's last step: the gradient of g_t is the sum of dG
over the rest of t's chunk. With KDA's in-kernel gate, gate_backward's kernel takes that reverse sum
through the activation in the same pass (to the raw g, and per-chunk partial sums for A_log and
dt_bias): done by autograd in separate elementwise kernels it cost ~1.9 ms of a 20 ms step at B1
T32768 H16 K128 on the H100, ten passes over a [B, T, HV, K] fp32 tensor.
"""

from __future__ import annotations

import torch

from .plan import Plan, block_size
from .reference import kda_gate

from .._triton import cdiv, tl, triton

# Gate activations of gate_cumsum: none, KDA's softplus form, KDA's lower-bound form.
ACTIVATION_NONE, ACTIVATION_SOFTPLUS, ACTIVATION_SIGMOID = 0, 1, 2


if triton is not None:
    from .tiles import _load_rows, _row_chunk_coords, _store_rows, _varlen_chunk_coords

    @triton.jit
    def _activation_input(g, A_log_ptr, dt_bias_ptr, head, cols, GK):
        """(rate, x) of KDA's gate activation for a [BT, BK] tile of raw gates: rate = e^A_log of
        the head, x = g_raw + dt_bias of the tile's channels."""
        rate = tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
        bias = tl.load(dt_bias_ptr + head * GK + cols, mask=cols < GK, other=0.0).to(tl.float32)
        return rate, g + bias[None, :]

    @triton.jit
    def _softplus(x):
        # Linear above 20, as torch's softplus; the clamp keeps exp finite there.
        return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))

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
            seq = tl.load(chunk_table_ptr + 2 * pid_chunk)
            chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
            batch, start, length = _varlen_chunk_coords(chunk, tl.load(cu_seqlens_ptr + seq),
                                                        tl.load(cu_seqlens_ptr + seq + 1), BT)
        else:
            batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
        local = tl.arange(0, BT)
        cols = pid_k * BK + tl.arange(0, BK)
        valid = local < length
        g = _load_rows(g_ptr + batch * stride_gb + head * stride_gh, start + local, cols,
                       stride_gt, stride_gk, valid, GK)
        if ACTIVATION != 0:
            rate, x = _activation_input(g, A_log_ptr, dt_bias_ptr, head, cols, GK)
            if ACTIVATION == 1:
                g = -rate * _softplus(x)
            else:
                g = lower_bound * tl.sigmoid(rate * x)
            g = tl.where(valid[:, None], g, 0.0)
        total = tl.cumsum(g, axis=0)
        if REVERSE:
            total = tl.sum(g, axis=0)[None, :] - total + g
        out_row = HV * GK
        _store_rows(out_ptr + (batch * T) * out_row + head * GK, total, start + local, cols,
                    out_row, 1, valid, GK)


    @triton.jit
    def _scalar_gate_sum(g_ptr, cum_ptr, start, length, stride_gt, HV, BT: tl.constexpr):
        """G of one chunk of a scalar gate, the kernel above's sum without an activation, for a
        kernel that is its chunk's first reader (wy_solve, plan.FOLDED_GATE_SUMS): g_ptr and cum_ptr
        at the chunk's batch row and value head, G stored fp32 for the later kernels."""
        local = tl.arange(0, BT)
        valid = local < length
        g = tl.load(g_ptr + (start + local).to(tl.int64) * stride_gt, mask=valid, other=0.0).to(tl.float32)
        tl.store(cum_ptr + (start + local).to(tl.int64) * HV, tl.cumsum(g, axis=0), mask=valid)

    @triton.jit
    def _gate_backward_kernel(
        dcum_ptr, g_ptr, A_log_ptr, dt_bias_ptr, dg_ptr, dA_log_partial_ptr, dt_bias_partial_ptr,
        stride_gb, stride_gt, stride_gh, stride_gk,
        chunk_table_ptr, cu_seqlens_ptr,
        T, NT, HV, GK, lower_bound,
        ACTIVATION: tl.constexpr,
        BT: tl.constexpr,
        BK: tl.constexpr,
        IS_VARLEN: tl.constexpr,
    ):
        """dg_raw = act'(g_raw) * (reverse chunk-local sum of dG), stored in g's dtype, contiguous
        [B, T, HV, GK]; this chunk's sums of the A_log and dt_bias gradients go to the partial
        buffers [chunks, HV, cdiv(GK, BK)] and [chunks, HV, GK] (summed by the host: deterministic,
        unlike atomics)."""
        lower_bound = tl.cast(lower_bound, tl.float32)
        pid_chunk = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        pid_k = tl.program_id(2)
        if IS_VARLEN:
            seq = tl.load(chunk_table_ptr + 2 * pid_chunk)
            chunk = tl.load(chunk_table_ptr + 2 * pid_chunk + 1)
            batch, start, length = _varlen_chunk_coords(chunk, tl.load(cu_seqlens_ptr + seq),
                                                        tl.load(cu_seqlens_ptr + seq + 1), BT)
        else:
            batch, start, length = _row_chunk_coords(pid_chunk, T, NT, BT)
        local = tl.arange(0, BT)
        cols = pid_k * BK + tl.arange(0, BK)
        valid = local < length
        row = HV * GK
        dcum = _load_rows(dcum_ptr + (batch * T) * row + head * GK, start + local, cols, row, 1, valid, GK)
        dgate = tl.cumsum(dcum, axis=0, reverse=True)
        g = _load_rows(g_ptr + batch * stride_gb + head * stride_gh, start + local, cols,
                       stride_gt, stride_gk, valid, GK)
        rate, x = _activation_input(g, A_log_ptr, dt_bias_ptr, head, cols, GK)
        if ACTIVATION == 1:
            # gate = -rate softplus(x); softplus' = sigmoid, 1 above 20 (torch's threshold)
            slope = tl.where(x > 20.0, 1.0, tl.sigmoid(x))
            dx = -rate * slope * dgate
            dA_log = -rate * _softplus(x) * dgate  # d gate / d A_log = gate
        else:
            # gate = b sigmoid(rate x)
            s = tl.sigmoid(rate * x)
            dz = lower_bound * s * (1.0 - s) * dgate
            dx = rate * dz
            dA_log = rate * x * dz
        dx = tl.where(valid[:, None], dx, 0.0)
        dA_log = tl.where(valid[:, None], dA_log, 0.0)
        _store_rows(dg_ptr + (batch * T) * row + head * GK, dx, start + local, cols, row, 1, valid, GK)
        partial_row = (pid_chunk * HV + head).to(tl.int64)
        tl.store(dA_log_partial_ptr + partial_row * tl.num_programs(2) + pid_k, tl.sum(tl.sum(dA_log, axis=1), axis=0))
        tl.store(dt_bias_partial_ptr + partial_row * GK + cols, tl.sum(dx, axis=0), mask=cols < GK)


def gate_activation(problem, lower_bound) -> int:
    """The gate_cumsum activation of a problem: KDA's in-kernel gate (softplus, or sigmoid with a
    lower bound) or none."""
    if not problem.gate_in_kernel:
        return ACTIVATION_NONE
    return ACTIVATION_SOFTPLUS if lower_bound is None else ACTIVATION_SIGMOID


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
    plan.launch(_gate_cumsum_kernel)[(plan.num_chunks, problem.value_heads, cdiv(width, block_k))](
        g, out, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        *strides, table, seqlens,
        problem.time, plan.chunks_per_row, problem.value_heads, width,
        float(lower_bound) if lower_bound is not None else 0.0,
        ACTIVATION=activation, REVERSE=reverse, BT=plan.chunk_size, BK=block_k, IS_VARLEN=plan.varlen,
    )
    return out


# gate_backward's key tile and warps. In a KDA fwd+bwd with the gate in the kernel on one H200 (B1 T32768
# H16 K128, analysis/gate_backward_variants.py, session 47; moving its bytes takes 0.104-0.147 ms): BK 64
# and 4 warps with the reverse sum as total - scan + dG 0.553 ms (204 registers at sm_90), BK 32 and 8
# warps 0.401; with the reverse scan BK 32 and 4 warps 0.324 (79 registers), 8 warps ~0.39, 2 warps ~0.57,
# BK 64 0.58-0.71, BK 16 0.38. Taking four chunks a program, to reduce the partial sums across warps once
# per four (elementwise accumulators between), was slower in the step (0.432 ms, 141 registers) although
# the partial sums cost 0.08-0.18 ms of the kernel alone.
GATE_BACKWARD_BLOCK_K = 32
GATE_BACKWARD_WARPS = 4


def gate_backward(plan: Plan, dcum: torch.Tensor, g_raw: torch.Tensor, activation: int, A_log, dt_bias,
                  lower_bound, out: torch.Tensor | None = None):
    """(dg_raw, dA_log, ddt_bias) of KDA's in-kernel gate from dcum = dL/dG (fp32 [B, T, HV, K],
    contiguous): dg_raw in g_raw's dtype and shape, into `out` when it is contiguous in that dtype;
    dA_log and ddt_bias fp32."""
    problem = plan.problem
    width = problem.key_dim
    block_k = min(block_size(width), GATE_BACKWARD_BLOCK_K)
    tiles = cdiv(width, block_k)
    chunks, heads = plan.num_chunks, problem.value_heads
    device = dcum.device
    direct = out is not None and out.dtype == g_raw.dtype and out.is_contiguous()
    dg = out if direct else torch.empty(g_raw.shape, dtype=g_raw.dtype, device=device)  # [B, T, HV, K]
    dA_log_partial = torch.empty(chunks, heads, tiles, dtype=torch.float32, device=device)
    dt_bias_partial = torch.empty(chunks, heads, width, dtype=torch.float32, device=device)
    table, seqlens = plan.chunk_args()
    plan.launch(_gate_backward_kernel)[(chunks, heads, tiles)](
        dcum, g_raw, A_log, dt_bias, dg, dA_log_partial, dt_bias_partial, *g_raw.stride(), table, seqlens,
        problem.time, plan.chunks_per_row, heads, width,
        float(lower_bound) if lower_bound is not None else 0.0,
        ACTIVATION=activation, BT=plan.chunk_size, BK=block_k, IS_VARLEN=plan.varlen, num_warps=GATE_BACKWARD_WARPS,
    )
    if out is not None and not direct:
        dg = out.copy_(dg)
    return dg, dA_log_partial.sum((0, 2)), dt_bias_partial.sum(0).view(heads * width)


def gate_activation_backward(g_raw, dg, A_log, dt_bias, lower_bound):
    """(dg_raw, dA_log, ddt_bias) through kda_gate by autograd: it is elementwise and cheap."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (g_raw, A_log, dt_bias)]
        gate = kda_gate(*leaves, lower_bound=lower_bound)
        return torch.autograd.grad(gate, leaves, dg)
