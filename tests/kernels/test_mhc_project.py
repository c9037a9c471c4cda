"""kernels/mhc/project.py and the hccompile::mhc_project ops: proj = v·φᵀ and Σ v² from one read of
the stream, dv and dφ from one more. Every output and gradient against float64 (relative RMS) on
awkward shapes (T not a block multiple, K not a column-block multiple, W not a power of two, the
token shares partly empty), float32 / bfloat16 / float16, strided and token-swapped v, outputs
poisoned with NaN; the reference past MAX_WIDTH; opcheck; one compiled graph for every length;
input errors naming the argument."""
from __future__ import annotations

import pytest
import torch

import hccompile.lowering.mhc as L
from hccompile.kernels.mhc import _common, mhc_project_bwd, mhc_project_bwd_ref, mhc_project_fwd, mhc_project_ref
from hccompile.kernels.mhc.project import MAX_WIDTH, MAX_WIDTH_FLOAT32, SPLITS

from test_mhc_kernels import DEVICE, TOL, poisoned, randn, rel, requires_triton, strided  # noqa: F401

CASES = [
    # T1, T2, K, W, dtype, layout
    (1, 1, 60, 24, torch.float32, "dense"),
    (2, 35, 200, 24, torch.bfloat16, "dense"),
    (1, 70, 100, 8, torch.float16, "strided"),
    (3, 5, 256, 80, torch.bfloat16, "tokens-swapped"),
    (2, 13, 150, 32, torch.float32, "tokens-swapped"),
    (1, 40, 96, 120, torch.float16, "dense"),
    (2, 67, 136, 35, torch.bfloat16, "strided"),
    (1, 9, 4096, 24, torch.bfloat16, "dense"),
]
# float32 through the dot in full precision: the float64 reference's error is float32 rounding
PROJECT_TOL = {**TOL, torch.float32: 1e-5}


def _inputs(T1, T2, K, W, dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v = randn(T1, T2, K, dtype=dtype, gen=gen)
    w = randn(W, K, dtype=dtype, gen=gen, scale=K ** -0.5)
    dproj = randn(T1, T2, W, dtype=dtype, gen=gen)
    dsq = randn(T1, T2, dtype=torch.float32, gen=gen, scale=0.1)
    if layout == "strided":
        v = strided(v, gen)
    elif layout == "tokens-swapped":
        v = v.transpose(0, 1).contiguous().transpose(0, 1)
    return v, w, dproj, dsq


@requires_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}x{c[1]}-K{c[2]}-W{c[3]}-{str(c[4])[6:]}-{c[5]}")
def test_project_kernels_match_float64(case, poisoned):
    T1, T2, K, W, dtype, layout = case
    v, w, dproj, dsq = _inputs(*case)
    proj, sq = mhc_project_fwd(v, w)
    ref_proj, ref_sq = mhc_project_ref(v.double(), w.double())
    assert proj.shape == (T1, T2, W) and proj.dtype == dtype and sq.shape == (T1, T2) and sq.dtype == torch.float32
    assert rel(proj, ref_proj) < PROJECT_TOL[dtype] and rel(sq, ref_sq) < 1e-5
    dv, dw = mhc_project_bwd(v, w, dproj, dsq)
    ref_dv, ref_dw = mhc_project_bwd_ref(v.double(), w.double(), dproj.double(), dsq.double())
    assert dv.shape == v.shape and dv.dtype == dtype and dw.shape == w.shape and dw.dtype == dtype
    assert rel(dv, ref_dv) < PROJECT_TOL[dtype] and rel(dw, ref_dw) < PROJECT_TOL[dtype]


def test_reference_backward_is_autograd():
    v, w, dproj, dsq = (t.double() for t in _inputs(2, 3, 20, 6, torch.float32, "dense"))
    v.requires_grad_()
    w.requires_grad_()
    proj, sq = mhc_project_ref(v, w)
    auto = torch.autograd.grad((proj, sq), (v, w), (dproj, dsq))
    assert all(rel(a, b) < 1e-12 for a, b in zip(mhc_project_bwd_ref(v, w, dproj, dsq), auto))


@requires_triton
@pytest.mark.parametrize("tokens", [1, 7, SPLITS * 64 + 3])
def test_every_token_share_writes_its_gradient(tokens, poisoned):
    """The backward splits the tokens into SPLITS shares whatever the length: with fewer tokens than
    shares most are empty (their partial dφ is zero), with more each share takes several tiles."""
    v, w, dproj, dsq = _inputs(1, tokens, 130, 24, torch.float32, "dense", seed=3)
    dv, dw = mhc_project_bwd(v, w, dproj, dsq)
    ref_dv, ref_dw = mhc_project_bwd_ref(v.double(), w.double(), dproj.double(), dsq.double())
    assert rel(dv, ref_dv) < 1e-5 and rel(dw, ref_dw) < 1e-5


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_op_gradients_match_float64(backend, monkeypatch):
    if backend == "kernel" and not (DEVICE == "cuda" or L.implementation("cpu") != "reference"):
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    if backend == "reference":
        monkeypatch.setattr(L, "_uses_triton", lambda t: False)
    v, w, dproj, dsq = _inputs(2, 9, 72, 24, torch.float32, "strided", seed=5)
    v, w = v.requires_grad_(), w.requires_grad_()
    proj, sq = L.mhc_project(v, w)
    got = torch.autograd.grad((proj, sq), (v, w), (dproj, dsq))
    v64, w64 = (t.detach().double().requires_grad_() for t in (v, w))
    want_proj, want_sq = mhc_project_ref(v64, w64)
    want = torch.autograd.grad((want_proj, want_sq), (v64, w64), (dproj.double(), dsq.double()))
    assert rel(proj, want_proj) < 1e-5 and rel(sq, want_sq) < 1e-5
    assert all(rel(g, e) < 1e-5 for g, e in zip(got, want))


