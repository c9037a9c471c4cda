"""What each node does, in the words every later stage uses: fx_match's spelling() of each node
(one name per op as written, in-place kept apart: `masked_fill_`, `iadd`, `getattr.mT`), the op
classes the walks decide by, named by fx_match's kinds where a kind's every spelling belongs to the
class (so a spelling taught to fx_match reaches them) and by spelling where the class tells apart
what a kind merges, and one index of graph order and storage aliasing built per run. Kept apart so
that the loop finder, the region walk and the evaluator read the graph the same way."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from ...compat import concrete_shape
from .. import fx_match as M


# ----------------------------------------------------------------------------------------------
# What each node does

_name = M.spelling
_plain = M.plain
_is_scan = M.is_scan
_mutated_operand = M.mutated_operand

# Ops whose result may share storage with their first operand (for mutation tracking).
_ALIASING = M.spellings("getitem", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "narrow",
                        "contiguous", "split", "cast", "mT") | {
    "select", "flatten", "unflatten", "movedim", "moveaxis", "unbind", "chunk", "detach", "t", "as_strided"}
_LAYOUT = _ALIASING | M.spellings("cat") | {"clone", "repeat_interleave", "pad", "stack"}
_ARITH = M.spellings("add", "sub", "mul", "div", "neg", "exp", "pow", "sum", "cumsum", "where", "masked_fill",
                     "tril", "triu", "matmul", "einsum", "setitem") | {
    "exp2", "log", "sqrt", "rsqrt", "square", "reciprocal", "abs", "mean", "clamp", "clamp_min", "clamp_max",
    "normalize", "norm", "vector_norm", "outer", "invert", "logical_not", "and", "or", "lt", "le", "gt", "ge",
    "eq", "ne", "bool", "maximum", "minimum", "rsub", "diagonal", "diag_embed", "tensordot",
    "linalg_solve_triangular", "solve_triangular", "inverse", "linalg_inv", "copy", "zero", "fill", "isub",
    "imul", "idiv", "floordiv"}
_ABSORB = _LAYOUT | _ARITH
_CREATE = {"zeros", "ones", "empty", "full", "eye", "arange", "tensor", "as_tensor", "scalar_tensor",
           "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
           "new_full", "new_tensor", "linspace", "tril_indices", "triu_indices"}
_RANDOM = M.random_spellings() | {"randint_like", "uniform", "random", "exponential", "native_dropout",
                                  "feature_dropout", "alpha_dropout"}
# Ops whose operands after the first are read for dtype/shape/device only (by spelling: `view`'s
# sizes are operands, `view_as`'s tensor is not).
_META_AFTER_FIRST = {"to", "type_as", "expand_as", "view_as", "reshape_as"}
# Ops that keep a value "a log-gate" on its way to the exp (gate classification).
_GATE_PATH = (_LAYOUT | M.spellings("cumsum", "sub", "add", "neg", "tril", "triu", "masked_fill", "where")
              | {"rsub", "isub"}) - M.spellings("cat") - {"stack"}
_EXP = M.spellings("exp") | {"exp2"}
# Ops allowed between the loop's output and the value the rest of the graph uses (by spelling where
# a kind holds more: `view_as`/`reshape_as` read a second tensor, `x.T` is no mT beyond 2 dims).
_POST = M.spellings("getitem", "transpose", "permute", "unsqueeze", "squeeze", "contiguous", "cast") | {
    "view", "reshape", "flatten", "unflatten", "movedim", "moveaxis", "getattr.mT", "clone"}


# Ops whose integer arguments are positions (the loop variable may appear in them).
_POSITIONAL = {"lt", "le", "gt", "ge", "eq", "ne", "narrow", "select", "arange", "roll"}


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _tensor_example(node: Any) -> torch.Tensor | None:
    ev = _example(node)
    return ev if isinstance(ev, torch.Tensor) else None


def _shape(node: Any) -> tuple[int, ...] | None:
    ev = _tensor_example(node)
    return None if ev is None else concrete_shape(ev)


def _is_erased(node: fx.Node) -> bool:
    return bool(getattr(node, "_erased", False))


def _describe(node: fx.Node) -> str:
    shape = _shape(node)
    what = f"{node.op} {node.target}" if node.op in ("placeholder", "get_attr") else _name(node)
    return f"`{node.name}` ({what}{', shape ' + str(list(shape)) if shape is not None else ''})"


def _data_operands(node: fx.Node) -> list[fx.Node]:
    """Operands whose values (not only metadata) the node reads."""
    name = _plain(_name(node))
    if name in _CREATE:
        return []
    if name in _META_AFTER_FIRST:
        first = node.args[0] if node.args else None
        return [first] if isinstance(first, fx.Node) else []
    return list(node.all_input_nodes)


class _Index:
    """Graph order and storage aliasing, built once per pass run (linear in the graph size)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.pos: dict[fx.Node, float] = {}
        self.base: dict[fx.Node, fx.Node] = {}
        self.mutators: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        self.names: dict[fx.Node, str] = {}
        for i, n in enumerate(graph.nodes):
            self.pos[n] = float(i)
            name = self.names[n] = _name(n)
            target = _mutated_operand(n)
            if target is not None:
                b = self.base.get(target, target)
                self.base[n] = b
                self.mutators[b].append(n)
            elif name in _ALIASING and n.args and isinstance(n.args[0], fx.Node):
                self.base[n] = self.base.get(n.args[0], n.args[0])
            else:
                self.base[n] = n

    def name(self, n: fx.Node) -> str:
        name = self.names.get(n)
        if name is None:
            name = self.names[n] = _name(n)
        return name

    def base_of(self, n: fx.Node) -> fx.Node:
        return self.base.get(n, n)

    def mutators_before(self, n: fx.Node, pos: float) -> list[fx.Node]:
        """In-place writes to n's storage that happen before graph position `pos`."""
        return [m for m in self.mutators.get(self.base_of(n), ()) if self.pos.get(m, math.inf) < pos
                and not _is_erased(m) and m is not n]

    def place(self, new_nodes: list[fx.Node], after: fx.Node) -> None:
        """Positions for nodes inserted after `after` (order stays valid for the old nodes)."""
        p = self.pos[after]
        for i, n in enumerate(new_nodes):
            self.pos[n] = p + (i + 1) / (len(new_nodes) + 1)
            self.base[n] = n
