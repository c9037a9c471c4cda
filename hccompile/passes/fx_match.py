"""Helpers for matching on Dynamo (torch-IR) graphs, where one operation has many spellings:
`a @ b`, `torch.matmul(a, b)`, `a.matmul(b)`; `torch.tril(x)`, `x.tril()`; and so on. Also what
every pass shares to refuse a candidate (Refusal) and to prove a match by probe (probe_tolerance,
rel_rms_error, evaluate)."""
from __future__ import annotations

import operator
from collections import ChainMap, deque
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torch.fx as fx

from ..compat import size_hint, view_attribute

# canonical op name -> (call_function targets, call_method names)
_SPELLINGS: dict[str, tuple[tuple[Any, ...], tuple[str, ...]]] = {
    "matmul": ((operator.matmul, torch.matmul, torch.bmm), ("matmul", "bmm", "__matmul__")),
    "einsum": ((torch.einsum, torch.functional.einsum), ()),
    "transpose": ((torch.transpose, torch.swapaxes, torch.swapdims), ("transpose", "swapaxes", "swapdims")),
    "permute": ((torch.permute,), ("permute",)),
    "tril": ((torch.tril,), ("tril",)),
    "triu": ((torch.triu,), ("triu",)),
    "masked_fill": ((torch.masked_fill,), ("masked_fill",)),
    "where": ((torch.where,), ("where",)),
    "mul": ((operator.mul, torch.mul, torch.multiply), ("mul", "multiply", "__mul__")),
    "div": ((operator.truediv, torch.div, torch.true_divide), ("div", "divide", "true_divide", "__truediv__")),
    "softmax": ((torch.softmax, torch.nn.functional.softmax, torch.log_softmax,
                 torch.nn.functional.log_softmax), ("softmax", "log_softmax")),
    "cast": ((), ("float", "to", "type_as", "half", "bfloat16", "double", "type")),
    "contiguous": ((), ("contiguous",)),
    "getattr": ((getattr,), ()),
    # Arithmetic and reductions; an in-place add is an add here (is_impure reports the mutation).
    "exp": ((torch.exp,), ("exp",)),
    "pow": ((torch.pow, operator.pow), ("pow", "__pow__")),
    "neg": ((torch.neg, torch.negative, operator.neg), ("neg", "negative", "__neg__")),
    "add": ((operator.add, torch.add, operator.iadd), ("add", "__add__", "add_")),
    "sub": ((operator.sub, torch.sub, torch.subtract), ("sub", "subtract", "__sub__")),
    "cumsum": ((torch.cumsum,), ("cumsum",)),
    "sum": ((torch.sum,), ("sum",)),
    "nan_to_num": ((torch.nan_to_num,), ("nan_to_num",)),
    # Shapes: joining, indexing, splitting, reshaping, broadcasting.
    "cat": ((torch.cat, torch.concat, torch.concatenate), ()),
    "setitem": ((operator.setitem,), ()),
    "getitem": ((operator.getitem,), ()),
    "unsqueeze": ((torch.unsqueeze,), ("unsqueeze",)),
    "squeeze": ((torch.squeeze,), ("squeeze",)),
    "narrow": ((torch.narrow,), ("narrow",)),
    "split": ((torch.split,), ("split",)),
    "reshape": ((torch.reshape,), ("view", "reshape", "view_as", "reshape_as")),
    "expand": ((), ("expand", "expand_as")),
}

# A view attribute (getattr(x, "mT"), on torch 2.15 aten.mT(x)) by kind: x.T is read as x.mT.
_ATTRIBUTE_SPELLINGS: dict[str, tuple[str, ...]] = {"mT": ("mT", "T")}

# Python's in-place operators (`a += b`, ...) -> the operator they update with. Each writes its
# first operand (mutated_operand); kind() knows only iadd, as an add.
_INPLACE_OPERATORS: dict[Any, Any] = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
    operator.irshift: operator.rshift,
}

