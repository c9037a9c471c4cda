"""Every kernel launch of every family writes only its outputs, as torch's mutation analysis reads it.

A traced launch (torch.compile of an op, lowering/_launch.py) is functionalised: Inductor copies
every tensor argument that torch's analysis of the kernel's Triton IR finds written, before each
launch, and a written graph input becomes a mutation of the caller's tensor. The analysis walks back
from each store's address through every op the address is computed from, a jit helper's call
included (all of its arguments), though not through a load. So an index table or cu_seqlens pointer
passed into a helper whose results index a store counts as written: Inductor then copies the table
before every launch (11 extra kernels per GDN step; the GPU suite caught this at 680ba4e through
tests/test_traced_launch.py, and lightning's segment table once before). The analysis needs no GPU,
only a target (helpers.kernel_target): this runs it on the CPU, on each family's launches recorded
from its eager entry points with small CPU tensors (hccompile.kernels.launch_recorder: the kernels
are not run), fixed-length and varlen, forward and backward."""
from __future__ import annotations

import os
import re

import pytest
import torch

import helpers

triton = pytest.importorskip("triton")
from triton import language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_compiled_kernels = pytest.mark.skipif(INTERPRETED, reason="run by test_in_a_process_without_the_interpreter")

READ_ONLY = re.compile(r"table|seqlens|offsets")


@pytest.mark.skipif(not INTERPRETED, reason="the checks run in this process")
def test_in_a_process_without_the_interpreter():
    helpers.rerun_without_interpreter(__file__)


def written_tensors(kernel, arguments: dict) -> list[str]:
    """The tensor arguments torch's mutation analysis takes `kernel` to write."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    with helpers.kernel_target():
        if hasattr(wrap, "identify_accessed_tensors"):  # torch 2.13 on
            names = [dep.name for dep in wrap.identify_accessed_tensors(kernel, arguments, {}).read_writes.writes]
        else:  # torch 2.11
            names = wrap.identify_mutated_tensors(kernel, arguments, {})
    return [name for name in names if isinstance(arguments.get(name), torch.Tensor)]


def recorded(run) -> list:
    """(kernel, arguments by name) of every launch `run()` makes (hccompile.kernels.launch_recorder)."""
    from hccompile.kernels.launch_recorder import recording_launches

    with recording_launches() as calls:
        run()
    return [(kernel, _named(kernel, args, kwargs)) for kernel, _grid, args, kwargs in calls]


def _named(kernel, args, kwargs) -> dict:
    return dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}


def check_launches(calls: list, inputs: tuple = ()) -> int:
    """No launch writes an index table or one of the entry point's `inputs`; each writes something
    (an analysis that failed would take every argument as written, which the first check catches)."""
    input_storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
    bad, seen = [], set()
    for kernel, arguments in calls:
        key = (kernel.__name__, tuple(sorted((n, str(getattr(v, "dtype", v))) for n, v in arguments.items())))
        if key in seen:
            continue
        seen.add(key)
        written = written_tensors(kernel, arguments)
        assert written, f"{kernel.__name__}: no output found (the analysis read nothing)"
        bad += [(kernel.__name__, name) for name in written if READ_ONLY.search(name)
                or arguments[name].untyped_storage().data_ptr() in input_storages]
    assert not bad, bad
    return len(seen)


# --- the delta rule: chunk.py's forward and backward and cp.py's summaries (compile_check) -----------
@needs_compiled_kernels
@pytest.mark.parametrize("varlen", [False, True], ids=["rows", "varlen"])
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_delta_rule_launches_write_no_index_table(gate, varlen):
    from hccompile.kernels.delta_rule.compile_check import recorded_launches

    calls = [(kernel, _named(kernel, args, kwargs))
             for _, kernel, args, kwargs in recorded_launches(gate, 64, torch.bfloat16, varlen)]
    assert check_launches(calls) >= 5


@needs_compiled_kernels
@pytest.mark.parametrize("varlen", [False, True], ids=["rows", "varlen"])
def test_delta_rule_chunk_score_programs_write_no_index_table(monkeypatch, varlen):
    """Per-channel gates with decayed_scores' one program per chunk (plan.CHUNK_SCORE_PROGRAMS)."""
    from hccompile.kernels.delta_rule import plan as kernel_plan
    from hccompile.kernels.delta_rule.compile_check import recorded_launches

    monkeypatch.setattr(kernel_plan, "CHUNK_SCORE_PROGRAMS", True)
    launches = recorded_launches("channel", 64, torch.bfloat16, varlen)
    assert "_chunk_scores_kernel" in {kernel.fn.__name__ for _, kernel, _, _ in launches}
    calls = [(kernel, _named(kernel, args, kwargs)) for _, kernel, args, kwargs in launches]
    assert check_launches(calls) >= 5


