"""htree Triton kernels (forward and backward) against the float64 PyTorch reference.

The kernels record the nodes they selected; the tests check those against the reference's own
selection (sort mode pinned) and the outputs and gradients against the reference evaluated with
the kernels' selection, so a near-tie decided differently in float32 cannot hide a real error,
and a wrong selection cannot hide behind a loose tolerance. Outputs are poisoned (NaN) by the
launchers before the kernels write them; rel_err fails on NaN.

CPU runs use Triton's interpreter (TRITON_INTERPRET=1) at tiny shapes; `gpu` tests run larger ones.
"""
from __future__ import annotations

import os

import pytest
import torch

from hccompile.kernels.htree import tiles
from hccompile.kernels.htree.backward import htree_backward
from hccompile.kernels.htree.forward import htree_forward, selections_from_record
from hccompile.kernels.htree.reference import (htree_attention_ref, htree_layer_sizes, htree_selections,
                                               resolve_htree_config)
from helpers import rel_err

TRITON_CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not TRITON_CAN_RUN, reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative RMS error limits. The interpreter casts float32 to bfloat16 by truncation.
TOLERANCE = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def make_inputs(batch, time, kv_heads, group, key_dim, value_dim, dtype, seed, device=DEVICE, q_scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, time, kv_heads * group, key_dim, generator=generator) * q_scale
    k = torch.randn(batch, time, kv_heads, key_dim, generator=generator)
    v = torch.randn(batch, time, kv_heads, value_dim, generator=generator)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def reference_selected(q, k, options) -> list[torch.Tensor | None]:
    selections = htree_selections(q.double(), k.double(), **options)
    return [None if s.selected is None else s.selected.to(q.device) for s in selections]


def differing_rows(record: torch.Tensor, expected: list) -> int:
    return sum(int((record[layer].long() != expected[layer]).any(-1).sum())
               for layer in range(1, record.shape[0]))


