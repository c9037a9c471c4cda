"""The forward's output kernel beside its state sweep (plan.PIPELINED_OUTPUT, kernels/delta_rule/pipeline.py):
state_forward counts each chunk done per value head and sweep value tile (one per thread of the tile's
program), and the output kernel waits for its chunk's counts. The same o and final state bit for bit as the forward without
it, on every gate, GVA, varlen, an initial state, narrowed sweep tiles (several programs per chunk) and T not
a chunk multiple; every counter complete, and the output kernel's programs reading their own. On a GPU the two kernels run side by side (programmatic dependent launch on Hopper);
under the interpreter one after the other."""

from __future__ import annotations

import pytest
import torch

from hccompile.kernels.delta_rule import chunk as chunk_kernels
from hccompile.kernels.delta_rule import plan as kernel_plan
from hccompile.kernels.delta_rule.chunk import chunk_delta_rule_fwd

from test_delta_rule import build_case
from test_delta_rule_chunk import THREE_SEQUENCE_OPTIONS, THREE_SEQUENCES, kernel_inputs, requires_triton

# name, (batch, time, H, HV, K, V), gate, options, dtype, chunk size
CASES = [
    ("plain-T63-b2", (2, 63, 1, 1, 32, 32), "none", {}, torch.float32, 64),
    ("gdn-T100-gva-l2norm", (1, 100, 2, 4, 60, 64), "scalar", {"l2norm": True}, torch.float16, 32),
    ("gdn-T130-h0-bf16", (1, 130, 1, 2, 64, 60), "scalar", {"initial_state": True}, torch.bfloat16, 64),
    ("kda-T90-gva", (1, 90, 1, 2, 48, 32), "channel", {}, torch.float32, 32),
    ("kda-varlen-h0", THREE_SEQUENCES, "channel", THREE_SEQUENCE_OPTIONS, torch.bfloat16, 16),
    ("gdn-varlen-h0", THREE_SEQUENCES, "scalar", THREE_SEQUENCE_OPTIONS, torch.float32, 16),
]


def _forward(inputs, kwargs, chunk):
    return chunk_delta_rule_fwd(**inputs, **kwargs, chunk_size=chunk)


@requires_triton
@pytest.mark.parametrize("narrow", [False, True], ids=["tiles", "narrowed"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", CASES, ids=[c[0] for c in CASES])
def test_pipelined_output_equals_the_forward_after_the_sweep(monkeypatch, name, sizes, gate, options, dtype, chunk,
                                                             narrow):
    if narrow:  # 16-wide sweep tiles: several flags per chunk and head
        monkeypatch.setattr(kernel_plan, "SWEEP_MIN_PROGRAMS", 1 << 20)
    inputs, kwargs = build_case(sizes, gate, options, seed=sizes[1] + 11)
    inputs = kernel_inputs(inputs, dtype)
    monkeypatch.setattr(kernel_plan, "PIPELINED_OUTPUT", False)
    o_ref, state_ref = _forward(inputs, kwargs, chunk)
    flags = []
    original = chunk_kernels.chunk_flags
    monkeypatch.setattr(chunk_kernels, "chunk_flags", lambda *a: flags.append(original(*a)) or flags[-1])
    monkeypatch.setattr(kernel_plan, "PIPELINED_OUTPUT", True)
    o, state = _forward(inputs, kwargs, chunk)
    assert len(flags) == 1, "the pipelined forward did not run"
    counts = flags[0]
    full = int(counts.max())
    assert counts.numel() > 0 and full > 0 and full % 32 == 0, f"chunk counts {counts.unique().tolist()}"
    assert bool((counts == full).all()), f"{int((counts != full).sum())} of {counts.numel()} chunk counts short"
    assert torch.equal(o, o_ref), f"o: max difference {(o.float() - o_ref.float()).abs().max():.2e}"
    assert torch.equal(state, state_ref), "final state"


@requires_triton
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_output_program_reads_its_own_chunk_flags(gate):
    """The output kernel alone on a forward's intermediates, with every (chunk, head, tile) counter at its
    target but one, one short: under the interpreter a program whose counts are short writes NaN, so exactly
    that chunk's rows of that head are NaN and every other element equals the run with every count complete
    (a program reading another slot's counters would differ)."""
    from hccompile.kernels.delta_rule.output import launch_output

    sizes, chunk = (2, 100, 1, 2, 32, 48), 32  # 4 chunks a row, 8 in all
    inputs, kwargs = build_case(sizes, gate, {}, seed=5)
    inputs = kernel_inputs(inputs, torch.float32)
    q, k, v, beta, g = (inputs[n] for n in ("q", "k", "v", "beta", "g"))
    problem = chunk_kernels._validate(q, k, v, beta, g, gate, None, None, None, None, None, chunk)
    plan = kernel_plan.make_plan(problem, chunk, None, q)
    fwd = chunk_kernels._forward(plan, q, k, v, beta, g, 0.5, None, None, None, False, None, None, None)
    table, seqlens = plan.chunk_args()
    tiles, threads, value_heads = 3, 128, sizes[3]

    def output(flags):
        o = torch.empty_like(v)
        launch_output(plan, fwd.q, fwd.k, fwd.cum if fwd.cum is not None else plan.dummy, fwd.h, fwd.scores, fwd.u,
                      o, plan.num_chunks, table, seqlens, 0.5, form_scores=False, flags=flags, flag_tiles=tiles,
                      flag_threads=threads)
        return o

    every = output(chunk_kernels.chunk_flags(plan.num_chunks * value_heads * tiles, q.device) + threads)
    assert not every.isnan().any()
    flags = chunk_kernels.chunk_flags(plan.num_chunks * value_heads * tiles, q.device) + threads
    missing_chunk, missing_head = 6, 1  # the second row's third chunk
    flags[(missing_chunk * value_heads + missing_head) * tiles + 2] -= 1
    o = output(flags)
    rows = slice((missing_chunk % 4) * chunk, (missing_chunk % 4 + 1) * chunk)
    assert o[1, rows, missing_head].isnan().all(), "the program of the unflagged slot did not wait for it"
    o[1, rows, missing_head] = every[1, rows, missing_head]
    assert torch.equal(o, every), "a program waited for another slot's flags"