_FN_TO_KIND: dict[Any, str] = {}
_METHOD_TO_KIND: dict[str, str] = {}
for _kind, (_fns, _methods) in _SPELLINGS.items():
    for _f in _fns:
        _FN_TO_KIND[_f] = _kind
    for _m in _methods:
        _METHOD_TO_KIND[_m] = _kind

_RANDOM_TARGETS = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
                   torch.bernoulli, torch.nn.functional.dropout, torch.dropout, torch.multinomial,
                   torch.normal}


class Refusal(Exception):
    """A candidate is not lowered; the message is the reason the pass's report gives."""


def probe_tolerance(dtype: torch.dtype, config: Any) -> float:
    """The relative RMS error a pass's probe accepts between a replacement and the region it
    replaces, computed in `dtype`: 1e-4 in float32/float64 (the same math in another order), the
    configured `probe_tolerance` in half precision (rounding of intermediates differs)."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else config.probe_tolerance


def kind(node: Any) -> str | None:
    """Canonical name of what `node` computes, or None for anything we do not model."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        if view_attribute(node) in _ATTRIBUTE_SPELLINGS["mT"]:  # getattr(x, "mT") or, on torch 2.15, aten.mT(x)
            return "mT"
        return _FN_TO_KIND.get(node.target)
    if node.op == "call_method":
        return _METHOD_TO_KIND.get(node.target)
    return None


def spelling(node: fx.Node) -> str:
    """The name `node`'s op is written with, where kind() would merge spellings a pass tells apart:
    a method by its name as called (`masked_fill_` stays in-place, `view_as` stays apart from
    `view`); a function by its `__name__` (`bmm`, `true_divide`); a Python operator by its kind
    (`a / b` is `div`, `a & b` is `and`), an in-place one with an `i` before it (`a += b` is
    `iadd`, `a /= b` is `idiv`); an attribute as `getattr.<name>` (`getattr.mT`, `getattr.shape`);
    a higher-order scan as `scan`; any other node by its op (`placeholder`, `output`...)."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return node.op
    attr = view_attribute(node)  # getattr(x, "mT") or, on torch 2.15, aten.mT(x)
    if attr is not None:
        return f"getattr.{attr}"
    if node.target is getattr:
        return f"getattr.{node.args[1]}" if len(node.args) > 1 else "getattr"
    if is_scan(node):
        return "scan"
    return _function_spelling(node.target)


def _function_spelling(target: Any) -> str:
    if getattr(target, "__module__", None) == "_operator":  # operator.add, operator.iadd, ...
        if target in _INPLACE_OPERATORS:
            return "i" + _function_spelling(_INPLACE_OPERATORS[target])
        if target in _FN_TO_KIND:
            return _FN_TO_KIND[target]
        return target.__name__.rstrip("_")  # and_ -> and: Python's keyword, not an in-place op
    if target is getattr:
        return "getattr"
    return getattr(target, "__name__", str(target))


def spellings(*kinds: str) -> frozenset[str]:
    """Every spelling() of the ops of these kinds (`spellings("transpose")`: transpose, swapaxes,
    swapdims), for a pass that decides by spelling: named by kind, its op classes learn a spelling
    taught to the table above."""
    out: set[str] = set()
    for k in kinds:
        if k in _ATTRIBUTE_SPELLINGS:
            out.update(f"getattr.{a}" for a in _ATTRIBUTE_SPELLINGS[k])
            continue
        fns, methods = _SPELLINGS[k]
        out.update(_function_spelling(f) for f in fns)
        out.update(methods)
    return frozenset(out)


def plain(name: str) -> str:
    """A spelling's out-of-place form (masked_fill_ -> masked_fill); Python's in-place operators
    keep theirs (iadd)."""
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def mutated_operand(node: fx.Node) -> fx.Node | None:
    """The node an in-place op writes (`x[i] = v`, `x += y`, `x.masked_fill_(...)`), or None."""
    if node.op == "call_function" and getattr(node.target, "__module__", None) == "_operator":
        inplace = node.target is operator.setitem or node.target in _INPLACE_OPERATORS
    elif node.op == "call_function" and node.target is getattr:
        inplace = False  # reading x.add_ calls nothing
    elif node.op in ("call_function", "call_method"):
        name = spelling(node)
        inplace = name.endswith("_") and not name.startswith("_")
    else:
        return None
    if inplace and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def is_scan(node: fx.Node) -> bool:
    """A call of torch's higher-order scan."""
    return node.op == "call_function" and type(node.target).__name__ == "ScanOp"


