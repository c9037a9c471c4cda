"""Issue 24 without a GPU: what AOTAutograd makes of each kernel op on CUDA tensors.

torch.compile traces a triton_op's body into its kernel launches (lowering/_launch.py). Here each
op's forward and backward is traced as torch.compile would, on fake CUDA tensors whose every size
is symbolic, and the graph is read, not run: it must hold our kernel launches (op_inventory names
the op once from them) and no call of the op or its host twin, and tracing must put no guard on
the sequence length that some length from 16 on fails (one graph for every length). Fake CUDA tensors need a CUDA build of torch,
not a GPU: the GPU suite runs these, and so does a CPU machine with the CUDA wheel."""
from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

import helpers

triton = pytest.importorskip("triton")

# Under TRITON_INTERPRET=1 (make test) the kernels are interpreted functions, which torch cannot
# trace: the checks then run in a fresh process without it (test_in_a_process_without_the_interpreter).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

pytestmark = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                reason="fake CUDA tensors need a CUDA build of torch")
needs_compiled_kernels = pytest.mark.skipif(INTERPRETED, reason="run by test_in_a_process_without_the_interpreter")


@pytest.mark.skipif(not INTERPRETED, reason="the checks run in this process")
def test_in_a_process_without_the_interpreter():
    helpers.rerun_without_interpreter(__file__)


class _Traced(Exception):
    pass


def trace(fn, *shapes_and_dtypes, ints=()):
    """(graph, time symbol's guards) of AOTAutograd's inference graph of fn on fake CUDA tensors of
    the given (shape, dtype) pairs, every size symbolic. Dimension 1 of the first tensor is the
    sequence length; `ints` are integer tensors (cu_seqlens and the like), as (shape, dtype)."""
    from torch._functorch.aot_autograd import aot_function
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False)
    fakes = [mode.from_tensor(torch.empty(shape, dtype=dtype)) for shape, dtype in shapes_and_dtypes]
    with mode:
        fakes = [t.to("cuda") for t in fakes]
    graphs = []

    def capture(gm, _):
        graphs.append(gm)
        raise _Traced

    with warnings.catch_warnings(), helpers.kernel_target():
        warnings.simplefilter("ignore")
        try:
            aot_function(fn, fw_compiler=capture, dynamic=True)(*fakes)
        except _Traced:
            pass
    # A guard on the length must hold for every length from 16 on (torch itself guards out the
    # single-row case of a tensor it makes contiguous): the other sizes keep their values.
    time, env = fakes[0].shape[1].node.expr, mode.shape_env
    others = {sym: val for sym, val in env.var_to_val.items() if sym != time}
    pinned = [(g.expr, str(g.sloc)) for g in env.guards if time in g.expr.free_symbols
              and not all(bool(g.expr.subs({**others, time: t})) for t in (16, 17, 63, 64, 65, 1000, 4097, 65536))]
    return graphs[0], pinned


def _check(traced, op: str) -> None:
    from hccompile.passes.op_inventory import hccompile_ops

    gm, pinned = traced

    launches = [n for n in gm.graph.nodes if n.op == "call_function"
                and getattr(n.target, "__name__", "").startswith("triton_kernel_wrapper")]
    from hccompile.lowering._launch import RUNTIME_CHECKS

    # run-time checks (a traced delta-rule graph must not run inside context_parallel) may stay
    calls = [str(n.target) for n in gm.graph.nodes if str(n.target).startswith("hccompile.")
             and str(n.target) not in RUNTIME_CHECKS]
    assert launches and not calls, (op, calls)
    # a launch writes only tensors the op allocated: a graph input it writes (an input passed as a
    # kernel's dummy pointer, say) becomes a mutation of the caller's tensor, which autograd refuses
    written_inputs = [(n.kwargs["kernel_idx"], name) for n in launches for name in n.kwargs.get("tensors_to_clone", ())
                      if n.kwargs["kwargs"][name].op == "placeholder"]
    assert not written_inputs, (op, [(_kernel_name(k), name) for k, name in written_inputs])
    # nor an index table or cu_seqlens, which kernels only read: counted as written (a pointer
    # passed into a jit helper makes the analysis take the helper's results as derived from it),
    # the argument, shared by the launches, is copied before each (11 extra kernels per GDN step)
    written_tables = [(_kernel_name(n.kwargs["kernel_idx"]), name) for n in launches
                      for name in n.kwargs.get("tensors_to_clone", ()) if _READ_ONLY.search(name)]
    assert not written_tables, (op, written_tables)
    assert hccompile_ops(gm.graph) == [f"hccompile.{op}.default"], gm.graph
    assert not pinned, f"{op}: the sequence length is guarded: {pinned}"
    _check_cached_analysis(launches)