# --- lightning attention (segments and sweeps), causal linear attention --------------------------
def _lightning_inputs(varlen: bool):
    torch.manual_seed(0)
    B, T, H, D = (1, 200, 2, 32) if varlen else (2, 200, 2, 32)
    q, k, v, do = (torch.randn(B, T, H, D, dtype=torch.bfloat16) for _ in range(4))
    decay = -torch.rand(H)
    sequences = 2 if varlen else B
    h0, dht = (torch.randn(sequences, H, D, D) for _ in range(2))
    cu_seqlens = torch.tensor([0, 70, T], dtype=torch.int32) if varlen else None
    return q, k, v, do, decay, h0, dht, cu_seqlens


# (sweeps.FLAT_SWEEPS, sweeps.PAIRED_REVERSE, segments.SEQUENTIAL_STATES) of each way to launch
LIGHTNING_LOOPS = {"nested": (False, False, False), "flat": (True, False, False), "paired": (True, True, False),
                   "sequential-states": (True, False, True)}


@needs_compiled_kernels
@pytest.mark.parametrize("loops", list(LIGHTNING_LOOPS))
@pytest.mark.parametrize("varlen", [False, True], ids=["rows", "varlen"])
def test_lightning_launches_write_only_outputs(varlen, loops, monkeypatch):
    """Every way the lightning launchers can run: the nested or flat sweeps, the paired reverse sweep,
    the segments' states from the summary and prefix passes or one sequential walk (fixed rows)."""
    from hccompile.kernels.lightning import segments, sweeps
    from hccompile.kernels.lightning.chunk import lightning_attn_bwd, lightning_attn_fwd

    for module, name, value in zip((sweeps, sweeps, segments), ("FLAT_SWEEPS", "PAIRED_REVERSE", "SEQUENTIAL_STATES"),
                                   LIGHTNING_LOOPS[loops]):
        monkeypatch.setattr(module, name, value)
    q, k, v, do, decay, h0, dht, cu_seqlens = _lightning_inputs(varlen)
    # segment=64 (one block): the automatic segment length asks the GPU for its multiprocessors
    calls = recorded(lambda: (lightning_attn_fwd(q, k, v, decay, None, h0, True, cu_seqlens=cu_seqlens, segment=64),
                              lightning_attn_bwd(q, k, v, decay, do, None, h0, dht, cu_seqlens=cu_seqlens, segment=64)))
    assert check_launches(calls, (q, k, v, do, decay, h0, dht, cu_seqlens)) >= 3


@needs_compiled_kernels
def test_causal_linear_attn_launches_write_only_outputs():
    from hccompile.kernels.lightning.simple import causal_linear_attn_bwd, causal_linear_attn_fwd

    q, k, v, do, *_ = _lightning_inputs(False)
    calls = recorded(lambda: (causal_linear_attn_fwd(q, k, v, 0.125), causal_linear_attn_bwd(q, k, v, do, 0.125)))
    assert check_launches(calls, (q, k, v, do)) >= 2