def random_spellings() -> frozenset[str]:
    """spelling() of the random functions is_impure() refuses."""
    return frozenset(_function_spelling(f) for f in _RANDOM_TARGETS)


def describe(node: Any) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {node.target}"


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def scalar(value: Any) -> float | None:
    """A compile-time Python number (not a SymFloat, not a tensor)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def ndim(node: Any) -> int | None:
    ev = example(node)
    return ev.dim() if isinstance(ev, torch.Tensor) else None


class IndexEntry(NamedTuple):
    """One restricting entry of a slicing node: `base`'s `axis` taken at one position ("int": `value`
    the int) or over an interval ("slice": `value` (start, stop), unit step, int or None bounds);
    "new" is a None (a new axis, `axis` the base's axis it precedes). `mask` says where the entry sits in
    the node's args, for comparing nodes that differ only in it: ("tuple", arg, position) or ("arg", arg)."""
    base: fx.Node
    axis: int
    kind: str
    value: Any
    mask: tuple


def index_items(index: Any, rank: int) -> list[tuple[int, str, Any, int | None]] | None:
    """(axis, kind, value, position in the index tuple or None) for each restricting entry of a
    getitem / setitem `index` on a tensor of `rank` dims (kinds as IndexEntry's; whole slices are no
    entries); None where an entry is anything else (a tensor, a node, a bool, a list, a step, a
    symbolic bound) or Ellipsis appears twice. The one reading of "an index" the passes share."""
    entries = index if isinstance(index, tuple) else (index,)
    if sum(e is Ellipsis for e in entries) > 1:
        return None
    consuming = sum(e is not None and e is not Ellipsis for e in entries)
    axis, out = 0, []
    for position, e in enumerate(entries):
        where = position if isinstance(index, tuple) else None
        if e is None:
            out.append((axis, "new", None, where))
        elif e is Ellipsis:
            axis += rank - consuming
        elif isinstance(e, int) and not isinstance(e, bool):
            out.append((axis, "int", e, where))
            axis += 1
        elif isinstance(e, slice):
            if not all(b is None or (isinstance(b, int) and not isinstance(b, bool)) for b in (e.start, e.stop)) \
                    or e.step not in (None, 1):
                return None
            if not (e.start in (None, 0) and e.stop is None):
                out.append((axis, "slice", (e.start, e.stop), where))
            axis += 1
        else:
            return None
    return out


def index_entries(node: fx.Node) -> list[IndexEntry]:
    """The restricting entries of a slicing node: x[...] on a tensor, a piece of unbind or split,
    select, narrow ([] for any other node, and for an index index_items cannot read)."""
    name = spelling(node)
    if name == "getitem" and len(node.args) == 2 and isinstance(node.args[0], fx.Node):
        x, index = node.args
        ev = example(x)
        if isinstance(ev, torch.Tensor):
            items = index_items(index, ev.dim())
            return [IndexEntry(x, axis, kind, value, ("arg", 1) if where is None else ("tuple", 1, where))
                    for axis, kind, value, where in items or ()]
        source = x.args[0] if x.args and isinstance(x.args[0], fx.Node) else None
        if source is None or not isinstance(index, int) or isinstance(index, bool):
            return []
        if spelling(x) == "unbind":
            return [IndexEntry(source, arg(x, 1, "dim", 0), "int", index, ("arg", 1))]
        if spelling(x) == "split":
            return _split_piece(x, source, index)
        return []
    if name == "select" and len(node.args) == 3 and isinstance(node.args[0], fx.Node) and \
            all(isinstance(a, int) and not isinstance(a, bool) for a in node.args[1:]):
        return [IndexEntry(node.args[0], node.args[1], "int", node.args[2], ("arg", 2))]
    if name == "narrow" and isinstance(node.args[0], fx.Node):
        dim, start, length = (arg(node, i, key) for i, key in ((1, "dim"), (2, "start"), (3, "length")))
        if all(isinstance(a, int) and not isinstance(a, bool) for a in (dim, start, length)) and len(node.args) == 4:
            return [IndexEntry(node.args[0], dim, "slice", (start, start + length), ("arg", 2))]
    return []


def _split_piece(split: fx.Node, source: fx.Node, index: int) -> list[IndexEntry]:
    """Piece `index` of split(source, size or sizes, dim) as a slice of `source`."""
    size = arg(split, 1, "split_size_or_sections" if split.op == "call_function" else "split_size")
    dim = arg(split, 2, "dim", 0)
    ev = example(source)
    if not isinstance(ev, torch.Tensor) or not isinstance(dim, int) or isinstance(dim, bool):
        return []
    length = size_hint(ev.shape[dim % ev.dim()])
    if isinstance(size, int) and not isinstance(size, bool):
        start = index * size
        stop = min(start + size, length)
    elif isinstance(size, (list, tuple)) and all(isinstance(s, int) for s in size):
        start, stop = sum(size[:index]), sum(size[:index + 1])
    else:
        return []
    return [IndexEntry(source, dim, "slice", (start, stop), ("arg", 1))]


def permutation_of(node: fx.Node) -> tuple[fx.Node, list[int]] | None:
    """If `node` is a pure dim permutation of its input, return (input, perm) with
    node.dim(i) == input.dim(perm[i])."""
    k = kind(node)
    n = ndim(node)
    if n is None:
        return None
    if k == "transpose":
        src = node.args[0]
        d0, d1 = arg(node, 1, "dim0"), arg(node, 2, "dim1")
        if not isinstance(d0, int) or not isinstance(d1, int):
            return None
        d0, d1 = d0 % n, d1 % n
        perm = list(range(n))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return src, perm
    if k == "mT":
        perm = list(range(n))
        perm[-1], perm[-2] = perm[-2], perm[-1]
        return node.args[0], perm
    if k == "permute":
        dims = node.args[1:] if node.op == "call_method" else (arg(node, 1, "dims"),)
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = tuple(dims[0])
        if len(dims) != n or not all(isinstance(d, int) for d in dims):
            return None
        return node.args[0], [d % n for d in dims]
    return None


def walk(start: fx.Node | Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]], *,
         skip: Callable[[fx.Node], bool] | None = None, stop: Callable[[fx.Node], bool] | None = None,
         max_depth: int | None = None, depth_first: bool = False) -> Iterator[fx.Node]:
    """Each node reachable from `start` (a node or several) by `step`, once, in the order reached:
    breadth-first (nearest first), or with `depth_first` as a stack takes them (the last pushed).

    Every pass walks the graph to find a region, a producer or a reader; written once, each walk's
    bounds read as arguments rather than as one more copy of the loop to be checked by eye.
    step(node): the nodes one step on (`inputs`, `users`, or a filter of them).
    skip(node) true: the walk neither yields the node nor goes past it (outside the region).
    stop(node) true: the walk yields the node but goes no further (a border node, e.g. an input).
    max_depth: the most steps from a start (breadth-first, so a node's fewest)."""
    if depth_first and max_depth is not None:
        raise ValueError("max_depth counts the fewest steps, which only a breadth-first walk knows")
    todo = deque([(start, 0)] if isinstance(start, fx.Node) else [(n, 0) for n in start])
    take = todo.pop if depth_first else todo.popleft
    seen: set[fx.Node] = set()
    while todo:
        node, depth = take()
        if node in seen or (max_depth is not None and depth > max_depth) or (skip is not None and skip(node)):
            continue
        seen.add(node)
        yield node
        if stop is None or not stop(node):
            todo.extend((nxt, depth + 1) for nxt in step(node))