def _check_cached_analysis(launches) -> None:
    """compat caches torch's analysis of what each launch reads and writes: the cached answer must
    be torch's own, for every launch of every op traced here."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    from hccompile.compat import cache_triton_access_analysis

    analysis = cache_triton_access_analysis()
    assert getattr(analysis, "_hccompile_cached", False)
    for n in launches:
        kernel = wrap.kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
        constants = wrap.kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])
        values = {k: v.meta["val"] if isinstance(v, torch.fx.Node) else v for k, v in n.kwargs["kwargs"].items()}
        args = (kernel, {**values, **constants}, n.kwargs["tma_descriptor_metadata"])
        with helpers.kernel_target():
            assert analysis(*args) == analysis.__wrapped__(*args), _kernel_name(n.kwargs["kernel_idx"])


_READ_ONLY = re.compile(r"table|seqlens|offsets")


def _kernel_name(kernel_idx: int) -> str:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kernel = kernel_side_table.get_kernel(kernel_idx)
    return getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))


BF16, F32 = torch.bfloat16, torch.float32


@needs_compiled_kernels
def test_causal_linear_attn_traces_to_its_launches():
    from hccompile.lowering import linear_attn as LA

    qkv = [((2, 100, 3, 64), BF16)] * 3
    _check(trace(lambda q, k, v: LA.causal_linear_attn_op(q, k, v, 0.125), *qkv), "causal_linear_attn")
    _check(trace(lambda q, k, v, do: LA.causal_linear_attn_backward_op(q, k, v, do, 0.125), *qkv,
                  ((2, 100, 3, 64), BF16)), "causal_linear_attn_backward")


@needs_compiled_kernels
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_mhc_ops_trace_to_their_launches(dtype):
    from hccompile.kernels.mhc.reference import MappingSpec
    from hccompile.lowering import mhc as M

    B, S, n, C = 2, 100, 4, 64
    order = [0, 1, 2, 3]
    x, h_res, h_post, f = ((B, S, n, C), dtype), ((B, S, n, n), dtype), ((B, S, n), dtype), ((B, S, C), dtype)
    _check(trace(lambda *t: M.mhc_post_op(*t, False, order), x, h_res, h_post, f), "mhc_post")
    for with_dx in (True, False):  # without dx, the dummy dx pointer is the op's own, not an input
        _check(trace(lambda *t: M.mhc_post_backward_op(*t, False, order, with_dx), x, h_res, h_post, f, x),
               "mhc_post_backward")
    _check(trace(lambda *t: M.mhc_aggregate_op(*t), x, h_post), "mhc_aggregate")
    _check(trace(lambda *t: M.mhc_aggregate_backward_op(*t), x, h_post, f), "mhc_aggregate_backward")

    spec = MappingSpec(n=n, steps=8)
    scalars = M.spec_args(spec)
    params = [((1,), dtype)] * 3 + [((n,), dtype), ((n,), dtype), ((n * n,), dtype)]
    proj, r = ((B, S, spec.width), dtype), ((B, S, 1), dtype)
    _check(trace(lambda *t: M.mhc_mapping_op(*t, *scalars, dtype, dtype, dtype), proj, r, *params),
           "mhc_mapping")
    grads = [((B, S, n), dtype), ((B, S, n), dtype), ((B, S, n, n), dtype)]
    _check(trace(lambda *t: M.mhc_mapping_backward_op(*t, *scalars), proj, r, *params, *grads),
           "mhc_mapping_backward")


@needs_compiled_kernels
def test_launch_analysis_is_computed_once_per_key():
    """torch analyses a traced launch's Triton IR at every call site, several times (compat): the
    same kernel with the same argument kinds is analysed once."""
    from hccompile import compat
    from hccompile.lowering import mhc as M

    x, h_res, h_post, f = ((2, 100, 4, 64), BF16), ((2, 100, 4, 4), BF16), ((2, 100, 4), BF16), ((2, 100, 64), BF16)

    def traced_post_backward():
        trace(lambda *t: M.mhc_post_backward_op(*t, False, [0, 1, 2, 3], False), x, h_res, h_post, f, x)
        return dict(compat.access_analysis_counts)

    first = traced_post_backward()
    again = traced_post_backward()
    assert again["computed"] == first["computed"] and again["reused"] > first["reused"], (first, again)


@needs_compiled_kernels
def test_a_length_specialisation_is_caught():
    """The check above can fail: a body that branches on the length leaves a guard that some
    length breaks."""
    _, pinned = trace(lambda q: q * 2 if q.shape[1] < 128 else q + 1, ((2, 100, 3, 64), BF16))
    assert pinned


@pytest.fixture
def sm_count(monkeypatch):
    """The delta-rule sweeps size their tiles by the GPU's multiprocessors: without a GPU, an H100's."""
    if not torch.cuda.is_available():
        from hccompile.kernels.delta_rule import plan as kernel_plan

        monkeypatch.setattr(kernel_plan, "_multiprocessor_count", lambda device: 132)


@needs_compiled_kernels
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_delta_rule_ops_trace_to_their_launches(gate, dtype, sm_count):
    """Plain delta rule, GDN (scalar gate) and KDA (per-channel gate), GVA (H=2 key heads, HV=4),
    with l2norm, initial and final state and the kept intra-chunk matrices."""
    from hccompile.lowering import delta_rule as D

    B, T, H, HV, K, V = 2, 100, 2, 4, 64, 64
    q = ((B, T, H, K), dtype)
    v, beta, h0 = ((B, T, HV, V), dtype), ((B, T, HV), dtype), ((B, HV, K, V), F32)
    g = [] if gate == "none" else [((B, T, HV) if gate == "scalar" else (B, T, HV, K), F32)]
    options = (gate, 0.125, True, True, None, 64)

    def forward(q, k, v, beta, *rest):
        gate_value = rest[0] if g else None
        return D.chunk_delta_rule_op(q, k, v, beta, gate_value, rest[-1], None, None, None, *options, True)

    traced = trace(forward, q, q, v, beta, *g, h0)
    _check(traced, "chunk_delta_rule")
    _checks_context_at_run_time(traced[0])

    def backward(q, k, v, beta, *rest):
        gate_value = rest[0] if g else None
        h0_, do, dht, kdot, scores, inverse = rest[-6:]
        return D.chunk_delta_rule_backward_op(q, k, v, beta, gate_value, h0_, None, None, None, do, dht,
                                              gate, 0.125, True, None, 64, kdot, scores, inverse)

    square = ((B, T, HV, 64), F32)
    traced = trace(backward, q, q, v, beta, *g, h0, v, h0, square, square, square)
    _check(traced, "chunk_delta_rule_backward")
    _checks_context_at_run_time(traced[0])


def _checks_context_at_run_time(gm) -> None:
    """A traced delta-rule graph calls the run-time context_parallel check (eager calls skip it)."""
    targets = [str(n.target) for n in gm.graph.nodes]
    assert "hccompile.delta_rule_outside_context_parallel.default" in targets, targets


@needs_compiled_kernels
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_lightning_ops_trace_to_their_launches(dtype, monkeypatch):
    """Lightning attention with a decay and an initial and final state; fixed-length rows, whose
    segments the kernels derive from the sizes (no table from the lengths' values)."""
    import types

    from hccompile.lowering import lightning as L

    if not torch.cuda.is_available():  # the automatic segment length asks for the GPU's multiprocessors
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: types.SimpleNamespace(multi_processor_count=132))
    B, T, H, K, V = 2, 100, 4, 64, 64
    q, decay, h0 = ((B, T, H, K), dtype), ((H,), F32), ((B, H, K, V), F32)
    _check(trace(lambda q, k, v, decay, h0: L.lightning_attn_op(q, k, v, decay, h0, 0.125, True),
                 q, q, ((B, T, H, V), dtype), decay, h0), "lightning_attn")
    _check(trace(lambda q, k, v, decay, h0, do, dht: L.lightning_attn_backward_op(q, k, v, decay, h0, do, dht, 0.125),
                 q, q, ((B, T, H, V), dtype), decay, h0, ((B, T, H, V), dtype), h0), "lightning_attn_backward")
    # with the forward's segment states kept, and the backward from them
    _check(trace(lambda q, k, v, decay, h0: L.lightning_attn_op(q, k, v, decay, h0, 0.125, True, None, True),
                 q, q, ((B, T, H, V), dtype), decay, h0), "lightning_attn")
    _check(trace(lambda q, k, v, decay, h0, do, dht, states: L.lightning_attn_backward_op(
        q, k, v, decay, h0, do, dht, 0.125, None, states), q, q, ((B, T, H, V), dtype), decay, h0,
        ((B, T, H, V), dtype), h0, ((6, H, K, V), F32)), "lightning_attn_backward")


