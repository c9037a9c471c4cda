"""Per-channel gates past scores.FACTOR_SPAN_LIMIT: the score kernels split each diagonal sub-chunk
block into levels factored through middle rows. The cases the chunk tests leave out: key dims off
the tiles, GVA and fp16 in the backward's split, chunk 16 (a chunk of one sub-chunk), gates strong
enough to split every sub-chunk without a patched limit, and Kdot and P themselves against the
factored blocks."""

from __future__ import annotations

import pytest
import torch

from hccompile.kernels.delta_rule import chunk_delta_rule_fwd
from hccompile.kernels.delta_rule import plan as kernel_plan
from hccompile.kernels.delta_rule import scores as score_kernels

from test_delta_rule import build_case
from test_delta_rule_chunk import check_forward_and_backward, kernel_inputs, requires_triton

# name, (batch, time, H, HV, K, V), options, dtype, chunk size
SPLIT_CASES = [
    # K = 100: the split's key tiles end inside a tile; T = 45: a partial last chunk and sub-chunk
    ("fp16-K100-gva-T45", (1, 45, 1, 2, 100, 32), {"initial_state": True}, torch.float16, 32),
    ("bf16-K60-gva-varlen", (1, 80, 1, 2, 60, 32),
     {"cu_seqlens": torch.tensor([0, 37, 38, 80], dtype=torch.int32), "initial_state": True, "num_sequences": 3},
     torch.bfloat16, 64),
    ("fp32-chunk16-l2norm", (2, 40, 2, 2, 32, 16), {"l2norm": True}, torch.float32, 16),
]


@requires_triton
@pytest.mark.parametrize("name, sizes, options, dtype, chunk", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_split_diagonal_blocks_match_float64(monkeypatch, name, sizes, options, dtype, chunk):
    monkeypatch.setattr(score_kernels, "FACTOR_SPAN_LIMIT", 0.0)
    inputs, kwargs = build_case(sizes, "channel", options, seed=sizes[1] + 11)
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, chunk)


def smallest_sub_chunk_span(g: torch.Tensor, chunk: int) -> torch.Tensor:
    """min over full sub-chunks of the max over channels of G_first - G_last ([B, T, HV, K] log
    gates): every such sub-chunk's span is at least this."""
    batch, time, heads, dim = g.shape
    sub = kernel_plan.SUB_CHUNK
    full = time // chunk * chunk
    cum = g[:, :full].double().view(batch, full // chunk, chunk, heads, dim).cumsum(2)
    cum = cum.view(batch, full // sub, sub, heads, dim)
    return (cum[:, :, 0] - cum[:, :, -1]).amax(-1).min()


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_gates_strong_enough_to_split_every_sub_chunk(dtype):
    # Log-gates near -6 per token: 16 tokens span ~90 on some channel, past FACTOR_SPAN_LIMIT, so
    # the unpatched kernels split every sub-chunk; the decays inside a block reach e^-90.
    sizes, options = (1, 75, 1, 2, 48, 32), {"decay": 50.0, "initial_state": True}
    inputs, kwargs = build_case(sizes, "channel", options, seed=5)
    assert smallest_sub_chunk_span(inputs["g"], 64) > score_kernels.FACTOR_SPAN_LIMIT
    check_forward_and_backward(kernel_inputs(inputs, dtype), kwargs, dtype, 64)


@requires_triton
@pytest.mark.parametrize("chunk, sizes", [(64, (1, 100, 1, 2, 60, 16)), (32, (2, 45, 2, 2, 100, 16))],
                         ids=["chunk64-K60-gva", "chunk32-K100-T45"])
def test_split_and_factored_blocks_give_the_same_scores(monkeypatch, chunk, sizes):
    # fp32 inputs: exact fp32 products on both paths, so Kdot and P (stored in full, zeros above
    # the diagonal and past the sequence) agree to rounding wherever the diagonal block lands.
    inputs, kwargs = build_case(sizes, "channel", {}, seed=2)
    inputs = kernel_inputs(inputs, torch.float32)
    kept = {}
    for limit in (0.0, float("inf")):
        monkeypatch.setattr(score_kernels, "FACTOR_SPAN_LIMIT", limit)
        kept[limit] = chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk, return_intermediates=True)[2]
    split, factored = kept[0.0], kept[float("inf")]
    for name in ("kdot", "scores"):
        got, want = getattr(split, name), getattr(factored, name)
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
