"""The CP layout (hccompile/distributed/layout.py, context.py): pieces, local sequences, chains,
exchange slots and FLA-style roles, checked against token-level brute force. Pure Python."""
from __future__ import annotations

import random

import pytest
import torch

from hccompile.distributed import build_cp_context
from hccompile.distributed.layout import even_sizes, make_pieces


def contexts(world, layout="contiguous", cu=None, seq_len=None, **kwargs):
    return [build_cp_context(cu, seq_len=seq_len, layout=layout, rank=r, world_size=world, **kwargs)
            for r in range(world)]


def test_pieces_uneven_and_zigzag_owners():
    assert even_sizes(10, 3) == [4, 3, 3]
    pieces = make_pieces(10, 3)
    assert [(p.owner, p.start, p.end) for p in pieces] == [(0, 0, 4), (1, 4, 7), (2, 7, 10)]
    pieces = make_pieces(10, 2, "zigzag")
    assert [(p.owner, p.start, p.end) for p in pieces] == [(0, 0, 3), (1, 3, 6), (1, 6, 8), (0, 8, 10)]
    pieces = make_pieces(10, 2, sizes=[7, 3])
    assert [(p.start, p.end) for p in pieces] == [(0, 7), (7, 10)]


def _random_cu(rng, total_sequences):
    lengths = [rng.choice([0, 1, 3, 7, 16, 29, 40]) for _ in range(total_sequences)]
    lengths[rng.randrange(total_sequences)] += 50  # at least one long sequence
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize("seed", range(12))
def test_varlen_plans_against_token_brute_force(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 3, 4])
    layout = rng.choice(["contiguous", "zigzag"])
    cu = _random_cu(rng, rng.randint(1, 6))
    total = cu[-1]
    ctxs = contexts(world, layout, cu=cu)
    sequence_of = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor([b - a for a, b in zip(cu, cu[1:])]))
    positions = torch.arange(total)
    # Every token lands on exactly one rank, in the ctx.shard order.
    local_positions = [ctx.shard(positions[None])[0] for ctx in ctxs]
    assert sorted(torch.cat(local_positions).tolist()) == list(range(total))
    plans = [ctx.plan(1) for ctx in ctxs]
    owner_of = {}
    for rank, (ctx, plan, pos) in enumerate(zip(ctxs, plans, local_positions)):
        assert plan.num_tokens == ctx.num_local_tokens == len(pos)
        assert ctx.cu_seqlens.tolist() == plan.cu_seqlens()
        for segment, (lo, hi) in enumerate(plan.bounds):
            tokens = pos[lo:hi]
            sequence = plan.sequence[segment]
            # A segment is one sequence's contiguous run of tokens.
            assert (sequence_of[tokens] == sequence).all()
            assert tokens.tolist() == list(range(int(tokens[0]), int(tokens[0]) + len(tokens))) if len(tokens) else True
            if len(tokens):
                first, last = int(tokens[0]), int(tokens[-1])
                assert plan.incoming[segment] == (first > cu[sequence])
                assert plan.outgoing[segment] == (last < cu[sequence + 1] - 1)
                assert plan.ends_sequence[segment] == (last == cu[sequence + 1] - 1)
                assert (plan.initial_row[segment] >= 0) == (first == cu[sequence])
                owner_of[(sequence, first)] = (rank, segment)
            else:
                assert not plan.incoming[segment] and not plan.outgoing[segment]
    # Chains name, in order, the slots of every earlier (forward) or later (backward) part.
    for rank, plan in enumerate(plans):
        for segment in range(plan.num_segments):
            if not plan.incoming[segment]:
                assert plan.fwd_chain[segment] == ()
                continue
            sequence = plan.sequence[segment]
            earlier = sorted((first, owner) for (seq, first), owner in owner_of.items()
                             if seq == sequence and first < int(local_positions[rank][plan.bounds[segment][0]]))
            expected = [r * plans[0].out_slots + plans[r].out_slot[s] for _, (r, s) in earlier]
            assert list(plan.fwd_chain[segment]) == expected
        for segment in range(plan.num_segments):
            if not plan.outgoing[segment]:
                assert plan.bwd_chain[segment] == ()
                continue
            sequence = plan.sequence[segment]
            later = sorted((first, owner) for (seq, first), owner in owner_of.items()
                           if seq == sequence and first > int(local_positions[rank][plan.bounds[segment][0]]))
            expected = [(r * plans[0].in_slots + plans[r].in_slot[s], -1 if i == 0 else r * plans[0].out_slots
                         + plans[r].out_slot[s]) for i, (_, (r, s)) in enumerate(reversed(later))]
            assert list(plan.bwd_chain[segment]) == expected


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_fixed_length_rows_are_segments_row_major(layout):
    ctxs = contexts(3, layout, seq_len=20)
    for ctx in ctxs:
        plan = ctx.plan(2)
        assert plan.user_rows == 2 and plan.num_tokens == 2 * ctx.num_local_tokens
        assert [plan.sequence[s] for s in range(plan.num_segments)] == sorted(plan.sequence)
        for row in (0, 1):
            segments = [s for s in range(plan.num_segments) if plan.sequence[s] == row]
            assert plan.final_segment[row] == segments[-1]
    # Middle parts exist with three ranks: the transition matrix is exchanged.
    assert ctxs[1].plan(2).with_transition