def inputs(node: fx.Node) -> list[fx.Node]:
    """walk()'s step towards the graph's inputs."""
    return node.all_input_nodes


def users(node: fx.Node) -> Iterable[fx.Node]:
    """walk()'s step towards the graph's output."""
    return node.users


def downstream(node: fx.Node) -> set[fx.Node]:
    """`node` and every node that uses its value, transitively."""
    return set(walk(node, users))


def upstream(node: fx.Node) -> set[fx.Node]:
    """`node` and every node its value depends on, transitively (ancestors(), unordered and
    without stops)."""
    return set(walk(node, inputs))


def ancestors(node: fx.Node, stop: Iterable[fx.Node] = ()) -> list[fx.Node]:
    """Nodes `node` depends on, stopping at (and excluding the inputs of) `stop`, in graph order."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(walk(node, inputs, stop=set(stop).__contains__), key=order.__getitem__)


def is_impure(node: fx.Node) -> str | None:
    """Why evaluating this node at compile time would be wrong (randomness, mutation), or None."""
    if node.op == "call_function":
        if node.target in _RANDOM_TARGETS:
            return f"random op {describe(node)}"
        name = getattr(node.target, "__name__", "")
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            return f"mutating op {name}"
        # operator.and_ / or_ are Python's & and |, not in-place tensor ops.
        if name.endswith("_") and not name.startswith("_") and getattr(node.target, "__module__", "") != "_operator":
            return f"in-place op {name}"
    if node.op == "call_method":
        if node.target.endswith("_") and not node.target.startswith("_"):
            return f"in-place method .{node.target}()"
        if node.target in ("dropout", "bernoulli", "random_", "uniform_", "normal_"):
            return f"random method .{node.target}()"
    if node.op == "call_module":
        return "module call"
    return None


def attribute(gm: fx.GraphModule, target: str) -> Any:
    """The object a get_attr node names (a dotted path under gm)."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def run_node(gm: fx.GraphModule, n: fx.Node, value_of: Callable[[fx.Node], Any],
             example_inputs: list[Any] | None = None, placeholders: list[fx.Node] | None = None) -> Any:
    """One node's value at compile time, the step every evaluator of the passes shares: a call's
    from its arguments' values (`value_of`), an attribute's from gm, a placeholder's from the real
    example inputs (a SymInt at its hint; fake tensors refused: there is nothing to run on)."""
    if n.op == "call_function":
        return n.target(*fx.node.map_arg(n.args, value_of), **fx.node.map_arg(n.kwargs, value_of))
    if n.op == "call_method":
        self_arg, *rest = fx.node.map_arg(n.args, value_of)
        return getattr(self_arg, n.target)(*rest, **fx.node.map_arg(n.kwargs, value_of))
    if n.op == "get_attr":
        return attribute(gm, n.target)
    if n.op == "placeholder" and example_inputs is not None:
        if placeholders is None:
            placeholders = [p for p in gm.graph.nodes if p.op == "placeholder"]
        value = example_inputs[placeholders.index(n)]
        if isinstance(value, torch.SymInt):
            return size_hint(value)
        if isinstance(value, torch.Tensor) and _is_fake(value):
            raise ValueError("example inputs are fake tensors; cannot probe")
        return value
    raise ValueError(f"cannot evaluate {n.op} node {n.name}")


