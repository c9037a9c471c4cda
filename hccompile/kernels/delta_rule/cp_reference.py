"""Plain-PyTorch references for context parallelism of the delta rule (cp.py's kernels and engine).

Token by token, with D_t = 1, exp(g_t) or diag(exp(g_t)) and (optionally l2-normalised) k_t:

    S_t = A_t S_{t-1} + beta_t k_t v_t^T,     A_t = (I - beta_t k_t k_t^T) D_t

so over a segment S_out = M S_in + H with M = A_T ... A_1 and H the state reached from S_in = 0.
The backward summary dH = dL/dS_in of L = <o, do> + <S_out, dht> comes from autograd through
the token recurrence (reference.naive_recurrent_delta_rule). Both are independent of the chunked
kernels they check.

Also here: the plain fold of summary chains (merge_chains_ref, the merge kernel's reference), and
the reference engine (CPForwardRef, CPBackwardRef): cp.py's per-rank forward and backward written
with chunk_delta_rule_ref and autograd, used as the documented fallback where the Triton kernels
cannot run (CPU without TRITON_INTERPRET=1, or float64 inputs).
"""
from __future__ import annotations

import torch

from .reference import (_prepare, check_delta_rule_inputs, chunk_delta_rule_ref, naive_recurrent_delta_rule)

__all__ = [
    "CPBackwardRef",
    "CPForwardRef",
    "merge_chains_ref",
    "summary_backward_ref",
    "summary_forward_ref",
]