# --- htree ---------------------------------------------------------------------------------------
@needs_compiled_kernels
@pytest.mark.parametrize("from_forward", [False, True], ids=["selected-again", "forward-selections"])
@pytest.mark.parametrize("node_gradients", [False, True], ids=["atomics", "node-stationary"])
@pytest.mark.parametrize("causal", [True, False])
def test_htree_launches_write_only_outputs(causal, node_gradients, from_forward):
    """Both backward versions, each selecting again or reading the forward's selections (the ops' way
    for the node-stationary one). The atomics store at nodes computed from the selections: taken from a
    jit helper given their pointer, they counted as a write of the selections, an input (caught
    by tests/test_traced_launch.py when htree was first traced, before any GPU run)."""
    from hccompile.kernels.htree.backward import htree_backward
    from hccompile.kernels.htree.forward import htree_forward
    from hccompile.kernels.htree.reference import resolve_htree_config

    torch.manual_seed(0)
    B, T, H, H_kv, D = 1, 80, 4, 2, 32
    q, do = torch.randn(B, T, H, D, dtype=torch.bfloat16), torch.randn(B, T, H, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, T, H_kv, D, dtype=torch.bfloat16) for _ in range(2))
    cfg = resolve_htree_config(q, k, v, compression_rate=4, top_k=3, causal=causal)
    o, lse = torch.randn(B, T, H, D, dtype=torch.bfloat16), torch.randn(B, T, H)
    # The node-stationary backward reads the forward's selections (not run here: their values do not
    # matter to the analysis, only that the record is read).
    selections = torch.full((3, B, T, H_kv, 3), -1, dtype=torch.int32) if from_forward else None
    calls = recorded(lambda: (htree_forward(q, k, v, cfg, record_selections=from_forward),
                              htree_backward(q, k, v, o, lse, do, cfg, node_gradients=node_gradients,
                                             selections=selections)))
    inputs = (q, k, v, do, o, lse) + ((selections,) if from_forward else ())
    assert check_launches(calls, inputs) >= (2 if not node_gradients else 2 + 3)


# --- mHC (post, aggregate, mapping; compile_check records them) ------------------------------------
@needs_compiled_kernels
def test_mhc_launches_write_only_outputs():
    """n = 4 and n = 9: the post backward's slot sweep and its column sweep, whose helpers take the
    input tiles' pointers beside the outputs' and the scratch's (its second launch reads the
    scratch into dA and dH_post)."""
    from hccompile.kernels.mhc.compile_check import recorded_launches

    calls = [(kernel, _named(kernel, args, kwargs)) for n in (4, 9)
             for _, kernel, args, kwargs in recorded_launches(n=n, C=256, steps=4)]
    assert check_launches(calls) >= 13
    for name, kernel, args, kwargs in recorded_launches(n=9, C=256, steps=4):
        if name.startswith("post_bwd"):
            written = written_tensors(kernel, _named(kernel, args, kwargs))
            assert written and set(written) <= {"dx_ptr", "df_ptr", "da_ptr", "dhp_ptr", "sums_ptr"}, written


# --- the check itself ------------------------------------------------------------------------------
# A helper that takes the table pointer itself: what the kernels above must not do.
@triton.jit
def _coords_from_table(chunk_table_ptr, pid):
    return tl.load(chunk_table_ptr + pid)


@triton.jit
def _table_in_helper_kernel(chunk_table_ptr, out_ptr, BLOCK: tl.constexpr):
    start = _coords_from_table(chunk_table_ptr, tl.program_id(0))
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + start + cols, cols.to(tl.float32))


@triton.jit
def _table_loaded_kernel(chunk_table_ptr, out_ptr, BLOCK: tl.constexpr):
    start = tl.load(chunk_table_ptr + tl.program_id(0))
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + start + cols, cols.to(tl.float32))


@needs_compiled_kernels
def test_the_check_sees_a_table_passed_into_a_helper():
    """The can-fail twin: the analysis takes the table as written when a helper gets its pointer,
    and only the output when the kernel loads the entry itself; check_launches refuses the first."""
    arguments = dict(chunk_table_ptr=torch.zeros(4, dtype=torch.int32), out_ptr=torch.zeros(64), BLOCK=16)
    assert sorted(written_tensors(_table_in_helper_kernel, arguments)) == ["chunk_table_ptr", "out_ptr"]
    assert written_tensors(_table_loaded_kernel, arguments) == ["out_ptr"]
    with pytest.raises(AssertionError, match="chunk_table_ptr"):
        check_launches([(_table_in_helper_kernel, arguments)])
    out = arguments["out_ptr"]
    with pytest.raises(AssertionError, match="out_ptr"):  # an entry point's input, written
        check_launches([(_table_loaded_kernel, arguments)], inputs=(out,))