@pytest.mark.parametrize("W, dtype", [(MAX_WIDTH + 1, torch.bfloat16), (MAX_WIDTH_FLOAT32 + 1, torch.float32)])
def test_wider_projections_compute_with_the_reference(W, dtype, monkeypatch):
    """Past the kernels' width (W in one tile; float32's full-precision dots spill past 32) the ops
    take the reference."""
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was launched for a projection wider than the kernels take")
    monkeypatch.setattr(L.K_proj, "launch_project_fwd", no_kernel)
    monkeypatch.setattr(L.K_proj, "launch_project_bwd", no_kernel)
    v, w, _, _ = _inputs(1, 3, 40, W, dtype, "dense")
    v, w = v.requires_grad_(), w.requires_grad_()
    proj, sq = L.mhc_project(v, w)
    ref_proj, ref_sq = mhc_project_ref(v.detach().double(), w.detach().double())
    assert rel(proj, ref_proj) < PROJECT_TOL[dtype] and rel(sq, ref_sq) < 1e-6
    (proj.sum() + sq.sum()).backward()
    assert torch.isfinite(v.grad).all() and torch.isfinite(w.grad).all()


@requires_triton
def test_opcheck_project():
    v, w, dproj, dsq = _inputs(2, 5, 48, 24, torch.float32, "dense", seed=7)
    torch.library.opcheck(L.mhc_project_op, (v.requires_grad_(), w.requires_grad_()))
    torch.library.opcheck(L.mhc_project_backward_op, (v.detach(), w.detach(), dproj, dsq))


def test_input_errors_name_the_argument():
    v, w, dproj, dsq = _inputs(1, 2, 16, 4, torch.float32, "dense")
    with pytest.raises(ValueError, match=r"w: shape \(4, 15\) must be \[W, K\] with K = v's last size 16"):
        L.mhc_project(v, w[:, :15])
    with pytest.raises(TypeError, match=r"w: dtype torch.bfloat16 differs from v's torch.float32"):
        L.mhc_project(v, w.bfloat16())
    with pytest.raises(ValueError, match=r"v: expected a 3-D tensor \[T1, T2, K\]"):
        L.mhc_project(v[0], w)
    with pytest.raises(ValueError, match=r"dsq: shape \(1, 3\) must be \[T1, T2\] = \(1, 2\)"):
        L.mhc_project_backward_op(v, w, dproj, torch.zeros(1, 3))


@requires_triton
def test_one_compiled_graph_for_every_length():
    """fullgraph, dynamic lengths: one compile serves T 5, 37 and 130 (on CUDA the graph launches
    the kernels itself); outputs and gradients equal the eager op's."""
    from torch._inductor.compile_fx import compile_fx

    frames = []

    def counting(gm, example_inputs):
        frames.append(gm)
        return compile_fx(gm, example_inputs)

    def step(v, w):
        proj, sq = L.mhc_project(v, w)
        return (proj.float() * 2).sum() + sq.sum()

    compiled = torch.compile(step, backend=counting, fullgraph=True, dynamic=True)
    for T in (5, 37, 130):
        v, w, _, _ = _inputs(1, T, 64, 24, torch.float32, "dense", seed=T)
        v, w = v.requires_grad_(), w.requires_grad_()
        got = compiled(v, w)
        got_grads = torch.autograd.grad(got, (v, w))
        want = step(v, w)
        want_grads = torch.autograd.grad(want, (v, w))
        assert rel(got, want) < 1e-5 and all(rel(g, e) < 1e-5 for g, e in zip(got_grads, want_grads))
    assert len(frames) == 1


@pytest.mark.gpu
def test_gpu_inductor_code_launches_the_project_kernels():
    """Issue 24: on CUDA Inductor's output code launches both kernels itself, no call through the ops."""
    from torch._inductor.utils import run_and_get_code

    from helpers import calls_through_hccompile_ops

    v, w, _, _ = _inputs(2, 64, 512, 24, torch.bfloat16, "dense")
    v, w = v.requires_grad_(), w.requires_grad_()

    def loss(v, w):
        proj, sq = L.mhc_project(v, w)
        return proj.float().square().sum() + sq.sum()

    fn = torch.compile(loss, fullgraph=True)
    _, codes = run_and_get_code(lambda: fn(v, w).backward())
    code = "\n".join(codes)
    assert "_mhc_project_fwd_kernel" in code and "_mhc_project_bwd_kernel" in code
    assert not calls_through_hccompile_ops(code), calls_through_hccompile_ops(code)[:5]
    want = torch.autograd.grad(loss(v, w), (v, w))
    assert rel(v.grad, want[0]) < 1e-2 and rel(w.grad, want[1]) < 1e-2
