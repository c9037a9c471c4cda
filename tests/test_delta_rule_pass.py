"""The delta-rule pass: plain-PyTorch (gated) delta rules — token loops, chunked forms with their
forward-substitution loop, scan — are lowered to hccompile::chunk_delta_rule (outputs and gradients
as the uncompiled function), near-misses are refused with their reason.

hccompile.nn's plain chunked forms are substituted by the op under hc (hccompile.substitutes); these
tests turn that off (Collect below) so that the pass sees their unrolled loops.

Most tests run the op through its documented plain-PyTorch fallback (TRITON_INTERPRET=0 for the
op's dispatch): they test the lowering, and the Triton interpreter would spend minutes on kernels
that tests/test_delta_rule_ops.py checks already. test_inductor_graphs_call_the_kernels runs the
kernels (interpreted on CPU)."""
import os

import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

import hccompile.passes.delta_rule  # noqa: F401  (registers the pass now)
import helpers
from helpers import fwd_bwd, rel_err
from hccompile.nn.delta_net import (plain_chunk_gated_delta_rule, plain_chunk_kda, plain_recurrent_delta_rule)

OP = "hccompile.chunk_delta_rule.default"
OP_BWD = "hccompile.chunk_delta_rule_backward.default"
TOL = 2e-5  # fp32 CPU tensors: the op's fallback vs the plain code, both float32 internally


@pytest.fixture
def reference_op(monkeypatch):
    """The op's plain-PyTorch fallback instead of interpreted kernels (CPU only)."""
    if torch.cuda.is_available():
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def Collect(**options):
    """hc with the substitutions off: hccompile.nn's plain chunked forms, which hc otherwise traces
    as the op (hccompile.substitutes), reach this pass as written, their loops unrolled."""
    disabled = tuple(options.pop("disable_passes", ())) + ("substitutes",)
    return helpers.Collect(disable_passes=disabled, **options)


def _inputs(B=1, T=21, H=2, HV=2, K=16, V=16, gate="scalar", h0=True, seed=0, layout="bthd"):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, HV, V, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    g = None
    if gate == "scalar":
        g = -0.3 * torch.rand(B, T, HV, generator=gen)
    elif gate == "channel":
        g = -0.3 * torch.rand(B, T, HV, K, generator=gen)
    state = torch.randn(B, HV, K, V, generator=gen) * 0.5 if h0 else None
    if layout == "bhtd":
        q, k, v, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, beta))
        g = None if g is None else g.transpose(1, 2).contiguous()
    return [x for x in (q, k, v, beta, g, state) if x is not None]


def _check(fn, inputs, forms=None, count=1, tol=TOL):
    be = Collect(compiler="aot_eager")
    out, grads = fwd_bwd(torch.compile(fn, backend=be, fullgraph=True), *inputs)
    ref, ref_grads = fwd_bwd(fn, *inputs)
    assert [m["pattern"] for m in be.matches] == ["delta_rule"] * count, be.refusals
    assert not be.refusals, be.refusals
    if forms is not None:
        assert [(m["form"], m["gate"]) for m in be.matches] == forms
    assert rel_err(out, ref) < tol
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < tol
    return be


def _both(o, state):
    # one output for fwd_bwd: the final state enters the loss too (its gradient path is checked)
    return torch.cat([o.flatten(), state.flatten()])


# --- token loops ----------------------------------------------------------------------------------
def recurrent_gdn_bthd(q, k, v, beta, g, h0):
    return _both(*plain_recurrent_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm=True))


def recurrent_kda_bthd(q, k, v, beta, g, h0):
    return _both(*plain_recurrent_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True))


def recurrent_delta_rule_no_state(q, k, v, beta):
    return plain_recurrent_delta_rule(q, k, v, beta, scale=0.5)[0]


def recurrent_bhtd_buffer(q, k, v, beta, g):
    """[B, H, T, D] inputs; outputs written into a preallocated buffer; the gate applied with
    torch.exp before a clone; the scale applied to each step's output."""
    B, H, T, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32)
    o = torch.zeros_like(v)
    for t in range(T):
        S = S.clone() * torch.exp(g[:, :, t])[..., None, None]
        k_t = F.normalize(k[:, :, t], dim=-1)
        v_new = (v[:, :, t] - (S * k_t[..., None]).sum(-2)) * beta[:, :, t, None]
        S = S + k_t.unsqueeze(-1) * v_new.unsqueeze(-2)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", F.normalize(q[:, :, t], dim=-1), S) * 0.125
    return o


