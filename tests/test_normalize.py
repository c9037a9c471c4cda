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
    # einsums that are not one batched matrix product
    ("einsum diagonal 'bii->bi'", lambda x: torch.einsum("bii->bi", x) * 2, [(2, 3, 3)]),
    ("einsum diagonal of an operand", lambda a, b: torch.einsum("bii,bij->bij", a, b) * 2, [(2, 3, 3), (2, 3, 4)]),
    ("einsum of three operands", lambda a, b, c: torch.einsum("bij,bjk,bkl->bil", a, b, c) * 2,
     [(2, 3, 4), (2, 4, 5), (2, 5, 6)]),
    ("einsum with two contracted labels", lambda a, b: torch.einsum("bijk,bjkl->bil", a, b) * 2,
     [(2, 3, 4, 5), (2, 4, 5, 6)]),
    ("einsum outer product", lambda a, b: torch.einsum("bi,bj->bij", a, b) * 2, [(2, 3), (2, 4)]),
    ("einsum summing one operand's label", lambda a, b: torch.einsum("bij,bjk->bk", a, b) * 2,
     [(2, 3, 4), (2, 4, 5)]),
    ("einsum matrix-vector product", lambda s, k: torch.einsum("bhkv,bhk->bhv", s, k) * 2,
     [(2, 3, 4, 5), (2, 3, 4)]),
    ("einsum with a broadcast batch dim", lambda a, b: torch.einsum("bij,bkj->bik", a, b) * 2,
     [(1, 3, 4), (2, 5, 4)]),
    ("einsum with ellipses of different lengths", lambda a, b: torch.einsum("...ij,...jk->...ik", a, b) * 2,
     [(2, 3, 4), (4, 5)]),
    ("einsum with an implicit output", lambda a, b: torch.einsum("bij,bjk", a, b) * 2, [(2, 3, 4), (2, 4, 5)]),
]


