"""Every delta-rule kernel launch writes only its outputs, as torch's mutation analysis reads it.

A traced launch (torch.compile of an op, lowering/_launch.py) is functionalised: Inductor copies
every tensor argument that torch's analysis of the kernel's Triton IR finds written, before each
launch. The analysis walks back from each store's address through every op the address is computed
from, a jit helper's call included (all of its arguments), though not through a load. So a chunk
table or cu_seqlens pointer passed into a helper whose results index a store counts as written, and
Inductor then copies the table before every launch (11 extra kernels per GDN step). The GPU suite
saw this at 680ba4e (tests/test_traced_launch.py); the analysis itself needs no GPU, only a target
(helpers.kernel_target), so this runs it on the CPU for every launch of compile_check's recorded
forward, backward and CP summaries, fixed-length and varlen."""
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


def _arguments(kernel, args, kwargs) -> dict:
    arguments = dict(zip(kernel.arg_names, args))
    arguments.update({k: v for k, v in kwargs.items() if k in kernel.arg_names})
    return arguments


@needs_compiled_kernels
@pytest.mark.parametrize("varlen", [False, True], ids=["rows", "varlen"])
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_launches_write_no_index_table(gate, varlen):
    from hccompile.kernels.delta_rule.compile_check import recorded_launches

    seen, tables = set(), []
    for step, kernel, args, kwargs in recorded_launches(gate, 64, torch.bfloat16, varlen):
        if kernel.__name__ in seen:
            continue
        seen.add(kernel.__name__)
        written = written_tensors(kernel, _arguments(kernel, args, kwargs))
        assert written, f"{step} {kernel.__name__}: no output found (the analysis read nothing)"
        tables += [(kernel.__name__, name) for name in written if READ_ONLY.search(name)]
    assert len(seen) >= 5, seen
    assert not tables, tables


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
    and only the output when the kernel loads the entry itself."""
    arguments = dict(chunk_table_ptr=torch.zeros(4, dtype=torch.int32), out_ptr=torch.zeros(64), BLOCK=16)
    assert sorted(written_tensors(_table_in_helper_kernel, arguments)) == ["chunk_table_ptr", "out_ptr"]
    assert written_tensors(_table_loaded_kernel, arguments) == ["out_ptr"]