def recurrent_keepdim_slices_cat(q, k, v, beta, g, h0):
    """[B, T, H, D]; one-token slices that keep the time axis, outputs concatenated along time."""
    S = h0
    outs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]   # [B, 1, H, D]
        S = S * g[:, t:t + 1].exp().transpose(1, 2)[..., None]        # [B, H, 1, 1]
        pred = torch.einsum("bthk,bhkv->bthv", k_t, S)
        delta = (v_t - pred) * beta[:, t:t + 1, :, None]
        S = S + torch.einsum("bthk,bthv->bhkv", k_t, delta)
        outs.append(torch.einsum("bthk,bhkv->bthv", q_t * q.shape[-1] ** -0.5, S))
    return torch.cat(outs, dim=1)


def test_recurrent_gdn_grouped_heads_l2norm_states(reference_op):
    be = _check(recurrent_gdn_bthd, _inputs(B=2, T=12, H=1, HV=2, V=8),
                forms=[("recurrent", "scalar")])
    (m,) = be.matches
    assert m["grouped_heads"] and m["use_qk_l2norm_in_kernel"] and m["initial_state"] and m["final_state"]
    assert m["scale"] == pytest.approx(16 ** -0.5)
    # the report says the unrolled loop's trip count stays guarded, and what serves every length
    assert "12 iterations" in m["lengths"] and "hccompile.chunk_gated_delta_rule" in m["lengths"], m["lengths"]


def test_recurrent_kda(reference_op):
    be = _check(recurrent_kda_bthd, _inputs(T=10, gate="channel"), forms=[("recurrent", "channel")])
    assert "hccompile.chunk_kda" in be.matches[0]["lengths"]


def test_recurrent_delta_rule_without_gate_or_state(reference_op):
    be = _check(recurrent_delta_rule_no_state, _inputs(T=9, gate=None, h0=False), forms=[("recurrent", "none")])
    (m,) = be.matches
    assert not m["initial_state"] and not m["final_state"] and m["scale"] == 0.5


def test_recurrent_bhtd_buffer_scale_and_l2norm_inside_the_loop(reference_op):
    be = _check(recurrent_bhtd_buffer, _inputs(T=11, h0=False, layout="bhtd"), forms=[("recurrent", "scalar")])
    (m,) = be.matches
    assert m["use_qk_l2norm_in_kernel"] and m["scale"] == 0.125
    assert m["layout"]["q"] == ["b0", "b1", "t", "d"]


def test_recurrent_keepdim_slices_and_cat(reference_op):
    _check(recurrent_keepdim_slices_cat, _inputs(T=8, H=2, HV=2), forms=[("recurrent", "scalar")])


# --- chunked forms --------------------------------------------------------------------------------
def chunk_gdn_padded(q, k, v, beta, g, h0):
    return _both(*plain_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               use_qk_l2norm=True, chunk_size=8))


def chunk_delta_rule_bhtd(q, k, v, beta):
    """[B, H, T, D] caller of the [B, T, H, D] plain function, T a multiple of the chunk."""
    o, _ = plain_chunk_gated_delta_rule(*(x.transpose(1, 2) for x in (q, k, v)), None, beta.transpose(1, 2),
                                        chunk_size=8)
    return o.transpose(1, 2)


def chunk_kda(q, k, v, beta, g, h0):
    return _both(*plain_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                                  chunk_size=8))


def test_chunked_gdn_padded_tail_grouped_heads(reference_op):
    be = _check(chunk_gdn_padded, _inputs(T=21, H=1, HV=2, V=8), forms=[("chunked (chunk 8)", "scalar")])
    (m,) = be.matches
    assert m["tokens"] == 21 and m["steps"] == 3 and m["grouped_heads"]


