"""htree reference (vectorised, differentiable) against the loop-by-loop transcription of seed 003,
against dense attention where the tree has one layer, against finite differences, and the causal
variant against future tokens. Sort modes are always pinned."""

from __future__ import annotations

import itertools

import pytest
import torch

import hccompile.kernels.htree.reference as htree_reference
from hccompile.kernels.htree import (
    htree_attention_ref,
    htree_layer_sizes,
    htree_selections,
    packed_index_bits,
)
from hccompile.kernels.htree.transcription import htree_attention_transcribed

F64 = torch.float64


def make_inputs(batch, time, kv_heads, group, head_dim=6, value_dim=5, seed=0, dtype=F64):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, time, kv_heads * group, head_dim, generator=generator, dtype=dtype)
    k = torch.randn(batch, time, kv_heads, head_dim, generator=generator, dtype=dtype)
    v = torch.randn(batch, time, kv_heads, value_dim, generator=generator, dtype=dtype)
    return q, k, v


def assert_matches_transcription(q, k, v, **options):
    expected, trace = htree_attention_transcribed(q, k, v, return_selections=True, **options)
    out = htree_attention_ref(q, k, v, **options)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    selections = htree_selections(q, k, **options)
    assert len(selections) == len(trace[0, 0, 0])
    for (b, t, h_kv), layers in trace.items():
        for layer, candidates, selected in layers:
            got = selections[layer]
            n = int(got.num_candidates[b, t, h_kv])
            assert got.candidates[b, t, h_kv, :n].tolist() == candidates, (b, t, h_kv, layer)
            assert (got.candidates[b, t, h_kv, n:] == -1).all()
            if selected is None:
                assert got.selected is None
            else:
                row = got.selected[b, t, h_kv].tolist()
                assert row == selected + [-1] * (len(row) - len(selected)), (b, t, h_kv, layer)
    return out, selections