class Evaluator:
    """Node values at compile time, the one evaluator of the passes: each node computed once
    (`env`), in the order given, by run_node. What differs between passes is a policy, passed in:
    `admit(node)` raises ValueError for a node the caller will not run (random work, an in-place
    write it does not allow); `outside(node)` gives the value of a node not to be run (a stand-in),
    or NotImplemented to run it; `known` is read through and never written (another evaluation's
    memo: values computed here stay here)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any] | None = None, *,
                 admit: Callable[[fx.Node], None] | None = None,
                 outside: Callable[[fx.Node], Any] | None = None,
                 known: dict[fx.Node, Any] | None = None,
                 placeholders: list[fx.Node] | None = None):
        self.gm, self.example_inputs = gm, example_inputs
        self.admit, self.outside = admit, outside
        self.placeholders = placeholders
        self.env: Any = ChainMap({}, known) if known is not None else {}

    def run(self, needed: Iterable[fx.Node]) -> None:
        """Values for `needed` (in an order where a node follows what it reads) not known yet."""
        for n in needed:
            if n in self.env:
                continue
            if self.outside is not None:
                value = self.outside(n)
                if value is not NotImplemented:
                    self.env[n] = value
                    continue
            if self.admit is not None:
                self.admit(n)
            if self.placeholders is None and n.op == "placeholder":
                self.placeholders = [p for p in self.gm.graph.nodes if p.op == "placeholder"]
            self.env[n] = run_node(self.gm, n, self.env.__getitem__, self.example_inputs, self.placeholders)

    def values(self, wanted: Iterable[fx.Node]) -> list[Any]:
        return [self.env[w] for w in wanted]


def refuse_impure(n: fx.Node) -> None:
    """Evaluator's `admit` for probes: no random or mutating work."""
    why = is_impure(n)
    if why:
        raise ValueError(f"probe region contains a {why}")