def _sequences(q, cu_seqlens):
    batch, time = q.shape[0], q.shape[1]
    if cu_seqlens is None:
        return [(b, 0, time) for b in range(batch)]
    bounds = [int(x) for x in cu_seqlens]
    return [(0, lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def summary_forward_ref(q, k, v, beta, g=None, gate=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                        A_log=None, dt_bias=None, lower_bound=None) -> torch.Tensor:
    """[H | M] of every sequence by the token recurrence: float64 [N, HV, K, V + K]."""
    problem, q, k, v, beta, g, _, _ = _prepare(
        q.double(), k.double(), v.double(), beta.double(), None if g is None else g.double(), gate, None, None,
        cu_seqlens if cu_seqlens is None or isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu_seqlens),
        use_qk_l2norm_in_kernel, None if A_log is None else A_log.double(),
        None if dt_bias is None else dt_bias.double(), lower_bound)
    heads, key_dim, value_dim = problem.value_heads, problem.key_dim, problem.value_dim
    out = []
    eye = torch.eye(key_dim, dtype=torch.float64)
    for b, bos, eos in _sequences(q, cu_seqlens):
        h = torch.zeros(heads, key_dim, value_dim, dtype=torch.float64)
        m = eye.expand(heads, key_dim, key_dim).clone()
        for t in range(bos, eos):
            decay = g[b, t].exp()[..., None] if g is not None else 1.0  # [HV, K, 1]
            kk = k[b, t]  # [HV, K]
            project = eye - beta[b, t][:, None, None] * kk[:, :, None] * kk[:, None, :]
            h = project @ (decay * h) + beta[b, t][:, None, None] * kk[:, :, None] * v[b, t][:, None, :]
            m = project @ (decay * m)
        out.append(torch.cat([h, m], dim=-1))
    return torch.stack(out)


def summary_backward_ref(q, k, v, beta, g=None, gate=None, scale=None, cu_seqlens=None,
                         use_qk_l2norm_in_kernel=False, A_log=None, dt_bias=None, lower_bound=None, *, do,
                         dht=None) -> torch.Tensor:
    """[dH | M^T] of every sequence: dH by autograd through the float64 recurrence; float64 [N, HV, K, V + K]."""
    problem = check_delta_rule_inputs(q, k, v, beta, g, gate, None,
                                      None if cu_seqlens is None else torch.as_tensor(cu_seqlens), A_log, dt_bias,
                                      lower_bound)
    heads, key_dim, value_dim = problem.value_heads, problem.key_dim, problem.value_dim
    start = torch.zeros(problem.num_sequences, heads, key_dim, value_dim, dtype=torch.float64, requires_grad=True)
    as64 = {n: None if t is None else t.detach().double()
            for n, t in dict(q=q, k=k, v=v, beta=beta, g=g, A_log=A_log, dt_bias=dt_bias).items()}
    with torch.enable_grad():
        o, final = naive_recurrent_delta_rule(
            as64["q"], as64["k"], as64["v"], as64["beta"], as64["g"], gate=gate, scale=scale, initial_state=start,
            output_final_state=True, cu_seqlens=None if cu_seqlens is None else torch.as_tensor(cu_seqlens),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, A_log=as64["A_log"], dt_bias=as64["dt_bias"],
            lower_bound=lower_bound)
        loss = (o * do.double()).sum()
        if dht is not None:
            loss = loss + (final * dht.double()).sum()
        (dh,) = torch.autograd.grad(loss, start)
    transition = summary_forward_ref(q, k, v, beta, g, gate, cu_seqlens, use_qk_l2norm_in_kernel, A_log, dt_bias,
                                     lower_bound)[..., value_dim:]
    return torch.cat([dh, transition.transpose(-1, -2)], dim=-1)


def merge_chains_ref(plan, direction: str, summaries_out: torch.Tensor, summaries_in: torch.Tensor | None,
                     out: torch.Tensor, value_dim: int) -> None:
    """The fold of cp.merge_chains in plain PyTorch (same arguments): for each incoming segment
    S = H_0, S = M_j S + H_j over its forward chain into out[segment]; for each outgoing segment
    S = dH_0, S = M_j^T S + dH_j over its backward chain, added to out[segment]."""
    heads_h = summaries_out[..., :value_dim]
    for segment in range(plan.num_segments):
        if direction == "forward" and plan.incoming[segment]:
            chain = plan.fwd_chain[segment]
            state = heads_h[chain[0]].to(out.dtype)
            for slot in chain[1:]:
                state = summaries_out[slot, :, :, value_dim:].to(out.dtype) @ state + heads_h[slot].to(out.dtype)
            out[segment] = state
        elif direction == "backward" and plan.outgoing[segment]:
            chain = plan.bwd_chain[segment]
            state = summaries_in[chain[0][0]].to(out.dtype)
            for h_slot, m_slot in chain[1:]:
                transition = summaries_out[m_slot, :, :, value_dim:].to(out.dtype)
                state = transition.transpose(-1, -2) @ state + summaries_in[h_slot].to(out.dtype)
            out[segment] += state


# ----------------------------------------------------------------------------------------
# Reference engine (same steps as cp.CPForward / cp.CPBackward)


def _flatten(x, batch, time):
    if x is None or batch == 1:
        return x
    return x.reshape(1, batch * time, *x.shape[2:])


class CPForwardRef:
    """cp.CPForward's protocol (prepare, overlap, finish; initial_states and summaries_out) with
    chunk_delta_rule_ref: states in float32, or float64 for float64 inputs."""

    merge = staticmethod(merge_chains_ref)

    def __init__(self, plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound, scale,
                 use_qk_l2norm_in_kernel, chunk_size, **extra):
        batch, time = q.shape[0], q.shape[1]
        if batch * time != plan.num_tokens:
            raise ValueError(f"q: {batch} x {time} local tokens, but the context parallel plan of rank {plan.rank} "
                             f"holds {plan.num_tokens}")
        self.plan, self.batch, self.time = plan, batch, time
        self.flat = {n: _flatten(x, batch, time) for n, x in dict(q=q, k=k, v=v, beta=beta, g=g).items()}
        self.extra = {n: _flatten(x, batch, time) for n, x in extra.items()}
        problem = check_delta_rule_inputs(*(self.flat[n] for n in ("q", "k", "v", "beta", "g")), gate, None, None,
                                          A_log, dt_bias, lower_bound, **self.extra)
        self.state_shape = (problem.value_heads, problem.key_dim, problem.value_dim)
        if initial_state is not None and tuple(initial_state.shape) != (plan.user_rows, *self.state_shape):
            raise ValueError(f"initial_state: shape {tuple(initial_state.shape)} differs from the expected "
                             f"{(plan.user_rows, *self.state_shape)} (one row per local sequence)")
        self.value_dim = problem.value_dim
        self.dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.device = q.device
        self.initial_state, self.A_log, self.dt_bias = initial_state, A_log, dt_bias
        self.options = dict(gate=gate, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            lower_bound=lower_bound, chunk_size=chunk_size)
        self.cu_seqlens = torch.tensor(plan.cu_seqlens(), dtype=torch.int64, device=q.device)
        self.summaries_out = self.summaries_in = None

    def _zeros(self, rows):
        return torch.zeros(rows, *self.state_shape, dtype=self.dtype, device=self.device)

    def _start_states(self, initial_state, merged=None):
        """[segments, HV, K, V]: the caller's rows for segments that begin a sequence, merged rows for
        incoming ones (when given), zeros elsewhere; differentiable in initial_state."""
        rows = []
        for segment in range(self.plan.num_segments):
            row = self.plan.initial_row[segment]
            if initial_state is not None and row >= 0:
                rows.append(initial_state[row].to(self.dtype))
            elif merged is not None and self.plan.incoming[segment]:
                rows.append(merged[segment])
            else:
                rows.append(self._zeros(1)[0])
        return torch.stack(rows) if rows else self._zeros(0)

    def _run(self, inputs, start_states):
        return chunk_delta_rule_ref(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], inputs["g"],
                                    initial_state=start_states, output_final_state=True, cu_seqlens=self.cu_seqlens,
                                    A_log=inputs.get("A_log"), dt_bias=inputs.get("dt_bias"), **self.options)

    def _inputs(self):
        return dict(self.flat, A_log=self.A_log, dt_bias=self.dt_bias)

    def _forward_summaries(self) -> None:
        plan = self.plan
        with torch.no_grad():
            _, final = self._run(self._inputs(), self._start_states(self.initial_state))
            width = self.value_dim + (self.state_shape[1] if plan.with_transition else 0)
            self.summaries_out = torch.zeros(plan.out_slots, *self.state_shape[:2], width, dtype=self.dtype,
                                             device=self.device)
            for segment in range(plan.num_segments):
                if not plan.outgoing[segment]:
                    continue
                slot = plan.out_slot[segment]
                self.summaries_out[slot, :, :, :self.value_dim] = final[segment]
                if plan.incoming[segment]:
                    self.summaries_out[slot, :, :, self.value_dim:] = self._transition(segment)
        self.initial_states = self._start_states(self.initial_state).detach().clone()

    def _transition(self, segment):
        """M of a segment: the end state from S_in = I with the values set to zero."""
        lo, hi = self.plan.bounds[segment]
        inputs = {n: (None if x is None else x[:, lo:hi]) for n, x in self.flat.items()}
        key_dim = self.state_shape[1]
        inputs["v"] = inputs["v"].new_zeros(*inputs["v"].shape[:3], key_dim)
        eye = torch.eye(key_dim, dtype=self.dtype, device=self.device).expand(1, self.state_shape[0], key_dim, key_dim)
        _, final = chunk_delta_rule_ref(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], inputs["g"],
                                        initial_state=eye, output_final_state=True, A_log=self.A_log,
                                        dt_bias=self.dt_bias, **self.options)
        return final[0]

    def prepare(self) -> None:
        self._forward_summaries()

    def overlap(self) -> None:
        pass

    def finish(self, output_final_state: bool):
        with torch.no_grad():
            o, final = self._run(self._inputs(), self._start_states(self.initial_state, self.initial_states))
        o = o.view(self.batch, self.time, *o.shape[2:])
        return o, (self._user_final(final) if output_final_state else None)

    def _user_final(self, final):
        rows = [final[s] if s >= 0 else self._zeros(1)[0] for s in self.plan.final_segment]
        return torch.stack(rows) if rows else self._zeros(0)


