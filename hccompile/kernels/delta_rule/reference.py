"""Plain PyTorch references for the (gated) delta rule: token by token, and chunked (WY form).

Per value head, with state S in R^{K x V}, decay D_t and l2-normalised (optional) q_t, k_t:

    S'_{t-1} = D_t S_{t-1}                       D_t = 1, exp(g_t) or diag(exp(g_t))
    S_t      = S'_{t-1} + beta_t k_t (v_t - S'_{t-1}^T k_t)^T
    o_t      = scale * S_t^T q_t

The decay comes before the delta correction, as in FLA's chunk kernels. Layout is FLA's:
q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H (value head h uses key head
h // (HV / H)); beta [B, T, HV]; g [B, T, HV] ("scalar") or [B, T, HV, K] ("channel");
states [N, HV, K, V]; variable-length batches are B = 1 plus cu_seqlens [N + 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..value_checks import host_ints

__all__ = [
    "GATE_KINDS",
    "DeltaRuleProblem",
    "check_delta_rule_inputs",
    "chunk_delta_rule_ref",
    "kda_gate",
    "l2norm",
    "naive_recurrent_delta_rule",
]

GATE_KINDS = ("none", "scalar", "channel")
L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class DeltaRuleProblem:
    """Sizes and options of one call, as validated by check_delta_rule_inputs."""

    batch: int
    time: int
    key_heads: int  # H
    value_heads: int  # HV
    key_dim: int
    value_dim: int
    gate: str
    gate_in_kernel: bool
    varlen: bool
    # (batch index, first token, end token) of every sequence of a varlen batch, in state order;
    # None for fixed-length rows (one sequence per row: sequence_bounds() lists them). Not built
    # for them, so that a symbolic batch size (torch.compile) stays symbolic.
    sequences: tuple[tuple[int, int, int], ...] | None

    @property
    def num_sequences(self) -> int:
        return self.batch if self.sequences is None else len(self.sequences)

    def sequence_bounds(self) -> tuple[tuple[int, int, int], ...]:
        """(batch index, first token, end token) of every sequence, in state order."""
        if self.sequences is None:
            return tuple((b, 0, self.time) for b in range(self.batch))
        return self.sequences

    @property
    def group_size(self) -> int:
        return self.value_heads // self.key_heads


def _require_tensor(name: str, tensor, dim: int | None = None, layout: str = "") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if dim is not None and tensor.dim() != dim:
        raise ValueError(f"{name}: expected a {dim}-D tensor {layout}, got shape {tuple(tensor.shape)}")


def _require_float(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {tensor.dtype}")


def _sequences_from_cu_seqlens(cu_seqlens, batch: int, time: int) -> tuple[tuple[int, int, int], ...]:
    _require_tensor("cu_seqlens", cu_seqlens, 1, "[N + 1]")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: requires B == 1, got B={batch}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: needs at least 2 entries (one sequence), got {cu_seqlens.numel()}")
    bounds = list(host_ints(cu_seqlens))
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens: must start at 0, got {bounds[0]}")
    if bounds[-1] != time:
        raise ValueError(f"cu_seqlens: must end at T={time}, got {bounds[-1]}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens: must be non-decreasing, got {bounds}")
    return _sequences(bounds)


def _sequences(bounds) -> tuple[tuple[int, int, int], ...]:
    return tuple((0, bos, eos) for bos, eos in zip(bounds, bounds[1:]))


def check_delta_rule_inputs(
    q,
    k,
    v,
    beta,
    g=None,
    gate: str | None = None,
    initial_state=None,
    cu_seqlens=None,
    A_log=None,
    dt_bias=None,
    lower_bound: float | None = None,
    **extra,
) -> DeltaRuleProblem:
    """Shape checks shared by the references and the Triton launchers; raises ValueError/TypeError.

    `gate` None infers the kind from g (absent: "none", 3-D: "scalar", 4-D: "channel").
    `extra` holds tensors shaped like the output, e.g. do=..., or (names starting with "dh")
    like the states, e.g. dht=....
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, tensor, 4, "[batch, time, heads, head_dim]")
        _require_float(name, tensor)
    _require_tensor("beta", beta, 3, "[batch, time, value_heads]")
    _require_float("beta", beta)
    batch, time, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: shape {tuple(k.shape)} differs from q's shape {tuple(q.shape)}")
    if tuple(v.shape[:2]) != (batch, time):
        raise ValueError(f"v: batch, time {tuple(v.shape[:2])} differ from q's {(batch, time)}")
    if key_heads < 1 or value_heads % key_heads != 0 or value_heads < 1:
        raise ValueError(f"v: heads HV={value_heads} must be a multiple of q's H={key_heads}")
    if key_dim < 1:
        raise ValueError(f"q: head dim must be at least 1, got {key_dim}")
    if value_dim < 1:
        raise ValueError(f"v: head dim must be at least 1, got {value_dim}")
    if tuple(beta.shape) != (batch, time, value_heads):
        raise ValueError(f"beta: shape {tuple(beta.shape)} differs from the expected {(batch, time, value_heads)}")

    if gate is None:
        gate = "none" if g is None else ("scalar" if getattr(g, "dim", lambda: 0)() == 3 else "channel")
    if gate not in GATE_KINDS:
        raise ValueError(f"gate: expected one of {GATE_KINDS}, got {gate!r}")
    if gate == "none":
        if g is not None:
            raise ValueError('g: must be None for gate="none"')
    else:
        expected = (batch, time, value_heads) if gate == "scalar" else (batch, time, value_heads, key_dim)
        if g is None:
            raise ValueError(f'g: required for gate="{gate}", shape {expected}')
        _require_tensor("g", g)
        _require_float("g", g)
        if tuple(g.shape) != expected:
            raise ValueError(f'g: shape {tuple(g.shape)} differs from the expected {expected} for gate="{gate}"')

    gate_in_kernel = A_log is not None or dt_bias is not None
    if gate_in_kernel:
        if gate != "channel":
            raise ValueError(f'A_log: the in-kernel gate needs gate="channel", got gate="{gate}"')
        if A_log is None or dt_bias is None:
            raise ValueError("A_log: the in-kernel gate needs both A_log and dt_bias")
        _require_tensor("A_log", A_log, 1, "[HV]")
        _require_tensor("dt_bias", dt_bias, 1, "[HV * K]")
        _require_float("A_log", A_log)
        _require_float("dt_bias", dt_bias)
        if A_log.shape[0] != value_heads:
            raise ValueError(f"A_log: shape {tuple(A_log.shape)} differs from the expected ({value_heads},)")
        if dt_bias.shape[0] != value_heads * key_dim:
            raise ValueError(
                f"dt_bias: shape {tuple(dt_bias.shape)} differs from the expected ({value_heads * key_dim},)"
            )
    elif lower_bound is not None:
        raise ValueError("lower_bound: only used by the in-kernel gate (pass A_log and dt_bias)")
    if lower_bound is not None and not float(lower_bound) < 0:
        raise ValueError(f"lower_bound: must be negative (a log-decay), got {lower_bound}")

    sequences = None if cu_seqlens is None else _sequences_from_cu_seqlens(cu_seqlens, batch, time)
    state_shape = (batch if sequences is None else len(sequences), value_heads, key_dim, value_dim)
    if initial_state is not None:
        _require_tensor("initial_state", initial_state, 4, "[N, HV, K, V]")
        _require_float("initial_state", initial_state)
        if tuple(initial_state.shape) != state_shape:
            raise ValueError(
                f"initial_state: shape {tuple(initial_state.shape)} differs from the expected {state_shape}"
            )
    for name, tensor in extra.items():
        if tensor is None:
            continue
        _require_tensor(name, tensor)
        _require_float(name, tensor)
        expected = state_shape if name.startswith("dh") else (batch, time, value_heads, value_dim)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from the expected {expected}")
    return _problem(q, v, gate, gate_in_kernel, cu_seqlens, sequences)


