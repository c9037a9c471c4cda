"""HF transformers' plain-PyTorch delta-rule layers (the path they take without
flash-linear-attention), compiled as they are with backend="hc": Qwen3-Next, Qwen3.5 and OLMo-hybrid
Gated DeltaNet, Kimi-Linear KDA. Each layer is built through its model's config class (HF's own
initialisation), compiled once with dynamic=True and run at three lengths: one graph, the chunked
delta rule traced as hccompile.chunk_delta_rule (hccompile.substitutes) in forward and backward,
the short convolution as shifted sums (passes/depthwise_conv.py), outputs and every gradient
within the float32 error of HF's own code, both measured against HF's code in float64. MiniMax's
lightning attention layer the same way, its forward method substituted (one lightning_attn call).

The op runs its plain-PyTorch fallback here (TRITON_INTERPRET=0 for its dispatch, as in
test_delta_rule_pass.py): these tests are about the substitution; the kernels are checked against the
same reference in tests/test_delta_rule_ops.py."""
from __future__ import annotations

import copy
import sys
import textwrap

import pytest
import torch

from helpers import Collect, fwd_bwd, rel_err

transformers = pytest.importorskip("transformers")

from hccompile import substitutes  # noqa: E402

# Two, three and five-odd chunks of HF's 64, batch 1, then less than one (a traced launch plan's count of
# chunks or segments must not become a guard: kernels/_triton.scratch_rows). On the CPU, Inductor's C++
# reductions add a range guard (codegen/cpp.py need_use_acc_helper: 16 * B * T <= 4096) that recompiles
# past it, so the CPU lengths stay under it; CUDA (Triton code) takes the 96, 160, 288.
LENGTHS = (96, 160, 288, 40) if torch.cuda.is_available() else (96, 160, 250, 40)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OP = "hccompile.chunk_delta_rule.default"
OP_BWD = "hccompile.chunk_delta_rule_backward.default"
# hc's float32 error against HF in float64 may be this many times HF's own float32 error (or 1e-6);
# measured at most 1.6x, except on the decay's path below.
ERROR_RATIO = 4.0
# Gradients reached through the log-decay g (its parameters and projections): under Qwen's
# initialisation (A up to 12.6, per-token log-decays near -15) the op's dg has a relative RMS error of
# 1.7e-4 (plain fallback) and 3.3e-4 (kernels, interpreted) against float64, HF's float32 chunk
# form 2e-5 to 6e-5 (measured 2026-11-25). FLA's own limit for dg is 2e-2 (bf16); these must stay
# under GATE_FLOOR.
# On the H100 (torch 2.11, Triton 3.6) the kernels' float32 dg reached 2.0e-3 (Qwen3.5, dt_bias,
# T=288; HF's float32 3.1e-4; 2026-11-25), every other quantity within ERROR_RATIO.
GATE_NAMES = ("A_log", "dt_bias", "in_proj_a", "in_proj_ba", "a_proj", "f_a_proj", "f_b_proj")
GATE_FLOOR = 5e-3 if torch.cuda.is_available() else 1e-3


def _tiny(name: str) -> torch.nn.Module:
    """The first linear-attention layer of a tiny model of the family, as HF initialises it."""
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    gdn = dict(num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16)
    if name == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextModel
        model = Qwen3NextModel(Qwen3NextConfig(**common, **gdn, num_hidden_layers=1, layer_types=["linear_attention"],
                                               num_experts=0, mlp_only_layers=[0]))
    elif name == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel
        model = Qwen3_5TextModel(Qwen3_5TextConfig(**common, **gdn, num_hidden_layers=1,
                                                   layer_types=["linear_attention"]))
    elif name == "olmo_hybrid":
        from transformers.models.olmo_hybrid.configuration_olmo_hybrid import OlmoHybridConfig
        from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridModel
        model = OlmoHybridModel(OlmoHybridConfig(**common, **gdn, num_hidden_layers=2,
                                                 layer_types=["linear_attention", "full_attention"]))
    elif name == "kimi_linear":
        from transformers import KimiLinearConfig, KimiLinearModel
        model = KimiLinearModel(KimiLinearConfig(
            **common, num_hidden_layers=1, num_key_value_heads=2, linear_num_heads=2, linear_head_dim=16,
            moe_intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, layer_types=["linear_attention"],
            mlp_layer_types=["dense"], kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))
    else:
        raise ValueError(name)
    layer = model.layers[0]
    return getattr(layer, "linear_attn", None) or layer.self_attn


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _run(layer, x, w):
    leaves = [x] + list(layer.parameters())
    out = _first(layer(x))
    return out.detach(), torch.autograd.grad((out * w).sum(), leaves)


