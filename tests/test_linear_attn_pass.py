"""The linear-attention pass: every claimed spelling is lowered (forward and backward), every
near-miss is refused with its reason, and the replaced graph computes what the original did."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import Collect, calls_through_hccompile_ops, fwd_bwd, rel_err

OP = "hccompile.lightning_attn.default"
OP_BWD = "hccompile.lightning_attn_backward.default"


def _mask(T, device):
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


# --- forms that must be lowered; inputs q, k, v are [B, H, T, D] unless the name says bthd -------
def bhtd_matmul_tril(q, k, v):
    return torch.tril(q @ k.transpose(-2, -1)) @ v


def bhtd_method_tril_scaled_scores(q, k, v):
    return (torch.matmul(q, k.mT) * q.shape[-1] ** -0.5).tril() @ v


def bhtd_scale_on_q_where(q, k, v):
    T = q.shape[-2]
    return torch.where(_mask(T, q.device), (q / 8.0) @ k.swapaxes(-1, -2), 0.0) @ v


def bhtd_multiplied_mask(q, k, v):
    T = q.shape[-2]
    return (0.5 * (q @ torch.transpose(k, 2, 3)) * _mask(T, q.device)) @ v


def bhtd_masked_fill_triu(q, k, v):
    T = q.shape[-2]
    future = torch.triu(torch.ones(T, T, device=q.device), 1).bool()
    return (q @ k.permute(0, 1, 3, 2)).masked_fill(future, 0.0) @ v


def flat_bmm(q, k, v):
    B, H, T, D = q.shape
    qf, kf, vf = (t.reshape(B * H, T, -1) for t in (q, k, v))
    y = torch.bmm(torch.tril(torch.bmm(qf, kf.transpose(1, 2))), vf)
    return y.view(B, H, T, -1)


def bthd_einsum(q, k, v):
    # the same [B,H,T,D] test inputs are viewed as [B,T,H,D] tensors, as an FLA user has them
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    T = q.shape[1]
    s = torch.einsum("bthd,bshd->bhts", q, k) * 0.25
    return torch.einsum("bhts,bshd->bthd", s.masked_fill(~_mask(T, q.device), 0), v)


def bhtd_einsum_multiplied_mask(q, k, v):
    # normalize rewrites both einsums into torch.matmul (kᵀ a torch.transpose): the matmul spelling
    T = q.shape[-2]
    s = torch.einsum("bhid,bhjd->bhij", q, k) * _mask(T, q.device)
    return torch.einsum("bhij,bhjd->bhid", s, v)


def bhtd_matmul_multiplied_mask(q, k, v):
    T = q.shape[-2]
    return (q @ k.transpose(-2, -1) * _mask(T, q.device)) @ v


def bthd_matmul_permuted(q, k, v):
    # bthd_einsum in matmul spelling
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    T = q.shape[1]
    s = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) * 0.25
    return (s.masked_fill(~_mask(T, q.device), 0) @ v.transpose(1, 2)).transpose(1, 2)


def bthd_matmul_transposed(q, k, v):
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # real [B,T,H,D] tensors
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return (torch.tril(qt @ kt.transpose(-2, -1)) @ vt).transpose(1, 2)


LOWERED = [bhtd_matmul_tril, bhtd_method_tril_scaled_scores, bhtd_scale_on_q_where,
           bhtd_multiplied_mask, bhtd_masked_fill_triu, flat_bmm, bthd_einsum,
           bthd_matmul_transposed, bhtd_einsum_multiplied_mask]


def _inputs(B=2, H=3, T=21, K=16, V=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, d, generator=g, dtype=dtype) for d in (K, K, V)]


@pytest.mark.parametrize("normalized", [True, False], ids=["normalized", "as written"])
@pytest.mark.parametrize("fn", LOWERED, ids=lambda f: f.__name__)
def test_form_is_lowered_and_matches_eager(fn, normalized):
    """With the normalising pre-pass (one spelling per op) and without it (the matcher reads every
    spelling itself): both lower every form."""
    be = Collect(compiler="aot_eager", disable_passes=() if normalized else ("normalize",))
    compiled = torch.compile(fn, backend=be, fullgraph=True)
    q, k, v = _inputs()
    out, grads = fwd_bwd(compiled, q, k, v)
    ref, ref_grads = fwd_bwd(fn, q, k, v)
    assert [m["pattern"] for m in be.matches] == ["causal_linear_attn"], be.refusals
    assert [m["op"] for m in be.matches] == ["lightning_attn"]
    assert be.ops("dynamo") == [] and not be.refusals
    assert rel_err(out, ref) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("einsum_fn, matmul_fn, anchor", [
    (bhtd_einsum_multiplied_mask, bhtd_matmul_multiplied_mask, "einsum_1"),  # the value einsum, now a matmul
    (bthd_einsum, bthd_matmul_permuted, "matmul"),  # before einsum_1, now the transpose into [B, T, H, D]
], ids=["bhtd", "bthd"])
def test_einsum_attention_is_matched_as_its_matmul_spelling(einsum_fn, matmul_fn, anchor):
    """The normalising pre-pass rewrites einsum attention into torch.matmul (and transposes or
    permutes): the pass matches it as it matches the matmul spelling, with the same form, op, layout
    and scale, at the value product."""
    q, k, v = _inputs()
    found = {}
    for fn in (einsum_fn, matmul_fn):
        be = Collect(compiler="aot_eager")
        out, grads = fwd_bwd(torch.compile(fn, backend=be, fullgraph=True), q, k, v)
        ref, ref_grads = fwd_bwd(fn, q, k, v)
        assert rel_err(out, ref) < 1e-5 and all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))
        (match,) = be.matches
        found[fn] = {key: match[key] for key in ("pattern", "form", "op", "layout", "scale")}
        found[fn, "node"] = match["node"]
        (record,) = [p for r in be.reports for p in r.passes if p.name == "normalize"]
        found[fn, "normalize"] = record.notes
    assert found[einsum_fn] == found[matmul_fn]
    assert found[einsum_fn, "node"] == anchor
    assert found[einsum_fn]["pattern"] == "causal_linear_attn"
    (note,) = [n for n in found[einsum_fn, "normalize"] if n.startswith("matrix product:")]
    assert note.count("einsum(") == 2, note


@pytest.mark.parametrize("fn", [bhtd_matmul_tril, bthd_einsum], ids=lambda f: f.__name__)
def test_inductor_forward_and_backward_use_our_ops(fn):
    be = Collect(force_disable_caches=True)  # a cache hit would skip the inventory pass
    compiled = torch.compile(fn, backend=be, fullgraph=True)
    q, k, v = _inputs(T=40)
    out, grads = fwd_bwd(compiled, q, k, v)
    ref, ref_grads = fwd_bwd(fn, q, k, v)
    assert be.ops("forward") == [OP]
    assert be.ops("backward") == [OP_BWD]
    assert rel_err(out, ref) < 1e-5
    assert all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))


def test_dynamic_sequence_length_compiles_once():
    be = Collect(compiler="aot_eager")
    compiled = torch.compile(bhtd_matmul_tril, backend=be, fullgraph=True, dynamic=True)
    for T in (17, 33, 64, 70):
        q, k, v = _inputs(T=T, seed=T)
        out, grads = fwd_bwd(compiled, q, k, v)
        ref, ref_grads = fwd_bwd(bhtd_matmul_tril, q, k, v)
        assert rel_err(out, ref) < 1e-5
        assert all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))
    assert len(be.reports) == 1, "recompiled for a new sequence length"
    assert len(be.matches) == 1


def test_automatic_dynamic_after_second_length():
    be = Collect(compiler="aot_eager")
    compiled = torch.compile(bhtd_matmul_tril, backend=be, fullgraph=True)
    for T in (10, 20, 30, 40):
        compiled(*_inputs(T=T))
    assert len(be.reports) <= 2
    assert len(be.matches) == len(be.reports)


def test_bf16_inputs_lowered():
    be = Collect(compiler="aot_eager")
    q, k, v = _inputs(dtype=torch.bfloat16)
    out = torch.compile(bhtd_matmul_tril, backend=be, fullgraph=True)(q, k, v)
    ref = bhtd_matmul_tril(q.double(), k.double(), v.double())
    assert len(be.matches) == 1
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2


def test_module_in_model_lowered_with_inductor():
    from hccompile.nn import TinyLinearTransformer

    torch.manual_seed(0)
    for layout in ("bhtd", "bthd"):
        m = TinyLinearTransformer(dim=32, num_heads=2, layers=1, layout=layout)
        be = Collect()
        x = torch.randn(2, 19, 32)
        out, (gx,) = fwd_bwd(torch.compile(m, backend=be, fullgraph=True), x)
        ref, (rx,) = fwd_bwd(m, x)
        assert len(be.matches) == 1, (layout, be.refusals)
        assert rel_err(out, ref) < 1e-5 and rel_err(gx, rx) < 1e-5


# --- near-misses that must be refused -------------------------------------------------------------
def non_causal(q, k, v):
    return (q @ k.transpose(-2, -1)) @ v


def softmax_attention(q, k, v):
    T = q.shape[-2]
    s = (q @ k.transpose(-2, -1)).masked_fill(~_mask(T, q.device), float("-inf"))
    return F.softmax(s, dim=-1) @ v


def softmax_after_tril(q, k, v):
    return torch.softmax(torch.tril(q @ k.transpose(-2, -1)), dim=-1) @ v


def anti_causal_triu(q, k, v):
    return torch.triu(q @ k.transpose(-2, -1)) @ v


def strictly_causal(q, k, v):
    return torch.tril(q @ k.transpose(-2, -1), diagonal=-1) @ v


def wrong_mask_orientation(q, k, v):
    T = q.shape[-2]
    return (q @ k.transpose(-2, -1)).masked_fill(_mask(T, q.device), 0.0) @ v


def normalised(q, k, v):
    s = torch.tril(q @ k.transpose(-2, -1))
    return (s / s.sum(-1, keepdim=True)) @ v


def relu_scores(q, k, v):
    s = q @ k.transpose(-2, -1)
    return s.masked_fill(s < 0, 0.0) @ v


def float64_inputs(q, k, v):
    return bhtd_matmul_tril(q.double(), k.double(), v.double())


REFUSED = {
    non_causal: "no causal mask",
    softmax_attention: "softmax",
    softmax_after_tril: "softmax",
    anti_causal_triu: "triu",
    strictly_causal: "diagonal=-1",
    wrong_mask_orientation: "probe mismatch",
    normalised: "normaliser",
    relu_scores: "data-dependent mask",
    float64_inputs: "float64",
}


def decay_mask(q, k, v):
    T = q.shape[-2]
    i = torch.arange(T, device=q.device)
    decay = torch.where(i[:, None] >= i[None, :], 0.9 ** (i[:, None] - i[None, :]).float(), 0.0)
    return ((q @ k.transpose(-2, -1)) * decay) @ v


def test_decay_mask_goes_to_the_decay_form():
    """A decay is not the plain form: it is lowered to lightning_attn with γ = log 0.9 (more decay
    forms and their near-misses: test_lightning_pass.py)."""
    be = Collect(compiler="aot_eager")
    q, k, v = _inputs()
    out, grads = fwd_bwd(torch.compile(decay_mask, backend=be, fullgraph=True), q, k, v)
    ref, ref_grads = fwd_bwd(decay_mask, q, k, v)
    assert [(m["pattern"], m["op"]) for m in be.matches] == [("decayed_linear_attn", "lightning_attn")]
    assert be.matches[0]["decay"] == [pytest.approx(math.log(0.9), rel=1e-5)]
    assert rel_err(out, ref) < 1e-5 and all(rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("fn", list(REFUSED), ids=lambda f: f.__name__)
def test_near_miss_refused_and_left_alone(fn):
    be = Collect(compiler="aot_eager")
    q, k, v = _inputs()
    out = torch.compile(fn, backend=be, fullgraph=True)(q, k, v)
    assert be.matches == []
    reasons = [r["reason"] for r in be.refusals]
    assert any(REFUSED[fn] in r for r in reasons), reasons
    torch.testing.assert_close(out, fn(q, k, v), rtol=1e-5, atol=1e-5)


def mask_argument(q, k, v, mask):
    return (q @ k.transpose(-2, -1)).masked_fill(~mask, 0.0) @ v


def padding_mask(q, k, v):
    keep = torch.ones(q.shape[0], 1, 1, q.shape[-2])
    keep[0, ..., -3:] = 0  # padding on the first sequence
    return (torch.tril(q @ k.transpose(-2, -1)) * keep) @ v


def test_mask_from_an_input_refused():
    """The probe sees one value of a mask passed in; another call may pass another: refused."""
    be = Collect(compiler="aot_eager")
    q, k, v = _inputs()
    mask = _mask(q.shape[-2], q.device)
    out = torch.compile(mask_argument, backend=be, fullgraph=True)(q, k, v, mask)
    assert be.matches == []
    assert any("forward input" in r["reason"] for r in be.refusals), be.refusals
    torch.testing.assert_close(out, mask_argument(q, k, v, mask))


def test_padding_mask_refused():
    be = Collect(compiler="aot_eager")
    q, k, v = _inputs()
    out = torch.compile(padding_mask, backend=be, fullgraph=True)(q, k, v)
    assert be.matches == []
    assert any("padding mask" in r["reason"] for r in be.refusals), be.refusals
    torch.testing.assert_close(out, padding_mask(q, k, v))


def test_head_dim_over_limit_refused():
    be = Collect(compiler="aot_eager")
    q, k, v = _inputs(T=5, K=300, V=8)
    torch.compile(bhtd_matmul_tril, backend=be)(q, k, v)
    assert be.matches == []
    assert any("head dim 300 exceeds" in r["reason"] for r in be.refusals)


def test_probe_off_still_lowers_structural_match():
    be = Collect(compiler="aot_eager", probe=False)
    torch.compile(bhtd_matmul_tril, backend=be)(*_inputs())
    assert be.matches and be.matches[0]["probe_rel_err"] is None


def test_pass_can_be_disabled():
    be = Collect(compiler="aot_eager", disable_passes=["linear_attn"])
    torch.compile(bhtd_matmul_tril, backend=be)(*_inputs())
    assert be.matches == [] and all(p.name != "linear_attn" for r in be.reports for p in r.passes)


@pytest.mark.gpu
def test_gpu_inductor_code_launches_the_linear_attn_kernel_directly():
    """Issue 24: on CUDA causal_linear_attn is traced into its kernel launches (one forward, three
    backward), so Inductor's output code launches the kernel itself, with no call through
    torch.ops.hccompile; the report still names one op per direction."""
    from torch._inductor.utils import run_and_get_code

    import hccompile

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 100, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    be = Collect()
    fn = torch.compile(lambda q, k, v: hccompile.causal_linear_attn(q, k, v), backend=be)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _, codes = run_and_get_code(lambda: fn(*leaves).float().square().sum().backward())
    code = "\n".join(codes)
    assert "_masked_linear_attn_kernel" in code
    assert not calls_through_hccompile_ops(code), calls_through_hccompile_ops(code)[:5]
    assert be.ops("forward") == ["hccompile.causal_linear_attn.default"]
    assert be.ops("backward") == ["hccompile.causal_linear_attn_backward.default"]
    out, grads = fwd_bwd(fn, q, k, v)
    ref, ref_grads = fwd_bwd(lambda q, k, v: hccompile.causal_linear_attn(q.double(), k.double(), v.double()),
                             q, k, v)
    assert rel_err(out, ref) < 2e-2
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 3e-2
