"""The fused mHC kernels (post, aggregate, mapping) and their custom ops: every output and gradient
against float64 plain-PyTorch references (relative RMS), awkward channel counts, n = 2, 3, 4,
float32 and bfloat16, transposed mixing, permuted output layouts, strided inputs, outputs poisoned
with NaN before the kernels write them; opcheck; the reference fallback; input errors."""
from __future__ import annotations

import os

import pytest
import torch

import hccompile.lowering.mhc as L
from hccompile.kernels.mhc import (
    MappingSpec,
    _common,
    mhc_aggregate_bwd,
    mhc_aggregate_bwd_ref,
    mhc_aggregate_fwd,
    mhc_aggregate_ref,
    mhc_mapping_bwd,
    mhc_mapping_fwd,
    mhc_mapping_ref,
    mhc_post_bwd,
    mhc_post_bwd_ref,
    mhc_post_fwd,
    mhc_post_ref,
)

TRITON_CAN_RUN = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
requires_triton = pytest.mark.skipif(not TRITON_CAN_RUN,
                                     reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter casts float32 to bfloat16 by truncation, not round-to-nearest: about twice the error.
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 8e-3 if DEVICE == "cuda" else 1.6e-2}


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values: unwritten (NaN poison) or overflowed elements"
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture
def poisoned(monkeypatch):
    """Every kernel output starts as NaN: an element a kernel does not write fails."""
    original = _common.new_output

    def nan_output(shape, dtype, device, order=None):
        return original(shape, dtype, device, order).fill_(float("nan"))

    monkeypatch.setattr(_common, "new_output", nan_output)


def randn(*shape, dtype, gen, scale=1.0, offset=0.0):
    return (torch.randn(shape, generator=gen) * scale + offset).to(device=DEVICE, dtype=dtype)