@pytest.fixture
def reference_op(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")


def _one_graph_within_hf_error(layer, floors=None):
    """Compiles `layer` under hc with dynamic=True and runs it at every length of LENGTHS: the
    output and every gradient (x's and each parameter's) within ERROR_RATIO times the float32 error
    of HF's own code against HF's code in float64 (or a floor: `floors` maps parameter-name parts to
    their floor, 1e-6 otherwise), and one graph for all lengths. Returns the graph's report."""
    torch._dynamo.reset()
    layer = layer.to(DEVICE)
    layer64 = copy.deepcopy(layer).double()
    be = Collect(force_disable_caches=True)
    compiled = torch.compile(layer, backend=be, fullgraph=True, dynamic=True)
    for T in LENGTHS:
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(1, T, 64, generator=gen).to(DEVICE).requires_grad_(True)
        w = torch.randn(1, T, 64, generator=gen).to(DEVICE)
        out, grads = _run(compiled, x, w)
        out32, grads32 = _run(layer, x, w)
        out64, grads64 = _run(layer64, x.detach().double().requires_grad_(True), w.double())
        names = ["x"] + [n for n, _ in layer.named_parameters()]
        for name, a, a32, a64 in zip(["out"] + names, (out, *grads), (out32, *grads32), (out64, *grads64)):
            ours, theirs = rel_err(a, a64), rel_err(a32, a64)
            floor = max([1e-6] + [f for part, f in (floors or {}).items() if part in name])
            assert ours <= max(ERROR_RATIO * theirs, floor), (type(layer).__name__, T, name, ours, theirs)
    assert len(be.reports) == 1, f"{len(be.reports)} graphs for lengths {LENGTHS}"
    return be.reports[0]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5", "olmo_hybrid", "kimi_linear"])
def test_layer_is_one_graph_for_every_length_and_equals_hf(family, reference_op):
    report = _one_graph_within_hf_error(_tiny(family), floors={gate: GATE_FLOOR for gate in GATE_NAMES})
    substituted = [m for m in report.matches if m["pattern"] == "substitute"]
    assert len(substituted) == 1 and substituted[0]["probe_error"] < substitutes.PROBE_TOLERANCE, report.matches
    assert [m["kernel"] for m in report.matches if m["pattern"] == "depthwise_conv1d"] == [4]
    assert OP in report.lowered_ops["forward"] and OP_BWD in report.lowered_ops["backward"]
    assert not report.fallback


def test_other_backends_trace_hf_code_as_written(reference_op):
    """The substitution is hc's: Inductor itself (here aot_eager's graph) sees HF's chunk loop."""
    torch._dynamo.reset()
    layer = _tiny("qwen3_next")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(layer, backend=record, fullgraph=True)(torch.randn(1, 130, 64))
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")}
    assert not any(t.startswith("hccompile") for t in targets), targets
    # HF's own chunk form: the in-chunk decay cumsum and the causal mask (its triangular solve is
    # solve_triangular, or a forward-substitution loop while exporting; torch 2.11 on the H100
    # recorded no solve_triangular here)
    assert any("cumsum" in t for t in targets) and any("triu" in t for t in targets), targets


def test_disabled_substitution_leaves_the_loop_to_the_delta_rule_pass(reference_op):
    torch._dynamo.reset()
    layer = _tiny("qwen3_next")
    be = Collect(disable_passes=("substitutes",), force_disable_caches=True)
    x = torch.randn(1, 130, 64)
    out = torch.compile(layer, backend=be, fullgraph=True)(x)
    assert not [m for m in be.matches if m["pattern"] == "substitute"]
    assert [m["pattern"] for m in be.matches if m["pass"] == "delta_rule"] == ["delta_rule"]
    assert rel_err(out, layer(x)) < 1e-5


# --- the mechanism, on a library of our own ----------------------------------------------------------
LIBRARY = '''
import torch

SCALE = None

def chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, **kwargs):
    """A token loop of the gated delta rule, scaled by SCALE instead of K ** -0.5 when SCALE is set."""
    B, T, H, K = query.shape
    scale = SCALE if SCALE is not None else K ** -0.5
    q, k, v, g, beta = (t.float() for t in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = q.new_zeros(B, H, K, value.shape[-1]) if initial_state is None else initial_state.float()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        delta = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t][..., None] * delta)
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(outs, 1).to(query.dtype), (S if output_final_state else None)
'''


def _library(tmp_path, monkeypatch, name: str, scale=None) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(LIBRARY).replace("SCALE = None", f"SCALE = {scale!r}"))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _client(module: str):
    from hccompile.substitutes.clients import (_DELTA_RULE_PARAMETERS, _gated_delta_rule_substitute,
                                               _probe)
    return substitutes.Client(module, "chunk_rule", _DELTA_RULE_PARAMETERS, _gated_delta_rule_substitute,
                              _probe(per_channel=False))


