"""What each node does, in the words every later stage uses: one name per op whatever its spelling
(operator, function, method, in-place), the op classes the walks decide by, and one index of graph
order and storage aliasing built per run. Kept apart so that the loop finder, the region walk and
the evaluator read the graph the same way."""
from __future__ import annotations

import math
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx as fx

from ...compat import concrete_shape, view_attribute


# ----------------------------------------------------------------------------------------------
# What each node does


_OPERATOR_NAMES = {
    operator.getitem: "getitem", operator.setitem: "setitem", operator.add: "add", operator.sub: "sub",
    operator.mul: "mul", operator.truediv: "div", operator.floordiv: "floordiv", operator.neg: "neg",
    operator.pos: "pos", operator.matmul: "matmul", operator.pow: "pow", operator.invert: "invert",
    operator.and_: "and", operator.or_: "or", operator.xor: "xor", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge", operator.eq: "eq", operator.ne: "ne", operator.mod: "mod",
    operator.iadd: "iadd", operator.isub: "isub", operator.imul: "imul", operator.itruediv: "idiv",
    getattr: "getattr",
}
_INPLACE_OPERATORS = {"setitem", "iadd", "isub", "imul", "idiv"}

# Ops whose result may share storage with their first operand (for mutation tracking).
_ALIASING = {"getitem", "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand",
             "expand_as", "select", "narrow", "contiguous", "flatten", "unflatten", "view_as", "reshape_as",
             "movedim", "moveaxis", "swapaxes", "swapdims", "unbind", "split", "chunk", "detach", "t",
             "getattr.mT", "getattr.T", "as_strided", "to", "float", "double", "half", "bfloat16", "type",
             "type_as"}
_LAYOUT = _ALIASING | {"clone", "repeat_interleave", "pad", "stack", "cat"}
_ARITH = {"add", "sub", "mul", "div", "true_divide", "neg", "exp", "exp2", "log", "sqrt", "rsqrt", "pow",
          "square", "reciprocal", "abs", "sum", "mean", "cumsum", "clamp", "clamp_min", "clamp_max", "where",
          "masked_fill", "tril", "triu", "matmul", "bmm", "einsum", "normalize", "norm", "vector_norm", "outer",
          "invert", "logical_not", "and", "or", "lt", "le", "gt", "ge", "eq", "ne", "bool", "maximum",
          "minimum", "rsub", "diagonal", "diag_embed", "tensordot", "linalg_solve_triangular",
          "solve_triangular", "inverse", "linalg_inv", "copy", "zero", "fill", "iadd", "isub", "imul", "idiv",
          "setitem", "floordiv"}
_ABSORB = _LAYOUT | _ARITH
_CREATE = {"zeros", "ones", "empty", "full", "eye", "arange", "tensor", "as_tensor", "scalar_tensor",
           "zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
           "new_full", "new_tensor", "linspace", "tril_indices", "triu_indices"}
_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "dropout",
           "multinomial", "normal", "uniform", "random", "exponential", "native_dropout", "feature_dropout",
           "alpha_dropout"}
# Ops whose operands after the first are read for dtype/shape/device only.
_META_AFTER_FIRST = {"to", "type_as", "expand_as", "view_as", "reshape_as"}
# Ops that keep a value "a log-gate" on its way to the exp (gate classification).
_GATE_PATH = (_LAYOUT | {"cumsum", "sub", "add", "neg", "rsub", "tril", "triu", "masked_fill", "where", "iadd",
                         "isub"}) - {"stack", "cat"}
_EXP = {"exp", "exp2"}
# Ops allowed between the loop's output and the value the rest of the graph uses.
_POST = {"getitem", "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "contiguous", "flatten",
         "unflatten", "movedim", "moveaxis", "swapaxes", "swapdims", "getattr.mT", "to", "float", "double",
         "half", "bfloat16", "type", "type_as", "clone"}


# Ops whose integer arguments are positions (the loop variable may appear in them).
_POSITIONAL = {"lt", "le", "gt", "ge", "eq", "ne", "narrow", "select", "arange", "roll"}


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        attr = view_attribute(node)  # getattr(x, "mT") or, on torch 2.15, aten.mT(x)
        if attr is not None:
            return f"getattr.{attr}"
        target = node.target
        try:
            name = _OPERATOR_NAMES.get(target)
        except TypeError:
            name = None
        if name == "getattr":
            return f"getattr.{node.args[1]}" if len(node.args) > 1 else "getattr"
        if name is not None:
            return name
        if _is_scan(node):
            return "scan"
        return getattr(target, "__name__", str(target))
    return node.op


def _is_scan(node: fx.Node) -> bool:
    return node.op == "call_function" and type(node.target).__name__ == "ScanOp"


def _plain(name: str) -> str:
    """In-place spelling -> out-of-place spelling (masked_fill_ -> masked_fill)."""
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def _mutated_operand(node: fx.Node) -> fx.Node | None:
    """The node an in-place op writes (setitem, +=, x.masked_fill_(...)), or None."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = _name(node)
    inplace = name in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("_")
                                             and name not in ("and_", "or_"))
    if inplace and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


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