# Every T, r, top_k once; head layouts and (sort mode, causal) rotate through the combinations.
HEAD_LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]
MODES = [("exact", False), ("packed", False), ("exact", True), ("packed", True)]
SHAPES = [
    (time, r, top_k, HEAD_LAYOUTS[i % 4], MODES[(i + i // 4) % 4])
    for i, (time, r, top_k) in enumerate(itertools.product([1, 5, 16, 37, 64], [2, 4], [2, 4]))
] + [(40, 3, 3, (2, 2), ("exact", True)), (29, 3, 2, (1, 3), ("packed", False))]


@pytest.mark.parametrize("time,r,top_k,heads,mode", SHAPES)
def test_reference_matches_transcription(time, r, top_k, heads, mode):
    kv_heads, group = heads
    sort_mode, causal = mode
    q, k, v = make_inputs(2, time, kv_heads, group, seed=time * 100 + r * 10 + top_k)
    assert_matches_transcription(q, k, v, compression_rate=r, top_k=top_k, sort_mode=sort_mode, causal=causal)


@pytest.mark.parametrize("sort_mode", ["exact", "packed"])
def test_ties_go_to_the_smaller_buffer_position(sort_mode):
    # Zero queries give every candidate the same score: a full tie at every layer.
    q, k, v = make_inputs(1, 37, 2, 2, seed=1)
    options = dict(compression_rate=2, top_k=3, sort_mode=sort_mode)
    _, selections = assert_matches_transcription(torch.zeros_like(q), k, v, **options)
    for layer in selections[1:]:
        n = layer.num_candidates
        first = layer.selected_positions[..., 0]
        assert (first == n - 1).all(), "the rightmost candidate comes first"
        for rank in (1, 2):
            rest = layer.selected_positions[..., rank]
            expected = torch.where(n > rank, torch.full_like(n, rank - 1), -1)
            assert (rest == expected).all()

    # Zero and repeated keys: exact ties among pooled nodes, random queries around them.
    k = k.clone()
    k[:, 4:20] = 0
    k[:, 24:34] = k[:, 24:25]
    assert_matches_transcription(q, k, v, **options)
    q[:, :, 0] = 0  # one head of the first group ties everywhere, the other does not
    assert_matches_transcription(q, k, v, causal=True, **options)


def test_packed_sort_ties_near_equal_importances_that_exact_sort_separates():
    q, k, v = make_inputs(1, 64, 1, 2, seed=2)
    q = q * 1e-5  # importances then agree to ~1e-6, below the packed key's 10 mantissa bits
    options = dict(compression_rate=2, top_k=2)
    _, exact = assert_matches_transcription(q, k, v, sort_mode="exact", **options)
    _, packed = assert_matches_transcription(q, k, v, sort_mode="packed", **options)
    assert packed_index_bits(2, 2, 4) == 2
    differing = sum(int((a.selected != b.selected).any(-1).sum()) for a, b in zip(exact[1:], packed[1:]))
    assert differing > 0


def rope_at_absolute_positions(x, base):
    """Half-split RoPE written as a complex rotation, independent of the reference's helper."""
    half = x.shape[-1] // 2
    frequencies = base ** (-torch.arange(half, dtype=F64) * 2 / x.shape[-1])
    angles = torch.arange(x.shape[1], dtype=F64)[:, None] * frequencies
    rotated = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)[:, None]
    return torch.cat([rotated.real, rotated.imag], dim=-1)


def dense_causal_rope_attention(q, k, v, scale, base):
    time = q.shape[1]
    group = q.shape[2] // k.shape[2]
    q_rot = rope_at_absolute_positions(q, base)
    k_rot = rope_at_absolute_positions(k, base).repeat_interleave(group, dim=2)
    scores = torch.einsum("bthk,bshk->bhts", q_rot, k_rot) * scale
    future = torch.ones(time, time, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bhts,bshv->bthv", weights, v.repeat_interleave(group, dim=2))


@pytest.mark.parametrize("time,max_top_nodes", [(16, 16), (19, 20), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_single_layer_tree_is_dense_causal_attention_with_rope(time, max_top_nodes, causal):
    q, k, v = make_inputs(2, time, 2, 2, head_dim=8, seed=3)
    out = htree_attention_ref(q, k, v, compression_rate=4, top_k=2, max_top_nodes=max_top_nodes,
                              scale=0.3, rope_base=500.0, causal=causal)
    torch.testing.assert_close(out, dense_causal_rope_attention(q, k, v, 0.3, 500.0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("group,causal", [(1, False), (2, True)])
def test_gradients_match_finite_differences_with_selections_fixed(group, causal):
    q, k, v = make_inputs(1, 9, 1, group, head_dim=4, value_dim=3, seed=4)
    options = dict(compression_rate=2, top_k=2, max_top_nodes=4, causal=causal)
    assert htree_layer_sizes(9, 2, 4) == [9, 5, 3]  # two pooled layers: gradients cross the pooling
    selections = htree_selections(q, k, **options)

    def attention(q, k, v):
        return htree_attention_ref(q, k, v, selections=selections, **options)

    inputs = tuple(x.clone().requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(attention, inputs, eps=1e-6, atol=1e-8)
    # The recomputed selection is the same one, so the plain call has the same output.
    torch.testing.assert_close(attention(q, k, v), htree_attention_ref(q, k, v, **options), rtol=0, atol=0)


def test_selections_given_must_be_consistent():
    q, k, v = make_inputs(1, 20, 1, 1, seed=5)
    options = dict(compression_rate=2, top_k=2)
    selections = list(htree_selections(q, k, **options))
    top = len(selections) - 1
    broken = selections[top].selected.clone()
    broken[..., -1] = -1  # drops the rightmost (last ascending) node where two were selected
    selections[top] = htree_reference.HTreeLayerSelection(top, selections[top].candidates,
                                                         selections[top].num_candidates, broken, None)
    with pytest.raises(ValueError, match="rightmost"):
        htree_attention_ref(q, k, v, selections=tuple(selections), **options)
    with pytest.raises(ValueError, match="selections: expected"):
        htree_attention_ref(q, k, v, selections=tuple(selections[:-1]), **options)


@pytest.mark.parametrize("sort_mode", ["exact", "packed"])
def test_causal_variant_ignores_future_tokens_and_seed_does_not(sort_mode):
    time, options = 128, dict(compression_rate=4, top_k=2, max_top_nodes=8, sort_mode=sort_mode)
    q, k, v = make_inputs(1, time, 1, 2, head_dim=8, seed=6)
    generator = torch.Generator().manual_seed(7)
    seed_selection_changes = 0
    for cut in (9, 22, 45, 70, 101):
        k_future, v_future = k.clone(), v.clone()
        k_future[:, cut + 1 :] = 3 * torch.randn(k_future[:, cut + 1 :].shape, generator=generator, dtype=F64)
        v_future[:, cut + 1 :] = torch.randn(v_future[:, cut + 1 :].shape, generator=generator, dtype=F64)
        past = slice(0, cut + 1)

        causal_before = htree_attention_ref(q, k, v, causal=True, **options)
        causal_after = htree_attention_ref(q, k_future, v_future, causal=True, **options)
        torch.testing.assert_close(causal_after[:, past], causal_before[:, past], rtol=0, atol=1e-13)
        for before, after in zip(htree_selections(q, k, causal=True, **options),
                                 htree_selections(q, k_future, causal=True, **options)):
            if before.selected is not None:
                assert torch.equal(before.selected[:, past], after.selected[:, past])

        for before, after in zip(htree_selections(q, k, **options), htree_selections(q, k_future, **options)):
            if before.selected is not None:
                seed_selection_changes += int((before.selected[:, past] != after.selected[:, past]).any(-1).sum())
    assert seed_selection_changes > 0, "the seed's rightmost node in the lse should leak future keys"


def test_causal_variant_selects_as_the_seed_when_group_is_one():
    q, k, v = make_inputs(2, 100, 2, 1, seed=8)
    options = dict(compression_rate=3, top_k=3, max_top_nodes=8, sort_mode="exact")
    torch.testing.assert_close(htree_attention_ref(q, k, v, causal=True, **options),
                               htree_attention_ref(q, k, v, causal=False, **options), rtol=0, atol=0)


def test_chunking_over_positions_changes_nothing(monkeypatch):
    q, k, v = make_inputs(2, 150, 2, 2, seed=9)
    options = dict(compression_rate=4, top_k=3, max_top_nodes=10)
    whole = htree_attention_ref(q, k, v, **options)
    monkeypatch.setattr(htree_reference, "CHUNK_ELEMENTS", 1 << 10)
    chunked = htree_attention_ref(q, k, v, **options)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-13)


def test_selection_invariants_on_a_longer_sequence():
    time, r, top_k = 700, 3, 4
    q, k, _ = make_inputs(1, time, 2, 2, seed=10, dtype=torch.float32)
    selections = htree_selections(q, k, compression_rate=r, top_k=top_k, max_top_nodes=12, causal=True)
    t = torch.arange(time)[None, :, None]
    for layer in selections:
        n = layer.num_candidates
        last = layer.candidates.gather(-1, (n - 1)[..., None])[..., 0]
        assert (last == t // r**layer.layer).all()
        if layer.selected is None:
            continue
        picked = layer.selected
        assert ((picked >= 0).sum(-1) == n.clamp(max=top_k)).all()
        assert ((picked == (t // r**layer.layer)[..., None]).any(-1)).all(), "rightmost always expanded"
        both_valid = (picked[..., 1:] >= 0) & (picked[..., :-1] >= 0)
        assert (picked[..., 1:] > picked[..., :-1])[both_valid].all(), "ascending, no repeats"
        in_candidates = (picked[..., :, None] == layer.candidates[..., None, :]).any(-1)
        assert (in_candidates | (picked < 0)).all()


def test_half_precision_and_empty_inputs():
    q, k, v = make_inputs(1, 50, 1, 2, seed=11, dtype=torch.float32)
    options = dict(compression_rate=4, top_k=2)
    out = htree_attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), **options)
    assert out.dtype == torch.bfloat16
    assert (out.float() - htree_attention_ref(q, k, v, **options)).abs().max() < 0.1
    empty = htree_attention_ref(q[:, :0], k[:, :0], v[:, :0], **options)
    assert empty.shape == (1, 0, 2, 5)


def test_float32_run_of_a_thousand_positions():
    q, k, v = (x.requires_grad_() for x in make_inputs(1, 1024, 2, 2, head_dim=32, value_dim=32, seed=12,
                                                        dtype=torch.float32))
    out = htree_attention_ref(q, k, v, compression_rate=8, top_k=8)
    out.square().sum().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(x.grad).all() for x in (q, k, v))


BAD = [
    (dict(k_heads=3), "k: query heads H=4 must be a multiple of key/value heads H_kv=3"),
    (dict(head_dim=5), "q: head dim K=5 must be even"),
    (dict(compression_rate=1), "compression_rate: must be >= 2"),
    (dict(compression_rate=2.0), "compression_rate: must be an integer"),
    (dict(top_k=0), "top_k: must be >= 1"),
    (dict(max_top_nodes=0), "max_top_nodes: must be >= 1"),
    (dict(sort_mode="bitonic"), "sort_mode: must be one of"),
    (dict(causal="yes"), "causal: must be a bool"),
    (dict(scale=float("nan")), "scale: must be a finite number"),
    (dict(rope_base=0.0), "rope_base: must be a finite number > 0"),
    (dict(max_top_nodes=1 << 24, sort_mode="packed"), "packed sort needs buffer positions in <= 23 bits"),
    (dict(v_time=7), "v: batch, time"),
    (dict(k_dtype=torch.float32), "k: dtype torch.float32 differs"),
    (dict(q_dims=3), "q: expected a 4-D tensor"),
    (dict(v_heads=1), "v: 1 heads differ from k's H_kv=2"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_configurations_raise_clear_errors(change, message):
    change = dict(change)
    head_dim = change.pop("head_dim", 6)
    q = torch.randn(1, 8, 4, head_dim, dtype=F64)
    k = torch.randn(1, 8, change.pop("k_heads", 2), head_dim, dtype=change.pop("k_dtype", F64))
    v = torch.randn(1, change.pop("v_time", 8), change.pop("v_heads", 2), 5, dtype=F64)
    if change.pop("q_dims", 4) == 3:
        q = q[0]
    options = dict(compression_rate=2, top_k=2) | change
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        htree_attention_ref(q, k, v, **options)


def test_packed_sort_refuses_groups_the_forced_importance_cannot_beat():
    q, k, v = torch.randn(1, 3, 1000, 2), torch.randn(1, 3, 1, 2), torch.randn(1, 3, 1, 2)
    with pytest.raises(ValueError, match="group size G=H/H_kv < 1000"):
        htree_attention_ref(q, k, v, compression_rate=2, top_k=1, sort_mode="packed")
    assert htree_attention_ref(q, k, v, compression_rate=2, top_k=1, sort_mode="exact").shape == (1, 3, 1000, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_query_positions_evaluate_a_subset_exactly(monkeypatch, causal):
    """Sampled positions (what a long-T GPU check affords) give exactly the full run's rows, lse,
    selections and gradients (with the output gradient zero at the other rows)."""
    monkeypatch.setattr(htree_reference, "CHUNK_ELEMENTS", 500)  # several chunks of positions
    q, k, v = make_inputs(2, 45, 1, 2, seed=13)
    options = dict(compression_rate=3, top_k=2, causal=causal)
    positions = torch.tensor([0, 4, 5, 17, 26, 27, 44])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    full, full_lse = htree_attention_ref(*leaves, return_lse=True, **options)
    part, part_lse = htree_attention_ref(*leaves, return_lse=True, query_positions=positions, **options)
    torch.testing.assert_close(part, full[:, positions], rtol=0, atol=0)
    torch.testing.assert_close(part_lse, full_lse[:, positions], rtol=0, atol=0)
    do = torch.randn_like(full)
    keep = torch.zeros(45, dtype=torch.bool)
    keep[positions] = True
    want = torch.autograd.grad(full, leaves, do * keep[None, :, None, None])
    got = torch.autograd.grad(part, leaves, do[:, positions])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for layer_full, layer_part in zip(htree_selections(q, k, **options),
                                      htree_selections(q, k, query_positions=positions, **options)):
        if layer_full.selected is not None:
            assert torch.equal(layer_part.selected, layer_full.selected[:, positions])
        assert torch.equal(layer_part.candidates, layer_full.candidates[:, positions])
    for bad, message in (([3, 3], "strictly increasing"), ([45], r"lie in \[0, 45\)"), ([], "non-empty")):
        with pytest.raises(ValueError, match=message):
            htree_attention_ref(q, k, v, query_positions=torch.tensor(bad, dtype=torch.long), **options)
