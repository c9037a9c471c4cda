"""The normalising pre-pass (hccompile/passes/normalize.py): every spelling it claims becomes the one
canonical node, the near-misses stay as written, and a normalised graph computes what the user's did
(outputs and gradients), for several lengths in one dynamic graph."""
import operator

import pytest
import torch
import torch.fx as fx

from hccompile.passes.normalize import normalize

from helpers import Collect


def _dynamo_graph(fn, *inputs, dynamic=False) -> fx.GraphModule:
    """The Dynamo graph of fn (with example values on its nodes), as a pass sees it."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True, dynamic=dynamic)(*inputs)
    (gm,) = graphs
    return gm


def _calls(gm: fx.GraphModule) -> list[tuple[str, object]]:
    return [(n.op, n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


# (name, function, inputs' shapes, the canonical (op, target, args after the first) of its one call)
_MATMUL = ("call_function", torch.matmul)
_TRANSPOSE_12 = ("call_function", torch.transpose, (1, 2))
SPELLINGS = [
    ("a @ b", lambda a, b: a @ b, [(2, 3, 4), (2, 4, 5)], _MATMUL),
    ("a.matmul(b)", lambda a, b: a.matmul(b), [(2, 3, 4), (2, 4, 5)], _MATMUL),
    ("a.__matmul__(b)", lambda a, b: a.__matmul__(b), [(2, 3, 4), (2, 4, 5)], _MATMUL),
    ("torch.bmm", lambda a, b: torch.bmm(a, b), [(2, 3, 4), (2, 4, 5)], _MATMUL),
    ("a.bmm(b)", lambda a, b: a.bmm(b), [(2, 3, 4), (2, 4, 5)], _MATMUL),
    ("x.transpose", lambda x: x.transpose(1, 2), [(2, 3, 4)], _TRANSPOSE_12),
    ("x.swapaxes", lambda x: x.swapaxes(1, 2), [(2, 3, 4)], _TRANSPOSE_12),
    ("torch.swapdims", lambda x: torch.swapdims(x, 1, 2), [(2, 3, 4)], _TRANSPOSE_12),
    ("x.mT", lambda x: x.mT, [(2, 3, 4)], ("call_function", torch.transpose, (-2, -1))),
    ("m.T", lambda m: m.T, [(3, 4)], ("call_function", torch.transpose, (0, 1))),
    ("m.t()", lambda m: m.t(), [(3, 4)], ("call_function", torch.transpose, (0, 1))),
    ("x.permute(*dims)", lambda x: x.permute(0, 2, 1), [(2, 3, 4)], ("call_function", torch.permute, ([0, 2, 1],))),
    ("x.permute(tuple)", lambda x: x.permute((0, 2, 1)), [(2, 3, 4)],
     ("call_function", torch.permute, ([0, 2, 1],))),
    ("x.float()", lambda x: x.double().float(), [(2, 3)], None),  # two casts: checked below
    ("x.half()", lambda x: x.half(), [(2, 3)], ("call_method", "to", (torch.float16,))),
    ("x.bfloat16()", lambda x: x.bfloat16(), [(2, 3)], ("call_method", "to", (torch.bfloat16,))),
]


def _doubled(fn):
    return lambda *inputs: fn(*inputs) * 2


@pytest.mark.parametrize("name, fn, shapes, want", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_each_spelling_becomes_the_canonical_node(name, fn, shapes, want):
    inputs = [torch.randn(*shape) for shape in shapes]
    fn = _doubled(fn)  # an output that is not a view of an input: Dynamo keeps the op in the graph
    gm = _dynamo_graph(fn, *inputs)
    names_before = [n.name for n in gm.graph.nodes]
    rewritten = normalize(gm)
    assert rewritten, f"{name}: nothing rewritten"
    *calls, doubling = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert doubling.target is operator.mul
    if want is None:  # x.double().float()
        assert [(n.op, n.target, n.args[1:]) for n in calls] == [("call_method", "to", (torch.float64,)),
                                                                  ("call_method", "to", (torch.float32,))]
    else:
        op, target, *rest = want
        (node,) = calls
        assert (node.op, node.target) == (op, target)
        if rest:
            assert tuple(node.args[1:]) == rest[0]
        assert not node.kwargs
    # in place: names, order and example values stay
    assert [n.name for n in gm.graph.nodes] == names_before
    assert all("example_value" in n.meta for n in calls)
    got = gm(*inputs)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, fn(*inputs), rtol=0, atol=0)


NEAR_MISSES = [
    ("v.t() of a vector is the vector", lambda v: v.t() * 2, [(5,)]),
    ("x.view stays a view", lambda x: x.view(6, 4) * 2, [(2, 3, 4)]),
    ("a cast with memory_format", lambda x: x.float(memory_format=torch.contiguous_format) * 2, [(2, 3)]),
    ("torch.matmul is canonical already", lambda a, b: torch.matmul(a, b), [(3, 4), (4, 5)]),
    ("torch.permute is canonical already", lambda x: torch.permute(x, (1, 0)), [(3, 4)]),
    ("x.to(dtype) is canonical already", lambda x: x.to(torch.float64), [(3, 4)]),
    ("an in-place transpose stays in place", lambda x: x.clone().transpose_(0, 1) * 2, [(3, 4)]),
]


@pytest.mark.parametrize("name, fn, shapes", NEAR_MISSES, ids=[s[0] for s in NEAR_MISSES])
def test_near_misses_stay_as_written(name, fn, shapes):
    inputs = [torch.randn(*shape) for shape in shapes]
    gm = _dynamo_graph(fn, *inputs)
    before = [(n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes]
    assert normalize(gm) == {}, name
    assert [(n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes] == before


def _attention_like(q, k, v):
    # the spellings real code mixes in one region
    scores = torch.bmm(q, k.mT) * q.shape[-1] ** -0.5
    probs = scores.float().softmax(-1).to(q.dtype)
    out = probs.matmul(v).swapaxes(0, 1)
    return out.permute((1, 0, 2)) @ torch.ones(v.shape[-1], 3, dtype=v.dtype)


def test_a_normalised_graph_computes_the_same_values_and_gradients_for_several_lengths():
    """Under hc (normalize on, every other pass too) against eager, for three lengths in one dynamic
    graph; and hc's report says what normalize rewrote."""
    be = Collect(compiler="aot_eager")
    step = torch.compile(_attention_like, backend=be, dynamic=True, fullgraph=True)
    for length in (5, 9, 17):
        gen = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(2, length, 8, generator=gen, dtype=torch.float64, requires_grad=True)
                   for _ in range(3))
        out = step(q, k, v)
        ref = _attention_like(q, k, v)
        torch.testing.assert_close(out, ref)
        cot = torch.randn_like(ref)
        got = torch.autograd.grad(out, (q, k, v), cot)
        want = torch.autograd.grad(ref, (q, k, v), cot)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    assert len(be.reports) == 1, "one graph for every length"
    (record,) = [p for p in be.reports[0].passes if p.name == "normalize"]
    assert record.changed and any(note.startswith("matrix product:") for note in record.notes)


def test_the_report_names_what_was_rewritten():
    gm = _dynamo_graph(_attention_like, *(torch.randn(2, 5, 8) for _ in range(3)))
    rewritten = normalize(gm)
    assert rewritten["matrix product"] == {"bmm": 1, "@": 1, ".matmul()": 1}
    assert rewritten["transpose"] == {".mT": 1, ".swapaxes()": 1}
    assert rewritten["permute"] == {".permute()": 1}
    assert rewritten["cast"] == {".float()": 1}
    assert operator.matmul not in {t for _, t in _calls(gm)}