@pytest.mark.parametrize("name, fn, shapes", NEAR_MISSES, ids=[s[0] for s in NEAR_MISSES])
def test_near_misses_stay_as_written(name, fn, shapes):
    inputs = [torch.randn(*shape) for shape in shapes]
    gm = _dynamo_graph(fn, *inputs)
    before = [(n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes]
    assert normalize(gm) == {}, name
    assert [(n.op, n.target, n.args, dict(n.kwargs)) for n in gm.graph.nodes] == before


# einsum spellings of a batched matrix product: (name, function, the operands' shapes at each of
# several sizes, the canonical nodes that replace the einsum as (target, args after the first), the
# last of which keeps the einsum's name)
def _einsum(equation, as_list=False, function=torch.einsum):
    if as_list:
        return lambda a, b: function(equation, [a, b])
    return lambda a, b: function(equation, a, b)


_T = (torch.transpose, (-2, -1))
_MM = (torch.matmul, ())
_BHTD_QK = [[(2, 3, 5, 4), (2, 3, 6, 4)], [(1, 2, 7, 8), (1, 2, 9, 8)]]
_BHTD_AV = [[(2, 3, 5, 6), (2, 3, 6, 4)], [(1, 2, 9, 9), (1, 2, 9, 8)]]
EINSUMS = [
    ("q @ kT 'bhid,bhjd->bhij'", _einsum("bhid,bhjd->bhij"), _BHTD_QK, [_T, _MM]),
    ("a @ v 'bhij,bhjd->bhid'", _einsum("bhij,bhjd->bhid"), _BHTD_AV, [_MM]),
    ("kT @ v 'bhtd,bhte->bhde'", _einsum("bhtd,bhte->bhde"),
     [[(2, 3, 5, 4), (2, 3, 5, 7)], [(1, 2, 9, 8), (1, 2, 9, 8)]], [_T, _MM]),
    ("k before q 'bhjd,bhid->bhij'", _einsum("bhjd,bhid->bhij"),  # q @ kT: the operands swapped
     [[(2, 3, 6, 4), (2, 3, 5, 4)], [(1, 2, 9, 8), (1, 2, 7, 8)]], [_T, _MM]),
    ("batch dims reordered 'bhid,bhjd->hbij'", _einsum("bhid,bhjd->hbij"),  # no permute after the matmul
     [[(2, 3, 5, 4), (2, 3, 6, 4)], [(3, 2, 7, 8), (3, 2, 9, 8)]],
     [(torch.transpose, (0, 1)), (torch.permute, ([1, 0, 3, 2],)), _MM]),
    ("bthd scores 'bthd,bshd->bhts'", _einsum("bthd,bshd->bhts"),
     [[(2, 5, 3, 4), (2, 6, 3, 4)], [(1, 9, 2, 8), (1, 9, 2, 8)]],
     [(torch.transpose, (1, 2)), (torch.permute, ([0, 2, 3, 1],)), _MM]),
    ("bthd values 'bhts,bshd->bthd'", _einsum("bhts,bshd->bthd"),
     [[(2, 3, 5, 6), (2, 6, 3, 4)], [(1, 2, 9, 9), (1, 9, 2, 8)]],
     [(torch.transpose, (1, 2)), _MM, (torch.transpose, (1, 2))]),
    ("ellipsis '...id,...jd->...ij'", _einsum("...id,...jd->...ij"),  # 2, then 1 batch dim
     [[(2, 3, 5, 4), (2, 3, 6, 4)], [(4, 7, 8), (4, 9, 8)]], [_T, _MM]),
    ("no batch dim 'ij,jk->ik'", _einsum("ij,jk->ik"), [[(5, 4), (4, 6)], [(7, 8), (8, 9)]], [_MM]),
    ("spaces 'b i j, b j k -> b i k'", _einsum("b i j, b j k -> b i k"),
     [[(2, 3, 4), (2, 4, 5)], [(3, 7, 8), (3, 8, 9)]], [_MM]),
    ("operands in a list", _einsum("bhid,bhjd->bhij", as_list=True), _BHTD_QK, [_T, _MM]),
    ("torch.functional.einsum", _einsum("bhij,bhjd->bhid", function=torch.functional.einsum), _BHTD_AV, [_MM]),
]


@pytest.mark.parametrize("name, fn, sizes, want", EINSUMS, ids=[e[0] for e in EINSUMS])
def test_each_einsum_spelling_becomes_a_matmul(name, fn, sizes, want):
    """The einsum node becomes the last of the canonical nodes (its name and users kept), the new
    nodes before it; every node has an example value of the einsum's result's shape at the end; the
    graph computes what the einsum did."""
    fn = _doubled(fn)
    inputs = [torch.randn(*shape, dtype=torch.float64) for shape in sizes[0]]
    gm = _dynamo_graph(fn, *inputs)
    (einsum,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.functional.einsum]
    want_value = einsum.meta["example_value"]
    rewritten = normalize(gm)
    assert list(rewritten) == ["matrix product"] and sum(rewritten["matrix product"].values()) == 1
    (spelling,) = rewritten["matrix product"]
    assert spelling.startswith("einsum(")
    *calls, doubling = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert doubling.target is operator.mul and doubling.args[0] is calls[-1]
    assert calls[-1].name == "einsum"
    assert [(n.target, tuple(n.args[1:]) if n.target is not torch.matmul else ()) for n in calls] == want
    assert all(not n.kwargs and n.meta.get("stack_trace") == einsum.meta.get("stack_trace") for n in calls)
    assert all(isinstance(n.meta["example_value"], torch.Tensor) for n in calls)
    assert calls[-1].meta["example_value"].shape == want_value.shape
    gm.graph.lint()
    got = gm(*inputs)
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, fn(*inputs))


