"""The library functions hc substitutes: HF transformers' plain-PyTorch chunked delta rules (the
path its layers take when flash-linear-attention is not installed).

- Gated DeltaNet, `torch_chunk_gated_delta_rule` (Qwen3-Next, Qwen3.5, OLMo-hybrid): q, k
  [B, T, H, K], v [B, T, HV, V] (value head h reads key head h // (HV / H), as repeat_interleave),
  g [B, T, HV] log-decay, beta [B, T, HV]; float32 inside, output in q's dtype, scale K**-0.5.
- Kimi Delta Attention, `chunk_kimi_delta_attention` (Kimi-Linear): the same with g [B, T, H, K].

Both return (o, final state or None); the chunk size is how the original splits the work, not part
of the math, so the op's own chunking serves every value.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..kernels.delta_rule.reference import naive_recurrent_delta_rule
from ..lowering.delta_rule import chunk_gated_delta_rule, chunk_kda
from . import Client, register, required, use_substitute

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


def _probe(per_channel: bool) -> Callable[..., float]:
    def probe(original, key_heads, value_heads, key_dim, value_dim, chunk_size, l2norm, has_state) -> float:
        """The original against the op's token-by-token reference on random float32 inputs of this
        configuration: two chunks and a partial one, unit-norm keys unless the function normalises."""
        gen = torch.Generator().manual_seed(20261125)
        T = 2 * chunk_size + 3
        q = torch.randn(1, T, key_heads, key_dim, generator=gen)
        k = torch.randn(1, T, key_heads, key_dim, generator=gen)
        if not l2norm:
            q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        v = torch.randn(1, T, value_heads, value_dim, generator=gen)
        beta = torch.rand(1, T, value_heads, generator=gen)
        gate_shape = (1, T, value_heads, key_dim) if per_channel else (1, T, value_heads)
        g = -0.5 * torch.rand(gate_shape, generator=gen)
        h0 = torch.randn(1, value_heads, key_dim, value_dim, generator=gen) if has_state else None
        o, state = original(q, k, v, g, beta, chunk_size=chunk_size, initial_state=h0, output_final_state=True,
                            use_qk_l2norm_in_kernel=l2norm)
        o_ref, state_ref = naive_recurrent_delta_rule(q, k, v, beta, g, "channel" if per_channel else "scalar",
                                                      initial_state=h0, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=l2norm)
        return max(_relative_rms(o, o_ref), _relative_rms(state, state_ref))

    return probe


for _module in ("transformers.models.qwen3_next.modeling_qwen3_next",
                "transformers.models.qwen3_5.modeling_qwen3_5",
                "transformers.models.olmo_hybrid.modeling_olmo_hybrid"):
    register(Client(_module, "torch_chunk_gated_delta_rule", _DELTA_RULE_PARAMETERS,
                    _gated_delta_rule_substitute, _probe(per_channel=False)))
register(Client("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention",
                _DELTA_RULE_PARAMETERS, _kda_substitute, _probe(per_channel=True)))
