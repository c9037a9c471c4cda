"""KDA's backward state sweep on decayed queries and keys formed before it (plan.PREPARED_CHANNEL_SWEEP,
kernels/delta_rule/decayed_keys.py): every gradient and the initial-state gradient bit for bit those of the
sweep that forms them itself (the same fp32 products, rounded to the intermediates' dtype where the sweep's
products round them), on the kernel tests' per-channel cases (GVA, varlen, initial state, gate in the
kernel, strong decay, fp32 / bf16 / fp16) and with the sweep's value tiles narrowed; and the prep kernel's
qg and kg against float64 into NaN-poisoned buffers."""

from __future__ import annotations

import pytest
import torch

from hccompile.kernels.delta_rule import chunk as chunk_kernels
from hccompile.kernels.delta_rule import plan as kernel_plan
from hccompile.kernels.delta_rule.chunk import chunk_delta_rule_bwd
from hccompile.kernels.delta_rule.decayed_keys import launch_decayed_keys

from test_delta_rule import build_case
from test_delta_rule_chunk import (KERNEL_CASES, NARROW_SWEEP_CASES, kernel_inputs, random_output_gradients,
                                   relative_rms_error, requires_triton)
from test_delta_rule_wy_split import _nan

CHANNEL_CASES = [c for c in KERNEL_CASES + NARROW_SWEEP_CASES if c[2] == "channel"]


def _backward(inputs, kwargs, chunk, do, dht):
    bwd_kwargs = {n: a for n, a in kwargs.items() if n != "output_final_state"}
    return chunk_delta_rule_bwd(**inputs, **bwd_kwargs, chunk_size=chunk, do=do, dht=dht)


@requires_triton
@pytest.mark.parametrize("narrow", [False, True], ids=["tiles", "narrowed"])
@pytest.mark.parametrize("name, sizes, gate, options, dtype, chunk", CHANNEL_CASES, ids=[c[0] for c in CHANNEL_CASES])
def test_prepared_sweep_gradients_equal_the_sweep_forming_them(monkeypatch, name, sizes, gate, options, dtype, chunk,
                                                               narrow):
    if narrow:  # 16-wide sweep tiles
        monkeypatch.setattr(kernel_plan, "SWEEP_MIN_PROGRAMS", 1 << 20)
    inputs, kwargs = build_case(sizes, gate, {**options, "initial_state": True}, seed=sizes[1] + 13)
    inputs = kernel_inputs(inputs, dtype)
    do, dht = random_output_gradients(inputs, dtype)
    monkeypatch.setattr(kernel_plan, "PREPARED_CHANNEL_SWEEP", False)
    reference = _backward(inputs, kwargs, chunk, do, dht)
    launched = []
    original = chunk_kernels.launch_decayed_keys
    monkeypatch.setattr(chunk_kernels, "launch_decayed_keys", lambda *a: launched.append(1) or original(*a))
    monkeypatch.setattr(kernel_plan, "PREPARED_CHANNEL_SWEEP", True)
    grads = _backward(inputs, kwargs, chunk, do, dht)
    assert launched, "the prepared sweep did not run"
    for name_, want in reference.items():
        if want is not None:
            assert torch.equal(grads[name_], want), \
                f"d{name_}: max difference {(grads[name_].float() - want.float()).abs().max():.2e}"


@requires_triton
@pytest.mark.parametrize("varlen", [False, True], ids=["rows", "varlen"])
def test_decayed_keys_match_float64(varlen):
    sizes = (1, 90, 1, 2, 48, 16) if varlen else (2, 75, 2, 4, 100, 16)
    options = {"cu_seqlens": torch.tensor([0, 37, 38, 90], dtype=torch.int32), "num_sequences": 3} if varlen else {}
    chunk = 32
    inputs, kwargs = build_case(sizes, "channel", options, seed=3)
    inputs = kernel_inputs(inputs, torch.bfloat16)
    q, k, v, beta, g = (inputs[n] for n in ("q", "k", "v", "beta", "g"))
    cu_seqlens = inputs.get("cu_seqlens")
    problem = chunk_kernels._validate(q, k, v, beta, g, "channel", None, cu_seqlens, None, None, None, chunk)
    plan = kernel_plan.make_plan(problem, chunk, cu_seqlens, q)
    fwd = chunk_kernels._forward(plan, q, k, v, beta, g, 1.0, None, None, None, False, None, None, None)
    batch, time, value_heads, key_dim = problem.batch, problem.time, problem.value_heads, problem.key_dim
    qg, kg = (_nan(batch, time, value_heads, key_dim, dtype=plan.intermediate_dtype) for _ in range(2))
    table, seqlens = plan.chunk_args()
    launch_decayed_keys(plan, fwd.q, fwd.k, fwd.cum, qg, kg, plan.num_chunks, table, seqlens)
    group = value_heads // problem.key_heads
    q64, k64 = (x.double().repeat_interleave(group, dim=2) for x in (fwd.q, fwd.k))
    cum = fwd.cum.double()
    qg_ref, kg_ref = q64 * cum.exp(), torch.empty_like(k64)
    for b, bos, eos in problem.sequence_bounds():
        for start in range(bos, eos, chunk):
            last = min(start + chunk, eos) - 1
            kg_ref[b, start:last + 1] = k64[b, start:last + 1] * (cum[b, last] - cum[b, start:last + 1]).exp()
    for label, got, want in (("qg", qg, qg_ref), ("kg", kg, kg_ref)):
        error = relative_rms_error(got, want)  # fails on any unwritten (NaN) element
        assert error < 1e-2, f"{label}: relative RMS error {error:.2e}"
