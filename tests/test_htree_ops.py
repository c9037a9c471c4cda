"""The htree custom ops (hccompile::htree_attention{,_backward}) and htree_attention: opcheck,
outputs and gradients against float64 autograd through the reference, torch.compile(fullgraph)
with backend="hc" and a dynamic T, input errors.

"kernels" runs the Triton kernels (CUDA, or CPU with TRITON_INTERPRET=1 set before Python starts);
"reference" forces the documented plain-PyTorch fallback by setting TRITON_INTERPRET=0, which
triton_available reads at call time. Shapes are tiny: the interpreter makes each call slow."""
from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo.testing

from hccompile.kernels.htree.reference import htree_attention_ref, htree_selections
from hccompile.lowering.htree import (htree_attention, htree_attention_backward_op, htree_attention_op,
                                      implementation)
from helpers import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_CAN_RUN = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = 1e-5 if DEVICE == "cpu" else 1e-4  # fp32 against float64


@pytest.fixture(params=["kernels", "reference"])
def mode(request, monkeypatch):
    if request.param == "kernels":
        if not KERNELS_CAN_RUN:
            pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before Python starts")
    else:
        if DEVICE != "cpu":
            pytest.skip("the reference fallback is forced through TRITON_INTERPRET, a CPU-only switch")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    expected = "reference" if request.param == "reference" else ("triton" if DEVICE == "cuda" else
                                                                "triton-interpreter")
    assert implementation(DEVICE) == expected
    return request.param


def make_inputs(B=1, T=12, H_kv=1, G=2, K=8, V=8, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, T, H_kv * G, K), (B, T, H_kv, K), (B, T, H_kv, V))
    return [torch.randn(*shape, generator=generator).to(DEVICE, dtype) for shape in shapes]


# r=2, top_k=2, max_top_nodes=3: T=7 has three layers (7, 4, 2).
OPTIONS = dict(compression_rate=2, top_k=2, max_top_nodes=3, scale=0.4, rope_base=100.0)


@pytest.mark.parametrize("causal,sort_mode", [(False, "exact"), (True, "packed")])
def test_opcheck_forward_and_backward(mode, causal, sort_mode):
    if mode == "kernels" and not causal and DEVICE == "cpu":
        pytest.skip("one opcheck case under the interpreter: each makes dozens of slow calls")
    # T=5, r=2, max_top_nodes=2: three layers (5, 3, 2).
    q, k, v = make_inputs(T=5, seed=1)
    options = (2, 2, 2, 0.4, 100.0, causal, sort_mode)
    torch.library.opcheck(htree_attention_op, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
                                               *options))
    with torch.no_grad():
        o, lse, selections = htree_attention_op(q, k, v, *options)
    assert selections.numel() == 0  # not asked to save them
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    detached = [t.detach() for t in (q, k, v)]
    torch.library.opcheck(htree_attention_backward_op, (*detached, o, lse, do, dlse, *options))
    torch.library.opcheck(htree_attention_backward_op, (*detached, o, lse, do, None, *options),
                          test_utils=("test_schema", "test_faketensor"))
    if mode == "kernels":
        # The forward's selections saved for the backward, which reads them instead of selecting.
        torch.library.opcheck(htree_attention_op, (q, k, v, *options, True))
        with torch.no_grad():
            o, lse, selections = htree_attention_op(q.detach(), k.detach(), v.detach(), *options, True)
        assert selections.shape == (3, 1, 5, k.shape[2], 2) and selections.dtype == torch.int32
        torch.library.opcheck(htree_attention_backward_op, (*detached, o, lse, do, dlse, *options, selections))


GRADIENT_CASES = {
    # name: (make_inputs kwargs, options)
    "gqa_seed": (dict(T=14, H_kv=2, G=2), dict(compression_rate=3, top_k=2)),
    "causal_packed_k12_v6": (dict(T=17, G=3, K=12, V=6), dict(compression_rate=2, top_k=3, max_top_nodes=5,
                                                              causal=True, sort_mode="packed")),
}


