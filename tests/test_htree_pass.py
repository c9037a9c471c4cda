"""The htree pass: HTreeAttention's plain-PyTorch core (and the bare function) is found under
backend="hc", proven on probe inputs and lowered to hccompile::htree_attention; outputs and
gradients equal the uncompiled module; near-misses (another pooling, no forced rightmost node,
other scores) and dynamic lengths are refused with their reasons.

Most tests run the op's reference implementation (TRITON_INTERPRET=0, a call-time switch): what
is tested here is the rewrite; the kernels are tested in tests/kernels/test_htree_triton.py, and
one test here runs them (interpreter or GPU) through the whole pipeline."""
from __future__ import annotations

import pytest
import torch

import hccompile.lowering.htree  # noqa: F401  (registers the ops, and defines the kernels before any test
import hccompile.nn.htree as plain  # switches TRITON_INTERPRET off)
import hccompile.passes.htree  # noqa: F401  (registers the pass now)
from hccompile.kernels.htree.reference import htree_attention_ref
from hccompile.nn.htree import HTreeAttention, htree_attention_plain
from helpers import Collect, rel_err

OP = "hccompile.htree_attention.default"
OP_BWD = "hccompile.htree_attention_backward.default"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def reference_op(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def module_and_input(T=37, B=2, heads=4, kv_heads=2, head_dim=8, seed=0, **options):
    torch.manual_seed(seed)
    module = HTreeAttention(heads * head_dim, heads, kv_heads, head_dim, **options).to(DEVICE)
    return module, torch.randn(B, T, heads * head_dim, device=DEVICE)


def outputs_and_gradients(fn, module, x, seed=1):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    grads = torch.autograd.grad((out * weight).sum(), [x, *module.parameters()])
    return out.detach(), grads


def compile_and_compare(module, x, backend, tolerance=1e-5):
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    out, grads = outputs_and_gradients(compiled, module, x)
    ref, ref_grads = outputs_and_gradients(module, module, x)
    assert rel_err(out, ref) < tolerance
    for grad, ref_grad in zip(grads, ref_grads):
        assert rel_err(grad, ref_grad) < tolerance
    return backend


MODULE_CASES = {
    # name: (module_and_input kwargs, expected options)
    "gqa_seed_exact": (dict(compression_rate=4, top_k=2, max_top_nodes=8),
                       dict(compression_rate=4, top_k=2, max_top_nodes=8, causal=False, sort_mode="exact")),
    "causal_packed_r3": (dict(T=40, compression_rate=3, top_k=3, causal=True, sort_mode="packed"),
                         dict(compression_rate=3, top_k=3, max_top_nodes=9, causal=True, sort_mode="packed")),
    "mha_rope_base_500": (dict(T=30, heads=2, kv_heads=2, compression_rate=2, top_k=2, max_top_nodes=5,
                               rope_base=500.0),
                          # max_top_nodes 4 builds the same tree as 5 for T=30: top_k * r is preferred
                          dict(compression_rate=2, top_k=2, max_top_nodes=4, rope_base=500.0, causal=False)),
}


@pytest.mark.parametrize("name", list(MODULE_CASES))
def test_module_core_is_lowered_and_matches_eager(reference_op, name):
    kwargs, expected = MODULE_CASES[name]
    module, x = module_and_input(**kwargs)
    be = compile_and_compare(module, x, Collect(compiler="aot_eager"))
    assert [m["pattern"] for m in be.matches] == ["htree_attention"], be.refusals
    assert not be.refusals
    options = be.matches[0]["options"]
    for key, value in expected.items():
        assert options[key] == value, key
    assert options["scale"] == pytest.approx(8 ** -0.5)


def test_bare_function_with_scale_and_output_layout(reference_op):
    # Inputs are graph inputs; a non-default scale; the output transposed to [B, H, T, V].
    def attention(q, k, v):
        out = htree_attention_plain(q, k, v, compression_rate=2, top_k=3, max_top_nodes=6, scale=0.3)
        return out.transpose(1, 2) * 2.0

    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 25, h, 8, generator=generator).to(DEVICE) for h in (3, 1, 1))
    be = Collect(compiler="aot_eager")
    compiled = torch.compile(attention, backend=be, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention(*ref_leaves)
    assert [m["pattern"] for m in be.matches] == ["htree_attention"], be.refusals
    assert be.matches[0]["options"]["scale"] == pytest.approx(0.3)
    assert be.matches[0]["layout"] == "bhtv"
    assert rel_err(out, ref) < 1e-5
    do = torch.randn_like(out)
    for grad, ref_grad in zip(torch.autograd.grad(out, leaves, do), torch.autograd.grad(ref, ref_leaves, do)):
        assert rel_err(grad, ref_grad) < 1e-5


class TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(HTreeAttention(32, 4, 2, compression_rate=4, top_k=2, max_top_nodes=6)
                                          for _ in range(2))
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(self.norm(x))
        return x


def test_each_block_of_a_model_is_lowered(reference_op):
    torch.manual_seed(3)
    model = TwoBlocks().to(DEVICE)
    x = torch.randn(1, 29, 32, device=DEVICE)
    be = compile_and_compare(model, x, Collect(compiler="aot_eager"))
    assert [m["pattern"] for m in be.matches] == ["htree_attention"] * 2, be.refusals
    inputs = [m["inputs"] for m in be.matches]
    assert inputs[0] != inputs[1]


def test_inductor_graphs_hold_our_forward_and_backward_ops(reference_op):
    module, x = module_and_input(T=21, B=1, compression_rate=3, top_k=2, max_top_nodes=4)
    be = compile_and_compare(module, x, Collect(force_disable_caches=True))
    assert be.ops("forward") == [OP] and be.ops("backward") == [OP_BWD]


def test_kernels_through_the_pipeline():
    # The op's Triton kernels (interpreter on CPU when TRITON_INTERPRET=1, else the reference).
    module, x = module_and_input(T=20, B=1, heads=2, kv_heads=1, compression_rate=3, top_k=2, max_top_nodes=3)
    be = compile_and_compare(module, x, Collect(compiler="aot_eager"))
    assert len(be.matches) == 1


def test_kernels_through_the_pipeline_with_the_forwards_selections(monkeypatch):
    """With the node-stationary backward on, the lowered op keeps its selections for the backward
    (the graph is differentiated, so the pass asks for them) and the backward reads them; outputs
    and gradients as eager's."""
    import hccompile.lowering.htree as lowering
    from hccompile.kernels.htree import tiles

    if lowering.implementation("cpu") == "reference":
        pytest.skip("the kernels' path: TRITON_INTERPRET=1 on the CPU")
    monkeypatch.setattr(tiles, "NODE_GRADIENTS", True)
    seen = {"forward": [], "backward": []}
    forward, backward = lowering.htree_forward, lowering.htree_backward

    def forward_spy(*args, **kwargs):
        seen["forward"].append(kwargs.get("record_selections"))
        return forward(*args, **kwargs)

    def backward_spy(*args, **kwargs):
        seen["backward"].append(kwargs.get("selections") is not None)
        return backward(*args, **kwargs)

    monkeypatch.setattr(lowering, "htree_forward", forward_spy)
    monkeypatch.setattr(lowering, "htree_backward", backward_spy)
    module, x = module_and_input(T=20, B=1, heads=2, kv_heads=1, compression_rate=3, top_k=2, max_top_nodes=3)
    be = compile_and_compare(module, x, Collect(compiler="aot_eager"))
    assert len(be.matches) == 1
    assert True in seen["forward"] and True in seen["backward"], seen


def _no_forced_rightmost(importance, valid, is_rightmost, sort_mode, index_bits):
    return importance.masked_fill(~valid, -1.0)


def _max_pool(x, r):
    batch, heads, size, dim = x.shape
    parents = (size + r - 1) // r
    padded = torch.nn.functional.pad(x, (0, 0, 0, parents * r - size), value=float("-inf"))
    return padded.view(batch, heads, parents, r, dim).amax(3)


def _sum_pool(x, r):
    batch, heads, size, dim = x.shape
    parents = (size + r - 1) // r
    return torch.nn.functional.pad(x, (0, 0, 0, parents * r - size)).view(batch, heads, parents, r, dim).sum(3)


NEAR_MISSES = {
    # name: (attribute of hccompile.nn.htree to replace, replacement, refusal reason fragment)
    "max_pooling": ("_mean_pool", _max_pool, "no single mean-pooling rate"),
    "sum_pooling_without_mean": ("_mean_pool", _sum_pool, "probe mismatch"),
    "rightmost_not_forced": ("_sort_keys", _no_forced_rightmost, "probe mismatch"),
    "interleaved_rope": ("_rope", lambda x, cos, sin: torch.stack(
        [x[..., 0::2] * cos - x[..., 1::2] * sin, x[..., 0::2] * sin + x[..., 1::2] * cos], -1).flatten(-2),
        "probe mismatch"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_are_refused_and_left_as_written(reference_op, monkeypatch, name):
    attribute, replacement, reason = NEAR_MISSES[name]
    monkeypatch.setattr(plain, attribute, replacement)
    module, x = module_and_input(T=33, B=1, compression_rate=4, top_k=2, max_top_nodes=5)
    be = compile_and_compare(module, x, Collect(compiler="aot_eager"))
    assert not be.matches
    assert [r["pattern"] for r in be.refusals] == ["htree_attention"]
    assert reason in be.refusals[0]["reason"], be.refusals[0]["reason"]


def test_dynamic_length_and_disabled_probe_are_refused(reference_op):
    def attention(q, k, v):
        return htree_attention_plain(q, k, v, compression_rate=4, top_k=2, max_top_nodes=8)

    be = Collect(compiler="aot_eager")
    compiled = torch.compile(attention, backend=be, fullgraph=True, dynamic=True)
    q, k, v = (torch.randn(1, 40, h, 8, device=DEVICE) for h in (2, 1, 1))
    assert rel_err(compiled(q, k, v), htree_attention_ref(q, k, v, compression_rate=4, top_k=2)) < 1e-5
    assert not be.matches and "dynamic sequence length" in be.refusals[0]["reason"]

    be = Collect(compiler="aot_eager", probe=False)
    torch.compile(attention, backend=be, fullgraph=True)(*(torch.randn(1, 40, h, 8, device=DEVICE) for h in (2, 1, 1)))
    assert not be.matches and "probe=False" in be.refusals[0]["reason"]


def test_one_layer_tree_has_no_selection_and_is_left_alone(reference_op):
    module, x = module_and_input(T=12, compression_rate=4, top_k=2, max_top_nodes=16)
    be = compile_and_compare(module, x, Collect(compiler="aot_eager"))
    assert not be.matches and not [r for r in be.refusals if r["pattern"] == "htree_attention"]


PLAIN_CASES = [
    # T, H_kv, G, r, top_k, max_top_nodes, causal, sort_mode
    (37, 1, 2, 2, 2, None, False, "exact"),
    (64, 2, 2, 4, 2, 8, True, "packed"),
    (50, 1, 3, 3, 3, 5, True, "exact"),
    (19, 2, 2, 4, 2, 20, False, "exact"),
    (1, 1, 1, 2, 1, 1, False, "packed"),
]


@pytest.mark.parametrize("case", PLAIN_CASES, ids=lambda c: f"T{c[0]}-r{c[3]}-{c[7]}-causal{c[6]}")
def test_plain_path_is_the_reference(case):
    T, kv_heads, group, r, top_k, max_top_nodes, causal, sort_mode = case
    generator = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(2, T, h, d, generator=generator, dtype=torch.float64)
               for h, d in ((kv_heads * group, 8), (kv_heads, 8), (kv_heads, 6)))
    options = dict(compression_rate=r, top_k=top_k, max_top_nodes=max_top_nodes, causal=causal, sort_mode=sort_mode)
    torch.testing.assert_close(htree_attention_plain(q, k, v, **options), htree_attention_ref(q, k, v, **options),
                               rtol=0, atol=1e-12)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    do = torch.randn(2, T, kv_heads * group, 6, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad(htree_attention_plain(*leaves, **options), leaves, do)
    ref_grads = torch.autograd.grad(htree_attention_ref(*ref_leaves, **options), ref_leaves, do)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-10)


def test_module_arguments_are_checked():
    with pytest.raises(ValueError, match="num_kv_heads: num_heads=4 must be a multiple of num_kv_heads=3"):
        HTreeAttention(32, 4, 3)
    with pytest.raises(ValueError, match="head_dim: must be even"):
        HTreeAttention(32, 4, head_dim=7)
    with pytest.raises(ValueError, match="sort_mode: must be 'exact' or 'packed'"):
        HTreeAttention(32, 4, sort_mode="bitonic")