def test_chunked_delta_rule_bhtd_no_padding(reference_op):
    _check(chunk_delta_rule_bhtd, _inputs(T=24, gate=None, h0=False, layout="bhtd"),
           forms=[("chunked (chunk 8)", "none")])


def test_chunked_kda(reference_op):
    be = _check(chunk_kda, _inputs(T=19, gate="channel"), forms=[("chunked (chunk 8)", "channel")])
    # the loop that builds the intra-chunk matrix column by column carries nothing: noted, not refused
    notes = [n for r in be.reports for p in r.passes for n in p.notes]
    assert any("carries no value" in n for n in notes)


def test_long_loop_probe_checks_first_and_last_steps(reference_op):
    """40 steps: the probe runs steps 0-1 and 39 from the region, the rest from the op."""
    be = _check(recurrent_gdn_bthd, _inputs(T=40, K=16, V=16))
    assert be.matches[0]["steps"] == 40


# --- scan ---------------------------------------------------------------------------------------
def _gdn_step(S, xs):
    q, k, v, beta, g = xs
    S = S * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", S, k)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return S, torch.einsum("bhkv,bhk->bhv", S, q * 0.25)


def scan_gdn(q, k, v, beta, g, h0):
    xs = [x.movedim(1, 0) for x in (q, k, v, beta, g)]   # time first, as scan wants
    S, o = scan(_gdn_step, h0, xs)
    return _both(o.movedim(0, 1), S)


def test_scan_form(reference_op):
    be = _check(scan_gdn, _inputs(T=13), forms=[("scan", "scalar")])
    assert be.matches[0]["scale"] == 0.25
    assert "lengths" not in be.matches[0]  # a scan keeps the length symbolic: nothing to warn of


def test_scan_dynamic_length_compiles_once(reference_op):
    be = Collect(compiler="aot_eager")
    compiled = torch.compile(scan_gdn, backend=be, fullgraph=True, dynamic=True)
    for T in (9, 14, 23):
        inputs = _inputs(T=T, seed=T)
        out, grads = fwd_bwd(compiled, *inputs)
        ref, ref_grads = fwd_bwd(scan_gdn, *inputs)
        assert rel_err(out, ref) < TOL and all(rel_err(g, r) < TOL for g, r in zip(grads, ref_grads))
    assert len(be.reports) == 1 and len(be.matches) == 1, be.refusals


# --- roles come from use, not from argument order -------------------------------------------------
def caller_swaps_beta_and_g(q, k, v, beta, g, h0):
    # beta goes where the gate goes and g where beta goes: inside, the tensor under exp is the gate,
    # so this is the gated delta rule with the two tensors' roles exchanged, and lowered as such
    return _both(*plain_recurrent_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True))


def test_roles_come_from_use_not_argument_order(reference_op):
    _check(caller_swaps_beta_and_g, _inputs(T=8), forms=[("recurrent", "scalar")])


def test_two_layers_two_matches(reference_op):
    def two(q, k, v, beta, g, h0):
        o1, s1 = plain_recurrent_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
        o2, _ = plain_chunk_gated_delta_rule(q, k, o1.tanh(), g, beta, initial_state=s1, chunk_size=8)
        return o2

    _check(two, _inputs(T=12), count=2)


# --- near-misses: refused, left to Inductor, same results -----------------------------------------
def linear_attention_loop(q, k, v, beta, g, h0):
    S, outs = h0, []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None] + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * v[:, t])
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1)


def sign_flipped(q, k, v, beta, g, h0):
    S, outs = h0, []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S - torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1)


def gate_without_exp(q, k, v, beta, g, h0):
    S, outs = h0, []
    for t in range(q.shape[1]):
        S = S * (1.0 + g[:, t])[..., None, None]      # a linear decay, not exp of a log-gate
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1)


def beta_as_decay(q, k, v, beta, g, h0):
    # beta and g swapped inside the recurrence: beta decays the state without exp, exp(g) scales the
    # correction: no role assignment makes this the gated delta rule
    S, outs = h0, []
    for t in range(q.shape[1]):
        S = S * beta[:, t, :, None, None]
        delta = g[:, t].exp()[..., None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1)