@pytest.mark.parametrize("node_gradients", [False, True], ids=["atomics", "node-stationary"])
@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_outputs_and_gradients_match_float64_reference(name, mode, node_gradients, monkeypatch):
    from hccompile.kernels.htree import tiles

    # Both backward versions (the default is node-stationary) through the ops and autograd.
    monkeypatch.setattr(tiles, "NODE_GRADIENTS", node_gradients)
    input_kwargs, options = GRADIENT_CASES[name]
    leaves = [x.requires_grad_() for x in make_inputs(seed=2, **input_kwargs)]
    o, lse = htree_attention(*leaves, return_lse=True, **options)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32 and o.is_contiguous()
    as64 = [t.detach().double().requires_grad_() for t in leaves]
    # Same selection as the float64 reference (checked), so the reference is the exact target.
    for got, want in zip(htree_selections(*[t.detach() for t in leaves[:2]], **options),
                         htree_selections(*[t.detach() for t in as64[:2]], **options)):
        assert got.selected is None or torch.equal(got.selected, want.selected)
    o_ref, lse_ref = htree_attention_ref(*as64, return_lse=True, **options)
    assert rel_err(o, o_ref) < TOLERANCE and rel_err(lse, lse_ref) < TOLERANCE
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    grads = torch.autograd.grad((o, lse), leaves, (do, dlse))
    grads_ref = torch.autograd.grad((o_ref, lse_ref), as64, (do.double(), dlse.double()))
    for leaf_name, grad, grad_ref in zip("qkv", grads, grads_ref):
        assert grad.dtype == torch.float32
        assert rel_err(grad, grad_ref) < TOLERANCE, leaf_name


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_forward_selections_reach_the_node_stationary_backward(name, monkeypatch):
    """tiles.NODE_GRADIENTS: the forward op saves its selections, the backward op reads them (and
    writes the node gradients without atomics); gradients as the reference's."""
    if not KERNELS_CAN_RUN:
        pytest.skip("Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 set before Python starts")
    from hccompile.kernels.htree import backward as htree_backward_module, tiles

    monkeypatch.setattr(tiles, "NODE_GRADIENTS", True)
    given = []
    original = htree_backward_module.htree_backward

    def spy(*args, **kwargs):
        given.append(kwargs.get("selections"))
        return original(*args, **kwargs)

    monkeypatch.setattr("hccompile.lowering.htree.htree_backward", spy)
    input_kwargs, options = GRADIENT_CASES[name]
    leaves = [x.requires_grad_() for x in make_inputs(seed=4, **input_kwargs)]
    o, lse = htree_attention(*leaves, return_lse=True, **options)
    do, dlse = torch.randn_like(o), torch.randn_like(lse)
    grads = torch.autograd.grad((o, lse), leaves, (do, dlse))
    assert len(given) == 1 and given[0] is not None and given[0].dtype == torch.int32
    as64 = [t.detach().double().requires_grad_() for t in leaves]
    o_ref, lse_ref = htree_attention_ref(*as64, return_lse=True, **options)
    grads_ref = torch.autograd.grad((o_ref, lse_ref), as64, (do.double(), dlse.double()))
    for leaf_name, grad, grad_ref in zip("qkv", grads, grads_ref):
        assert rel_err(grad, grad_ref) < TOLERANCE, leaf_name
    # Without a gradient wanted, nothing is saved.
    with torch.no_grad():
        assert htree_attention_op(*[t.detach() for t in leaves], 2, 2, 4, 0.4, 100.0, False, "exact",
                                  False)[2].numel() == 0


def test_float64_runs_the_reference_and_only_lse_may_be_used(mode):
    assert implementation(DEVICE, torch.float64) == "reference"
    q, k, v = (x.double().requires_grad_() for x in make_inputs(T=9, seed=3))
    o, lse = htree_attention(q, k, v, return_lse=True, **OPTIONS)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(o, htree_attention_ref(q, k, v, **OPTIONS), rtol=0, atol=1e-12)
    # Gradient through lse alone: the op's backward receives do=None.
    grads = torch.autograd.grad(lse.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().requires_grad_() for t in (q, k, v))
    _, lse_ref = htree_attention_ref(q64, k64, v64, return_lse=True, **OPTIONS)
    for grad, grad_ref in zip(grads[:2], torch.autograd.grad(lse_ref.sum(), (q64, k64))):
        assert rel_err(grad, grad_ref) < 1e-10
    assert grads[2].abs().max() == 0  # v does not reach the normaliser