def _problem(q, v, gate: str, gate_in_kernel: bool, cu_seqlens, sequences) -> DeltaRuleProblem:
    batch, time, key_heads, key_dim = q.shape
    return DeltaRuleProblem(
        batch=batch,
        time=time,
        key_heads=key_heads,
        value_heads=v.shape[2],
        key_dim=key_dim,
        value_dim=v.shape[3],
        gate=gate,
        gate_in_kernel=gate_in_kernel,
        varlen=cu_seqlens is not None,
        sequences=sequences,
    )


def checked_problem(q, v, g=None, gate: str | None = None, cu_seqlens=None, A_log=None, dt_bias=None) -> DeltaRuleProblem:
    """The DeltaRuleProblem of inputs that check_delta_rule_inputs accepted before (a backward of
    the forward that checked them), without checking them again."""
    if gate is None:
        gate = "none" if g is None else ("scalar" if g.dim() == 3 else "channel")
    sequences = None if cu_seqlens is None else _sequences(host_ints(cu_seqlens))
    return _problem(q, v, gate, A_log is not None or dt_bias is not None, cu_seqlens, sequences)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (FLA's in-kernel l2norm, not F.normalize)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA's log-gate from raw activations g_raw [..., HV, K]; A_log [HV], dt_bias [HV * K].

    g = -exp(A_log) * softplus(g_raw + dt_bias), or with lower_bound b < 0:
    g = b * sigmoid(exp(A_log) * (g_raw + dt_bias)), which keeps every g in (b, 0).
    Computed in float32 (float64 for float64 inputs).
    """
    value_heads, key_dim = g_raw.shape[-2], g_raw.shape[-1]
    dtype = torch.float64 if torch.float64 in (g_raw.dtype, A_log.dtype, dt_bias.dtype) else torch.float32
    x = g_raw.to(dtype) + dt_bias.to(dtype).view(value_heads, key_dim)
    rate = A_log.to(dtype).exp().view(value_heads, 1)
    if lower_bound is None:
        return -rate * F.softplus(x)
    return lower_bound * torch.sigmoid(rate * x)


def _accumulation_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    # float64 stays float64 so that the references can be compared with each other exactly.
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _prepare(q, k, v, beta, g, gate, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias,
             lower_bound):
    problem = check_delta_rule_inputs(
        q, k, v, beta, g, gate, initial_state, cu_seqlens, A_log, dt_bias, lower_bound
    )
    acc = _accumulation_dtype(q, k, v)
    q, k = q.to(acc), k.to(acc)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    # Value head h reads key head h // group_size.
    q = q.repeat_interleave(problem.group_size, dim=2)
    k = k.repeat_interleave(problem.group_size, dim=2)
    if problem.gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    if problem.gate == "scalar":
        g = g.to(acc)[..., None].expand(*g.shape, problem.key_dim)
    elif problem.gate == "channel":
        g = g.to(acc)
    scale = problem.key_dim**-0.5 if scale is None else scale
    return problem, q, k, v.to(acc), beta.to(acc), g, scale, acc


def _initial_state(problem, initial_state, index, acc, device):
    if initial_state is None:
        return torch.zeros(problem.value_heads, problem.key_dim, problem.value_dim, dtype=acc, device=device)
    return initial_state[index].to(acc)


def naive_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    gate: str | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence; returns (o in v's dtype, final state [N, HV, K, V] or None).

    Computes in float32, or float64 when q, k or v is float64; differentiable by autograd.
    With A_log and dt_bias, g holds raw activations and the log-gate is kda_gate(g, ...).
    """
    problem, q, k, v_acc, beta, g, scale, acc = _prepare(
        q, k, v, beta, g, gate, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias,
        lower_bound,
    )
    outputs, states = [], []
    for index, (b, bos, eos) in enumerate(problem.sequence_bounds()):
        state = _initial_state(problem, initial_state, index, acc, q.device)
        steps = []
        for t in range(bos, eos):
            if g is not None:
                state = g[b, t].exp()[..., None] * state
            delta = v_acc[b, t] - torch.einsum("hkv,hk->hv", state, k[b, t])
            state = state + k[b, t][..., None] * (beta[b, t][:, None] * delta)[:, None, :]
            steps.append(scale * torch.einsum("hkv,hk->hv", state, q[b, t]))
        outputs.append(torch.stack(steps) if steps else v_acc.new_zeros(0, problem.value_heads, problem.value_dim))
        states.append(state)
    return _stack_outputs(problem, outputs, v), (torch.stack(states) if output_final_state else None)


def _stack_outputs(problem: DeltaRuleProblem, outputs: list[torch.Tensor], v: torch.Tensor) -> torch.Tensor:
    """Per-sequence [L, HV, V] outputs back to [B, T, HV, V] in v's dtype."""
    o = torch.cat(outputs)[None] if problem.varlen else torch.stack(outputs)
    return o.reshape(problem.batch, problem.time, problem.value_heads, problem.value_dim).to(v.dtype)


def chunk_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    gate: str | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY/UT-transform) form of naive_recurrent_delta_rule; same arguments and results.

    Within a chunk starting from state S0, with G the chunk-local cumulative log-gate and
    Gamma = exp(G) (per key channel):
      Kdot[t,s] = sum_c k[t,c] k[s,c] exp(G[t,c] - G[s,c])   (s < t)
      P[t,s]    = sum_c q[t,c] k[s,c] exp(G[t,c] - G[s,c])   (s <= t)
      A = (I + diag(beta) Kdot)^-1,  W = A diag(beta) (K * Gamma),  U~ = A diag(beta) V
      U = U~ - W S0          (the corrected values beta_t (v_t - S'_{t-1}^T k_t))
      O = scale ((Q * Gamma) S0 + P U)
      S_end = diag(Gamma_last) S0 + (K * exp(G_last - G))^T U
    Pairwise decays are formed from differences G[t] - G[s] <= 0, so nothing overflows.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size!r}")
    problem, q, k, v_acc, beta, g, scale, acc = _prepare(
        q, k, v, beta, g, gate, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias,
        lower_bound,
    )
    outputs, states = [], []
    for index, (b, bos, eos) in enumerate(problem.sequence_bounds()):
        state = _initial_state(problem, initial_state, index, acc, q.device)
        pieces = []
        for start in range(bos, eos, chunk_size):
            stop = min(start + chunk_size, eos)
            # [HV, C, D] per chunk.
            q_c, k_c, v_c = (x[b, start:stop].transpose(0, 1) for x in (q, k, v_acc))
            beta_c = beta[b, start:stop].transpose(0, 1)[..., None]
            length = stop - start
            if g is None:
                cum = torch.zeros(problem.value_heads, length, problem.key_dim, dtype=acc, device=q.device)
            else:
                cum = g[b, start:stop].transpose(0, 1).cumsum(dim=1)
            rows = torch.arange(length, device=q.device)
            strict = (rows[:, None] > rows[None, :])[None, :, :, None]
            inclusive = (rows[:, None] >= rows[None, :])[None, :, :, None]
            diff = cum[:, :, None, :] - cum[:, None, :, :]
            strict_decay = diff.masked_fill(~strict, float("-inf")).exp()
            inclusive_decay = diff.masked_fill(~inclusive, float("-inf")).exp()
            kdot = torch.einsum("htc,hsc,htsc->hts", k_c, k_c, strict_decay)
            scores = torch.einsum("htc,hsc,htsc->hts", q_c, k_c, inclusive_decay)
            eye = torch.eye(length, dtype=acc, device=q.device)
            solve = torch.linalg.solve_triangular(eye + beta_c * kdot, eye.expand_as(kdot), upper=False,
                                                  unitriangular=True)
            gamma = cum.exp()
            w = solve @ (beta_c * k_c * gamma)
            u = solve @ (beta_c * v_c) - w @ state
            pieces.append((scale * ((q_c * gamma) @ state + scores @ u)).transpose(0, 1))
            last = cum[:, -1:, :]
            state = last.transpose(1, 2).exp() * state + (k_c * (last - cum).exp()).transpose(1, 2) @ u
        outputs.append(torch.cat(pieces) if pieces else v_acc.new_zeros(0, problem.value_heads, problem.value_dim))
        states.append(state)
    return _stack_outputs(problem, outputs, v), (torch.stack(states) if output_final_state else None)


# ----------------------------------------------------------------------------------------
# The split wy_backward's two kernels (dqkw.py, wy_bwd.py), per chunk in float64: what each kernel
# computes from its inputs, for tests that run one kernel at a time. `chunks` lists (batch row, first
# token, valid rows) per global chunk (h[i], dh[i] are chunk i's start state and its gradient);
# `cum` is the chunk-local cumulative scalar log-gate [B, T, HV, 1] or None; q, k are [B, T, H, K]
# and value head hv reads key head hv // (HV / H). The score gradient through Kdot is taken the
# classic way, dbeta += rowsum(dL o Kdot), not wy_bwd.py's way without Kdot. Everything is computed
# on the device of the first tensor argument (do, v): every tensor made here is made there, and the
# other arguments are moved there (a test may pass a reference's own results back in).


def _chunk_decays(cum, b, start, length, hv, dtype, device):
    """(G [L], e^(G_t - G_s) for s <= t else 0 [L, L]) of one chunk, on `device`."""
    if cum is None:
        g = torch.zeros(length, dtype=dtype, device=device)
    else:
        g = cum[b, start:start + length, hv, 0].to(device=device, dtype=dtype)
    rows = torch.arange(length, device=device)
    visible = rows[:, None] >= rows[None, :]
    return g, (g[:, None] - g[None, :]).masked_fill(~visible, float("-inf")).exp()


def dqkw_ref(q, k, do, cum, u, du, h, dh, chunks, scale):
    """(dq, dk partial, dW [B, T, HV, K], dG partial [B, T, HV] or None) of dqkw.py, in float64."""
    f64 = torch.float64
    device = do.device
    batch, time, value_heads, _ = do.shape
    key_dim = q.shape[3]
    group = value_heads // q.shape[2]
    dq = torch.zeros(batch, time, value_heads, key_dim, dtype=f64, device=device)
    dk, dw = torch.zeros_like(dq), torch.zeros_like(dq)
    dg = torch.zeros(batch, time, value_heads, dtype=f64, device=device)
    for index, (b, start, length) in enumerate(chunks):
        span = slice(start, start + length)
        for hv in range(value_heads):
            q_c, k_c = (x[b, span, hv // group].to(device=device, dtype=f64) for x in (q, k))
            do_c, u_c, du_c = (x[b, span, hv].to(device=device, dtype=f64) for x in (do, u, du))
            h_c, dh_c = (x[index, hv].to(device=device, dtype=f64) for x in (h, dh))
            g, decays = _chunk_decays(cum, b, start, length, hv, f64, device)
            d_scores = scale * (do_c @ u_c.T) * decays
            dq_c = scale * g.exp()[:, None] * (do_c @ h_c.T) + d_scores @ k_c
            dk_scores = d_scores.T @ q_c
            dk_end = (u_c @ dh_c.T) * (g[-1] - g).exp()[:, None]
            dq[b, span, hv] = dq_c
            dk[b, span, hv] = dk_scores + dk_end
            dw[b, span, hv] = -du_c @ h_c.T
            dg_c = (q_c * dq_c - k_c * dk_scores - k_c * dk_end).sum(1)
            dg_c[-1] += (k_c * dk_end).sum() + g[-1].exp() * (h_c * dh_c).sum()
            dg[b, span, hv] = dg_c
    return dq, dk, dw, (dg if cum is not None else None)


def local_du_ref(scores, do, chunks, scale):
    """dU's local part scale P^T dO [B, T, HV, V] of local_du.py, in float64: P = `scores` [B, T, HV, BT]
    (the decayed scores, rows t, columns s of t's chunk), used where s <= t; rows outside `chunks` 0."""
    f64 = torch.float64
    batch, time, value_heads, value_dim = do.shape
    du = torch.zeros(batch, time, value_heads, value_dim, dtype=f64, device=do.device)
    for b, start, length in chunks:
        span = slice(start, start + length)
        visible = torch.ones(length, length, dtype=torch.bool, device=do.device).tril()
        for hv in range(value_heads):
            p = scores[b, span, hv, :length].to(f64).masked_fill(~visible, 0.0)
            du[b, span, hv] = scale * p.T @ do[b, span, hv].to(f64)
    return du


def wy_bwd_ref(k, v, beta, cum, inverse, du, dw, dk_partial, dg_partial, chunks):
    """(dv [B, T, HV, V], dbeta [B, T, HV], dk [B, T, HV, K], dG [B, T, HV] or None) of wy_bwd.py, in
    float64, given A (`inverse` [B, T, HV, BT]) and dqkw.py's dW, dk and dG partial sums."""
    f64 = torch.float64
    device = v.device
    batch, time, value_heads, value_dim = v.shape
    group = value_heads // k.shape[2]
    dv = torch.zeros(batch, time, value_heads, value_dim, dtype=f64, device=device)
    dbeta = torch.zeros(batch, time, value_heads, dtype=f64, device=device)
    dk = dk_partial.to(device=device, dtype=f64, copy=True)
    dg = dg_partial.to(device=device, dtype=f64, copy=True) if cum is not None else None
    for b, start, length in chunks:
        span = slice(start, start + length)
        for hv in range(value_heads):
            k_c = k[b, span, hv // group].to(device=device, dtype=f64)
            v_c, du_c, dw_c = (x[b, span, hv].to(device=device, dtype=f64) for x in (v, du, dw))
            beta_c = beta[b, span, hv].to(device=device, dtype=f64)
            a = inverse[b, span, hv, :length].to(device=device, dtype=f64).tril()
            g, decays = _chunk_decays(cum, b, start, length, hv, f64, device)
            gamma = g.exp()[:, None]
            d_inverse = du_c @ (v_c * beta_c[:, None]).T + dw_c @ (k_c * gamma * beta_c[:, None]).T
            a_t_du, a_t_dw = a.T @ du_c, a.T @ dw_c
            dv[b, span, hv] = a_t_du * beta_c[:, None]
            strict = torch.ones(length, length, dtype=torch.bool, device=device).tril(-1)
            d_lower = (-(a.T @ d_inverse @ a.T)).masked_fill(~strict, 0.0)
            kdot = (k_c @ k_c.T) * decays.masked_fill(~strict, 0.0)
            dbeta[b, span, hv] = (v_c * a_t_du).sum(1) + (k_c * gamma * a_t_dw).sum(1) + (d_lower * kdot).sum(1)
            d_kdot = beta_c[:, None] * d_lower * decays
            dk_w = a_t_dw * gamma * beta_c[:, None]
            dk[b, span, hv] += dk_w + d_kdot @ k_c + d_kdot.T @ k_c
            if dg is not None:
                dg[b, span, hv] += (k_c * dk_w).sum(1) + (k_c * (d_kdot @ k_c - d_kdot.T @ k_c)).sum(1)
    return dv, dbeta, dk, dg


# ----------------------------------------------------------------------------------------
# The forward's kernels that form the intra-chunk matrices themselves (plan.FUSED_SCORES_FORWARD: no
# decayed_scores launch): wy.py's wy_solve with FORM_KDOT and output.py's output kernel with
# FORM_SCORES, per chunk in float64 on the CPU, for tests that run one kernel at a time. `chunks`,
# `cum`, q and k as for dqkw_ref above; matrices are [B, T, HV, chunk_size], row t of a chunk against
# the chunk's columns, zero outside (s < t for Kdot, s <= t for P, s <= t for A).


def _chunk_pair_decays(cum, b, start, length, hv):
    """(G [L], e^(G_t - G_s) for s <= t else 0 [L, L]) of one chunk, float64 on the CPU."""
    if cum is None:
        g = torch.zeros(length, dtype=torch.float64)
    else:
        g = cum[b, start:start + length, hv, 0].to("cpu", torch.float64)
    rows = torch.arange(length)
    return g, (g[:, None] - g[None, :]).masked_fill(rows[:, None] < rows[None, :], float("-inf")).exp()


def intra_chunk_matrices_ref(q, k, cum, chunks, chunk_size, value_heads):
    """(Kdot, P) of every chunk and value head from the queries and keys, in float64: what
    decayed_scores stores and what wy_solve (FORM_KDOT) and the output kernel (FORM_SCORES) form.
    `cum`: None, a scalar gate's [B, T, HV, 1] or per-channel gates' [B, T, HV, K] cumulative sums."""
    f64, cpu = torch.float64, "cpu"
    batch, time, key_heads, _ = k.shape
    group = value_heads // key_heads
    q, k = q.to(cpu, f64), k.to(cpu, f64)
    kdot = torch.zeros(batch, time, value_heads, chunk_size, dtype=f64)
    scores = torch.zeros_like(kdot)
    for b, start, length in chunks:
        span = slice(start, start + length)
        for hv in range(value_heads):
            q_c, k_c = q[b, span, hv // group], k[b, span, hv // group]
            if cum is not None and cum.shape[-1] > 1:
                g = cum[b, span, hv].to(cpu, f64)
                rows = torch.arange(length)
                visible = (rows[:, None] >= rows[None, :])[:, :, None]
                decays = (g[:, None, :] - g[None, :, :]).masked_fill(~visible, float("-inf")).exp()
                kdot[b, span, hv, :length] = torch.einsum("tc,sc,tsc->ts", k_c, k_c, decays).tril(-1)
                scores[b, span, hv, :length] = torch.einsum("tc,sc,tsc->ts", q_c, k_c, decays)
                continue
            _, decays = _chunk_pair_decays(cum, b, start, length, hv)
            kdot[b, span, hv, :length] = ((k_c @ k_c.T) * decays).tril(-1)
            scores[b, span, hv, :length] = (q_c @ k_c.T) * decays
    return kdot, scores


def wy_solve_ref(k, v, beta, cum, chunks, chunk_size):
    """(A, W [B, T, HV, K], U~ [B, T, HV, V]) of wy_solve with Kdot formed from the keys (FORM_KDOT), in
    float64: A = (I + diag(beta) Kdot)^-1 per chunk, W = A diag(beta)(K e^G), U~ = A diag(beta) V."""
    f64, cpu = torch.float64, "cpu"
    batch, time, value_heads, value_dim = v.shape
    key_dim = k.shape[3]
    group = value_heads // k.shape[2]
    kdot, _ = intra_chunk_matrices_ref(k, k, cum, chunks, chunk_size, value_heads)
    k, v, beta = k.to(cpu, f64), v.to(cpu, f64), beta.to(cpu, f64)
    inverse = torch.zeros(batch, time, value_heads, chunk_size, dtype=f64)
    w = torch.zeros(batch, time, value_heads, key_dim, dtype=f64)
    u_tilde = torch.zeros(batch, time, value_heads, value_dim, dtype=f64)
    for b, start, length in chunks:
        span = slice(start, start + length)
        for hv in range(value_heads):
            g, _ = _chunk_pair_decays(cum, b, start, length, hv)
            beta_c = beta[b, span, hv][:, None]
            eye = torch.eye(length, dtype=f64)
            a = torch.linalg.inv(eye + beta_c * kdot[b, span, hv, :length])
            inverse[b, span, hv, :length] = a
            w[b, span, hv] = a @ (beta_c * k[b, span, hv // group] * g.exp()[:, None])
            u_tilde[b, span, hv] = a @ (beta_c * v[b, span, hv])
    return inverse, w, u_tilde


def output_ref(q, k, cum, h, u, chunks, scale, chunk_size):
    """(O [B, T, HV, V], P) of the output kernel with P formed from q and k (FORM_SCORES), in float64:
    O = scale ((Q e^G) h + P U) per chunk, h[i] chunk i's start state [HV, K, V], u the corrected values."""
    f64, cpu = torch.float64, "cpu"
    batch, time, value_heads, value_dim = u.shape
    group = value_heads // q.shape[2]
    _, scores = intra_chunk_matrices_ref(q, k, cum, chunks, chunk_size, value_heads)
    q, h, u = q.to(cpu, f64), h.to(cpu, f64), u.to(cpu, f64)
    o = torch.zeros(batch, time, value_heads, value_dim, dtype=f64)
    for index, (b, start, length) in enumerate(chunks):
        span = slice(start, start + length)
        for hv in range(value_heads):
            g, _ = _chunk_pair_decays(cum, b, start, length, hv)
            q_c = q[b, span, hv // group] * g.exp()[:, None]
            o[b, span, hv] = scale * (q_c @ h[index, hv] + scores[b, span, hv, :length] @ u[b, span, hv])
    return o, scores