def _inputs(T=9):
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, T, 2, 8, generator=gen), torch.randn(1, T, 2, 8, generator=gen)
    return (q, k, torch.randn(1, T, 2, 8, generator=gen), -0.3 * torch.rand(1, T, 2, generator=gen),
            torch.rand(1, T, 2, generator=gen))


def _layer(module):
    def layer(q, k, v, g, beta):
        return module.chunk_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    return layer


def test_a_library_imported_after_hccompile_is_substituted_once_proven(tmp_path, monkeypatch, reference_op):
    name = _library(tmp_path, monkeypatch, "hc_sub_lib_equal")
    substitutes.register(_client(name))  # not imported yet: installed by the import hook
    module = __import__(name)
    assert substitutes.installed()[f"{name}.chunk_rule"] == "substituted"
    torch._dynamo.reset()
    be = Collect(force_disable_caches=True)
    inputs = _inputs()
    out = torch.compile(_layer(module), backend=be, fullgraph=True)(*inputs)
    assert [m["client"] for m in be.matches if m["pattern"] == "substitute"] == [f"{name}.chunk_rule"]
    assert OP in be.reports[0].lowered_ops["inference"]
    assert rel_err(out, _layer(module)(*inputs)) < 1e-5


def test_a_library_whose_math_differs_is_traced_as_written(tmp_path, monkeypatch, reference_op):
    name = _library(tmp_path, monkeypatch, "hc_sub_lib_scaled", scale=1.0)
    module = __import__(name)
    substitutes.register(_client(name))  # already imported: installed now
    torch._dynamo.reset()
    be = Collect(force_disable_caches=True)
    inputs = _inputs()
    out = torch.compile(_layer(module), backend=be, fullgraph=True)(*inputs)
    refused = [r for r in be.refusals if r["pattern"] == "substitute"]
    assert len(refused) == 1 and "differ" in refused[0]["reason"], be.refusals
    assert rel_err(out, _layer(module)(*inputs)) < 1e-5