def test_compile_fullgraph_backend_hc_dynamic_time(mode):
    # fullgraph=True: htree_attention is one op in the graph, no break; dynamic T compiles once.
    def layer(q, k, v):
        # Literal floats: Dynamo turns floats read from a global dict into graph inputs.
        return htree_attention(q, k, v, compression_rate=2, top_k=2, max_top_nodes=3, scale=0.4,
                               rope_base=100.0) * 2.0

    counter = torch._dynamo.testing.CompileCounterWithBackend("hc")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for T in (7, 10):
        inputs = [x.requires_grad_() for x in make_inputs(T=T, seed=T)]
        out, out_eager = compiled(*inputs), layer(*inputs)
        assert rel_err(out, out_eager) < 1e-6
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, inputs, do)
        grads_eager = torch.autograd.grad(out_eager, inputs, do)
        for name, grad, grad_eager in zip("qkv", grads, grads_eager):
            assert rel_err(grad, grad_eager) < 1e-6, name
    assert counter.frame_count == 1


def test_options_from_a_dict_under_dynamic_compile(mode):
    # dynamic=True makes ints read from a dict or a closure symbols; the options are fixed at their
    # values (a guard), not rejected as non-integers, and every length still runs one graph.
    options = dict(compression_rate=3, top_k=2, max_top_nodes=5, causal=True)
    counter = torch._dynamo.testing.CompileCounterWithBackend("hc")
    compiled = torch.compile(lambda q, k, v: htree_attention(q, k, v, return_lse=True, **options),
                             backend=counter, fullgraph=True, dynamic=True)
    frames = None
    for T in (20, 11):  # depths 3 (20, 7, 3) and 2 (11, 4)
        inputs = make_inputs(T=T, seed=T)
        for got, want in zip(compiled(*inputs), htree_attention(*inputs, return_lse=True, **options)):
            assert rel_err(got, want) < 1e-6
        # (the first call may trace twice: hc asks Dynamo to specialise the default scale, a float
        # of the symbolic head dim, which the op takes as a Python float)
        frames = frames or counter.frame_count
    assert counter.frame_count == frames, "the second length compiled again"


def test_compile_graph_has_our_ops():
    from helpers import Collect, fwd_bwd

    be = Collect(force_disable_caches=True)
    compiled = torch.compile(lambda q, k, v: htree_attention(q, k, v, **OPTIONS), backend=be, fullgraph=True)
    out, grads = fwd_bwd(compiled, *make_inputs(T=9, seed=4))
    assert be.ops("forward") == ["hccompile.htree_attention.default"]
    assert be.ops("backward") == ["hccompile.htree_attention_backward.default"]


