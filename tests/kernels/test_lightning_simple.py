"""Tests for the simple chunked causal linear attention kernels and their PyTorch references."""

from __future__ import annotations

import os

import pytest
import torch

from hccompile.kernels.lightning import (
    MAX_HEAD_DIM,
    causal_linear_attn_bwd,
    causal_linear_attn_bwd_ref,
    causal_linear_attn_chunked_ref,
    causal_linear_attn_fwd,
    causal_linear_attn_ref,
    triton_available,
)

TRITON_CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
requires_triton = pytest.mark.skipif(
    not TRITON_CAN_RUN, reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (output, gradients) relative RMS error limits, FLA's for half precision. Triton's
# interpreter casts float32 to bfloat16 by truncation instead of round-to-nearest,
# which about triples the bfloat16 error there.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 8e-3),
    torch.bfloat16: (5e-3, 8e-3) if DEVICE == "cuda" else (1e-2, 1e-2),
}


def relative_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values: unwritten (NaN poison) or overflowed elements"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_inputs(batch, time, heads, key_dim, value_dim, dtype, device=DEVICE, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(dim):
        return torch.randn(batch, time, heads, dim, generator=generator).to(device=device, dtype=dtype)

    return randn(key_dim), randn(key_dim), randn(value_dim), randn(value_dim)


