"""The passes' one graph walk (hccompile/passes/fx_match.py: walk): order, depth, skip and stop, on
small hand-built graphs whose answers can be read off the picture."""
import operator

import pytest
import torch.fx as fx

from hccompile.passes import fx_match as M


def _diamond():
    """x -> a -> c -> out, x -> b -> c; a also feeds d, a dead end; y feeds b."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(operator.neg, (x,))
    b = g.call_function(operator.add, (x, y))
    c = g.call_function(operator.mul, (a, b))
    d = g.call_function(operator.abs, (a,))
    out = g.call_function(operator.neg, (c,))
    output = g.output((out, d))
    return g, dict(x=x, y=y, a=a, b=b, c=c, d=d, out=out, output=output)


def _chain(length):
    g = fx.Graph()
    node = g.placeholder("x")
    chain = [node]
    for _ in range(length):
        node = g.call_function(operator.neg, (node,))
        chain.append(node)
    g.output(node)
    return chain


def _letters(nodes, named):
    letter = {node: name for name, node in named.items()}
    return [letter[n] for n in nodes]


def test_breadth_first_yields_each_node_once_nearest_first_in_either_direction():
    _, n = _diamond()
    assert _letters(M.walk(n["x"], M.users), n) == ["x", "a", "b", "c", "d", "out", "output"]
    assert _letters(M.walk(n["out"], M.inputs), n) == ["out", "c", "a", "b", "x", "y"]


def test_depth_first_takes_the_last_node_pushed():
    _, n = _diamond()
    # c's inputs are [a, b]: the stack takes b first, and its inputs [x, y] y first
    assert _letters(M.walk(n["c"], M.inputs, depth_first=True), n) == ["c", "b", "y", "x", "a"]


def test_several_starts_and_a_node_reached_twice_is_yielded_once():
    _, n = _diamond()
    walked = list(M.walk([n["a"], n["b"]], M.users))
    assert _letters(walked, n) == ["a", "b", "c", "d", "out", "output"]
    assert len(walked) == len(set(walked))


def test_max_depth_counts_the_fewest_steps_from_a_start():
    chain = _chain(5)
    assert list(M.walk(chain[0], M.users, max_depth=0)) == chain[:1]
    assert list(M.walk(chain[0], M.users, max_depth=3)) == chain[:4]
    _, n = _diamond()
    # c is two steps from x by either path; out is three
    assert n["c"] in set(M.walk(n["x"], M.users, max_depth=2))
    assert n["out"] not in set(M.walk(n["x"], M.users, max_depth=2))


def test_max_depth_needs_breadth_first():
    with pytest.raises(ValueError):
        list(M.walk(_chain(2)[0], M.users, max_depth=1, depth_first=True))


def test_stop_yields_the_node_but_goes_no_further():
    _, n = _diamond()
    walked = set(M.walk(n["out"], M.inputs, stop=lambda node: node is n["b"]))
    assert n["b"] in walked
    assert n["y"] not in walked
    assert n["x"] in walked  # still reached through a


def test_skip_neither_yields_the_node_nor_goes_past_it():
    _, n = _diamond()
    walked = set(M.walk(n["out"], M.inputs, skip=lambda node: node is n["a"]))
    assert n["a"] not in walked
    assert {n["b"], n["x"], n["y"]} <= walked  # x still reached through b
    assert list(M.walk(n["out"], M.inputs, skip=lambda node: node is n["out"])) == []


def test_the_closures_and_ancestors_are_walks():
    _, n = _diamond()
    assert M.downstream(n["a"]) == {n["a"], n["c"], n["d"], n["out"], n["output"]}
    assert M.upstream(n["c"]) == {n["c"], n["a"], n["b"], n["x"], n["y"]}
    # stopping at b keeps b but not y; the order is the graph's
    assert M.ancestors(n["c"], stop=[n["b"]]) == [n["x"], n["a"], n["b"], n["c"]]


@pytest.mark.parametrize("target, op", [(operator.iadd, "call_function"), ("add_", "call_method"),
                                        ("aten.add_.Tensor", "call_function")])
def test_fake_value_on_real_examples_leaves_them_unchanged(target, op):
    """A graph recorded by running it carries real tensors as example values: computing a created
    node's value with an in-place target works on copies, not on the graph's own values."""
    import torch

    if target == "aten.add_.Tensor":
        target = torch.ops.aten.add_.Tensor
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    x.meta["example_value"], y.meta["example_value"] = torch.ones(3), torch.full((3,), 2.0)
    node = g.create_node(op, target, (x, y))
    assert M._mutates(node)
    value = M.fake_value(node)
    torch.testing.assert_close(value, torch.full((3,), 3.0))
    torch.testing.assert_close(x.meta["example_value"], torch.ones(3))


def test_fake_value_reads_out_of_place_targets_as_they_are():
    import torch

    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.arange(6.0).reshape(2, 3)
    node = g.call_method("transpose", (x, 0, 1))
    assert not M._mutates(node) and not M._mutates(g.call_function(operator.is_, (x, x)))
    value = M.fake_value(node)
    assert value.shape == (3, 2) and value.data_ptr() == x.meta["example_value"].data_ptr()  # a view, no copy


@pytest.mark.parametrize("index, rank, expected", [
    ((slice(None), 3, None, slice(2, 5)), 3, [(1, "int", 3, 1), (2, "new", None, 2), (2, "slice", (2, 5), 3)]),
    ((Ellipsis, slice(0, 4)), 4, [(3, "slice", (0, 4), 1)]),
    (slice(-3, None), 2, [(0, "slice", (-3, None), None)]),
    ((slice(None), slice(0, None)), 2, []),  # whole slices restrict nothing
    (2, 3, [(0, "int", 2, None)]),
    (slice(None, None, 2), 2, None),  # a step
    ((Ellipsis, 1, Ellipsis), 3, None),
    ((True,), 1, None),
    ([0, 1], 1, None),
])
def test_index_items_read_every_spelling_of_an_index_once(index, rank, expected):
    assert M.index_items(index, rank) == expected


def _recorded(fn, *shapes):
    """fn traced with real example values on its nodes (as a graph recorded by running it)."""
    import torch

    gm = fx.symbolic_trace(fn)
    values = {}
    args = iter(torch.randn(*s) for s in shapes)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            values[n] = next(args)
        elif n.op != "output":
            values[n] = M._call(n, *fx.node.map_arg((n.args, n.kwargs), values.__getitem__))
        n.meta["example_value"] = values.get(n)
    return gm


@pytest.mark.parametrize("fn, expected", [
    (lambda x: x[:, 2:6], ("x", 1, "slice", (2, 6), ("tuple", 1, 1))),
    (lambda x: x[3], ("x", 0, "int", 3, ("arg", 1))),
    (lambda x: x.narrow(1, 4, 3), ("x", 1, "slice", (4, 7), ("arg", 2))),
    (lambda x: x.select(1, 5), ("x", 1, "int", 5, ("arg", 2))),
    (lambda x: x.unbind(1)[2], ("x", 1, "int", 2, ("arg", 1))),
    (lambda x: x.split(3, 1)[2], ("x", 1, "slice", (6, 8), ("arg", 1))),
    (lambda x: x.split([2, 5, 1], 1)[1], ("x", 1, "slice", (2, 7), ("arg", 1))),
])
def test_index_entries_of_each_slicing_node(fn, expected):
    gm = _recorded(fn, (4, 8))
    node = list(gm.graph.nodes)[-2]
    (entry,) = M.index_entries(node)
    assert (entry.base.name, *entry[1:]) == expected


def test_index_entries_refuse_what_they_cannot_read():
    import torch

    gm = _recorded(lambda x, i: x[i.long()], (4, 8), (2,))
    node = list(gm.graph.nodes)[-2]
    assert M.index_entries(node) == []  # a tensor index
    gm = _recorded(lambda x: x[:, ::2], (4, 8))
    assert M.index_entries(list(gm.graph.nodes)[-2]) == []
    assert torch.is_tensor(list(gm.graph.nodes)[-2].meta["example_value"])