def only_k_normalised(q, k, v, beta, g, h0):
    # the op's l2 option normalises q and k together: normalising k alone is not expressible
    k = F.normalize(k, dim=-1)
    return plain_recurrent_delta_rule(q, k, v, beta, g, initial_state=h0)[0]


def backwards_loop(q, k, v, beta, g, h0):
    S, outs = h0, []
    for t in reversed(range(q.shape[1])):
        S = S * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs[::-1], 1)


def output_from_final_state(q, k, v, beta, g, h0):
    S = h0
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
    return torch.einsum("bhkv,bthk->bthv", S, q)


def one_step_differs(q, k, v, beta, g, h0):
    S, outs = h0, []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        if t == 4:
            S = S * 0.5
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1)


def states_returned(q, k, v, beta, g, h0):
    S, outs, states = h0, [], []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        states.append(S)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1).sum() + torch.stack(states).sum()


class PerHeadDecay(torch.nn.Module):
    """A constant per-head decay (a parameter) inside the loop: lightning attention's, not a gate."""

    def __init__(self):
        super().__init__()
        self.log_decay = torch.nn.Parameter(-torch.rand(2))

    def forward(self, q, k, v, beta, g, h0):
        S, outs = h0, []
        for t in range(q.shape[1]):
            S = S * self.log_decay.exp()[None, :, None, None]
            delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
            S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
            outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
        return torch.stack(outs, 1)