@pytest.mark.parametrize("name, fn, sizes, want", EINSUMS, ids=[e[0] for e in EINSUMS])
def test_einsum_rewritten_under_hc_computes_the_same_values_and_gradients(name, fn, sizes, want):
    """Under hc (every pass) against eager, for each size (one dynamic graph per rank); the report
    says the einsum was rewritten."""
    fn = _doubled(fn)
    be = Collect(compiler="aot_eager")
    step = torch.compile(fn, backend=be, dynamic=True, fullgraph=True)
    for i, shapes in enumerate(sizes):
        gen = torch.Generator().manual_seed(i)
        inputs = [torch.randn(*s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]
        out = step(*inputs)
        ref = fn(*inputs)
        torch.testing.assert_close(out, ref)
        cot = torch.randn_like(ref)
        for g, w in zip(torch.autograd.grad(out, inputs, cot), torch.autograd.grad(ref, inputs, cot)):
            torch.testing.assert_close(g, w)
    for report in be.reports:
        (record,) = [p for p in report.passes if p.name == "normalize"]
        assert any(note.startswith("matrix product: 1 x einsum(") for note in record.notes), record.notes


def test_an_einsum_with_symbolic_sizes_is_rewritten():
    """dynamic=True: the batch and contracted sizes are symbols, equal by construction (no guard
    needed to prove it)."""
    fn = _doubled(_einsum("bthd,bshd->bhts"))
    gm = _dynamo_graph(fn, torch.randn(2, 5, 3, 4), torch.randn(2, 6, 3, 4), dynamic=True)
    (einsum,) = [n for n in gm.graph.nodes if n.target is torch.functional.einsum]
    shape_env = einsum.meta["example_value"].fake_mode.shape_env
    guards = len(shape_env.guards)
    assert normalize(gm) == {"matrix product": {"einsum('bthd,bshd->bhts')": 1}}
    assert len(shape_env.guards) == guards
    assert torch.functional.einsum not in {t for _, t in _calls(gm)}
    assert _calls(gm)[-2] == ("call_function", torch.matmul)
    gm.graph.lint()


def test_an_einsum_with_real_example_values_is_rewritten():
    """A graph whose example values are real tensors (no fake mode): the new nodes' values are
    computed on them."""
    def fn(a, b):
        return torch.einsum("bthd,bshd->bhts", a, b) * 2

    gm = fx.symbolic_trace(fn)
    a, b = torch.randn(2, 5, 3, 4), torch.randn(2, 6, 3, 4)

    class Record(fx.Interpreter):
        def run_node(self, n):
            n.meta["example_value"] = super().run_node(n)
            return n.meta["example_value"]

    Record(gm).run(a, b)
    assert normalize(gm) == {"matrix product": {"einsum('bthd,bshd->bhts')": 1}}
    q_t, k_p, product = [n for n in gm.graph.nodes if n.op == "call_function"][:3]
    torch.testing.assert_close(q_t.meta["example_value"], a.transpose(1, 2))
    torch.testing.assert_close(k_p.meta["example_value"], b.permute(0, 2, 3, 1))
    assert product.target is torch.matmul and product.meta["example_value"].shape == (2, 3, 5, 6)
    torch.testing.assert_close(gm(a, b), fn(a, b))


@pytest.mark.parametrize("failure", ["no value", "an error"])
def test_an_einsum_whose_new_values_cannot_be_computed_stays_as_written(failure, monkeypatch):
    """The einsum's replacement without example values would mislead every later pass: the nodes
    already inserted are erased and the einsum stays."""
    import hccompile.passes.fx_match as module

    def fails(node, fake_mode=None):
        if failure == "an error":
            raise RuntimeError("no fake mode")
        return None

    gm = _dynamo_graph(_doubled(_einsum("bthd,bshd->bhts")), torch.randn(2, 5, 3, 4), torch.randn(2, 6, 3, 4))
    before = [(n.name, n.op, n.target, n.args) for n in gm.graph.nodes]
    monkeypatch.setattr(module, "fake_value", fails)
    assert normalize(gm) == {}
    assert [(n.name, n.op, n.target, n.args) for n in gm.graph.nodes] == before
    gm.graph.lint()


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


def test_the_report_names_each_einsum_by_its_equation():
    def fn(q, k, v):
        s = torch.einsum("bhid,bhjd->bhij", q, k)
        twice = torch.einsum("bhij,bhjd->bhid", s, v) + torch.einsum("bhij,bhjd->bhid", s, v)
        return twice + torch.bmm(q[0], k[0].mT).sum()

    gm = _dynamo_graph(fn, *(torch.randn(2, 3, 5, 4) for _ in range(3)))
    rewritten = normalize(gm)
    assert rewritten["matrix product"] == {"einsum('bhid,bhjd->bhij')": 1, "einsum('bhij,bhjd->bhid')": 2, "bmm": 1}
    assert torch.functional.einsum not in {t for _, t in _calls(gm)}
