"""The library functions hc substitutes.

HF transformers' plain-PyTorch chunked delta rules (the path its layers take when
flash-linear-attention is not installed):

- Gated DeltaNet, `torch_chunk_gated_delta_rule` (Qwen3-Next, Qwen3.5, OLMo-hybrid): q, k
  [B, T, H, K], v [B, T, HV, V] (value head h reads key head h // (HV / H), as repeat_interleave),
  g [B, T, HV] log-decay, beta [B, T, HV]; float32 inside, output in q's dtype, scale K**-0.5.
- Kimi Delta Attention, `chunk_kimi_delta_attention` (Kimi-Linear): the same with g [B, T, H, K].

Both return (o, final state or None); the chunk size is how the original splits the work, not part
of the math, so the op's own chunking serves every value.

hccompile.nn's own plain chunked forms (`plain_chunk_gated_delta_rule`, `plain_chunk_kda`, what the
GatedDeltaNet and KimiDeltaAttention layers run with mode="plain"): the same math with FLA's
argument order and names (g before beta, `scale`, `use_qk_l2norm`); g may be None (no gate) in the
first. With substitutes disabled they stay what the delta_rule pass matches, unrolled.

HF MiniMax's lightning attention layer, `MiniMaxLightningAttention.forward`: its block loop is inline
in the method, so the method is the substitute's unit. See `minimax_lightning_forward`.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch

from ..kernels.delta_rule.reference import naive_recurrent_delta_rule
from ..kernels.lightning.decay_reference import lightning_attn_ref
from ..lowering.delta_rule import chunk_delta_rule, chunk_gated_delta_rule, chunk_kda
from ..lowering.lightning import lightning_attn
from . import Client, decline, register, required, use_substitute

_DELTA_RULE_PARAMETERS = required("query", "key", "value", "g", "beta") + (
    ("chunk_size", 64), ("initial_state", None), ("output_final_state", False),
    ("use_qk_l2norm_in_kernel", False))


def _state(initial_state):
    return None if initial_state is None else initial_state.float()


def _substitute_with(op: Callable[..., Any]) -> Callable[[Callable[..., Any], str], Callable[..., Any]]:
    """The substitute factory for HF's chunked delta rules (one signature), calling `op` (the scalar
    gate's chunk_gated_delta_rule or KDA's per-channel chunk_kda; the same arguments otherwise)."""
    def make(original: Callable[..., Any], client: str) -> Callable[..., Any]:
        def substitute(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **kwargs):
            if use_substitute(client, query.shape[2], value.shape[2], query.shape[3], value.shape[3],
                              chunk_size, bool(use_qk_l2norm_in_kernel), initial_state is not None):
                o, state = op(query, key, value, g.float(), beta, initial_state=_state(initial_state),
                              output_final_state=output_final_state,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
                return o.to(query.dtype), state
            return original(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                            use_qk_l2norm_in_kernel, **kwargs)

        return substitute

    return make


_gated_delta_rule_substitute = _substitute_with(chunk_gated_delta_rule)
_kda_substitute = _substitute_with(chunk_kda)


def _relative_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _probe_inputs(key_heads, value_heads, key_dim, value_dim, chunk_size, l2norm, has_state, gate):
    """Random float32 inputs of one configuration: two chunks and a partial one, unit-norm keys
    unless the function normalises them, log-gates in [-0.5, 0]."""
    gen = torch.Generator().manual_seed(20261125)
    T = 2 * chunk_size + 3
    q = torch.randn(1, T, key_heads, key_dim, generator=gen)
    k = torch.randn(1, T, key_heads, key_dim, generator=gen)
    if not l2norm:
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(1, T, value_heads, value_dim, generator=gen)
    beta = torch.rand(1, T, value_heads, generator=gen)
    g = None
    if gate != "none":
        gate_shape = (1, T, value_heads, key_dim) if gate == "channel" else (1, T, value_heads)
        g = -0.5 * torch.rand(gate_shape, generator=gen)
    h0 = torch.randn(1, value_heads, key_dim, value_dim, generator=gen) if has_state else None
    return q, k, v, g, beta, h0


def _against_reference(o, state, q, k, v, g, beta, h0, gate, l2norm, scale=None) -> float:
    o_ref, state_ref = naive_recurrent_delta_rule(q, k, v, beta, g, gate, scale=scale, initial_state=h0,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    return max(_relative_rms(o, o_ref), _relative_rms(state, state_ref))


def _probe(per_channel: bool) -> Callable[..., float]:
    def probe(original, key_heads, value_heads, key_dim, value_dim, chunk_size, l2norm, has_state) -> float:
        """The original against the op's token-by-token reference on random float32 inputs of this
        configuration (_probe_inputs)."""
        gate = "channel" if per_channel else "scalar"
        q, k, v, g, beta, h0 = _probe_inputs(key_heads, value_heads, key_dim, value_dim, chunk_size, l2norm,
                                             has_state, gate)
        o, state = original(q, k, v, g, beta, chunk_size=chunk_size, initial_state=h0, output_final_state=True,
                            use_qk_l2norm_in_kernel=l2norm)
        return _against_reference(o, state, q, k, v, g, beta, h0, gate, l2norm)

    return probe


# --- hccompile.nn's plain chunked forms -------------------------------------------------------------
_NN_PARAMETERS = required("q", "k", "v", "g", "beta") + (
    ("scale", None), ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm", False),
    ("chunk_size", 64))


def _nn_substitute_with(per_channel: bool) -> Callable[[Callable[..., Any], str], Callable[..., Any]]:
    """The substitute factory for hccompile.nn's plain_chunk_gated_delta_rule (per_channel False: a
    scalar gate, or none when g is None) and plain_chunk_kda (a per-channel gate)."""
    def make(original: Callable[..., Any], client: str) -> Callable[..., Any]:
        def substitute(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                       use_qk_l2norm=False, chunk_size=64):
            gate = "channel" if per_channel else ("none" if g is None else "scalar")
            # Under dynamic=True a compiled function's input sizes are symbols: operator.index fixes the
            # head counts and dims (Dynamo guards them; the op fixes them anyway), so the decision folds
            heads, value_heads, key_dim, value_dim = (operator.index(n) for n in (q.shape[2], v.shape[2], q.shape[3],
                                                                                       v.shape[3]))
            config = (heads, value_heads, key_dim, value_dim, chunk_size, bool(use_qk_l2norm),
                      initial_state is not None, gate)
            if scale is not None and not isinstance(scale, (int, float)):
                decline(client, "scale is not a Python number (a tensor?): the op takes a constant scale; traced "
                        "as written", *config)
            elif use_substitute(client, *config, scale):
                options = dict(scale=scale, initial_state=_state(initial_state), output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=bool(use_qk_l2norm))
                if gate == "none":
                    o, state = chunk_delta_rule(q, k, v, beta, **options)
                else:
                    o, state = (chunk_kda if per_channel else chunk_gated_delta_rule)(q, k, v, g.float(), beta,
                                                                                      **options)
                # the plain forms keep a float32 state for every input dtype (the op: float64 for float64)
                return o, (None if state is None else state.float())
            return original(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, chunk_size)

        return substitute

    return make


def _nn_probe(per_channel: bool) -> Callable[..., float]:
    def probe(original, key_heads, value_heads, key_dim, value_dim, chunk_size, l2norm, has_state, gate,
              scale) -> float:
        """hccompile.nn's plain chunked form against the op's token-by-token reference (_probe_inputs)."""
        q, k, v, g, beta, h0 = _probe_inputs(key_heads, value_heads, key_dim, value_dim, chunk_size, l2norm,
                                             has_state, gate)
        o, state = original(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                            use_qk_l2norm=l2norm, chunk_size=chunk_size)
        return _against_reference(o, state, q, k, v, g, beta, h0, gate, l2norm, scale)

    return probe


# --- HF MiniMax's lightning attention ---------------------------------------------------------------
MINIMAX_MODULE = "transformers.models.minimax.modeling_minimax"
_MINIMAX_PARAMETERS = required("self", "hidden_states", "position_embeddings", "attention_mask") + (("cache", None),)


def minimax_lightning_forward(layer, hidden_states, attention_mask, attend, mask_padding):
    """MiniMaxLightningAttention.forward without a cache, its attention (HF's block loop: intra-block
    scores times `diagonal_decay`, inter-block through a KV state decayed by `query_decay`,
    `key_decay` and `exp(-slope_rate · block)`) done by one call of `attend` (lightning_attn's
    signature): lightning attention with log-decay -slope_rate per head and no scale, from which
    HF's constructor and _init_weights derive those three buffers. The projections, gate, norm and
    the returned final state ([B, H, D, D] in v's dtype) are HF's. Returns (output, final state)."""
    batch, time, _ = hidden_states.shape
    heads, head_dim = layer.num_attention_heads, layer.head_dim
    qkv = layer.act_fn(layer.qkv_proj(hidden_states))
    qkv = mask_padding(qkv, attention_mask)
    q, k, v = torch.split(qkv.reshape(batch, time, heads, 3 * head_dim), head_dim, dim=3)  # [B, T, H, D]
    decay = -layer.slope_rate.reshape(heads).float()
    o, state = attend(q, k, v, decay=decay, scale=1.0, output_final_state=True)
    o = layer.norm(o.reshape(batch, time, heads * head_dim))
    o = torch.sigmoid(layer.output_gate(hidden_states)) * o
    return layer.out_proj(o), state.to(v.dtype)


def _minimax_substitute(original: Callable[..., Any], client: str) -> Callable[..., Any]:
    mask_padding = original.__globals__.get("apply_mask_to_padding_states")

    def substitute(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        config = (self.num_attention_heads, self.head_dim, self.block_size, attention_mask is not None)
        if cache is not None:
            decline(client, "a cache is given: HF's layer reads and writes its linear state there (its decode "
                    "path is a token loop); traced as written. Prefill without a cache, or call "
                    "hccompile.lightning_attn with initial_state", *config)
        elif use_substitute(client, *config):
            return minimax_lightning_forward(self, hidden_states, attention_mask, lightning_attn, mask_padding)
        return original(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)

    return substitute


def _lightning_reference(q, k, v, decay, scale, output_final_state):
    return lightning_attn_ref(q, k, v, decay, scale, None, output_final_state)


def _minimax_probe(original, heads, head_dim, block_size, has_mask) -> float:
    """HF's forward against minimax_lightning_forward with the op's reference, on a layer HF builds
    (its config class and constructor, random projections) with this configuration's heads, head
    dim and block size (the hidden size is 32: the projections are the same code on both sides),
    batch 2, two blocks and a partial one; with a mask when the call has one (left padding on the
    second row)."""
    names = original.__globals__
    config = names["MiniMaxConfig"](hidden_size=32, num_attention_heads=heads, num_key_value_heads=heads,
                                    head_dim=head_dim, block_size=block_size, num_hidden_layers=2,
                                    layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(20261125)
    layer = names["MiniMaxLightningAttention"](config, 0)
    T = 2 * block_size + 3
    x = torch.randn(2, T, 32)
    mask = None
    if has_mask:
        mask = torch.ones(2, T, dtype=torch.long)
        mask[1, :3] = 0
    o, state = original(layer, x, None, mask)
    o_ref, state_ref = minimax_lightning_forward(layer, x, mask, _lightning_reference,
                                                 names["apply_mask_to_padding_states"])
    return max(_relative_rms(o, o_ref), _relative_rms(state, state_ref))


for _module in ("transformers.models.qwen3_next.modeling_qwen3_next",
                "transformers.models.qwen3_5.modeling_qwen3_5",
                "transformers.models.olmo_hybrid.modeling_olmo_hybrid"):
    register(Client(_module, "torch_chunk_gated_delta_rule", _DELTA_RULE_PARAMETERS,
                    _gated_delta_rule_substitute, _probe(per_channel=False)))
register(Client("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention",
                _DELTA_RULE_PARAMETERS, _kda_substitute, _probe(per_channel=True)))
register(Client("hccompile.nn.delta_net", "plain_chunk_gated_delta_rule", _NN_PARAMETERS,
                _nn_substitute_with(per_channel=False), _nn_probe(per_channel=False)))
register(Client("hccompile.nn.delta_net", "plain_chunk_kda", _NN_PARAMETERS, _nn_substitute_with(per_channel=True),
                _nn_probe(per_channel=True)))
register(Client(MINIMAX_MODULE, "MiniMaxLightningAttention.forward", _MINIMAX_PARAMETERS, _minimax_substitute,
                _minimax_probe))