def non_causal_chunk(q, k, v, beta):
    """The chunked delta rule whose intra-chunk scores are not masked: each chunk sees its future."""
    B, T, H, K = q.shape
    C = 4
    q, k, v, beta = (x.transpose(1, 2).reshape(B, H, T // C, C, *x.shape[3:]) for x in (q, k, v, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    attn = -(k_beta @ k.transpose(-1, -2)).masked_fill(torch.triu(torch.ones(C, C, dtype=torch.bool)), 0)
    for i in range(1, C):
        row, above = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * above).sum(-2)
    attn = attn + torch.eye(C)
    u, w = attn @ v_beta, attn @ k_beta
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for n in range(T // C):
        u_n = u[:, :, n] - w[:, :, n] @ S
        outs.append(q[:, :, n] @ S + (q[:, :, n] @ k[:, :, n].transpose(-1, -2)) @ u_n)   # no causal mask
        S = S + k[:, :, n].transpose(-1, -2) @ u_n
    return torch.cat(outs, dim=2)


def chunk_gdn_padded_with(q, k, v, beta, g, gate_pad=0.0, clone_rows=True):
    """A compact chunked GDN (chunk 4) whose padding of the log-gate is a parameter: with -1 the
    padded tail decays the final state. Every iteration is the same graph; only the last step's data
    shows the difference."""
    B, T, H, K = q.shape
    C = 4
    pad = (-T) % C

    def chunks(x, value=0.0):
        x = F.pad(x.transpose(1, 2), (0, 0, 0, pad) if x.dim() == 4 else (0, pad), value=value)
        return x.reshape(B, H, -1, C, *x.shape[3:])

    q, k, v, beta, g = chunks(q), chunks(k), chunks(v), chunks(beta), chunks(g, value=gate_pad).cumsum(-1)
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().tril()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(torch.triu(torch.ones(C, C, dtype=torch.bool)), 0)
    for i in range(1, C):
        if clone_rows:  # differentiable in eager
            row, above = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
            attn[..., i, :i] = row + (row.unsqueeze(-1) * above).sum(-2)
        else:  # the spelling of inference code: in place on the rows it reads
            attn[..., i, :i] = attn[..., i, :i] + (attn[..., i, :, None] * attn[..., :, :i]).sum(-2)
    attn = attn + torch.eye(C)
    u, w = attn @ v_beta, attn @ (k_beta * g.exp()[..., None])
    S = q.new_zeros(B, H, K, v.shape[-1])
    outs = []
    for n in range(u.shape[2]):
        u_n = u[:, :, n] - w[:, :, n] @ S
        scores = ((q[:, :, n] @ k[:, :, n].transpose(-1, -2)) * decay[:, :, n])
        outs.append((q[:, :, n] * g[:, :, n, :, None].exp()) @ S + scores @ u_n)
        g_n = g[:, :, n]
        S = S * g_n[..., -1, None, None].exp() + \
            (k[:, :, n] * (g_n[..., -1:] - g_n).exp()[..., None]).transpose(-1, -2) @ u_n
    return _both(torch.cat(outs, dim=2)[:, :, :T].transpose(1, 2), S)


def test_last_chunk_checked_by_the_probe(reference_op):
    inputs = _inputs(T=10, h0=False)
    _check(chunk_gdn_padded_with, inputs, forms=[("chunked (chunk 4)", "scalar")])
    torch._dynamo.reset()
    be = Collect(compiler="aot_eager")

    def decaying_padding(*args):
        return chunk_gdn_padded_with(*args, gate_pad=-1.0)

    out = torch.compile(decaying_padding, backend=be, fullgraph=True)(*inputs)
    assert be.matches == [] and any("probe mismatch (whole loop)" in r["reason"] for r in be.refusals), be.refusals
    torch.testing.assert_close(out, decaying_padding(*inputs), rtol=1e-5, atol=1e-5)


def test_forward_substitution_in_place_spelling(reference_op):
    """attn[..., i, :i] = attn[..., i, :i] + (attn[..., i, :, None] * attn[..., :, :i]).sum(-2): eager
    autograd rejects it (it overwrites what the product saved), the compiled and lowered function
    differentiates; compared with the clone spelling's eager gradients."""
    inputs = _inputs(T=11, h0=False)
    be = Collect(compiler="aot_eager")

    def in_place(*args):
        return chunk_gdn_padded_with(*args, clone_rows=False)

    out, grads = fwd_bwd(torch.compile(in_place, backend=be, fullgraph=True), *inputs)
    ref, ref_grads = fwd_bwd(chunk_gdn_padded_with, *inputs)
    assert len(be.matches) == 1 and not be.refusals, be.refusals
    assert rel_err(out, ref) < TOL and all(rel_err(g, r) < TOL for g, r in zip(grads, ref_grads))


REFUSED = {
    linear_attention_loop: "probe mismatch",
    sign_flipped: "probe mismatch",
    gate_without_exp: "log-gate that enters an exp",
    beta_as_decay: "probe mismatch",
    only_k_normalised: "probe mismatch",
    backwards_loop: "backwards",
    output_from_final_state: "writes out no value",
    one_step_differs: "differs between steps",
    states_returned: "used outside the loop",
}


@pytest.mark.parametrize("fn", list(REFUSED), ids=lambda f: f.__name__)
def test_near_miss_refused_and_left_alone(fn):
    be = Collect(compiler="aot_eager")
    inputs = _inputs(T=7)
    out = torch.compile(fn, backend=be, fullgraph=True)(*inputs)
    assert be.matches == []
    reasons = [r["reason"] for r in be.refusals]
    assert any(REFUSED[fn] in r for r in reasons), reasons
    torch.testing.assert_close(out, fn(*inputs), rtol=1e-5, atol=1e-5)


def test_parameter_inside_the_loop_refused():
    be = Collect(compiler="aot_eager")
    m = PerHeadDecay()
    inputs = _inputs(T=6)
    torch.compile(m, backend=be, fullgraph=True)(*inputs)
    assert be.matches == []
    assert any("neither a per-token input" in r["reason"] for r in be.refusals), be.refusals


def test_non_causal_chunk_refused():
    be = Collect(compiler="aot_eager")
    inputs = _inputs(T=12, gate=None, h0=False)
    out = torch.compile(non_causal_chunk, backend=be, fullgraph=True)(*inputs)
    assert be.matches == [] and any("probe mismatch" in r["reason"] for r in be.refusals), be.refusals
    torch.testing.assert_close(out, non_causal_chunk(*inputs), rtol=1e-5, atol=1e-5)


def test_float64_refused():
    be = Collect(compiler="aot_eager")
    inputs = [x.double() for x in _inputs(T=5)]
    torch.compile(recurrent_kda_bthd, backend=be, fullgraph=True)(*inputs)
    assert be.matches == [] and any("float64" in r["reason"] for r in be.refusals), be.refusals


def test_probe_off_refuses():
    be = Collect(compiler="aot_eager", probe=False)
    torch.compile(recurrent_kda_bthd, backend=be, fullgraph=True)(*_inputs(T=5))
    assert be.matches == [] and any("probe=False" in r["reason"] for r in be.refusals)


def test_pass_can_be_disabled():
    be = Collect(compiler="aot_eager", disable_passes=["delta_rule"])
    torch.compile(recurrent_kda_bthd, backend=be, fullgraph=True)(*_inputs(T=5))
    assert be.matches == [] and all(p.name != "delta_rule" for r in be.reports for p in r.passes)


# --- through Inductor, with the kernels -----------------------------------------------------------
def test_inductor_graphs_call_the_kernels():
    be = Collect(force_disable_caches=True)
    inputs = _inputs(T=20, K=16, V=16)
    out, grads = fwd_bwd(torch.compile(chunk_gdn_padded, backend=be, fullgraph=True), *inputs)
    ref, ref_grads = fwd_bwd(chunk_gdn_padded, *inputs)
    assert be.ops("forward") == [OP] and be.ops("backward") == [OP_BWD]
    kernels = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    tol = 2e-3 if kernels else TOL  # the kernels' dots may round through tf32
    assert rel_err(out, ref) < tol
    assert all(rel_err(g, r) < tol for g, r in zip(grads, ref_grads))


# --- on the GPU: bf16 layers through Inductor and the kernels, and a long sequence ---------------
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_gpu_bf16_layer_lowered_to_the_kernels(kind):
    import copy

    from hccompile.nn.delta_net import GatedDeltaNet, KimiDeltaAttention

    torch.manual_seed(0)
    cls = GatedDeltaNet if kind == "gdn" else KimiDeltaAttention
    layer32 = cls(hidden_size=256, num_heads=2, head_dim=128, num_v_heads=4, mode="plain").cuda()
    layer = copy.deepcopy(layer32).to(torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda")
    be = Collect(force_disable_caches=True)
    out, (gx,) = fwd_bwd(torch.compile(layer, backend=be, fullgraph=True), x.to(torch.bfloat16))
    ref, (rx,) = fwd_bwd(layer32, x)
    delta = [m for m in be.matches if m["pattern"] == "delta_rule"]
    assert len(delta) == 1 and delta[0]["grouped_heads"], be.refusals
    # the layer's short convolutions (q, k, v) are the depthwise_conv pass's, not kernels
    assert [m["pattern"] for m in be.matches if m not in delta] == ["depthwise_conv1d"] * 3, be.matches
    assert be.ops("forward") == [OP] and be.ops("backward") == [OP_BWD]
    assert rel_err(out, ref) < 3e-2 and rel_err(gx, rx) < 3e-2


@pytest.mark.gpu
def test_gpu_long_sequence_pass_work_grows_linearly(monkeypatch):
    """T=8192 in chunks of 64: 128 chunk iterations and a 63-step substitution loop in the graph. The
    pass (analysis, probe, rewrite) stays linear in the loop's length, counted in calls of the passes'
    own functions (helpers.count_pass_work), not in seconds: no timed assertions in tests."""
    from hccompile.passes.delta_rule import DeltaRulePass

    calls = helpers.count_pass_work(monkeypatch, DeltaRulePass)

    def fn(q, k, v, beta, g):
        return plain_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=64)[0]

    def compiled(T):
        torch._dynamo.reset()
        inputs = [x.cuda().to(torch.bfloat16) for x in _inputs(B=1, T=T, H=4, HV=4, K=128, V=128, h0=False)]
        be = Collect(compiler="aot_eager")
        out = torch.compile(fn, backend=be, fullgraph=True)(*inputs)
        (m,) = be.matches
        assert m["steps"] == T // 64
        return calls[-1], inputs, out

    work_short, _, _ = compiled(2048)
    work_long, inputs, out = compiled(8192)
    assert work_long < 8 * work_short, (work_short, work_long)  # 4x the steps; quadratic would be 16x
    ref = fn(*[x.float() for x in inputs])
    assert rel_err(out, ref) < 2e-2