def test_contiguous_roles_match_fla_definitions():
    cu = [0, 5, 60, 68]  # 68 tokens over 4 ranks: 17 each; sequence 1 spans ranks 0..3
    ctxs = contexts(4, cu=cu)
    assert [ctx.is_first_rank for ctx in ctxs] == [True, False, False, False]
    assert [ctx.pre_num_ranks for ctx in ctxs] == [0, 1, 2, 3]
    assert [ctx.is_last_rank for ctx in ctxs] == [False, False, False, True]
    assert [ctx.post_num_ranks for ctx in ctxs] == [3, 2, 1, 0]
    assert [ctx.cu_seqlens.tolist() for ctx in ctxs] == [[0, 5, 17], [0, 17], [0, 17], [0, 9, 17]]


def test_local_initial_state_rows():
    ctxs = contexts(2, "zigzag", cu=[0, 10, 30])  # pieces [0,8) [8,15) [15,23) [23,30)
    h0 = torch.arange(2.0)[:, None]
    assert ctxs[0].local_initial_state(h0).flatten().tolist() == [0.0, 1.0]
    assert ctxs[1].local_initial_state(h0).flatten().tolist() == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(cu=[0, 3], world=4), r"tokens: 3 tokens cannot give every one of the 4 pieces"),
    (dict(seq_len=5, world=3, layout="zigzag"), r"seq_len: 5 tokens cannot give every one of the 6 pieces"),
    (dict(cu=[0, 10], world=2, layout="ring"), r"layout: expected one of"),
    (dict(cu=[0, 10], world=2, sizes=[3, 3]), r"sizes: expected 2 non-negative token counts summing to 10"),
    (dict(cu=[1, 10], world=2), r"cu_seqlens: expected \[0, \.\.\., total\]"),
    (dict(cu=[0, 10], world=2, strategy="tree"), r"strategy: expected one of"),
])
def test_bad_contexts_name_the_argument(kwargs, match):
    world = kwargs.pop("world")
    cu = kwargs.pop("cu", None)
    with pytest.raises(ValueError, match=match):
        build_cp_context(cu, rank=0, world_size=world, **kwargs)


def test_context_needs_a_group_or_explicit_ranks():
    with pytest.raises(ValueError, match="pass exactly one of cu_seqlens"):
        build_cp_context([0, 4], seq_len=4, rank=0, world_size=1)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
            build_cp_context([0, 4])