@pytest.fixture
def gpu_properties(monkeypatch):
    """The launch plans that fill the GPU ask for its multiprocessors: without a GPU, an H100's."""
    import types

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: types.SimpleNamespace(multi_processor_count=132))


# r 32, top_k 16, max_top_nodes 16: the lengths the check tries (16 .. 65536) have trees of 1 to 4 layers,
# the plan for every length 6 (lowering/htree.MAX_TRACED_LAYERS: a deeper plan stays a host op).
HTREE_OPTIONS = (32, 16, 16, 0.125, 10000.0, True, "exact")


@needs_compiled_kernels
@pytest.mark.parametrize("save_selections", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_htree_forward_traces_to_its_launches(dtype, save_selections, gpu_properties):
    """The forward, with and without the selections it saves for the node-stationary backward: one
    graph for every length (the tree's depth is read by the kernels, the selections' layer count is
    an expression of T)."""
    from hccompile.lowering import htree as HT

    B, T, H, H_kv, K, V = 2, 100, 6, 3, 64, 32
    q, k, v = ((B, T, H, K), dtype), ((B, T, H_kv, K), dtype), ((B, T, H_kv, V), dtype)
    _check(trace(lambda q, k, v: HT.htree_attention_op(q, k, v, *HTREE_OPTIONS, save_selections), q, k, v),
           "htree_attention")


@needs_compiled_kernels
def test_htree_deeper_than_the_traced_limit_stays_a_host_op(gpu_properties):
    """r 2, top_k 2, max_top_nodes 2 plans 30 layers for every length: tracing that took a minute
    per direction (and hung an opcheck on the GPU), so the call stays the opaque host op, whose
    output sizes are still expressions of T (no guard on the depth)."""
    from hccompile.lowering import htree as HT
    from hccompile.kernels.htree.reference import HTreeConfig
    from hccompile.kernels.htree.tiles import max_layers

    options = (2, 2, 2, 0.4, 100.0, True, "packed")
    assert max_layers(HTreeConfig(*options)) > HT.MAX_TRACED_LAYERS
    q = ((1, 40, 2, 16), F32)
    gm, pinned = trace(lambda q, k, v: HT.htree_attention_op(q, k, v, *options, True), q, q, q)
    calls = [str(n.target) for n in gm.graph.nodes if str(n.target).startswith("hccompile.")]
    assert calls == ["hccompile.htree_attention_host.default"], calls
    assert not pinned, pinned


@needs_compiled_kernels
@pytest.mark.parametrize("selections", [False, True], ids=["reselected", "forward-selections"])
@pytest.mark.parametrize("node_gradients", [False, True], ids=["atomics", "node-stationary"])
def test_htree_backward_traces_to_its_launches(node_gradients, selections, gpu_properties, monkeypatch):
    """Both backward versions (tiles.NODE_GRADIENTS), selecting again or reading the forward's
    selections; with a gradient into lse."""
    from hccompile.kernels.htree import tiles
    from hccompile.lowering import htree as HT

    monkeypatch.setattr(tiles, "NODE_GRADIENTS", node_gradients)
    B, T, H, H_kv, K, V = 2, 100, 6, 3, 64, 32
    q, k, v = ((B, T, H, K), BF16), ((B, T, H_kv, K), BF16), ((B, T, H_kv, V), BF16)
    o, lse = ((B, T, H, V), BF16), ((B, T, H), F32)
    saved = [((2, B, T, H_kv, 16), torch.int32)] if selections else []

    def backward(q, k, v, o, lse, do, dlse, *saved):
        return HT.htree_attention_backward_op(q, k, v, o, lse, do, dlse, *HTREE_OPTIONS, *saved)

    _check(trace(backward, q, k, v, o, lse, o, lse, *saved), "htree_attention_backward")