def _bad_calls():
    """(call, the exception it raises, its message): a wrong dtype is a TypeError, as for the other
    ops; a wrong shape or option value a ValueError."""
    q, k, v = make_inputs(T=8, H_kv=2, G=2)

    def zeros(*shape):
        return torch.zeros(*shape, device=DEVICE)

    return [
        (lambda: htree_attention(q[0], k, v), ValueError, r"q: expected a 4-D tensor"),
        (lambda: htree_attention(q, k[:, :, :1].expand(-1, -1, 3, -1), v), ValueError,
         r"k: query heads H=4 must be a multiple"),
        (lambda: htree_attention(q, k, v[:, :5]), ValueError, r"v: batch, time"),
        (lambda: htree_attention(q[..., :7], k[..., :7], v), ValueError, r"q: head dim K=7 must be even"),
        (lambda: htree_attention(q, k.half(), v), TypeError, r"k: dtype torch.float16 differs"),
        (lambda: htree_attention(q, k, v.double()), TypeError, r"v: dtype torch.float64 differs"),
        (lambda: htree_attention(q, k, v, compression_rate=1), ValueError, r"compression_rate: must be >= 2"),
        (lambda: htree_attention(q, k, v, top_k=0), ValueError, r"top_k: must be >= 1"),
        (lambda: htree_attention(q, k, v, sort_mode="bitonic"), ValueError, r"sort_mode: must be one of"),
        (lambda: htree_attention(q, k, v, causal=1), ValueError, r"causal: must be a bool"),
        (lambda: htree_attention(q, k, v, scale=float("inf")), ValueError, r"scale: must be a finite number"),
        (lambda: htree_attention(q.int(), k.int(), v.int()), TypeError, r"q: expected a floating-point tensor"),
        (lambda: htree_attention(q, k, v.int()), TypeError, r"v: expected a floating-point tensor"),
        (lambda: htree_attention_op(q, k.half(), v, 2, 2, 4, 0.5, 1e4, False, "exact"), TypeError,
         r"k: dtype torch.float16 differs"),
        (lambda: htree_attention(zeros(1, 8, 2, 300), zeros(1, 8, 2, 300), v), ValueError,
         r"head dim 300 exceeds the supported maximum 256"),
        (lambda: htree_attention_backward_op(q, k, v, zeros(1, 8, 4, 3), zeros(1, 8, 4), zeros(1, 8, 4, 3), None,
                                             2, 2, 4, 0.5, 1e4, False, "exact"), ValueError,
         r"o: shape \(1, 8, 4, 3\) differs from the expected \(1, 8, 4, 8\)"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_inputs_raise_clear_errors(index):
    call, error, message = _bad_calls()[index]
    with pytest.raises(error, match=message) as raised:
        call()
    assert type(raised.value) is error


@pytest.mark.gpu
@pytest.mark.parametrize("node_gradients", [False, True], ids=["atomics", "node-stationary"])
def test_gpu_inductor_code_launches_the_htree_kernels_directly(node_gradients, monkeypatch):
    """Issue 24: on CUDA htree is traced into its kernel launches, so Inductor's output code launches
    our kernels itself (no call through torch.ops.hccompile), the report still names one op per
    direction, and the compiled function (GQA, causal, three layers) matches float64 through the
    reference, both backward versions. Compiled with dynamic=True: lengths of other depths (two
    layers, one) run the same graphs, no recompile. r 32, top_k 16: the deepest tree planned for
    every length has 6 layers (lowering/htree.MAX_TRACED_LAYERS); with r 4 (14 layers) the
    node-stationary case compiled for over 3 minutes on the H200 host."""
    from hccompile.kernels.htree import tiles
    from helpers import Collect, calls_through_hccompile_ops, inductor_step

    monkeypatch.setattr(tiles, "NODE_GRADIENTS", node_gradients)
    options = dict(compression_rate=32, top_k=16, max_top_nodes=16, causal=True)
    leaves = [x.requires_grad_() for x in make_inputs(T=600, H_kv=2, G=2, K=64, V=64, seed=7)]
    be = Collect()
    compiled = torch.compile(lambda q, k, v: htree_attention(q, k, v, return_lse=True, **options), backend=be,
                             fullgraph=True, dynamic=True)
    (o, lse), code = inductor_step(compiled, leaves, (torch.randn(1, 600, 4, 64, device=DEVICE),
                                                      torch.randn(1, 600, 4, device=DEVICE)))
    kernels = ["_htree_forward_kernel", "_pool_kernel", "_htree_backward_kernel", "_unpool_kernel"]
    kernels += ["_selection_bits_kernel", "_node_gradients_kernel"] if node_gradients else []
    for kernel in kernels:
        assert kernel in code, kernel
    if not node_gradients:
        assert "_node_gradients_kernel" not in code
    assert not calls_through_hccompile_ops(code), calls_through_hccompile_ops(code)[:5]
    assert be.ops("forward") == ["hccompile.htree_attention.default"], be.ops("forward")
    assert be.ops("backward") == ["hccompile.htree_attention_backward.default"], be.ops("backward")

    reports = len(be.reports)
    for T in (600, 100, 16):  # depths 3 (600, 19, 1), 2 (100, 4) and 1 (16: dense)
        leaves = [x.requires_grad_() for x in make_inputs(T=T, H_kv=2, G=2, K=64, V=64, seed=T)]
        o, lse = compiled(*leaves)
        do, dlse = torch.randn_like(o), torch.randn_like(lse)
        grads = torch.autograd.grad((o, lse), leaves, (do, dlse))
        assert len(be.reports) == reports, f"T={T} compiled again"
        as64 = [t.detach().double().requires_grad_() for t in leaves]
        for got, want in zip(htree_selections(*[t.detach() for t in leaves[:2]], **options),
                             htree_selections(*[t.detach() for t in as64[:2]], **options)):
            assert got.selected is None or torch.equal(got.selected, want.selected)
        o_ref, lse_ref = htree_attention_ref(*as64, return_lse=True, **options)
        assert rel_err(o, o_ref) < TOLERANCE and rel_err(lse, lse_ref) < TOLERANCE, T
        grads_ref = torch.autograd.grad((o_ref, lse_ref), as64, (do.double(), dlse.double()))
        for name, grad, grad_ref in zip("qkv", grads, grads_ref):
            assert rel_err(grad, grad_ref) < TOLERANCE, (T, name)