def test_a_changed_signature_is_not_substituted(tmp_path, monkeypatch):
    name = "hc_sub_lib_signature"
    (tmp_path / f"{name}.py").write_text("def chunk_rule(query, key, value, beta, g):\n    return query\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    substitutes.register(_client(name))
    assert "not the one this substitute was written for" in substitutes.installed()[f"{name}.chunk_rule"]
    sys.modules.pop(name, None)


# --- HF MiniMax: lightning attention, the layer's forward substituted -------------------------------
LIGHTNING_OP = "hccompile.lightning_attn.default"
LIGHTNING_BWD = "hccompile.lightning_attn_backward.default"
MINIMAX_CLIENT = "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention.forward"


def _minimax(**config):
    """A tiny MiniMax model (linear-attention layer first, block size 16) as HF initialises it."""
    from transformers import MiniMaxConfig, MiniMaxModel

    torch.manual_seed(0)
    return MiniMaxModel(MiniMaxConfig(**{
        **dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, head_dim=32, num_local_experts=2, num_experts_per_tok=1, block_size=16,
               layer_types=["linear_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2),
        **config}))


class _Attention(torch.nn.Module):
    """The layer called as MiniMax's decoder layer calls it (no position embeddings, no mask)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x, None, None)[0]


def test_minimax_layer_is_one_graph_for_every_length_and_equals_hf(reference_op):
    """MiniMax's lightning layer runs its block loop inline in forward: hc substitutes the method,
    the attention (the inter-block recurrence included) one lightning_attn call. dynamic=True at three
    lengths: one graph, the op in forward and backward, outputs and every gradient within the
    float32 error of HF's own code against HF's code in float64."""
    report = _one_graph_within_hf_error(_Attention(_minimax().layers[0].self_attn))
    (m,) = [m for m in report.matches if m["pattern"] == "substitute"]
    assert m["client"] == MINIMAX_CLIENT and m["config"] == [2, 32, 16, False], m  # heads, head dim, block, mask
    assert m["probe_error"] < substitutes.PROBE_TOLERANCE
    assert not [m for m in report.matches if m["pass"] == "linear_attn"]  # no block loop left to lower
    assert LIGHTNING_OP in report.lowered_ops["forward"] and LIGHTNING_BWD in report.lowered_ops["backward"]
    assert not report.fallback


def test_minimax_model_without_cache_is_substituted_with_a_cache_traced_as_written(reference_op):
    """The whole model (its decoder layers call the attention with keywords, through HF's
    deprecate_kwarg wrapper): use_cache=False, the layer is substituted; use_cache=True hands the layer
    a MiniMaxCache, which the substitute does not cover: HF's code is traced (each block's intra-block
    product still lowered by the linear_attn pass) and the report says why."""
    model = _minimax()
    tokens = torch.randint(3, 64, (1, 40))

    def run(use_cache):
        torch._dynamo.reset()
        be = Collect(compiler="aot_eager")
        out = torch.compile(lambda t: model(t, use_cache=use_cache).last_hidden_state, backend=be,
                            fullgraph=True)(tokens)
        assert rel_err(out, model(tokens, use_cache=use_cache).last_hidden_state) < 1e-5
        return be

    be = run(False)
    assert [m["client"] for m in be.matches if m["pattern"] == "substitute"] == [MINIMAX_CLIENT]
    be = run(True)
    assert not [m for m in be.matches if m["pattern"] == "substitute"]
    (refused,) = [r for r in be.refusals if r["pattern"] == "substitute"]
    assert refused["client"] == MINIMAX_CLIENT and refused["reason"].startswith("a cache is given"), refused
    assert [m["pattern"] for m in be.matches if m["pass"] == "linear_attn"] == ["decayed_linear_attn"] * 3


def test_a_minimax_release_whose_math_differs_is_traced_as_written(tmp_path, monkeypatch, reference_op):
    """A copy of HF's layer whose inter-block state decays at half the rate (one changed line): the
    probe (HF's forward against lightning_attn's reference on a layer that copy builds) refuses it,
    and the copy's own code is traced."""
    import inspect

    from hccompile.substitutes.clients import (_MINIMAX_PARAMETERS, _minimax_probe, _minimax_substitute)
    from transformers.models.minimax import modeling_minimax

    source = textwrap.dedent(inspect.getsource(modeling_minimax.MiniMaxLightningAttention))
    line = "block_decay = torch.exp(-self.slope_rate * current_block_size)"
    assert line in source, "HF's MiniMax changed: pick another line to alter"
    name = "hc_sub_minimax_halved"
    (tmp_path / f"{name}.py").write_text(
        "from transformers.models.minimax import modeling_minimax as _hf\n"
        "globals().update({k: v for k, v in vars(_hf).items() if not k.startswith('__')})\n\n"
        + source.replace(line, line.replace("current_block_size)", "current_block_size * 0.5)")))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    client = f"{name}.MiniMaxLightningAttention.forward"
    substitutes.register(substitutes.Client(name, "MiniMaxLightningAttention.forward", _MINIMAX_PARAMETERS,
                                            _minimax_substitute, _minimax_probe))
    assert substitutes.installed()[client] == "substituted"  # the signature is HF's: the probe decides
    config = _minimax().config
    torch.manual_seed(0)
    layer = _Attention(module.MiniMaxLightningAttention(config, 0))
    torch._dynamo.reset()
    be = Collect(compiler="aot_eager")
    x = torch.randn(1, 40, 64)
    out = torch.compile(layer, backend=be, fullgraph=True)(x)
    (refused,) = [r for r in be.refusals if r["pattern"] == "substitute"]
    assert refused["client"] == client and "differ" in refused["reason"], refused
    assert not [m for m in be.matches if m["pattern"] == "substitute"]
    assert rel_err(out, layer(x)) < 1e-5


def test_minimax_lightning_blocks_are_lowered_with_substitutes_disabled(reference_op):
    """HF MiniMax's lightning attention with disable_passes=("substitutes",): its block loop, inline in
    forward, reaches the passes unrolled, its decay a precomputed buffer (diagonal_decay). The
    linear_attn pass lowers each block's decayed intra-block attention, the decay read off the buffer
    and the whole buffer checked against exp(γ_h (t−s)); the inter-block part stays as written, and
    the length stays pinned (one graph per block count)."""
    torch._dynamo.reset()
    layer = _minimax().layers[0].self_attn

    def attention(x):
        return layer(x, None, None)[0]

    be = Collect(compiler="aot_eager", disable_passes=("substitutes",))
    x = torch.randn(1, 40, 64)
    out, (dx,) = fwd_bwd(torch.compile(attention, backend=be, fullgraph=True), x)
    ref, (rx,) = fwd_bwd(attention, x)
    assert not [m for m in be.matches if m["pattern"] == "substitute"]
    matches = [(m["pattern"], m["op"]) for m in be.matches if m["pass"] == "linear_attn"]
    assert matches == [("decayed_linear_attn", "lightning_attn")] * 3, be.refusals  # 40 tokens: 3 blocks
    assert rel_err(out, ref) < 1e-5 and rel_err(dx, rx) < 1e-5