def evaluate(gm: fx.GraphModule, wanted: list[fx.Node], overrides: dict[fx.Node, Any],
             example_inputs: list[Any], max_nodes: int = 256) -> list[Any]:
    """Evaluate only what `wanted` needs, with `overrides` standing in for some nodes and the real
    example inputs for placeholders. Refuses (ValueError) random or mutating work."""
    needed: list[fx.Node] = []
    seen: set[fx.Node] = set()
    for w in wanted:
        for n in ancestors(w, stop=overrides):
            if n not in seen:
                seen.add(n)
                needed.append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    needed.sort(key=order.__getitem__)
    if len(needed) > max_nodes:
        raise ValueError(f"probe region has {len(needed)} nodes (limit {max_nodes})")
    evaluator = Evaluator(gm, example_inputs, admit=refuse_impure)
    evaluator.env.update(overrides)
    evaluator.run(needed)
    return evaluator.values(wanted)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def rel_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num / denom if denom > 0 else (0.0 if num == 0 else float("inf"))


# Method and function spellings by what they do to a tensor, for the walks that look through layout:
# a reshape keeps the values in row-major order under another shape; a permute reorders dims; a cast
# keeps the values at another precision.
RESHAPE_METHODS = frozenset({"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as",
                             "reshape_as"})
RESHAPE_FUNCTIONS = frozenset({torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze,
                               torch.Tensor.view})
PERMUTE_METHODS = frozenset({"permute", "transpose"})
PERMUTE_FUNCTIONS = frozenset({torch.permute, torch.transpose})
CAST_METHODS = frozenset({"float", "to", "type_as", "half", "bfloat16", "double"})
# Layout without a change of values: reshapes, permutes, casts and a copy into contiguous memory.
LAYOUT_METHODS = RESHAPE_METHODS | PERMUTE_METHODS | CAST_METHODS | {"contiguous"}
LAYOUT_FUNCTIONS = RESHAPE_FUNCTIONS | PERMUTE_FUNCTIONS


# Ops whose result aliases their first argument's storage (a view), in Dynamo-graph spellings.
_VIEW_METHODS = {"view", "reshape", "permute", "transpose", "unsqueeze", "squeeze", "flatten",
                 "unflatten", "expand", "contiguous", "t", "view_as", "reshape_as", "swapaxes",
                 "swapdims", "movedim", "narrow", "select", "unfold"}