def strided(t: torch.Tensor, gen) -> torch.Tensor:
    """The same values in a non-contiguous tensor (every other element of a wider buffer)."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


# ----------------------------------------------------------------------------------------
# post and aggregate

POST_CASES = [
    # T1, T2, n, C, dtype, transpose_res, out_order, strided inputs
    (2, 3, 4, 37, torch.float32, True, (0, 1, 2, 3), False),
    (1, 5, 2, 100, torch.float32, False, (0, 2, 1, 3), True),
    (3, 2, 3, 130, torch.bfloat16, False, (0, 1, 2, 3), False),
    (2, 7, 4, 200, torch.bfloat16, True, (0, 2, 1, 3), True),
    (1, 1, 4, 1, torch.float32, False, (2, 0, 1, 3), False),
    (2, 3, 4, 48, torch.float16, True, (0, 1, 2, 3), False),
]


def _post_inputs(T1, T2, n, C, dtype, strided_inputs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = randn(T1, T2, n, C, dtype=dtype, gen=gen)
    h_res = randn(T1, T2, n, n, dtype=dtype, gen=gen, scale=0.5, offset=0.25)
    h_post = randn(T1, T2, n, dtype=dtype, gen=gen, scale=0.5, offset=1.0)
    f = randn(T1, T2, C, dtype=dtype, gen=gen)
    dout = randn(T1, T2, n, C, dtype=dtype, gen=gen)
    if strided_inputs:
        x, h_res, f, dout = (strided(t, gen) for t in (x, h_res, f, dout))
        assert not x.is_contiguous()
    return x, h_res, h_post, f, dout


@requires_triton
@pytest.mark.parametrize("case", POST_CASES, ids=lambda c: f"T{c[0]}x{c[1]}-n{c[2]}-C{c[3]}-"
                         f"{str(c[4])[6:]}-{'T' if c[5] else 'N'}-{''.join(map(str, c[6]))}-"
                         f"{'strided' if c[7] else 'dense'}")
def test_post_kernel_matches_float64(case, poisoned):
    T1, T2, n, C, dtype, transpose_res, order, strided_inputs = case
    x, h_res, h_post, f, dout = _post_inputs(T1, T2, n, C, dtype, strided_inputs)
    out = mhc_post_fwd(x, h_res, h_post, f, transpose_res, order)
    ref = mhc_post_ref(*(t.double() for t in (x, h_res, h_post, f)), transpose_res)
    assert rel(out, ref) < TOL[dtype]
    assert out.dtype == dtype and out.shape == x.shape
    mem = out.permute(*order)
    assert mem.is_contiguous(), "out_order is the memory order"
    grads = mhc_post_bwd(x, h_res, h_post, f, dout, transpose_res, order)
    refs = mhc_post_bwd_ref(*(t.double() for t in (x, h_res, h_post, f, dout)), transpose_res)
    for name, g, r, like in zip(("dx", "dh_res", "dh_post", "df"), grads, refs, (x, h_res, h_post, f)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert rel(g, r) < TOL[dtype], name
    assert grads[0].permute(*order).is_contiguous()


def test_post_backward_reference_is_autograd():
    """The written-out backward reference equals autograd through the forward reference."""
    x, h_res, h_post, f, dout = (t.double().cpu().requires_grad_() for t in
                                 _post_inputs(2, 3, 3, 11, torch.float32, False, seed=3))
    for transpose_res in (False, True):
        out = mhc_post_ref(x, h_res, h_post, f, transpose_res)
        auto = torch.autograd.grad(out, (x, h_res, h_post, f), dout)
        mine = mhc_post_bwd_ref(x, h_res, h_post, f, dout, transpose_res)
        assert all(rel(a, b) < 1e-12 for a, b in zip(mine, auto))
    y = mhc_aggregate_ref(x, h_post)
    dy = torch.randn_like(y)
    auto = torch.autograd.grad(y, (x, h_post), dy)
    assert all(rel(a, b) < 1e-12 for a, b in zip(mhc_aggregate_bwd_ref(x, h_post, dy), auto))


@requires_triton
@pytest.mark.parametrize("case", POST_CASES[:4], ids=lambda c: f"n{c[2]}-C{c[3]}-{str(c[4])[6:]}")
def test_aggregate_kernel_matches_float64(case, poisoned):
    T1, T2, n, C, dtype, _, order, strided_inputs = case
    x, _, h_pre, _, dout = _post_inputs(T1, T2, n, C, dtype, strided_inputs, seed=1)
    dy = dout[:, :, 0]
    y = mhc_aggregate_fwd(x, h_pre)
    assert rel(y, mhc_aggregate_ref(x.double(), h_pre.double())) < TOL[dtype]
    dh = mhc_aggregate_bwd(x, h_pre, dy)
    _, rdh = mhc_aggregate_bwd_ref(x.double(), h_pre.double(), dy.double())
    assert dh.shape == h_pre.shape and dh.dtype == h_pre.dtype and rel(dh, rdh) < TOL[dtype]


# The backward sweeps (post, aggregate) walk C in [tokens, BLOCK_C] tiles: C over several tiles with
# a tail, token counts off the token block, n from 1 to MAX_STREAMS, token dims in any memory order,
# a non-unit channel stride. The post backward's slot sweep (n = 1, 2, 4: the streams unrolled, the
# n² + n sums over C in slots of one register tile) and its column sweep (other n: run-time loops over
# columns and streams, the sums through a scratch): n = 3 (one stream past an unroll of 2), 5, 8,
# 9 and 13 (one past 4 and 12), 12 and 16 (no remainder); fp32 steps of one tile, 16-bit steps of
# two, C a multiple of 16 or not (unrolled 4 or 2 fp32 tiles), partial and empty second halves.
SWEEP_CASES = [
    # T1, T2, n, C, dtype, transpose_res, out_order, input layout
    (3, 13, 5, 150, torch.float32, True, (2, 0, 1, 3), "tokens-swapped"),
    (2, 11, 8, 200, torch.bfloat16, False, (0, 2, 1, 3), "strided"),
    (1, 5, 16, 40, torch.float32, True, (0, 1, 2, 3), "dense"),
    (4, 9, 1, 300, torch.float16, False, (0, 1, 2, 3), "tokens-swapped"),
    (2, 17, 3, 64, torch.bfloat16, True, (1, 0, 2, 3), "dense"),
    (2, 9, 9, 130, torch.float32, False, (0, 1, 2, 3), "dense"),
    (3, 5, 13, 96, torch.float32, True, (1, 0, 2, 3), "tokens-swapped"),
    (1, 7, 12, 200, torch.bfloat16, True, (2, 0, 1, 3), "strided"),
]


def _layout(t: torch.Tensor, kind: str, gen) -> torch.Tensor:
    if kind == "strided":
        return strided(t, gen)
    if kind == "tokens-swapped":  # the same values, T1 and T2 swapped in memory
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


@requires_triton
@pytest.mark.parametrize("case", SWEEP_CASES, ids=lambda c: f"T{c[0]}x{c[1]}-n{c[2]}-C{c[3]}-"
                         f"{str(c[4])[6:]}-{'T' if c[5] else 'N'}-{''.join(map(str, c[6]))}-{c[7]}")
def test_backward_sweeps_awkward_shapes(case, poisoned):
    T1, T2, n, C, dtype, transpose_res, order, layout = case
    gen = torch.Generator().manual_seed(11)
    x, h_res, h_post, f, dout = (_layout(t, layout, gen) for t in
                                 _post_inputs(T1, T2, n, C, dtype, False, seed=5))
    if layout != "dense":
        assert not x.is_contiguous()
    d64 = [t.double() for t in (x, h_res, h_post, f, dout)]
    grads = mhc_post_bwd(x, h_res, h_post, f, dout, transpose_res, order)
    refs = mhc_post_bwd_ref(*d64, transpose_res)
    for name, g, r, like in zip(("dx", "dh_res", "dh_post", "df"), grads, refs, (x, h_res, h_post, f)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert rel(g, r) < TOL[dtype], name
    assert grads[0].permute(*order).is_contiguous()
    # without dx (a compiled backward forms it): the same sums, nothing written through dx
    no_dx = mhc_post_bwd(x, h_res, h_post, f, dout, transpose_res, order, with_dx=False)
    assert no_dx[0].shape == (0,)
    # not bitwise: WRITE_DX compiles another kernel, whose sums may run in another order on a GPU
    for name, g, r, like in zip(("dh_res", "dh_post", "df"), no_dx[1:], refs[1:], (h_res, h_post, f)):
        assert g.shape == like.shape and g.dtype == like.dtype and rel(g, r) < TOL[dtype], name
    out = mhc_post_fwd(x, h_res, h_post, f, transpose_res, order)
    assert rel(out, mhc_post_ref(*d64[:4], transpose_res)) < TOL[dtype]

    dy = dout[:, :, 0]
    y = mhc_aggregate_fwd(x, h_post)
    assert rel(y, mhc_aggregate_ref(d64[0], d64[2])) < TOL[dtype]
    dh = mhc_aggregate_bwd(x, h_post, dy)
    _, rdh = mhc_aggregate_bwd_ref(d64[0], d64[2], dy.double())
    assert dh.shape == h_post.shape and dh.dtype == h_post.dtype and rel(dh, rdh) < TOL[dtype]


@requires_triton
@pytest.mark.parametrize("n", [4, 6], ids=["slots", "columns"])
def test_post_backward_mixing_matrices_in_other_dtypes(n, poisoned):
    """H_post and H_res in different dtypes (the mapping's outputs have one dtype each): the column
    sweep then loads H_post on its own instead of through one pointer with H_res."""
    x, h_res, h_post, f, dout = _post_inputs(2, 9, n, 70, torch.bfloat16, False, seed=4)
    for h_res, h_post in ((h_res, h_post.float()), (h_res.float(), h_post)):
        grads = mhc_post_bwd(x, h_res, h_post, f, dout, True)
        refs = mhc_post_bwd_ref(*(t.double() for t in (x, h_res, h_post, f, dout)), True)
        for name, g, r, like in zip(("dx", "dh_res", "dh_post", "df"), grads, refs, (x, h_res, h_post, f)):
            assert g.shape == like.shape and g.dtype == like.dtype, name
            assert rel(g, r) < TOL[torch.bfloat16], name


@requires_triton
def test_backward_sweep_blocks_keep_c_inside_a_warp():
    """The sweep tiles: C over 8 lanes of 16-byte vectors (less for a small C), the rest of the
    4 warps' lanes over tokens, slots for every sum over C. The column sweep's tiles: 8 lanes of
    4 fp32 (the scratch's sums take the data tiles' layout), two per step in 16-bit dtypes."""
    assert _common.sweep_blocks(1024, 2, 20) == (16, 64, 32, 4)     # bf16, n = 4: 16 tokens
    assert _common.sweep_blocks(1024, 4, 20) == (16, 32, 32, 4)     # fp32
    assert _common.sweep_blocks(37, 2, 272) == (16, 64, 512, 4)     # n² + n slots of n = 16
    bt, bc, _, warps = _common.sweep_blocks(1, 4, 2)
    assert bc == 16 and bt * bc == warps * 32 * 4                   # every lane busy
    assert _common.column_sweep_blocks(4) == (16, 32, 1, 4)         # fp32: 128 bytes per row
    assert _common.column_sweep_blocks(2) == (16, 32, 2, 4)         # bf16, fp16: two tiles


# ----------------------------------------------------------------------------------------
# mapping

MAPPING_CASES = [
    # lead dims, dtype, spec
    ((2, 9), torch.float32, MappingSpec(n=4, steps=40)),
    ((3, 5), torch.float32, MappingSpec(n=2, steps=7, init="softmax", init_eps=1e-3, row_first=False,
                                        norm_eps=1e-4)),
    ((17,), torch.float32, MappingSpec(n=3, steps=6, offsets=(12, 0, 3), coefs=(0.5, -2.0, 1.5),
                                       pre_affine=(1.0, 1e-2), post_affine=(1.5, 0.25),
                                       r_divides=False)),
    ((4, 6), torch.bfloat16, MappingSpec(n=4, steps=40, init="softmax", init_eps=1e-6)),
    ((1, 13), torch.bfloat16, MappingSpec(n=2, steps=1)),
    ((3, 7), torch.float16, MappingSpec(n=4, steps=10)),
]


def _mapping_inputs(lead, dtype, spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = spec.n
    proj = randn(*lead, spec.width, dtype=dtype, gen=gen)
    r = (torch.rand(*lead, 1, generator=gen) + 0.5).to(DEVICE, dtype)
    alphas = [randn(dtype=dtype, gen=gen, scale=0.3, offset=1.0) for _ in range(3)]
    biases = [randn(n, dtype=dtype, gen=gen), randn(n, dtype=dtype, gen=gen),
              randn(n * n, dtype=dtype, gen=gen)]
    return proj, r, alphas, biases


def _float64_mapping(proj, r, alphas, biases, spec, grads):
    leaves = [t.detach().double().requires_grad_() for t in (proj, r, *alphas, *biases)]
    outs = mhc_mapping_ref(leaves[0], leaves[1], tuple(leaves[2:5]), tuple(leaves[5:8]), spec)
    got = torch.autograd.grad(outs, leaves, [g.double() for g in grads])
    return outs, got


@requires_triton
@pytest.mark.parametrize("case", MAPPING_CASES, ids=lambda c: f"n{c[2].n}-{c[2].init}-s{c[2].steps}-"
                         f"{str(c[1])[6:]}")
def test_mapping_kernel_matches_float64(case, poisoned):
    lead, dtype, spec = case
    proj, r, alphas, biases = _mapping_inputs(lead, dtype, spec)
    outs = mhc_mapping_fwd(proj, r, alphas, biases, spec)
    gen = torch.Generator().manual_seed(5)
    grads = [randn(*o.shape, dtype=dtype, gen=gen) for o in outs]
    refs, ref_grads = _float64_mapping(proj, r, alphas, biases, spec, grads)
    for name, o, ref in zip(("h_pre", "h_post", "h_res"), outs, refs):
        assert o.dtype == dtype and o.shape == ref.shape, name
        assert rel(o, ref) < TOL[dtype], name
    dproj, dr, dalphas, dbiases = mhc_mapping_bwd(proj, r, alphas, biases, *grads, spec)
    names = ("dproj", "dr", "dalpha_pre", "dalpha_post", "dalpha_res", "dbias_pre", "dbias_post",
             "dbias_res")
    # fp32: a few ulps per Sinkhorn step over up to 40 steps; bf16: the rounding of the outputs
    tol = 2e-5 if dtype == torch.float32 else TOL[dtype]
    for name, g, ref, like in zip(names, (dproj, dr, *dalphas, *dbiases), ref_grads,
                                  (proj, r, *alphas, *biases)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert rel(g, ref) < tol, name


@requires_triton
def test_mapping_parameter_gradients_mixed_dtypes_and_shapes(poisoned):
    """α and biases in another dtype and shape than proj (float32 parameters of a bf16 model, α
    of shape [1], bias_res as [n, n]): their gradients come back in those dtypes and shapes, in
    separate storage, equal to float64 autograd."""
    spec = MappingSpec(n=3, steps=5)
    proj, r, alphas, biases = _mapping_inputs((5, 7), torch.bfloat16, spec, seed=8)
    alphas = [alphas[0].float(), alphas[1].float().reshape(1), alphas[2].float()]
    biases = [biases[0].float(), biases[1], biases[2].float().reshape(3, 3)]
    outs = mhc_mapping_fwd(proj, r, alphas, biases, spec)
    gen = torch.Generator().manual_seed(9)
    grads = [randn(*o.shape, dtype=o.dtype, gen=gen) for o in outs]
    _, ref_grads = _float64_mapping(proj, r, alphas, biases, spec, grads)
    _, _, dalphas, dbiases = mhc_mapping_bwd(proj, r, alphas, biases, *grads, spec)
    got = (*dalphas, *dbiases)
    for g, ref, like in zip(got, ref_grads[2:], (*alphas, *biases)):
        assert g.shape == like.shape and g.dtype == like.dtype
        assert rel(g, ref) < TOL[torch.bfloat16]
    assert len({g.untyped_storage().data_ptr() for g in got}) == 6


@requires_triton
def test_mapping_parameter_gradient_sum_over_many_rows(poisoned):
    """The reduction of the per-program partial sums, over more rows than one block (a fixed
    order: the same bits on every call)."""
    from hccompile.kernels.mhc.mapping import PARAM_GRADS_TILE, sum_param_grads

    n = 4
    gen = torch.Generator().manual_seed(3)
    rows = 2 * PARAM_GRADS_TILE // 32 + 89  # two whole [rows, 32] tiles and a part of a third
    partial = torch.randn(rows, 3 + 2 * n + n * n, generator=gen).to(DEVICE)
    alphas = [torch.zeros((), device=DEVICE), torch.zeros(1, device=DEVICE, dtype=torch.bfloat16),
              torch.zeros((), device=DEVICE, dtype=torch.float16)]
    biases = [torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE),
              torch.zeros(n, n, device=DEVICE)]
    dalphas, dbiases = sum_param_grads(partial, alphas, biases, n)
    want = partial.double().sum(0)
    for k, (g, like) in enumerate(zip(dalphas, alphas)):
        assert g.shape == like.shape and g.dtype == like.dtype
        assert rel(g.reshape(()), want[k]) < TOL[like.dtype]
    starts = (3, 3 + n, 3 + 2 * n)
    for g, s, like in zip(dbiases, starts, biases):
        assert g.shape == like.shape
        assert rel(g.flatten(), want[s:s + like.numel()]) < 2e-6
    again = sum_param_grads(partial, alphas, biases, n)
    assert all(torch.equal(a, b) for a, b in zip((*dalphas, *dbiases), (*again[0], *again[1])))
    with pytest.raises(ValueError, match=r"partial: expected contiguous float32 \[rows, 27\]"):
        sum_param_grads(partial[:, :20], alphas, biases, n)


@requires_triton
def test_mapping_op_spec_built_once_and_still_validated():
    """The ops build their MappingSpec once per distinct set of scalars; a bad one still fails with
    the field and the limit."""
    spec = MappingSpec(n=3, steps=5)
    args = L.spec_args(spec)
    built = L._spec(*args)
    assert L._spec(*args) is built
    assert (built.n, built.steps, built.part_offsets()) == (3, 5, spec.part_offsets())
    bad = MappingSpec(n=3, steps=300)
    proj, r, alphas, biases = _mapping_inputs((2,), torch.float32, spec)
    with pytest.raises(ValueError, match=r"steps: Sinkhorn normalisations must be an int in \[0, 256\]"):
        L.mhc_mapping_op(proj, r, *alphas, *biases, *L.spec_args(bad), *(torch.float32,) * 3)


@requires_triton
def test_mapping_is_sinkhorn_of_the_model():
    """The kernel reproduces nn.mhc.MHCMapping (exp init, 20 iterations) from its projection."""
    from hccompile.nn.mhc import MHCMapping

    torch.manual_seed(0)
    n, C = 4, 24
    m = MHCMapping(n, C, sinkhorn_iters=20).to(DEVICE)
    with torch.no_grad():
        m.alpha_pre.fill_(0.7), m.alpha_post.fill_(-0.4), m.alpha_res.fill_(1.3)
        m.bias_pre.normal_(), m.bias_post.normal_()
    v = torch.randn(3, 5, n * C, device=DEVICE)
    h_pre, h_post, h_res = m(v)
    r = v.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    got = mhc_mapping_fwd(m.phi(v), r, (m.alpha_pre, m.alpha_post, m.alpha_res),
                          (m.bias_pre, m.bias_post, m.bias_res), MappingSpec(n=n, steps=40))
    for a, b in zip(got, (h_pre, h_post, h_res)):
        assert rel(a, b) < 1e-5
    assert torch.allclose(got[2].sum(-2), torch.ones(()), atol=1e-5)  # columns normalised last


# ----------------------------------------------------------------------------------------
# ops: opcheck, gradients through autograd, the reference fallback


def _op_args(dtype=torch.float32, requires_grad=True):
    x, h_res, h_post, f, _ = _post_inputs(2, 3, 4, 5, dtype, False, seed=7)
    leaves = [t.detach().requires_grad_(requires_grad) for t in (x, h_res, h_post, f)]
    return leaves


@requires_triton
def test_opcheck_post_and_aggregate():
    x, h_res, h_post, f = _op_args()
    torch.library.opcheck(L.mhc_post_op, (x, h_res, h_post, f, True, [0, 2, 1, 3]))
    torch.library.opcheck(L.mhc_aggregate_op, (x, h_post))
    d = [t.detach() for t in (x, h_res, h_post, f)]
    for with_dx in (True, False):
        torch.library.opcheck(L.mhc_post_backward_op, (*d, torch.randn_like(d[0]), False, [0, 1, 2, 3], with_dx))
    torch.library.opcheck(L.mhc_aggregate_backward_op, (d[0], d[2], torch.randn_like(d[3])))


@requires_triton
def test_opcheck_mapping():
    spec = MappingSpec(n=3, steps=5, init="softmax", init_eps=1e-3)
    proj, r, alphas, biases = _mapping_inputs((2, 3), torch.float32, spec, seed=2)
    leaves = [t.detach().requires_grad_() for t in (proj, r, *alphas, *biases)]
    dtypes = (torch.float32,) * 3
    torch.library.opcheck(L.mhc_mapping_op, (*leaves, *L.spec_args(spec), *dtypes))
    outs = L.mhc_mapping(leaves[0], leaves[1], leaves[2:5], leaves[5:8], spec)
    grads = [torch.randn_like(o) for o in outs]
    torch.library.opcheck(L.mhc_mapping_backward_op,
                          (*(t.detach() for t in leaves), *grads, *L.spec_args(spec)))


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_ops_gradients_match_float64(backend, monkeypatch):
    """Through autograd (the ops' registered backward), on the kernels or on the fallback."""
    if backend == "kernel" and not TRITON_CAN_RUN:
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    if backend == "reference":
        monkeypatch.setattr(L, "_uses_triton", lambda t: False)
    x, h_res, h_post, f = _op_args()
    out = L.mhc_post(x, h_res, h_post, f, transpose_res=True, out_order=(0, 2, 1, 3))
    y = L.mhc_aggregate(x, h_post)
    # seeded, not the global stream: the α gradients are scalar sums whose cancellation depends on
    # the upstream gradients (one draw of the global stream left 3.6e-3 relative in float32)
    gen = torch.Generator().manual_seed(11)
    w, wy = (randn(*t.shape, dtype=t.dtype, gen=gen) for t in (out, y))
    got = torch.autograd.grad((out * w).sum() + (y * wy).sum(), (x, h_res, h_post, f))
    d64 = [t.detach().double().requires_grad_() for t in (x, h_res, h_post, f)]
    ref = mhc_post_ref(*d64, True)
    ref_y = mhc_aggregate_ref(d64[0], d64[2])
    want = torch.autograd.grad((ref * w.double()).sum() + (ref_y * wy.double()).sum(), d64)
    assert rel(out, ref) < 1e-6 and rel(y, ref_y) < 1e-6
    assert all(rel(a, b) < 1e-6 for a, b in zip(got, want))

    spec = MappingSpec(n=4, steps=9)
    proj, r, alphas, biases = _mapping_inputs((2, 3), torch.float32, spec, seed=4)
    leaves = [t.detach().requires_grad_() for t in (proj, r, *alphas, *biases)]
    outs = L.mhc_mapping(leaves[0], leaves[1], leaves[2:5], leaves[5:8], spec)
    gs = [randn(*o.shape, dtype=o.dtype, gen=gen) for o in outs]
    got = torch.autograd.grad(outs, leaves, gs)
    refs, want = _float64_mapping(proj, r, alphas, biases, spec, gs)
    assert all(rel(a, b) < 1e-5 for a, b in zip(outs, refs))
    assert all(rel(a, b) < 2e-5 for a, b in zip(got, want))


def test_reference_fallback_without_interpreter(monkeypatch):
    """CPU without TRITON_INTERPRET: the ops run the reference, in float32, same layouts."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert L.implementation("cpu", torch.bfloat16) == "reference"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 6, generator=gen).bfloat16()
    h_res, h_post = torch.rand(2, 3, 4, 4).bfloat16(), torch.rand(2, 3, 4).bfloat16()
    f = torch.randn(2, 3, 6).bfloat16()
    out = L.mhc_post(x, h_res, h_post, f, out_order=(0, 2, 1, 3))
    assert out.dtype == torch.bfloat16 and out.permute(0, 2, 1, 3).is_contiguous()
    assert rel(out, mhc_post_ref(x.double(), h_res.double(), h_post.double(), f.double())) < 8e-3


@requires_triton
def test_input_errors_name_argument_and_limit():
    x, h_res, h_post, f = (t.detach() for t in _op_args())
    with pytest.raises(ValueError, match=r"h_res: shape .* must be \[T1, T2, n, n\]"):
        mhc_post_fwd(x, h_res[..., :3], h_post, f)
    with pytest.raises(ValueError, match=r"f: shape"):
        mhc_post_fwd(x, h_res, h_post, f[..., :2])
    with pytest.raises(ValueError, match=r"out_order: must be a permutation"):
        mhc_post_fwd(x, h_res, h_post, f, out_order=(0, 1, 1, 3))
    with pytest.raises(TypeError, match=r"x: dtype torch.int64"):
        mhc_post_fwd(x.long(), h_res, h_post, f)
    big = torch.zeros(1, 1, 17, 2, device=x.device)
    with pytest.raises(ValueError, match=r"17 streams exceed the kernels' maximum 16"):
        mhc_aggregate_fwd(big, torch.zeros(1, 1, 17, device=x.device))
    spec = MappingSpec(n=4)
    proj, r, alphas, biases = _mapping_inputs((2,), torch.float32, spec)
    with pytest.raises(ValueError, match=r"proj: last dim 23 must be n²\+2n = 24"):
        mhc_mapping_fwd(proj[..., :23], r, alphas, biases, spec)
    with pytest.raises(ValueError, match=r"steps: Sinkhorn normalisations must be an int in \[0, 256\]"):
        mhc_mapping_fwd(proj, r, alphas, biases, MappingSpec(n=4, steps=300))
    with pytest.raises(ValueError, match=r"offsets: the pre \(4\), post \(4\) and res \(16\) parts"):
        mhc_mapping_fwd(proj, r, alphas, biases, MappingSpec(n=4, offsets=(0, 2, 8)))
    with pytest.raises(ValueError, match=r"bias_res: expected 16 elements"):
        mhc_mapping_fwd(proj, r, alphas, (biases[0], biases[1], biases[2][:15]), spec)
    with pytest.raises(ValueError, match=r"init: must be one of"):
        MappingSpec(n=4, init="tanh").validate()


def compile_check_lines(*args: str) -> list[str]:
    """hccompile.kernels.mhc.compile_check's lines (one per compiled launch) for `args`, run in a
    process without TRITON_INTERPRET (the interpreter never invokes the compiler); skips where
    Triton's NVIDIA tools (ptxas, cuobjdump) are not installed."""
    import pathlib
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip("Triton's NVIDIA backend tools (ptxas, cuobjdump) are not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "hccompile.kernels.mhc.compile_check", *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.strip().splitlines()


def test_kernels_compile_for_h100_without_spills():
    """The GPU compiler (Triton -> PTX -> ptxas, sm_90) accepts every kernel as the launchers
    specialise them for the benchmark shape, with no register spills; runs without a GPU, in a
    process without TRITON_INTERPRET (the interpreter never invokes the compiler)."""
    lines = compile_check_lines()
    # post, aggregate, mapping, projection: forward and backward (the post's with and without dx),
    # the mapping backward in two launches; bfloat16 and float32
    assert len(lines) == 20 and all("STACK 0" in line for line in lines), "\n".join(lines)
    # The backward sweeps reduce over C inside a warp: no layout conversion (a shared-memory round
    # trip with barriers) inside the sweep, and after it at most one per output stored from the
    # sums (post: dH_res and dH_post, aggregate: dH_pre). Triton 3.8 merges post's two into one
    # (1 barrier); 3.6 converts each store separately (3 barriers), both after the loop.
    final_stores = {"post_bwd": 2, "post_bwd_nodx": 2, "aggregate_bwd": 1}
    for line in lines:
        name = line.split()[0]
        field = lambda key: int(line.split(f" {key} ")[1].split()[0])  # noqa: E731
        if name in final_stores:
            assert field("LOOPCVT") == 0, line
            assert field("CVT") <= final_stores[name] and field("BAR") <= 2 * final_stores[name] - 1, line
        # the mapping backward's Sinkhorn chain: one warp at n 4, its divisors through global
        # scratch: no shared memory, one barrier (between storing and loading the divisors)
        if name == "mapping_bwd":
            assert field("SHARED") == 0 and field("BAR") <= 1, line
        # the post forward's tiles are all [tokens, C], one stream at a time: no layout conversion
        # the mapping forward at n 4: one warp, each Sinkhorn sum inside it, no barrier (Triton 3.6
        # gives each thread a whole matrix: no shuffle either; 3.9 spreads a matrix over lanes)
        if name == "mapping_fwd":
            assert field("BAR") == 0, line
        if name == "post_fwd":
            assert field("CVT") == 0 and field("BAR") == 0 and field("SHARED") == 0, line


def test_post_backward_compiles_for_h100_at_other_stream_counts_without_spills():
    """The post backward at stream counts that take the column sweep (n = 3, 5, 9, 16; the test
    above compiles n = 4's slot sweep), its sums kernel included, compiled for sm_90 at the
    benchmark shape: no register spills and no layout conversion inside a loop, since the scratch's
    sums tile takes the data tiles' layout. At n = 16 the slot sweep spilled and took minutes."""
    lines = compile_check_lines("--streams", "3", "5", "9", "16", "--launches", "post_bwd", "post_bwd_nodx")
    # bfloat16 and float32, per n the sweep and the sums kernel, with and without dx
    assert len(lines) == 32 and all("STACK 0" in line and "LOOPCVT 0" in line for line in lines), "\n".join(lines)
    assert sum("'BY_COLUMN': True" in line for line in lines) == 16, "\n".join(lines)


def test_post_forward_compiles_for_h100_at_other_stream_counts_without_spills():
    """The post forward keeps the n input tiles in registers across its output streams (the
    compiler hoists their loads): its tile shrinks with n so that n = 3, 5, 8 and 16 compile for
    sm_90 without spills, bfloat16 and float32."""
    lines = compile_check_lines("--streams", "3", "5", "8", "16", "--launches", "post_fwd")
    assert len(lines) == 8 and all("STACK 0" in line and " CVT 0 " in line for line in lines), "\n".join(lines)