class CPBackwardRef(CPForwardRef):
    """cp.CPBackward's protocol with autograd through chunk_delta_rule_ref."""

    def __init__(self, plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound, scale,
                 use_qk_l2norm_in_kernel, chunk_size, *, do, dht=None):
        super().__init__(plan, q, k, v, beta, g, gate, initial_state, A_log, dt_bias, lower_bound, scale,
                         use_qk_l2norm_in_kernel, chunk_size, do=do)
        if dht is not None and tuple(dht.shape) != (plan.user_rows, *self.state_shape):
            raise ValueError(f"dht: shape {tuple(dht.shape)} differs from the expected "
                             f"{(plan.user_rows, *self.state_shape)}")
        self.originals = dict(q=q, k=k, v=v, beta=beta, g=g, initial_state=initial_state, A_log=A_log,
                              dt_bias=dt_bias)
        self.do, self.dht = self.extra["do"], dht

    def prepare(self) -> None:
        plan = self.plan
        self._forward_summaries()
        self.final_grads = self._zeros(plan.num_segments)
        if self.dht is not None:
            for row, segment in enumerate(plan.final_segment):
                if segment >= 0:
                    self.final_grads[segment] = self.dht[row].to(self.dtype)
        self.summaries_in = self._zeros(plan.in_slots)
        incoming = [s for s in range(plan.num_segments) if plan.incoming[s]]
        if incoming:
            with torch.enable_grad():
                start = self._start_states(self.initial_state).detach().requires_grad_()
                o, final = self._run(self._inputs(), start)
                (d_start,) = torch.autograd.grad((o, final), start, (self.do.to(o.dtype), self.final_grads))
            for segment in incoming:
                self.summaries_in[plan.in_slot[segment]] = d_start[segment]

    def finish(self) -> dict:
        names = ("q", "k", "v", "beta", "g", "A_log", "dt_bias")
        with torch.enable_grad():
            leaves = {n: self.originals[n].detach().requires_grad_() for n in names if self.originals[n] is not None}
            initial = self.originals["initial_state"]
            initial_leaf = None if initial is None else initial.detach().requires_grad_()
            inputs = {n: _flatten(leaves.get(n), self.batch, self.time) for n in ("q", "k", "v", "beta", "g")}
            inputs.update(A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"))
            o, final = self._run(inputs, self._start_states(initial_leaf, self.initial_states))
            wrt = list(leaves.values()) + ([initial_leaf] if initial_leaf is not None else [])
            grads = torch.autograd.grad((o, final), wrt, (self.do.to(o.dtype), self.final_grads), allow_unused=True)
        result = dict.fromkeys(("q", "k", "v", "beta", "g", "initial_state", "A_log", "dt_bias"))
        for name, leaf, grad in zip(list(leaves) + (["initial_state"] if initial_leaf is not None else []), wrt, grads):
            result[name] = torch.zeros_like(leaf) if grad is None else grad.to(leaf.dtype)
        return result
