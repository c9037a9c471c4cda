"""The shared emitter (hccompile/passes/emit.py): a builder run eagerly and run into an FX graph
computes the same values, and every node it inserts carries its fake example value."""
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from hccompile.passes.emit import EagerEmitter, Emitter, GraphEmitter


def _builder(em: Emitter, x, y, scale_node):
    a = em.method("permute", x, 0, 2, 1)
    b = em.call(torch.add, a, em.method("unsqueeze", y, 1))
    ones = em.method("new_ones", b, [em.size(b, 1)], dtype=torch.float64)
    c = em.call(operator.mul, em.cast(b, torch.float64), em.method("unsqueeze", ones, -1))
    c = em.call(operator.mul, c, em.input(scale_node))
    first = em.getitem(c, (Ellipsis, 0))
    return [c, first, em.cast(first, torch.float64)]


def _graph(examples):
    g = fx.Graph()
    nodes = []
    for name, ev in examples.items():
        node = g.placeholder(name)
        node.meta["example_value"] = ev
        nodes.append(node)
    return g, nodes


def test_eager_and_graph_emitters_agree_and_the_graph_nodes_carry_example_values():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, generator=gen)
    scale = torch.tensor(0.5, dtype=torch.float64)

    mode = FakeTensorMode()
    g, (xn, yn, sn) = _graph({"x": mode.from_tensor(x), "y": mode.from_tensor(y),
                                    "scale": mode.from_tensor(scale)})
    eager = _builder(EagerEmitter({sn: scale}.__getitem__), x, y, sn)

    em = GraphEmitter(g, mode, {"stack_trace": "the replaced node's"})
    outs = _builder(em, xn, yn, sn)
    g.output(outs)
    got = fx.GraphModule(torch.nn.Module(), g)(x, y, scale)

    assert outs[2] is outs[1]  # a cast to the dtype it has emits nothing
    assert [n.op for n in em.created] == ["call_method", "call_method", "call_function", "call_method",
                                          "call_method", "call_method", "call_function",
                                          "call_function", "call_function"]
    for want, have in zip(eager, got):
        assert want.dtype == have.dtype and want.shape == have.shape
        torch.testing.assert_close(have, want, rtol=0, atol=0)
    for node in em.created:
        ev = node.meta["example_value"]
        assert isinstance(ev, FakeTensor) and ev.fake_mode is mode, node
        assert node.meta["stack_trace"] == "the replaced node's"
    assert tuple(outs[0].meta["example_value"].shape) == tuple(eager[0].shape)
    assert outs[0].meta["example_value"].dtype == torch.float64


def test_op_calls_agree():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=gen) for _ in range(3))
    mode = FakeTensorMode()
    g, nodes = _graph({name: mode.from_tensor(t) for name, t in zip("qkv", (q, k, v))})
    eager = EagerEmitter().op("causal_linear_attn", q, k, v, 0.5)
    em = GraphEmitter(g, mode)
    out = em.op("causal_linear_attn", *nodes, 0.5)
    g.output(out)
    assert out.target is torch.ops.hccompile.causal_linear_attn.default
    assert tuple(out.meta["example_value"].shape) == tuple(eager.shape)
    got = fx.GraphModule(torch.nn.Module(), g)(q, k, v)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_a_symbolic_size_is_read_in_the_graph_and_a_static_one_is_an_int():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    g, (xn,) = _graph({"x": mode.from_tensor(torch.randn(5, 3), symbolic_context=context)})
    em = GraphEmitter(g, mode)
    assert em.size(xn, 1) == 3 and not em.created
    tokens = em.size(xn, 0)
    assert isinstance(tokens, fx.Node) and tokens.op == "call_method" and tokens.target == "size"
    assert isinstance(tokens.meta["example_value"], torch.SymInt)
    assert EagerEmitter().size(torch.randn(5, 3), 0) == 5