def check_forward(q, k, v, *, exact_selection=True, block_c=None, **options):
    cfg = resolve_htree_config(q, k, v, **options)
    o, lse, record = htree_forward(q, k, v, cfg, block_c=block_c, record_selections=True)
    layers = len(htree_layer_sizes(q.shape[1], cfg.compression_rate, cfg.max_top_nodes))
    assert record.shape == (layers, q.shape[0], q.shape[1], k.shape[2], cfg.top_k)
    expected = reference_selected(q, k, options)
    rows = q.shape[0] * q.shape[1] * k.shape[2] * (layers - 1)
    differing = differing_rows(record, expected)
    if exact_selection:
        assert differing == 0, f"{differing} of {rows} selections differ from the reference"
    else:  # half precision scores: near-ties may go the other way
        assert differing <= max(1, rows // 10), f"{differing} of {rows} selections differ"
    q64, k64, v64 = (x.double() for x in (q, k, v))
    ref, ref_lse = htree_attention_ref(q64, k64, v64, selections=selections_from_record(record), return_lse=True,
                                       **options)
    assert o.dtype == v.dtype and lse.dtype == torch.float32
    assert rel_err(o, ref) < TOLERANCE[q.dtype]
    assert rel_err(lse, ref_lse) < TOLERANCE[q.dtype]
    return cfg, o, lse, record


FORWARD_CASES = {
    # name: (batch, time, kv_heads, group, K, V, dtype, options)
    "five_layers_r2": (1, 37, 1, 2, 16, 16, torch.float32, dict(compression_rate=2, top_k=2)),
    "r3_causal_g1": (1, 30, 2, 1, 8, 12, torch.float32, dict(compression_rate=3, top_k=2, causal=True)),
    "packed_k48_topk_r_ne_max_top": (1, 40, 1, 3, 48, 20, torch.float32,
                                     dict(compression_rate=4, top_k=3, max_top_nodes=5, sort_mode="packed")),
    "causal_packed_b2_g2_k64_v64": (2, 20, 1, 2, 64, 64, torch.float32,
                            dict(compression_rate=2, top_k=3, max_top_nodes=5, causal=True, sort_mode="packed")),
    "single_layer_dense": (1, 19, 1, 2, 8, 8, torch.float32, dict(compression_rate=4, top_k=2, max_top_nodes=20)),
    "bf16_k96_v64_causal": (1, 33, 1, 2, 96, 64, torch.bfloat16,
                            dict(compression_rate=4, top_k=2, max_top_nodes=6, causal=True)),
}


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_forward_matches_reference(name):
    batch, time, kv_heads, group, key_dim, value_dim, dtype, options = FORWARD_CASES[name]
    q, k, v = make_inputs(batch, time, kv_heads, group, key_dim, value_dim, dtype, seed=len(name))
    check_forward(q, k, v, exact_selection=dtype == torch.float32, **options)


@pytest.fixture
def radix_select(monkeypatch):
    """Run the GPU's 31-step threshold search under the interpreter too."""
    monkeypatch.setattr(tiles, "INTERPRETER_RANK_SELECT_WIDTH", 0)


@pytest.mark.parametrize("sort_mode", ["exact", "packed"])
def test_streaming_tiles_and_radix_selection(radix_select, sort_mode):
    # block_c=16 < every width (top layer 18 nodes, lower layers top_k * r = 20): the lse, the keys
    # and the merge are streamed over several tiles, and the selection is the threshold search.
    options = dict(compression_rate=4, top_k=5, max_top_nodes=24, sort_mode=sort_mode)
    assert htree_layer_sizes(70, 4, 24) == [70, 18]
    q, k, v = make_inputs(1, 70, 1, 2, 16, 16, torch.float32, seed=3)
    check_forward(q, k, v, block_c=16, **options)


@pytest.mark.parametrize("rank_width", [256, 0], ids=["rank", "radix"])
def test_ties_go_to_the_smaller_position(monkeypatch, rank_width):
    monkeypatch.setattr(tiles, "INTERPRETER_RANK_SELECT_WIDTH", rank_width)
    q, k, v = make_inputs(1, 20, 1, 2, 8, 8, torch.float32, seed=4)
    options = dict(compression_rate=2, top_k=3, max_top_nodes=5)
    assert htree_layer_sizes(20, 2, 5) == [20, 10, 5]
    _, _, _, record = check_forward(torch.zeros_like(q), k, v, **options)  # every score ties
    rightmost = torch.arange(20) // 4
    # Full ties at the top layer (node = position): the two first nodes and the rightmost one.
    expected = torch.stack([torch.tensor(sorted({0, 1, int(m)}) if m >= 2 else list(range(int(m) + 1)) +
                                         [-1] * (2 - int(m))) for m in rightmost])
    assert torch.equal(record[2, 0, :, 0].cpu().long(), expected)
    k[:, 4:14] = 0.0  # equal pooled keys among others: partial ties
    check_forward(q, k, v, sort_mode="packed" if rank_width else "exact", causal=not rank_width, **options)


def test_lengths_zero_and_one():
    q, k, v = make_inputs(1, 1, 1, 2, 8, 8, torch.float32, seed=5)
    check_forward(q, k, v, compression_rate=2, top_k=1, max_top_nodes=1)
    cfg = resolve_htree_config(q[:, :0], k[:, :0], v[:, :0], compression_rate=2, top_k=1)
    o, lse, _ = htree_forward(q[:, :0], k[:, :0], v[:, :0], cfg)
    assert o.shape == (1, 0, 2, 8) and lse.shape == (1, 0, 2)


def check_backward(q, k, v, *, block_c=None, with_dlse=False, node_gradients=False, from_forward=False, **options):
    cfg, o, lse, record = check_forward(q, k, v, block_c=block_c, exact_selection=q.dtype == torch.float32,
                                        **options)
    generator = torch.Generator().manual_seed(11)
    do = torch.randn(o.shape, generator=generator).to(q.device, q.dtype)
    dlse = torch.randn(lse.shape, generator=generator).to(q.device) if with_dlse else None
    dq, dk, dv, record_bwd = htree_backward(q, k, v, o, lse, do, cfg, dlse, block_c=block_c,
                                            record_selections=True, node_gradients=node_gradients,
                                            selections=record.clone() if from_forward else None)
    assert torch.equal(record_bwd, record), "the backward recomputed a different selection"
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = htree_attention_ref(*leaves, selections=selections_from_record(record), return_lse=True,
                                       **options)
    loss = (ref * do.double()).sum() + ((ref_lse * dlse.double()).sum() if with_dlse else 0.0)
    grads = torch.autograd.grad(loss, leaves)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        assert got.dtype == q.dtype, name
        assert rel_err(got, want) < TOLERANCE[q.dtype], name


BACKWARD_CASES = {
    "fp32_three_layers_g2": (1, 27, 1, 2, 16, 12, torch.float32, dict(compression_rate=3, top_k=2, max_top_nodes=3)),
    "causal_packed_g3_k48": (1, 24, 1, 3, 48, 20, torch.float32,
                             dict(compression_rate=4, top_k=2, max_top_nodes=5, causal=True, sort_mode="packed")),
    "two_kv_heads_g1": (1, 20, 2, 1, 8, 8, torch.float32, dict(compression_rate=3, top_k=2, max_top_nodes=4)),
    "bf16": (1, 30, 1, 2, 32, 16, torch.bfloat16, dict(compression_rate=4, top_k=2, max_top_nodes=6)),
}


@pytest.mark.parametrize("name", list(BACKWARD_CASES))
def test_backward_matches_autograd_through_reference(name):
    batch, time, kv_heads, group, key_dim, value_dim, dtype, options = BACKWARD_CASES[name]
    q, k, v = make_inputs(batch, time, kv_heads, group, key_dim, value_dim, dtype, seed=len(name) + 20)
    check_backward(q, k, v, **options)


NODE_GRADIENT_CASES = {
    **BACKWARD_CASES,
    "one_layer": (1, 9, 1, 2, 16, 8, torch.float32, dict(compression_rate=4, top_k=3, max_top_nodes=16)),
    "r5_two_batches_g3": (2, 33, 2, 3, 16, 12, torch.float32, dict(compression_rate=5, top_k=3, max_top_nodes=4)),
}


@pytest.mark.parametrize("from_forward", [False, True], ids=["reselected", "forward-selections"])
@pytest.mark.parametrize("name", list(NODE_GRADIENT_CASES))
def test_node_gradients_from_selections_match_reference(name, from_forward):
    """dk and dv node-stationary from the recorded selections (node_gradients.py), every node written
    once (the node buffers start poisoned), against autograd through the float64 reference; the
    selections either recomputed by the dq kernel or the forward's, read by it (no selection pass)."""
    batch, time, kv_heads, group, key_dim, value_dim, dtype, options = NODE_GRADIENT_CASES[name]
    q, k, v = make_inputs(batch, time, kv_heads, group, key_dim, value_dim, dtype, seed=len(name) + 40)
    check_backward(q, k, v, with_dlse=True, node_gradients=True, from_forward=from_forward, **options)


SPLIT_CASES = {
    # name: (batch, time, kv_heads, group, K, V, dtype, options, TARGET_PROGRAMS_PER_SM, from_forward).
    # Layers [33, 7, 2]: 28, 8 and 4 programs before the splits, 2, 5 and 10 splits (target 40).
    "r5_two_batches_g3": (2, 33, 2, 3, 16, 12, torch.float32, dict(compression_rate=5, top_k=3, max_top_nodes=4),
                          20, False),
    # Layers [29, 10, 4]: 20, 8 and 2 programs, 2, 3 and 12 splits (target 24).
    "causal_t29_g2": (1, 29, 2, 2, 16, 8, torch.float32, dict(compression_rate=3, top_k=2, max_top_nodes=4,
                                                               causal=True), 12, True),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_node_gradients_split_over_queries(monkeypatch, name):
    """Every layer's query ranges split over several programs (node_gradients.query_splits), partial
    sums added by torch: more splits at the top than its first group has query tiles (empty shares,
    which must write zeros), tiles of a few queries so that most shares hold several."""
    from hccompile.kernels.htree import node_gradients

    batch, time, kv_heads, group, key_dim, value_dim, dtype, options, per_sm, from_forward = SPLIT_CASES[name]
    monkeypatch.setattr(node_gradients, "INTERPRETER_SMS", 2)
    monkeypatch.setattr(node_gradients, "TARGET_PROGRAMS_PER_SM", per_sm)
    monkeypatch.setattr(node_gradients, "TILE_ROWS", 16)
    chosen, query_splits = [], node_gradients.query_splits

    def recording_splits(*args):
        chosen.append(query_splits(*args))
        return chosen[-1]

    monkeypatch.setattr(node_gradients, "query_splits", recording_splits)
    q, k, v = make_inputs(batch, time, kv_heads, group, key_dim, value_dim, dtype, seed=len(name) + 60)
    check_backward(q, k, v, with_dlse=True, node_gradients=True, from_forward=from_forward, **options)
    layers = len(htree_layer_sizes(time, options["compression_rate"], options["max_top_nodes"]))
    queries_per_tile = 16 // tiles._pow2(group, 1)
    assert len(chosen) == layers and min(chosen) > 1, chosen
    assert chosen[-1] > -(-time // queries_per_tile), chosen  # more splits than the top's query tiles


def test_atomics_backward_from_forward_selections():
    q, k, v = make_inputs(1, 40, 1, 2, 16, 8, torch.float32, seed=16)
    check_backward(q, k, v, block_c=16, with_dlse=True, from_forward=True, compression_rate=4, top_k=5,
                   max_top_nodes=12)


@pytest.mark.parametrize("budget", ["one-at-a-time", "several", "all"])
def test_selection_index_lists_each_nodes_queries_with_ranks(monkeypatch, budget):
    from hccompile.kernels.htree import node_gradients
    from hccompile.kernels.htree.node_gradients import selection_bits, selection_index

    generator = torch.Generator().manual_seed(5)
    batch, time, kv_heads, top_k, nodes = 2, 7, 3, 4, 9
    # selection_bits stages a block of queries at a time, selection_index sorts a block of KV heads:
    # one query / head, a few (T 7 and H_kv 3 are not multiples), all.
    staging, sort_entries = {"one-at-a-time": (1, 1), "several": (1000, 2 * time * top_k),
                             "all": (1 << 28, 1 << 25)}[budget]
    monkeypatch.setattr(node_gradients, "STAGING_BYTES", staging)
    monkeypatch.setattr(node_gradients, "SORT_ENTRIES", sort_entries)
    selected = torch.full((batch, time, kv_heads, top_k), -1, dtype=torch.int32)
    for b in range(batch):
        for t in range(time):
            for h in range(kv_heads):
                count = int(torch.randint(0, top_k + 1, (1,), generator=generator))
                chosen = torch.randperm(nodes, generator=generator)[:count].sort().values
                selected[b, t, h, :count] = chosen.to(torch.int32)
    offsets, entries = selection_index(selected, nodes)
    assert offsets.dtype == torch.int64 and entries.dtype == torch.int32
    bits = selection_bits(selected, nodes)
    for b in range(batch):
        for h in range(kv_heads):
            for j in range(nodes):
                owner = (b * kv_heads + h) * (nodes + 1) + j
                listed = entries[offsets[owner]:offsets[owner + 1]].tolist()
                got = [(e // top_k, e % top_k) for e in listed]
                want = [(t, r) for t in range(time) for r in range(top_k) if int(selected[b, t, h, r]) == j]
                assert got == want, (b, h, j)
                for t in range(time):
                    bit = (int(bits[b, h, t, j // 8]) >> (j % 8)) & 1
                    assert bit == int((selected[b, t, h] == j).any())
            # Each slice's unused slots come after its nodes' entries, inside the slice.
            last = (b * kv_heads + h) * (nodes + 1) + nodes
            assert int(offsets[last]) - (b * kv_heads + h) * time * top_k == int((selected[b, :, h] >= 0).sum())


@pytest.mark.parametrize("budget", ["one-at-a-time", "all"])
def test_inverted_index_and_bitmasks_of_every_layer_at_once(monkeypatch, budget):
    """The backward's index and bitmasks of all selecting layers (node_gradients.inverted_index, the
    bitmask kernel) against the per-layer torch versions above: record slots 1.. are layers, each
    listed and masked as selection_index and selection_bits list and mask it alone."""
    from hccompile.kernels.htree import node_gradients
    from hccompile.kernels.htree.node_gradients import (inverted_index, selection_bitmasks, selection_bits,
                                                        selection_index)

    monkeypatch.setattr(node_gradients, "SORT_ENTRIES", 1 if budget == "one-at-a-time" else 1 << 25)
    generator = torch.Generator().manual_seed(6)
    batch, time, kv_heads, top_k, r, max_top_nodes = 2, 37, 3, 4, 3, 4
    cfg = resolve_htree_config(*make_inputs(batch, time, kv_heads, 1, 8, 8, torch.float32, seed=1),
                               compression_rate=r, top_k=top_k, max_top_nodes=max_top_nodes)
    plan = tiles.make_plan(time, 1, 8, 8, cfg, DEVICE)
    sizes = plan.layer_sizes
    assert sizes == (37, 13, 5, 2)
    record = torch.full((len(sizes), batch, time, kv_heads, top_k), -1, dtype=torch.int32)
    for layer in range(1, len(sizes)):
        for index in range(batch * time * kv_heads):
            count = int(torch.randint(0, min(top_k, sizes[layer]) + 1, (1,), generator=generator))
            chosen = torch.randperm(sizes[layer], generator=generator)[:count].sort().values
            record[layer].view(-1, top_k)[index, :count] = chosen.to(torch.int32)
    offsets, entries, rows = inverted_index(record.to(DEVICE), sizes[1], whole=budget == "all")
    assert rows == (len(sizes) - 1) * batch
    bits, table = selection_bitmasks(record.to(DEVICE), plan, r, max_top_nodes)
    offsets, entries, bits, table = (x.cpu() for x in (offsets, entries, bits, table))
    for layer in range(1, len(sizes)):
        want_offsets, want_entries = selection_index(record[layer], sizes[layer])
        want_bits = selection_bits(record[layer], sizes[layer])
        start, width = (int(x) for x in table[layer])
        assert width == want_bits.shape[-1]
        assert torch.equal(bits[start:start + want_bits.numel()].view_as(want_bits), want_bits), layer
        for b in range(batch):
            for h in range(kv_heads):
                owner = (h * rows + (layer - 1) * batch + b) * (sizes[1] + 1)
                want = (b * kv_heads + h) * (sizes[layer] + 1)
                for j in range(sizes[layer]):
                    got = entries[offsets[owner + j]:offsets[owner + j + 1]]
                    assert torch.equal(got, want_entries[want_offsets[want + j]:want_offsets[want + j + 1]]), \
                        (layer, b, h, j)


# (case, backward): every backward on a three-layer and a one-layer tree; two batches and two KV
# heads (the index's rows) once, the slowest under the interpreter (12 layers planned, 3 used).
EVERY_LENGTH_CASES = [(name, backward) for name in ("fp32_three_layers_g2", "one_layer")
                      for backward in ("atomics", "node-stationary", "forward-selections")]
EVERY_LENGTH_CASES += [("bf16", "atomics"), ("r5_two_batches_g3", "forward-selections")]


@pytest.mark.parametrize("name,backward", EVERY_LENGTH_CASES)
def test_the_plan_of_a_traced_call(monkeypatch, name, backward):
    """tiles.PLAN_EVERY_LENGTH: the launch plan of a call traced under torch.compile(dynamic=True),
    which on the GPU only compiled graphs run (the deepest tree's layers, each kernel reading the depth
    from T, the widths' bounds, the selections' slots at least 2, every layer's node gradients laid out
    for any top), run by the interpreter: the forward as the call's own plan, bit for bit; the
    gradients against the float64 reference."""
    batch, time, kv_heads, group, key_dim, value_dim, dtype, options = NODE_GRADIENT_CASES[name]
    q, k, v = make_inputs(batch, time, kv_heads, group, key_dim, value_dim, dtype, seed=len(name) + 80)
    cfg = resolve_htree_config(q, k, v, **options)
    o, lse, record = htree_forward(q, k, v, cfg, record_selections=True)
    monkeypatch.setattr(tiles, "PLAN_EVERY_LENGTH", True)
    plan = tiles.make_plan(time, group, key_dim, value_dim, cfg, DEVICE)
    assert plan.layers == tiles.max_layers(cfg) > plan.depth == record.shape[0]
    o_all, lse_all, record_all = htree_forward(q, k, v, cfg, record_selections=True)
    depth = record.shape[0]
    assert record_all.shape[0] == max(depth, 2) and torch.equal(record_all[:depth], record)
    assert bool((record_all[depth:] == -1).all())
    assert torch.equal(o_all, o) and torch.equal(lse_all, lse)
    generator = torch.Generator().manual_seed(12)
    do = torch.randn(o.shape, generator=generator).to(q.device, q.dtype)
    dlse = torch.randn(lse.shape, generator=generator).to(q.device)
    dq, dk, dv, record_bwd = htree_backward(q, k, v, o, lse, do, cfg, dlse, record_selections=True,
                                            node_gradients=backward != "atomics",
                                            selections=record_all.clone() if backward == "forward-selections"
                                            else None)
    assert torch.equal(record_bwd, record_all)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref, ref_lse = htree_attention_ref(*leaves, selections=selections_from_record(record), return_lse=True,
                                       **options)
    grads = torch.autograd.grad((ref * do.double()).sum() + (ref_lse * dlse.double()).sum(), leaves)
    for grad_name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        assert got.dtype == q.dtype, grad_name
        assert rel_err(got, want) < TOLERANCE[q.dtype], grad_name


def test_the_tables_of_a_traced_plan_are_those_of_its_values():
    """The symbolic plan's tables are built entry by entry (tiles.int_table: torch.full, so that each
    stays an expression of T); with the values in place, the same as torch.tensor's."""
    rows = [(37, 0, 0, 1), (13, 0, 37, 4), (5, 13, 50, 16)]
    assert torch.equal(tiles.int_table(rows, "cpu"), torch.tensor(rows))
    for time in (1, 3, 4, 5, 12, 13, 48, 49, 1000, 4097):
        assert tiles.tree_depth(time, 4, 12, 30) == len(htree_layer_sizes(time, 4, 12)), time


def test_backward_streaming_radix_and_lse_gradient(radix_select):
    q, k, v = make_inputs(1, 40, 1, 2, 16, 8, torch.float32, seed=6)
    check_backward(q, k, v, block_c=16, with_dlse=True, compression_rate=4, top_k=5, max_top_nodes=12)


def test_strided_inputs():
    # q, k, v as slices of wider tensors (e.g. a fused qkv projection viewed per head).
    base = make_inputs(1, 22, 2, 2, 16, 8, torch.float32, seed=7)
    q = torch.cat([base[0], base[0]], dim=-1)[:, :, :2, :16]  # one KV head's group
    k = torch.cat([base[1], base[1]], dim=2)[:, :, 1:2]
    v = base[2].transpose(1, 2).contiguous().transpose(1, 2)[:, :, :1]
    assert not q.is_contiguous() and not k.is_contiguous()
    check_backward(q, k, v, compression_rate=3, top_k=2, max_top_nodes=4)


def test_kernel_limits_give_clear_errors():
    q, k, v = make_inputs(1, 8, 1, 1, 8, 8, torch.float32, seed=8)
    cfg = resolve_htree_config(q, k, v, compression_rate=2, top_k=2)
    with pytest.raises(TypeError, match="q: dtype torch.float64 is not supported"):
        htree_forward(q.double(), k.double(), v.double(), cfg)
    big = torch.randn(1, 8, 1, 258, device=DEVICE)  # on q's device: the head-dim limit is what is tested
    with pytest.raises(ValueError, match="q: head dim K=258 exceeds the kernels' maximum 256"):
        htree_forward(big, big, v, resolve_htree_config(big, big, v, compression_rate=2, top_k=2))
    wide = make_inputs(1, 40000, 1, 1, 2, 1, torch.float32, seed=9, device="cpu")
    cfg = resolve_htree_config(*wide, compression_rate=2, top_k=1, max_top_nodes=20000)
    with pytest.raises(ValueError, match="max_top_nodes: the top layer has 20000 nodes"):
        htree_forward(*wide, cfg)
    with pytest.raises(ValueError, match="block_c: must be a power of two"):
        htree_forward(q, k, v, resolve_htree_config(q, k, v, compression_rate=2, top_k=2), block_c=24)


# --------------------------------------------------------------------------------------------
# GPU: realistic sizes, several tiles per layer, the threshold search.

GPU_CASES = [
    # batch, time, kv_heads, group, K, V, dtype, options
    (2, 1000, 2, 4, 64, 64, torch.float32, dict(compression_rate=16, top_k=8)),
    (1, 3000, 2, 8, 128, 128, torch.bfloat16, dict(compression_rate=16, top_k=16)),
    (1, 4099, 1, 2, 96, 48, torch.float16, dict(compression_rate=8, top_k=12, max_top_nodes=100, causal=True)),
    (1, 2500, 2, 3, 64, 32, torch.float32, dict(compression_rate=4, top_k=20, max_top_nodes=300,
                                                sort_mode="packed")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("node_gradients", [False, True], ids=["atomics", "node-stationary"])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_forward_backward(case, node_gradients):
    check_gpu_case(case, *GPU_CASES[case], node_gradients=node_gradients)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("node_gradients", [False, True], ids=["atomics", "node-stationary"])
def test_gpu_public_regime_8192_wide_selection(node_gradients):
    # The public code's regime (r=16, top_k=512, max_top_nodes=8192): T=70000 gives a top layer of
    # 4375 nodes (an 8192-wide selection in registers) and 8192 candidates per query below. The
    # kernels run every position; the float64 reference (whose autograd graph over all 70000
    # queries needed ~60 GiB) checks 448 of them: the gradient seeds are zero elsewhere, so dk
    # and dv are exactly the sampled queries' contributions, and dq is zero at every other row.
    generator = torch.Generator().manual_seed(9)
    sampled = torch.cat([torch.randint(0, 69000, (320,), generator=generator), torch.arange(69872, 70000)])
    check_gpu_case(9, 1, 70000, 1, 2, 16, 16, torch.float32, dict(compression_rate=16, top_k=512,
                                                                   max_top_nodes=8192),
                   query_positions=sampled.unique().cuda(), node_gradients=node_gradients)


def check_gpu_case(case, batch, time, kv_heads, group, key_dim, value_dim, dtype, options, query_positions=None,
                   node_gradients=False):
    q, k, v = make_inputs(batch, time, kv_heads, group, key_dim, value_dim, dtype, seed=case, device="cuda")
    cfg = resolve_htree_config(q, k, v, **options)
    o, lse, record = htree_forward(q, k, v, cfg, record_selections=True)
    rows_at = slice(None) if query_positions is None else query_positions
    expected = reference_selected(q, k, dict(options, query_positions=query_positions))
    checked = time if query_positions is None else query_positions.numel()
    rows = batch * checked * kv_heads * (record.shape[0] - 1)
    # float32: only near-ties may differ; half types score in half precision.
    limit = rows // 1000 + 1 if dtype == torch.float32 else rows // 20 + 1
    assert differing_rows(record[:, :, rows_at], expected) <= limit
    do = torch.randn_like(o)
    if query_positions is not None:
        keep = torch.zeros(time, dtype=torch.bool, device=o.device)
        keep[query_positions] = True
        do = do * keep[None, :, None, None]
    dq, dk, dv, record_bwd = htree_backward(q, k, v, o, lse, do, cfg, record_selections=True,
                                            node_gradients=node_gradients)
    assert torch.equal(record_bwd, record), "the backward recomputed a different selection"
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = htree_attention_ref(*leaves, selections=selections_from_record(record), query_positions=query_positions,
                              **options)
    grads = torch.autograd.grad(ref, leaves, do[:, rows_at].double())
    # Half types: rounded operands of every dot; gradients also sum through float32 atomics.
    tol_o, tol_grad = (1e-4, 1e-4) if dtype == torch.float32 else (1e-2, 2e-2)
    assert rel_err(o[:, rows_at], ref) < tol_o
    for got, want in zip((dq, dk, dv), grads):
        assert rel_err(got, want) < tol_grad