_VIEW_FUNCTIONS = {torch.reshape, torch.permute, torch.transpose, torch.unsqueeze, torch.squeeze,
                   torch.flatten, torch.swapaxes, torch.swapdims, torch.movedim, torch.narrow,
                   torch.select, torch.t}


def is_view(node: Any) -> bool:
    """Whether an FX node of the Dynamo graph makes a view of its first argument (reshape too:
    it is one whenever the strides allow, which is where it matters)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op == "call_function":
        if view_attribute(node) is not None:
            return True
        if node.target is operator.getitem:
            return isinstance(example(node.args[0]), torch.Tensor)
        return node.target in _VIEW_FUNCTIONS
    return False


def view_chain(node: Any) -> list[fx.Node]:
    """The views `node` is made of, from `node` back to (not including) the first value that is not
    a view (a computed tensor or a graph input)."""
    chain = []
    while is_view(node):
        chain.append(node)
        node = node.args[0]
    return chain


def _detached(t: Any) -> Any:
    # not t itself: a saved output kept with its grad_fn is a cycle through C++ that gc cannot
    # free when no backward runs (pytorch#189025), and no backward runs on these fake values
    return t.detach()


def _same(t: Any) -> Any:
    return t


def fake_value(node: fx.Node, fake_mode: Any = None) -> Any:
    """Example value for a node a pass created, computed in the fake mode of its own inputs (Dynamo
    graphs can hold values of more than one fake mode, e.g. for lifted parameters; not
    detect_fake_mode(), which prefers the tracing context's mode); `fake_mode` when no input has one.
    Where the inputs' example values are real tensors and Python ints (a graph recorded by running
    it, as tests and tools build them), on those tensors, without autograd; None where neither.
    The Python dispatcher is on, as while Dynamo traces: without it some ops' C++ meta functions
    read symbolic sizes as ints and pin them (constant_pad_nd guarded T == 21). Saved-tensor hooks of
    our own (detaching, storing nothing) shadow any the user has active around the compile: an op with autograd saves its fake
    inputs, and a user's pack hook (e.g. one reading data_ptr()) failed on them, undoing the pass."""
    args = fx.node.map_arg(node.args, lambda n: n.meta.get("example_value"))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("example_value"))
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    flat = [a for a in leaves if isinstance(a, torch.Tensor)]
    mode = next((a.fake_mode for a in flat if hasattr(a, "fake_mode")), None) or fake_mode
    if mode is None:
        if not flat or not all(isinstance(v, (torch.Tensor, int)) for v in leaves):
            return None
        if _mutates(node):
            # real example values are the graph's own: an in-place target works on copies
            args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
        with torch.no_grad():
            return _call(node, args, kwargs)
    from torch._dispatch.python import enable_python_dispatcher

    with mode, enable_python_dispatcher(), torch.autograd.graph.saved_tensors_hooks(_detached, _same):
        return _call(node, args, kwargs)


def _mutates(node: fx.Node) -> bool:
    """Whether `node`'s target may write an input: a mutable aten schema, an in-place method or
    function (`add_`), an in-place operator (`operator.iadd`), or an `out=` argument."""
    target = node.target
    if "out" in node.kwargs:
        return True
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = getattr(target, "default", target)
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if getattr(target, "__module__", None) == "_operator":
        return name in _IN_PLACE_OPERATORS
    return name.endswith("_") and not name.startswith("__")


_IN_PLACE_OPERATORS = frozenset(f"i{name}" for name in (
    "add", "and", "concat", "floordiv", "lshift", "matmul", "mod", "mul", "or", "pow", "rshift", "sub", "truediv",
    "xor"))


def _call(node: fx.Node, args: Any, kwargs: Any) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    self_arg, *rest = args
    return getattr(self_arg, node.target)(*rest, **kwargs)