def float64_reference(q, k, v, do, scale):
    """Output and (dq, dk, dv) of the quadratic reference, by autograd in float64."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = causal_linear_attn_ref(q64, k64, v64, scale)
    dq64, dk64, dv64 = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    return o64.detach(), dq64, dk64, dv64


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


# Covers T in {1, 17, 64, 100, 130, 200}, head dims {16, 60, 64, 100, 128, 256} with K != V,
# and every dtype, without the cartesian product (the interpreter is slow).
KERNEL_CASES = [
    # batch, time, heads, key_dim, value_dim, dtype
    (1, 1, 1, 16, 16, torch.float32),
    (2, 17, 3, 60, 100, torch.float32),
    (1, 64, 2, 64, 64, torch.float16),
    (2, 100, 1, 100, 60, torch.bfloat16),
    (1, 130, 2, 128, 128, torch.float32),
    (3, 130, 1, 16, 64, torch.float16),
    (1, 100, 2, 128, 100, torch.bfloat16),
    (1, 17, 1, 100, 16, torch.float16),
    (1, 40, 1, MAX_HEAD_DIM, MAX_HEAD_DIM, torch.float32),
    (2, 200, 2, 64, 128, torch.bfloat16),
]


def case_id(case) -> str:
    batch, time, heads, key_dim, value_dim, dtype = case
    return f"B{batch}-T{time}-H{heads}-K{key_dim}-V{value_dim}-{str(dtype).removeprefix('torch.')}"


@requires_triton
@pytest.mark.parametrize("case", KERNEL_CASES, ids=case_id)
def test_kernels_match_float64_reference(case):
    batch, time, heads, key_dim, value_dim, dtype = case
    q, k, v, do = random_inputs(batch, time, heads, key_dim, value_dim, dtype, seed=time * 1000 + key_dim)
    scale = key_dim**-0.5

    # NaN-filled outputs catch any element the kernels fail to write.
    o_out = nan_like(v)
    grads_out = (nan_like(q), nan_like(k), nan_like(v))
    o = causal_linear_attn_fwd(q, k, v, scale, out=o_out)
    grads = causal_linear_attn_bwd(q, k, v, do, scale, out=grads_out)
    assert o is o_out
    assert all(grad is given for grad, given in zip(grads, grads_out))

    o_tol, grad_tol = TOLERANCES[dtype]
    o_ref, *grads_ref = float64_reference(q, k, v, do, scale)
    assert o.dtype == dtype and o.shape == (batch, time, heads, value_dim)
    assert relative_rms_error(o, o_ref) < o_tol
    for name, grad, grad_ref, like in zip(("dq", "dk", "dv"), grads, grads_ref, (q, k, v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape, name
        assert relative_rms_error(grad, grad_ref) < grad_tol, name


@requires_triton
def test_kernels_accept_non_contiguous_inputs():
    batch, time, heads, key_dim, value_dim = 2, 70, 3, 32, 48
    q, k, v, do = random_inputs(batch, time, heads, key_dim, value_dim, torch.float32, seed=7)
    # Same values, other memory layouts: heads-major, a slice of wider rows, a stride-2 head dim.
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_strided = torch.cat([k, torch.randn_like(k)], dim=-1)[..., :key_dim]
    v_strided = torch.stack([v, torch.randn_like(v)], dim=-1).flatten(-2)[..., ::2]
    do_strided = do.transpose(0, 2).contiguous().transpose(0, 2)
    strided = (q_strided, k_strided, v_strided, do_strided)
    assert not any(t.is_contiguous() for t in strided)
    assert all(torch.equal(a, b) for a, b in zip(strided, (q, k, v, do)))

    scale = 0.37
    o = causal_linear_attn_fwd(*strided[:3], scale)
    grads = causal_linear_attn_bwd(*strided, scale)
    assert o.is_contiguous() and all(grad.is_contiguous() for grad in grads)

    # The kernels read the same values in the same order, so results are bitwise equal.
    assert torch.equal(o, causal_linear_attn_fwd(q, k, v, scale))
    for grad, grad_contiguous in zip(grads, causal_linear_attn_bwd(q, k, v, do, scale)):
        assert torch.equal(grad, grad_contiguous)

    o_ref, *grads_ref = float64_reference(q, k, v, do, scale)
    assert relative_rms_error(o, o_ref) < 1e-4
    for grad, grad_ref in zip(grads, grads_ref):
        assert relative_rms_error(grad, grad_ref) < 1e-4


@requires_triton
def test_kernels_handle_empty_time():
    q, k, v, do = random_inputs(2, 0, 3, 16, 24, torch.float16)
    o = causal_linear_attn_fwd(q, k, v, 1.0)
    dq, dk, dv = causal_linear_attn_bwd(q, k, v, do, 1.0)
    assert o.shape == (2, 0, 3, 24) and o.dtype == torch.float16
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# The checks below run before any kernel, so they need no Triton.


def valid_cpu_inputs(key_dim=16, value_dim=16, time=5):
    return random_inputs(1, time, 2, key_dim, value_dim, torch.float32, device="cpu")


def replace(inputs, **changes):
    named = dict(zip(("q", "k", "v", "do"), inputs))
    named.update(changes)
    if "v" in changes and "do" not in changes:
        # do follows v so that the bwd launcher reports the same problem as the fwd one.
        named["do"] = torch.zeros_like(changes["v"])
    return named


def shaped(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


INVALID_INPUT_CASES = [
    # changes to valid [1, 5, 2, D] inputs, expected error, message pattern
    ({"q": shaped(5, 2, 16)}, ValueError, r"q: expected a 4-D tensor"),
    ({"k": shaped(1, 6, 2, 16)}, ValueError, r"k: batch, time, heads \(1, 6, 2\) differ from q's \(1, 5, 2\)"),
    ({"v": shaped(1, 5, 3, 16)}, ValueError, r"v: batch, time, heads"),
    ({"k": shaped(1, 5, 2, 32)}, ValueError, r"k: head dim 32 differs from q's head dim 16"),
    ({"q": shaped(1, 5, 2, 300), "k": shaped(1, 5, 2, 300)}, ValueError,
     r"q: head dim 300 exceeds the supported maximum 256"),
    ({"v": shaped(1, 5, 2, 257)}, ValueError, r"v: head dim 257 exceeds the supported maximum 256"),
    ({"v": shaped(1, 5, 2, 0)}, ValueError, r"v: head dim must be at least 1"),
    ({"q": shaped(1, 5, 2, 16, dtype=torch.float64)}, TypeError, r"q: dtype torch.float64 is not supported"),
    ({"v": shaped(1, 5, 2, 16, dtype=torch.int32)}, TypeError, r"v: dtype torch.int32 is not supported"),
    ({"k": shaped(1, 5, 2, 16, dtype=torch.float16)}, TypeError, r"k: dtype torch.float16 differs from q's"),
    ({"v": shaped(1, 5, 2, 16, device="meta")}, ValueError, r"v: device meta differs from q's device cpu"),
    ({"q": [[0.0]]}, TypeError, r"q: expected a torch.Tensor"),
]


@pytest.mark.parametrize("changes, error, pattern", INVALID_INPUT_CASES)
def test_launchers_reject_invalid_inputs(changes, error, pattern):
    named = replace(valid_cpu_inputs(), **changes)
    with pytest.raises(error, match=pattern):
        causal_linear_attn_fwd(named["q"], named["k"], named["v"], 1.0)
    with pytest.raises(error, match=pattern):
        causal_linear_attn_bwd(named["q"], named["k"], named["v"], named["do"], 1.0)


@pytest.mark.parametrize(
    "do, error, pattern",
    [
        (shaped(1, 5, 2, 8), ValueError, r"do: head dim 8 differs from v's head dim 16"),
        (shaped(1, 4, 2, 16), ValueError, r"do: batch, time, heads"),
        (shaped(1, 5, 2, 16, dtype=torch.bfloat16), TypeError, r"do: dtype torch.bfloat16 differs"),
    ],
)
def test_bwd_rejects_invalid_output_gradient(do, error, pattern):
    q, k, v, _ = valid_cpu_inputs()
    with pytest.raises(error, match=pattern):
        causal_linear_attn_bwd(q, k, v, do, 1.0)


def test_launchers_reject_invalid_out():
    q, k, v, do = valid_cpu_inputs(key_dim=16, value_dim=8)
    with pytest.raises(ValueError, match=r"out: shape \(1, 5, 2, 16\) differs from the expected \(1, 5, 2, 8\)"):
        causal_linear_attn_fwd(q, k, v, 1.0, out=torch.empty_like(q))
    with pytest.raises(TypeError, match=r"out: dtype torch.float16"):
        causal_linear_attn_fwd(q, k, v, 1.0, out=torch.empty_like(v, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out\[1\] \(dk\): shape"):
        causal_linear_attn_bwd(q, k, v, do, 1.0, out=(torch.empty_like(q), torch.empty_like(v), torch.empty_like(v)))
    with pytest.raises(TypeError, match=r"out: expected a tuple \(dq, dk, dv\)"):
        causal_linear_attn_bwd(q, k, v, do, 1.0, out=torch.empty_like(q))


def test_launchers_explain_missing_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, do = valid_cpu_inputs()
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1"):
        causal_linear_attn_fwd(q, k, v, 1.0)
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1"):
        causal_linear_attn_bwd(q, k, v, do, 1.0)


def test_triton_available_reads_environment_at_call_time(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available("cpu")
    assert triton_available(torch.device("cpu"))
    assert triton_available("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available("cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_available("cpu")
    assert not triton_available("meta")


# The references run anywhere; they are checked against the quadratic one in float64.

REFERENCE_CASES = [
    # batch, time, heads, key_dim, value_dim, chunk
    (1, 0, 1, 4, 4, 64),
    (1, 1, 1, 16, 16, 64),
    (2, 17, 3, 60, 100, 16),
    (1, 64, 2, 64, 64, 64),
    (2, 100, 1, 100, 60, 64),
    (1, 130, 2, 128, 128, 64),
    (2, 130, 2, 16, 24, 7),
]


@pytest.mark.parametrize("batch, time, heads, key_dim, value_dim, chunk", REFERENCE_CASES)
def test_chunked_references_match_quadratic_reference(batch, time, heads, key_dim, value_dim, chunk):
    q, k, v, do = random_inputs(batch, time, heads, key_dim, value_dim, torch.float64, device="cpu", seed=time)
    scale = key_dim**-0.5
    o_ref, *grads_ref = float64_reference(q, k, v, do, scale)

    o = causal_linear_attn_chunked_ref(q, k, v, scale, chunk=chunk)
    grads = causal_linear_attn_bwd_ref(q, k, v, do, scale, chunk=chunk)
    assert o.dtype == torch.float64 and o.shape == o_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    for name, grad, grad_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert grad.dtype == torch.float64 and grad.shape == grad_ref.shape, name
        torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunked_references_keep_input_dtypes(dtype):
    q, k, v, do = random_inputs(2, 100, 2, 60, 100, dtype, device="cpu", seed=3)
    scale = 60**-0.5
    o_ref, *grads_ref = float64_reference(q, k, v, do, scale)
    o_tol, grad_tol = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 8e-3), torch.bfloat16: (5e-3, 8e-3)}[dtype]

    o = causal_linear_attn_chunked_ref(q, k, v, scale)
    assert o.dtype == dtype
    assert relative_rms_error(o, o_ref) < o_tol
    grads = causal_linear_attn_bwd_ref(q, k, v, do, scale)
    for grad, grad_ref in zip(grads, grads_ref):
        assert grad.dtype == dtype
        assert relative_rms_error(grad, grad_ref) < grad_tol
