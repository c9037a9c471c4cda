"""Lower the (gated) delta rule written in plain PyTorch to `hccompile::chunk_delta_rule`.

Per value head, with state S in R^{K x V}: S_t = D_t S_{t-1} + beta_t k_t (v_t - (D_t S_{t-1})^T k_t)^T,
o_t = scale S_t^T q_t, where D_t = 1 (delta rule), exp(g_t) (GDN, one log-gate per head) or
diag(exp(g_t)) (KDA, one per key channel).

Recognised forms (each in [B, T, H, D], [B, H, T, D] or any layout whose non-time, non-feature axes
are the state's batch axes in order):

* a token-by-token loop (`for t in range(T)`), which Dynamo unrolls into T copies of one step;
* the chunked form that model libraries ship: intra-chunk machinery over the whole sequence
  (padding, cumulative gates, the masked k·kᵀ matrix and its forward-substitution loop), then a loop
  over chunks carrying the state;
* one `torch._higher_order_ops.scan` over time whose step function is the recurrence.

How, without knowing the spelling:

1. Loops. Tensors indexed at every position 0..L-1 of one axis, in increasing order through the
   graph, are sliced sequences; sequences with the same count whose slices interleave form one loop.
   Iteration j is the run of nodes from the first slice of step j to the first slice of step j+1.
   Every iteration must be the same graph as the next (a structural signature with the step index
   masked, linear in the graph size); the one value an iteration hands to the next is the state, the
   one value it writes out (a buffer slot or an element of a later stack/cat) is the output.
2. Region and inputs. From what the loop reads, walk back through the recurrence's own machinery
   (layout, casts, padding, cumsum, products, exp, masks, l2 norms, mutation of loop-local buffers)
   and stop at tensors shaped like the op's inputs: per-token tensors whose other axes are the
   state's batch axes (q, k, v, beta, g) and one state-shaped tensor (h0). Anything else that the
   loop reads (a parameter, a per-head decay) refuses the region. Roles come from use: the per-token
   input that reaches an exp is the gate; the per-token input of value width is v.
3. Proof. The region is evaluated at compile time on random inputs shaped for their roles and
   compared with the op's math (its plain-PyTorch reference, float64): the first iteration from the
   initial state, the last one from a random state (which also checks padding and the last chunk),
   the final state, and the output after the loop's assembly, where random values stand in for
   the outputs of the iterations in between (step 2 proved those compute what the checked ones do;
   the assembly must put each value where the op's output has it). The scale is fitted, l2
   normalisation and the role assignments that shapes leave open are tried; the probe runs a fixed
   number of iterations, whatever the sequence length. A mismatch is a refusal.
4. Rewrite. One op call after the last input, the layout permutes, the region erased.

Near-misses (another update rule, a sign flip, a gate without exp, a non-causal chunk, a loop over
time backwards, a state decay that is not exp of a per-token input) are refused with the reason.
"""
from __future__ import annotations

import heapq
import math
import operator
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import permutations
from typing import Any

import torch
import torch.fx as fx

from ..compat import concrete_shape, size_hint, view_attribute
from ..lowering.delta_rule import keeps_intermediates
from . import fx_match as M
from .fx_match import Refusal, probe_tolerance
from .base import GraphPass, PassContext, register_pass, unrolled_loop_note

PATTERN = "delta_rule"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
OP_CHUNK_SIZE = 64
# Iterations evaluated in full by the probe from the initial state (the last one is evaluated from a
# random state, which checks what the state feeds into the step).
PROBE_HEAD_STEPS = 1
# Scan steps run by the probe (every scan step runs the same body).
PROBE_SCAN_STEPS = 2
# Nodes an iteration may compute for the next one before reading its slices (S = S.clone() ...).
MAX_ROTATION = 8
# Probe references shorter than this run the token loop (faster for short inputs).
NAIVE_REFERENCE_TOKENS = 256
# Forward walks that classify an input stop after this many nodes.
GATE_WALK_LIMIT = 512


class NotARecurrence(Exception):
    """A loop that carries no state: not a candidate at all (recorded as a note)."""


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


# ----------------------------------------------------------------------------------------------
# Loops: sliced sequences, iterations, state, output


@dataclass
class _Slice:
    node: fx.Node
    step: int
    mask: tuple  # how to hide the step index in the node's args: ("tuple", arg, pos) or ("arg", arg)


@dataclass
class _Family:
    base: fx.Node
    axis: int
    steps: int
    reverse: bool
    slices: list[_Slice]
    first: float
    last: float


def _index_entries(idx: _Index, node: fx.Node) -> list[tuple[fx.Node, int, str, Any, tuple]]:
    """(base, axis, kind, value, mask) for each integer or interval index in a slicing node."""
    name = idx.name(node)
    if name == "getitem" and len(node.args) == 2 and isinstance(node.args[0], fx.Node):
        x, index = node.args
        ev = _example(x)
        if isinstance(ev, torch.Tensor):
            entries = index if isinstance(index, tuple) else (index,)
            consuming = 0
            for e in entries:
                if isinstance(e, fx.Node) or isinstance(e, bool) or (isinstance(e, (list, torch.Tensor))):
                    return []
                if e is not None and e is not Ellipsis:
                    consuming += 1
            axis, out = 0, []
            for p, e in enumerate(entries):
                if e is None:
                    continue
                if e is Ellipsis:
                    axis += ev.dim() - consuming
                    continue
                mask = ("tuple", 1, p) if isinstance(index, tuple) else ("arg", 1)
                if isinstance(e, int):
                    out.append((x, axis, "int", e, mask))
                elif isinstance(e, slice):
                    if all(s is None or isinstance(s, int) for s in (e.start, e.stop, e.step)) and \
                            e.step in (None, 1) and not (e.start in (None, 0) and e.stop is None):
                        out.append((x, axis, "slice", (e.start, e.stop), mask))
                axis += 1
            return out
        src = x
        if idx.name(src) == "unbind" and isinstance(index, int) and src.args and isinstance(src.args[0], fx.Node):
            dim = src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)
            return [(src.args[0], dim, "int", index, ("arg", 1))]
        return []
    if name == "select" and len(node.args) == 3 and isinstance(node.args[0], fx.Node) and \
            isinstance(node.args[1], int) and isinstance(node.args[2], int):
        return [(node.args[0], node.args[1], "int", node.args[2], ("arg", 2))]
    return []


def _find_families(idx: _Index) -> list[_Family]:
    groups: dict[tuple, list[tuple[float, Any, fx.Node, tuple]]] = defaultdict(list)
    for n in idx.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        for base, axis, kind, value, mask in _index_entries(idx, n):
            shape = _shape(base)
            if shape is None:
                continue
            axis = axis % len(shape) if len(shape) else axis
            groups[(base, axis, kind)].append((idx.pos[n], value, n, mask))
    families = []
    for (base, axis, kind), entries in groups.items():
        length = _shape(base)[axis]
        if length < 2:
            continue
        entries.sort(key=lambda e: e[0])
        if kind == "int":
            steps = [v + length if v < 0 else v for _, v, _, _ in entries]
            if set(steps) != set(range(length)):
                continue
            count = length
        else:
            spans = []
            for _, (start, stop), _, _ in entries:
                start = 0 if start is None else (start + length if start < 0 else start)
                stop = length if stop is None else (stop + length if stop < 0 else min(stop, length))
                spans.append((start, stop))
            width = min(b - a for a, b in spans) if spans else 0
            distinct = sorted(set(spans))
            if width < 1 or distinct[0][0] != 0 or distinct[-1][1] != length:
                continue
            width = distinct[0][1] - distinct[0][0]
            if any(a != i * width or b != min((i + 1) * width, length) for i, (a, b) in enumerate(distinct)):
                continue
            steps = [a // width for a, _ in spans]
            count = len(distinct)
            if count < 2:
                continue
        forward = all(a <= b for a, b in zip(steps, steps[1:]))
        backward = all(a >= b for a, b in zip(steps, steps[1:]))
        if not (forward or backward):
            continue  # an inner loop nested in another one: part of that loop's iterations
        slices = [_Slice(n, s, mask) for (_, _, n, mask), s in zip(entries, steps)]
        families.append(_Family(base, axis, count, not forward, slices, entries[0][0], entries[-1][0]))
    return families


@dataclass
class _Loop:
    kind: str  # "unrolled" or "scan"
    anchor: fx.Node
    steps: int
    families: list[_Family] = field(default_factory=list)
    reverse: bool = False
    # unrolled: the iterations, each a list of nodes of the same length
    iterations: list[list[fx.Node]] = field(default_factory=list)
    state_index: int = -1
    output_index: int = -1
    init: fx.Node | None = None
    end: float = 0.0  # position after the last iteration
    mode: str = ""  # "buffer" (setitem into a tensor) or "collect" (stack/cat after the loop)
    buffer: fx.Node | None = None
    # scan
    scan: fx.Node | None = None
    body: fx.GraphModule | None = None
    scan_inputs: tuple = ()
    # the loop's outputs as the rest of the graph sees them
    post: list[fx.Node] = field(default_factory=list)  # assembly after the loop, ending at `out`
    out: fx.Node | None = None
    out_users: list[fx.Node] = field(default_factory=list)
    final: fx.Node | None = None  # node whose outside users receive the final state
    final_users: list[fx.Node] = field(default_factory=list)
    externals: list[fx.Node] = field(default_factory=list)  # what the loop reads from before it
    nodes: set = field(default_factory=set)  # the loop's own nodes (iterations + assembly)

    states: list[fx.Node] = field(default_factory=list)  # unrolled: the state after each step
    outputs: list[fx.Node] = field(default_factory=list)  # unrolled: each step's output


def _group_loops(families: list[_Family], idx: _Index) -> list[_Loop]:
    """Sequences with the same step count whose slices interleave are read by one loop."""
    families = sorted(families, key=lambda f: f.first)
    loops: list[_Loop] = []
    current: list[_Family] = []

    def close():
        if current:
            anchor = min((s for f in current for s in f.slices), key=lambda s: idx.pos[s.node]).node
            loops.append(_Loop("unrolled", anchor, current[0].steps, list(current),
                               reverse=any(f.reverse for f in current)))

    start = end = -1.0
    for f in families:
        if current and f.steps == current[0].steps and f.first <= end and idx.pos[f.base] < start:
            current.append(f)
            end = max(end, f.last)
            continue
        if current and f.first <= end:
            continue  # a sequence first sliced inside the current loop: an inner loop of its body
        close()
        current, start, end = [f], f.first, f.last
    close()
    return loops


def _mask_args(args: tuple, mask: tuple) -> tuple:
    args = list(args)
    if mask[0] == "tuple":
        _, a, p = mask
        entries = list(args[a])
        entries[p] = "<step>"
        args[a] = tuple(entries)
    else:
        args[mask[1]] = "<step>"
    return tuple(args)


class _Signer:
    """Structural signature of one iteration: ops, constants and where each operand comes from.

    Integers that are positions (indices such as x[..., t] = o_t or x[:, t * C:(t + 1) * C], and the
    bounds of position masks such as arange(C) > t) are left out of the signature and returned
    separately: across iterations they must be constant or affine in the step, which is what
    indexing by the loop variable gives."""

    def __init__(self, masks: dict[fx.Node, tuple]):
        self.masks = masks

    def sign(self, nodes: list[fx.Node], prev: list[fx.Node] | None, externals: set):
        local = {n: i for i, n in enumerate(nodes)}
        before = {n: i for i, n in enumerate(prev)} if prev is not None else {}
        ints: list[int] = []

        def norm(a, in_index=False):
            if isinstance(a, fx.Node):
                if a in local:
                    return ("L", local[a])
                if a in before:
                    return ("P", before[a])
                externals.add(a)
                return ("X", a)
            if isinstance(a, (list, tuple)):
                return (type(a).__name__,) + tuple(norm(x, in_index) for x in a)
            if isinstance(a, slice):
                return ("slice", norm(a.start, in_index), norm(a.stop, in_index), norm(a.step, in_index))
            if isinstance(a, dict):
                return ("dict",) + tuple((k, norm(v)) for k, v in a.items())
            if in_index and isinstance(a, int) and not isinstance(a, bool):
                ints.append(a)
                return ("I",)
            try:
                hash(a)
                return ("C", type(a).__name__, a)
            except TypeError:
                return ("C", type(a).__name__, repr(a))

        sig = []
        for n in nodes:
            args = n.args
            if n in self.masks:
                args = _mask_args(args, self.masks[n])
            name = _name(n)
            if name in ("getitem", "setitem") and len(args) >= 2:
                normed = (norm(args[0]), norm(args[1], in_index=True)) + tuple(norm(a) for a in args[2:])
                normed = ("tuple",) + normed
            elif name in _POSITIONAL:
                normed = norm(args, in_index=True)
            else:
                normed = norm(args)
            sig.append((n.op, n.target, normed, norm(n.kwargs, in_index=name in _POSITIONAL)))
        return sig, ints


def _walk(start: fx.Node, count: int) -> list[fx.Node]:
    """Up to `count` nodes from `start` in graph order, stopping before the output node."""
    out, n = [], start
    while len(out) < count and n.op not in ("output", "root"):
        out.append(n)
        n = n.next
    return out


def _analyse_unrolled(loop: _Loop, idx: _Index) -> None:
    """Split the loop into iterations, prove they are one step repeated, find state and output."""
    if loop.reverse:
        raise Refusal(f"the loop runs backwards over time ({loop.steps} steps): anti-causal, not the "
                      f"delta rule's forward recurrence")
    n_steps = loop.steps
    anchors: list[fx.Node | None] = [None] * n_steps
    masks: dict[fx.Node, tuple] = {}
    for f in loop.families:
        for s in f.slices:
            masks[s.node] = s.mask
            a = anchors[s.step]
            if a is None or idx.pos[s.node] < idx.pos[a]:
                anchors[s.step] = s.node
    pos = [idx.pos[a] for a in anchors]
    if any(b <= a for a, b in zip(pos, pos[1:])):
        raise Refusal("the sequences' slices of one step are interleaved with other steps")
    for f in loop.families:
        for s in f.slices:
            hi = pos[s.step + 1] if s.step + 1 < n_steps else math.inf
            if not pos[s.step] <= idx.pos[s.node] < hi:
                raise Refusal(f"{_describe(s.node)} slices step {s.step} outside that step's iteration")
    slices = set(masks)

    def run_between(a: fx.Node, b: fx.Node) -> list[fx.Node]:
        out, n = [], a
        while n is not b:
            out.append(n)
            n = n.next
        return out

    # Values computed from this loop's slices (directly or through earlier such values): what a
    # recurrence hands on. Constants an iteration prepares for the next one (a position mask built
    # before the next slices are read) are not.
    first, second = run_between(anchors[0], anchors[1]), (run_between(anchors[1], anchors[2]) if n_steps > 2
                                                          else _walk(anchors[1], len(run_between(anchors[0],
                                                                                                 anchors[1]))))
    dynamic: set = set()
    for n in first + second:
        if n in slices or any(a in dynamic for a in n.all_input_nodes):
            dynamic.add(n)
            target = _mutated_operand(n)
            if target is not None:
                dynamic.add(target)
    first_set = set(first)
    carried_nodes = {a for n in second for a in n.all_input_nodes if a in first_set and a in dynamic}
    if not carried_nodes:
        raise NotARecurrence(f"loop of {n_steps} steps at `{loop.anchor.name}` carries no value from one "
                             f"step to the next")
    # An iteration may compute at its top, before reading its slices, what the previous one hands
    # on (S = S.clone() * ...) or constants it needs (a position mask). Such nodes sit at the end
    # of the previous anchor-to-anchor run; shifting every boundary back over them makes all
    # iterations, the first and the last included, the same graph. The smallest shift that does is
    # the program's loop body.
    max_shift, moved = 0, set()
    second_set = set(second)
    for n in reversed(first):
        if n in slices or not n.users or not all(u in second_set or u in moved for u in n.users):
            break
        moved.add(n)
        max_shift += 1
        if max_shift == MAX_ROTATION:
            break
    failure = None
    for shift in range(max_shift + 1):
        try:
            _split_iterations(loop, idx, anchors, shift, masks, dynamic)
            return
        except Refusal as e:
            failure = failure or e
    raise failure


def _split_iterations(loop: _Loop, idx: _Index, anchors: list[fx.Node], shift: int, masks: dict,
                      dynamic: set) -> None:
    n_steps = loop.steps

    def back(n: fx.Node, count: int) -> fx.Node:
        for _ in range(count):
            n = n.prev
            if n.op in ("placeholder", "root"):
                raise Refusal("the loop starts at the top of the graph")
        return n

    def run_between(a: fx.Node, b: fx.Node) -> list[fx.Node]:
        out, n = [], a
        while n is not b:
            out.append(n)
            n = n.next
        return out

    starts = [back(a, shift) for a in anchors]
    iterations = [run_between(starts[j], starts[j + 1]) for j in range(n_steps - 1)]
    length = len(iterations[1]) if n_steps >= 3 else len(iterations[0])
    for j, it in enumerate(iterations):
        if len(it) != length:
            raise Refusal(f"iteration {j} has {len(it)} nodes, iteration {1 if n_steps >= 3 else 0} has {length}: "
                          f"the loop body differs between steps")
    last = _walk(starts[-1], length)
    if len(last) != length:
        raise Refusal("the last iteration is shorter than the others")
    iterations.append(last)
    start = idx.pos[starts[0]]

    signer = _Signer(masks)
    externals: set = set()
    signatures, index_ints = [], []
    for j in range(n_steps):
        sig, ints = signer.sign(iterations[j], iterations[j - 1] if j else None, externals)
        signatures.append(sig)
        index_ints.append(ints)
    for a in externals:
        if idx.pos.get(a, -1) >= start:
            raise Refusal(f"an iteration reads {_describe(a)} from an iteration before the previous one")
    template = signatures[1]
    for j in range(2, n_steps):
        if signatures[j] != template:
            k = next(i for i, (x, y) in enumerate(zip(signatures[j], template)) if x != y)
            raise Refusal(f"iteration {j} differs from iteration 1 at {_describe(iterations[j][k])}: the "
                          f"steps are not one repeated recurrence")
    if any(len(x) != len(index_ints[0]) for x in index_ints):
        raise Refusal("the iterations index tensors differently")
    for slot in range(len(index_ints[0])):
        first_int, step = index_ints[0][slot], index_ints[1][slot] - index_ints[0][slot]
        if any(index_ints[j][slot] != first_int + j * step for j in range(n_steps)):
            raise Refusal("an index inside the loop varies between iterations other than with the step")
    local0 = {n: i for i, n in enumerate(iterations[0])}
    carried = sorted({local0[a] for n in iterations[1] for a in n.all_input_nodes
                      if a in local0 and a in dynamic})
    if len(carried) != 1:
        if not carried:
            raise NotARecurrence(f"loop of {n_steps} steps at `{loop.anchor.name}` carries no value from one "
                                 f"step to the next")
        names = ", ".join(_describe(iterations[0][i]) for i in carried)
        raise Refusal(f"each step hands {len(carried)} values to the next ({names}); the delta rule "
                      f"carries one state")
    state_index = carried[0]
    # Step 0 must be step 1 with the initial state in place of the previous state.
    init = None
    for e0, e1 in zip(signatures[0], template):
        diffs = _diff_refs(e0, e1)
        if diffs is None:
            k = signatures[0].index(e0)
            raise Refusal(f"iteration 0 differs from iteration 1 at {_describe(iterations[0][k])}")
        for ref0, ref1 in diffs:
            if ref1 != ("P", state_index) or ref0[0] != "X":
                raise Refusal("iteration 0 reads something other than an initial state where later "
                              "iterations read the previous state")
            if init is not None and ref0[1] is not init:
                raise Refusal("iteration 0 starts from two different initial states")
            init = ref0[1]
    loop.iterations = iterations
    loop.end = idx.pos[last[-1]] + 0.5
    loop.state_index = state_index
    loop.states = [it[state_index] for it in iterations]
    loop.init = init
    loop.externals = sorted(externals, key=lambda n: idx.pos[n])
    _find_output(loop, idx)


def _diff_refs(a, b):
    """Pairs of differing operand references between two signature entries, or None when they
    differ in anything else."""
    if a == b:
        return []
    if isinstance(a, tuple) and isinstance(b, tuple):
        if len(a) == 2 and len(b) == 2 and a[0] in ("L", "P", "X") and b[0] in ("L", "P", "X") and \
                not isinstance(a[1], tuple) and not isinstance(b[1], tuple):
            return [(a, b)]
        if len(a) != len(b):
            return None
        out = []
        for x, y in zip(a, b):
            d = _diff_refs(x, y)
            if d is None:
                return None
            out += d
        return out
    return None


def _find_output(loop: _Loop, idx: _Index) -> None:
    """The value each iteration writes out, and where the rest of the graph reads it."""
    n_steps = loop.steps
    batch = _shape(loop.states[0])[:-2] if _shape(loop.states[0]) else ()
    own = {n for it in loop.iterations for n in it}
    start = idx.pos[loop.iterations[0][0]]
    per_step: list[tuple[str, int, fx.Node | None]] = []
    for j, it in enumerate(loop.iterations):
        found = []
        for i, n in enumerate(it):
            target = _mutated_operand(n)
            if target is not None and idx.pos.get(idx.base_of(target), math.inf) < start:
                if idx.name(n) != "setitem":
                    raise Refusal(f"{_describe(n)} updates a tensor from before the loop in place; only "
                                  f"slot writes (x[..., t] = o_t) are an output")
                value = n.args[2]
                if value not in it:
                    raise Refusal(f"{_describe(n)} writes a value that is not computed by the step")
                found.append(("buffer", it.index(value), idx.base_of(target)))
                continue
            outside = [u for u in n.users if u not in own]
            if outside and not (j == n_steps - 1 and i == loop.state_index):
                if i == loop.state_index:
                    raise Refusal(f"the state after step {j} is used outside the loop ({_describe(outside[0])}); "
                                  f"only the final state may be")
                found.append(("collect", i, None))
        if len(found) != 1:
            what = "no value" if not found else f"{len(found)} values"
            raise Refusal(f"step {j} writes out {what}; the delta rule writes one output per step (a "
                          f"non-causal form that reads the final state is not lowered)")
        per_step.append(found[0])
    if len({(m, i, b) for m, i, b in per_step}) != 1:
        raise Refusal("the steps write their outputs to different places")
    mode, index, buffer = per_step[0]
    loop.mode, loop.output_index = mode, index
    loop.outputs = [it[index] for it in loop.iterations]
    if mode == "buffer":
        loop.buffer = buffer
        # The buffer and its views made before the loop (o = torch.zeros(...).to(v)) all read it.
        aliases, todo = {buffer}, [buffer]
        while todo:
            for u in todo.pop().users:
                if u not in aliases and idx.pos.get(u, math.inf) < start and idx.base_of(u) is buffer:
                    aliases.add(u)
                    todo.append(u)
        readers = [u for a in aliases for u in a.users if u not in own and idx.pos.get(u, -1) > loop.end]
        if len(readers) > 1:
            raise Refusal(f"the output buffer {_describe(buffer)} is read {len(readers)} times after the loop")
        loop.post = [buffer]
        if readers:
            _extend_post(loop, readers[0], idx, batch)
        loop.out = loop.post[-1]
    else:
        outs = loop.outputs
        users = {u for o in outs for u in o.users if u not in own}
        if len(users) != 1:
            raise Refusal(f"the per-step outputs are used by {len(users)} nodes after the loop; expected one "
                          f"stack or cat")
        (collector,) = users
        if idx.name(collector) not in ("stack", "cat") or not collector.args or \
                list(collector.args[0]) != outs:
            raise Refusal(f"the per-step outputs are combined by {_describe(collector)}, not by one "
                          f"stack/cat of every step in order")
        loop.post = [collector]
        _extend_post(loop, collector, idx, batch, include_first=False)
        loop.out = loop.post[-1]
    loop.out_users = [u for u in loop.out.users if idx.pos.get(u, math.inf) > loop.end]
    final = loop.iterations[-1][loop.state_index]
    loop.final = final
    loop.final_users = [u for u in final.users if u not in own]
    loop.nodes = own | set(loop.post)
    if loop.mode == "buffer":
        loop.nodes.discard(loop.buffer)


def _extend_post(loop: _Loop, first: fx.Node, idx: _Index, batch: tuple[int, ...],
                 include_first: bool = True) -> None:
    """Follow layout-only ops (reshape, slicing, transposes, casts) from the loop's output, up to the
    last one whose result still reads as [state batch axes + time, value width] in some order."""
    chain, cur = [], first
    if include_first:
        if first.op == "output" or idx.name(first) not in _POST or idx.base_of(first.args[0]) is not \
                idx.base_of(loop.post[-1]):
            return
        chain.append(first)
    while True:
        users = list(cur.users)
        if len(users) != 1:
            break
        (u,) = users
        if u.op not in ("call_function", "call_method") or idx.name(u) not in _POST or u.args[0] is not cur:
            break
        chain.append(u)
        cur = u
    readable = [i for i, n in enumerate(chain) if _reads_as_output(_shape(n), batch)]
    if readable:
        loop.post += chain[:readable[-1] + 1]


def _reads_as_output(shape: tuple[int, ...] | None, batch: tuple[int, ...]) -> bool:
    if shape is None or len(shape) != len(batch) + 2:
        return False
    core = shape[:-1]
    return any(tuple(core[:t] + core[t + 1:]) == tuple(batch) for t in range(len(core)))


def _analyse_scan(node: fx.Node, gm: fx.GraphModule, idx: _Index) -> _Loop:
    args = list(node.args)
    if len(args) < 3:
        raise Refusal("scan call with an unexpected signature")
    body_ref, init, xs = args[0], args[1], args[2]
    extra = args[3] if len(args) > 3 else node.kwargs.get("additional_inputs", [])
    if not isinstance(body_ref, fx.Node) or body_ref.op != "get_attr":
        raise Refusal("scan step function is not a graph module")
    body = gm
    for part in body_ref.target.split("."):
        body = getattr(body, part)
    init, xs, extra = list(init), list(xs), list(extra or [])
    if len(init) != 1:
        raise Refusal(f"scan carries {len(init)} values; the delta rule carries one state")
    outs = body.graph.output_node().args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if len(outs) != 2:
        raise Refusal(f"the scan step returns {len(outs) - 1} outputs besides the state; expected one")
    shape = _shape(xs[0]) if xs else None
    if shape is None:
        raise Refusal("scan without sequence inputs")
    loop = _Loop("scan", node, shape[0], scan=node, body=body, scan_inputs=(init, xs, extra))
    loop.end = idx.pos[node] + 0.5
    getters = {}
    for u in node.users:
        if idx.name(u) != "getitem" or not isinstance(u.args[1], int):
            raise Refusal(f"scan result used by {_describe(u)}")
        getters.setdefault(u.args[1], []).append(u)
    if any(len(v) > 1 for v in getters.values()):
        raise Refusal("a scan result is unpacked twice")
    if 1 not in getters:
        raise Refusal("the scan's per-step outputs are unused")
    loop.post = [getters[1][0]]
    _extend_post(loop, getters[1][0], idx, (_shape(init[0]) or (0, 0))[:-2], include_first=False)
    loop.out = loop.post[-1]
    loop.out_users = list(loop.out.users)
    if 0 in getters:
        loop.final = getters[0][0]
        loop.final_users = list(loop.final.users)
    loop.nodes = {node, body_ref, *loop.post} | ({loop.final} if loop.final is not None else set())
    loop.externals = [a for a in init + xs + extra if isinstance(a, fx.Node)]
    loop.init = init[0] if isinstance(init[0], fx.Node) else None
    return loop


# ----------------------------------------------------------------------------------------------
# Region: walk back from what the loop reads to the op's inputs


_WALK_LEAF, _ABSORBED, _CONST = "leaf?", "absorbed", "const"
_LEAF, _INTERNAL, _BAD = "leaf", "internal", "bad"


@dataclass
class _TokenLayout:
    time: int
    feature: bool


def _token_layouts(shape: tuple[int, ...], batch: tuple[int, ...]) -> list[_TokenLayout]:
    """Readings of `shape` as a per-token tensor: one time axis, the state's batch axes in order (one
    of them may divide the state's, for grouped value heads) and, if present, a last feature axis."""
    out = []
    nb = len(batch)
    for feature in (False, True):
        core = shape[:-1] if feature else shape
        if len(core) != nb + 1:
            continue
        for t in range(len(core)):
            rest = core[:t] + core[t + 1:]
            divides = [r != b for r, b in zip(rest, batch)]
            if all(r == b or (r >= 1 and b % r == 0) for r, b in zip(rest, batch)) and sum(divides) <= 1 \
                    and core[t] >= 1:
                out.append(_TokenLayout(t, feature))
    return out


@dataclass
class _Region:
    nodes: set  # every node the replacement makes dead (loop, machinery before it, assembly after it)
    leaves: list[fx.Node]
    state_shape: tuple[int, ...]


def _classify(n: fx.Node, idx: _Index) -> str:
    """How the backward walk treats a node: machinery of the recurrence to absorb, a constant
    (creation ops, graph constants, sizes) or where the walk stops."""
    if n.op == "get_attr":
        return _CONST
    ev = _example(n)
    if n.op == "placeholder":
        return _WALK_LEAF if isinstance(ev, torch.Tensor) else _CONST
    if n.op not in ("call_function", "call_method"):
        return _WALK_LEAF
    name = _plain(idx.name(n))
    if name in _CREATE:
        return _CONST
    if name in _ABSORB or name in _RANDOM:
        return _ABSORBED
    if ev is not None and not isinstance(ev, (torch.Tensor, list, tuple)):
        return _CONST  # a size or other Python number
    return _WALK_LEAF


def _build_region(loop: _Loop, idx: _Index, state_shape: tuple[int, ...]) -> _Region:
    batch = state_shape[:-2]

    def role_shaped(n: fx.Node) -> bool:
        ev = _tensor_example(n)
        if ev is None or not ev.is_floating_point():
            return False
        shape = concrete_shape(ev)
        if shape == state_shape or shape == state_shape[:-2] + state_shape[-2:][::-1]:
            return True
        return bool(_token_layouts(shape, batch))

    kind: dict[fx.Node, str] = {}
    operands: dict[fx.Node, list[fx.Node]] = {}
    heap = [(-idx.pos[n], id(n), n) for n in loop.externals]
    heapq.heapify(heap)
    while heap:
        _, _, n = heapq.heappop(heap)
        if n in kind:
            continue
        kind[n], operands[n] = _classify(n, idx), []
        if kind[n] != _ABSORBED:
            continue
        name = _plain(idx.name(n))
        if name in _RANDOM:
            raise Refusal(f"random op {_describe(n)} in the recurrence")
        ops = _data_operands(n)
        for a in list(ops):
            ops += idx.mutators_before(a, idx.pos[n])
        operands[n] = list(dict.fromkeys(ops))
        for a in operands[n]:
            if a not in kind:
                heapq.heappush(heap, (-idx.pos[a], id(a), a))

    status: dict[fx.Node, str] = {}
    for n in sorted(kind, key=lambda x: idx.pos[x]):
        k = kind[n]
        if k == _WALK_LEAF:
            status[n] = _LEAF if role_shaped(n) else _BAD
        elif k == _CONST:
            status[n] = _CONST
        else:
            st = [status[a] for a in operands[n]]
            if _BAD in st:
                status[n] = _LEAF if role_shaped(n) else _BAD
            elif all(s == _CONST for s in st):
                status[n] = _CONST
            else:
                status[n] = _INTERNAL

    region: set = set()
    leaves: list[fx.Node] = []
    todo = list(loop.externals)
    seen: set = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        st = status[n]
        if st == _BAD:
            raise Refusal(f"the recurrence reads {_describe(n)}, which is neither a per-token input "
                          f"(the state's batch axes plus time) nor the initial state; e.g. a constant "
                          f"per-head decay or a parameter used inside the loop")
        if st == _LEAF:
            leaves.append(n)
            continue
        region.add(n)
        todo.extend(operands[n])
    region |= loop.nodes
    replaced_users = set(loop.out_users) | set(loop.final_users)
    for n in region:
        target = _mutated_operand(n)
        if target is None:
            continue
        base = idx.base_of(target)
        # the replacement drops the region's in-place writes: nothing else may see them
        if base not in region:
            raise Refusal(f"{_describe(n)} writes in place into {_describe(base)}, which the recurrence "
                          f"does not create")
        aliases, todo = {base}, [base]
        while todo:
            a = todo.pop()
            if a is loop.out or a is loop.final:
                continue  # what reads these reads the op's results after the rewrite
            for u in a.users:
                if u not in aliases and u not in replaced_users and idx.base_of(u) is base:
                    aliases.add(u)
                    todo.append(u)
        for a in aliases:
            if a is loop.out or a is loop.final:
                continue
            outside = [u for u in a.users if u not in region and u not in replaced_users]
            if outside:
                raise Refusal(f"{_describe(outside[0])} reads {_describe(a)}, which the recurrence writes in "
                              f"place")
    leaves.sort(key=lambda n: idx.pos[n])
    return _Region(region, leaves, state_shape)


# ----------------------------------------------------------------------------------------------
# Roles


@dataclass
class _Input:
    node: fx.Node
    labels: list[str]  # per axis of the node: "b0", "b1", "t", "d"


@dataclass
class _Roles:
    q: _Input
    k: _Input
    v: _Input
    beta: _Input | None
    g: _Input | None
    h0: fx.Node | None
    gate: str
    T: int
    nb: int


def _is_exact(shape: tuple[int, ...], layout: _TokenLayout, batch: tuple[int, ...]) -> bool:
    core = shape[:-1] if layout.feature else shape
    return tuple(core[:layout.time] + core[layout.time + 1:]) == tuple(batch)


def _labels(shape: tuple[int, ...], layout: _TokenLayout) -> list[str]:
    labels, b = [], 0
    for i in range(len(shape)):
        if i == layout.time:
            labels.append("t")
        elif layout.feature and i == len(shape) - 1:
            labels.append("d")
        else:
            labels.append(f"b{b}")
            b += 1
    return labels


def _reaches_exp(leaf: fx.Node, region: _Region, loop: _Loop, idx: _Index) -> bool:
    """Does the input flow into an exp through gate-like ops (layout, cumsum, differences, masks)?"""
    limit_pos = math.inf
    if loop.kind == "unrolled" and len(loop.iterations) > 2:
        limit_pos = idx.pos[loop.iterations[2][0]]
    seen, todo = set(), [leaf]
    while todo and len(seen) < GATE_WALK_LIMIT:
        n = todo.pop()
        for u in n.users:
            if u in seen or u not in region.nodes or idx.pos.get(u, math.inf) >= limit_pos:
                continue
            seen.add(u)
            if _is_scan(u):
                if _scan_input_reaches_exp(loop, n):
                    return True
                continue
            name = _plain(idx.name(u))
            if name in _EXP:
                return True
            if name in ("mul", "div"):
                other = [a for a in u.args if a is not n]
                if any(isinstance(a, fx.Node) for a in other):
                    continue  # a product with another tensor: no longer a log-gate
                todo.append(u)
            elif name in _GATE_PATH:
                todo.append(u)
    return False


def _reaches_state(leaf: fx.Node, region: _Region, loop: _Loop, idx: _Index) -> bool:
    """Does the state after the first step depend on this input?"""
    if loop.kind == "scan":
        init, xs, _ = loop.scan_inputs
        placeholders = [n for n in loop.body.graph.nodes if n.op == "placeholder"]
        out = loop.body.graph.output_node().args[0]
        target = (list(out) if isinstance(out, (list, tuple)) else [out])[0]
        starts = []
        for i, x in enumerate(xs):
            if isinstance(x, fx.Node) and _depends_on(x, leaf, region.nodes, idx):
                starts.append(placeholders[len(init) + i])
        return any(_depends_on(target, st, set(loop.body.graph.nodes), None) for st in starts)
    return _depends_on(loop.states[0], leaf, region.nodes, idx)


def _depends_on(node: fx.Node, source: fx.Node, within: set, idx: _Index | None) -> bool:
    """Is `source` an ancestor of `node` through nodes of `within` (mutations included)?"""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n in seen or n not in within:
            continue
        seen.add(n)
        inputs = _data_operands(n) if n.op in ("call_function", "call_method") else []
        todo.extend(inputs)
        if idx is not None:
            for a in inputs:
                todo.extend(idx.mutators_before(a, idx.pos.get(n, math.inf)))
    return False


def _scan_input_reaches_exp(loop: _Loop, xs_node: fx.Node) -> bool:
    init, xs, _ = loop.scan_inputs
    if xs_node not in xs:
        return False
    placeholders = [n for n in loop.body.graph.nodes if n.op == "placeholder"]
    start = placeholders[len(init) + xs.index(xs_node)]
    seen, todo = set(), [start]
    while todo and len(seen) < GATE_WALK_LIMIT:
        n = todo.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            name = _plain(_name(u))
            if name in _EXP:
                return True
            if name in ("mul", "div"):
                if any(isinstance(a, fx.Node) for a in u.args if a is not n):
                    continue
                todo.append(u)
            elif name in _GATE_PATH:
                todo.append(u)
    return False


def _assign_roles(loop: _Loop, region: _Region, idx: _Index, out_value_dim: int) -> list[_Roles]:
    """Role assignments consistent with shapes and use (usually one; q/k/v of equal widths give
    several, which the probe tells apart)."""
    state_shape = region.state_shape
    batch = state_shape[:-2]
    nb = len(batch)
    if nb > 2:
        raise Refusal(f"the state {list(state_shape)} has {nb} batch axes (at most 2 are lowered)")
    h0 = None
    readings: list[tuple[fx.Node, list[_TokenLayout]]] = []
    for leaf in region.leaves:
        shape = _shape(leaf)
        if shape in (state_shape, state_shape[:-2] + state_shape[-2:][::-1]):
            if h0 is not None:
                raise Refusal(f"two state-shaped inputs: {_describe(h0)} and {_describe(leaf)}")
            h0 = leaf
            continue
        readings.append((leaf, _token_layouts(shape, batch)))
    # The sequence length is the one time-axis size every per-token input agrees on.
    common = None
    for leaf, layouts in readings:
        sizes = {_shape(leaf)[lay.time] for lay in layouts}
        common = sizes if common is None else common & sizes
    if not readings or not common:
        raise Refusal("the per-token inputs do not share one sequence length")
    if len(common) > 1 and loop.kind == "scan":
        common &= {loop.steps}
    if len(common) != 1:
        raise Refusal(f"cannot tell the time axis: the per-token inputs have axes of sizes {sorted(common)} "
                      f"that could each be time")
    (T,) = common
    featured, featureless = [], []
    for leaf, layouts in readings:
        shape = _shape(leaf)
        fits = [lay for lay in layouts if shape[lay.time] == T]
        exact = [lay for lay in fits if _is_exact(shape, lay, batch)]
        fits = exact or fits
        if len(fits) != 1:
            raise Refusal(f"cannot tell the time axis of the input {_describe(leaf)} (state "
                          f"{list(state_shape)})")
        item = _Input(leaf, _labels(shape, fits[0]))
        (featured if fits[0].feature else featureless).append(item)
    gate_like = {id(i): _reaches_exp(i.node, region, loop, idx) for i in featured + featureless}
    g = beta = None
    gate = "none"
    scalar_gates = [i for i in featureless if gate_like[id(i)]]
    betas = [i for i in featureless if not gate_like[id(i)]]
    if len(scalar_gates) > 1 or len(betas) > 1:
        raise Refusal(f"{len(featureless)} per-head inputs ({', '.join(_describe(i.node) for i in featureless)}): "
                      f"expected at most one beta and one log-gate that enters an exp")
    if scalar_gates:
        g, gate = scalar_gates[0], "scalar"
    if betas:
        beta = betas[0]
    channel = [i for i in featured if gate_like[id(i)]]
    if channel:
        if len(channel) > 1 or g is not None:
            raise Refusal("more than one gate-like input (inputs that enter an exp)")
        g, gate = channel[0], "channel"
    qkv = [i for i in featured if not gate_like[id(i)]]
    if len(qkv) != 3:
        raise Refusal(f"{len(qkv)} per-token inputs with a feature axis "
                      f"({', '.join(_describe(i.node) for i in qkv)}); expected q, k and v")

    def width(i):
        return _shape(i.node)[-1]

    # q is read by the outputs only: of q, k and v it is the one the state does not depend on.
    stateless = [i for i in qkv if not _reaches_state(i.node, region, loop, idx)]
    options = []
    for q, k, v in permutations(qkv):
        if width(v) != out_value_dim or width(q) != width(k):
            continue
        if len(stateless) == 1 and q is not stateless[0]:
            continue
        options.append(_Roles(q, k, v, beta, g, h0, gate, T, nb))
    if not options:
        raise Refusal(f"no assignment of q, k, v to inputs of widths {[width(i) for i in qkv]} gives "
                      f"an output of width {out_value_dim}")
    for r in options:
        if g is not None and gate == "channel" and width(g) != width(r.k):
            raise Refusal(f"the per-channel gate {_describe(g.node)} is not as wide as k")
    return options


# ----------------------------------------------------------------------------------------------
# Layout conversions, written once for the probe (eager) and the rewrite (FX nodes)


class _Eager:
    def permute(self, x, perm):
        return x.permute(*perm)

    def unsqueeze(self, x, d):
        return x.unsqueeze(d)

    def squeeze(self, x, d):
        return x.squeeze(d)

    def transpose(self, x):
        return x.transpose(-1, -2)

    def cast(self, x, dtype):
        return x.to(dtype)


class _Emitter:
    def __init__(self, graph: fx.Graph, meta_source: fx.Node, fake_mode: Any):
        self.graph = graph
        self.meta_source = meta_source
        self.fake_mode = fake_mode
        self.created: list[fx.Node] = []

    def _node(self, kind: str, target: Any, args: tuple) -> fx.Node:
        if kind == "method":
            node = self.graph.call_method(target, args)
        else:
            node = self.graph.call_function(target, args)
        node.meta["stack_trace"] = self.meta_source.meta.get("stack_trace")
        node.meta["example_value"] = M.fake_value(node, self.fake_mode)
        self.created.append(node)
        return node

    def permute(self, x, perm):
        return x if list(perm) == list(range(len(perm))) else self._node("method", "permute", (x, *perm))

    def unsqueeze(self, x, d):
        return self._node("method", "unsqueeze", (x, d))

    def squeeze(self, x, d):
        return self._node("method", "squeeze", (x, d))

    def transpose(self, x):
        return self._node("method", "transpose", (x, -1, -2))

    def cast(self, x, dtype):
        ev = _example(x)
        if isinstance(ev, torch.Tensor) and ev.dtype == dtype:
            return x
        return self._node("method", "to", (x, dtype))

    def call(self, target, *args):
        return self._node("function", target, args)


_OP_ORDER = ("b0", "t", "b1", "d")


def _to_op(x, labels: list[str], nb: int, E) -> Any:
    """A per-token input, labelled axis by axis, to the op's [B, T, H(, D)] layout."""
    order = [lab for lab in _OP_ORDER if lab in labels]
    x = E.permute(x, [labels.index(lab) for lab in order])
    if nb == 0:
        x = E.unsqueeze(x, 0)
    if nb <= 1:
        x = E.unsqueeze(x, 2)
    return x


def _state_to_op(x, nb: int, transposed: bool, E) -> Any:
    if transposed:
        x = E.transpose(x)
    for _ in range(2 - nb):
        x = E.unsqueeze(x, 0)
    return x


def _state_from_op(x, nb: int, transposed: bool, E) -> Any:
    for _ in range(2 - nb):
        x = E.squeeze(x, 0)
    return E.transpose(x) if transposed else x


def _out_from_op(o, labels: list[str], nb: int, E) -> Any:
    """The op's output [B, T, HV, V] to a layout labelled with b0, b1, t, e."""
    if nb <= 1:
        o = E.squeeze(o, 2)
    if nb == 0:
        o = E.squeeze(o, 0)
    cur = {2: ["b0", "t", "b1", "e"], 1: ["b0", "t", "e"], 0: ["t", "e"]}[nb]
    return E.permute(o, [cur.index(lab) for lab in labels])


def _out_labels(shape: tuple[int, ...], batch: tuple[int, ...], T: int | None, what: str) -> list[list[str]]:
    """Readings of an output (or one step's output) as batch axes in order, time, value width."""
    core = shape[:-1]
    nb = len(batch)
    readings = []
    if len(core) == nb and tuple(core) == tuple(batch):
        return [[f"b{i}" for i in range(nb)] + ["e"]]
    if len(core) == nb + 1:
        for t in range(len(core)):
            rest = core[:t] + core[t + 1:]
            if tuple(rest) == tuple(batch) and (T is None or core[t] == T):
                labels = [f"b{i}" for i in range(nb)]
                labels.insert(t, "t")
                readings.append(labels + ["e"])
    if not readings:
        raise Refusal(f"the {what} has shape {list(shape)}; expected the state's batch axes "
                      f"{list(batch)} plus time and the value width")
    return readings


# ----------------------------------------------------------------------------------------------
# Evaluation of the region at compile time


class _Evaluator:
    """Evaluates region nodes on probe values, in graph order, mutations included."""

    def __init__(self, gm: fx.GraphModule, idx: _Index, region: _Region, inputs: dict[fx.Node, Any]):
        self.gm, self.idx, self.region = gm, idx, region
        self.env: dict[fx.Node, Any] = dict(inputs)

    def _standin(self, n: fx.Node) -> Any:
        """Value for a node outside the region (read for metadata only): NaN-filled, so a data use
        poisons the probe instead of passing it."""
        ev = _example(n)
        if isinstance(ev, torch.Tensor):
            t = torch.empty(concrete_shape(ev), dtype=ev.dtype, device=ev.device)
            return t.fill_(float("nan")) if t.is_floating_point() else t.zero_()
        if isinstance(ev, (torch.SymInt, int)):
            return size_hint(ev)
        if isinstance(ev, (torch.SymFloat, float)):
            return float(ev.node.hint) if isinstance(ev, torch.SymFloat) else ev
        if n.op == "get_attr":
            return self._attr(n)
        raise ValueError(f"cannot stand in for {n.name}")

    def _attr(self, n: fx.Node) -> Any:
        obj: Any = self.gm
        for part in n.target.split("."):
            obj = getattr(obj, part)
        return obj

    def run(self, wanted: list[fx.Node], read_pos: float | None = None) -> list[Any]:
        """Values of `wanted` as read at `read_pos` (default: right after each node), i.e. with the
        in-place writes to their storage that happen before that point."""
        needed: set = set()
        todo = list(wanted)
        for w in wanted:
            todo += self.idx.mutators_before(w, self.idx.pos[w] + 0.5 if read_pos is None else read_pos)
        while todo:
            n = todo.pop()
            if n in needed or n in self.env:
                continue
            needed.add(n)
            if n not in self.region.nodes:
                continue
            ins = list(n.all_input_nodes)
            for a in list(ins):
                ins += self.idx.mutators_before(a, self.idx.pos[n])
            todo += ins
        for n in sorted(needed, key=lambda x: self.idx.pos[x]):
            if n in self.env:
                continue
            if n not in self.region.nodes:
                self.env[n] = self._standin(n)
                continue
            ev = _example(n)
            if isinstance(ev, (torch.SymInt, torch.SymFloat)) or (n.op != "placeholder" and
                                                                   isinstance(ev, (int, float)) and
                                                                   not isinstance(ev, bool)):
                self.env[n] = self._standin(n)
                continue
            args = fx.node.map_arg(n.args, lambda a: self.env[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: self.env[a])
            if n.op == "call_function":
                self.env[n] = n.target(*args, **kwargs)
            elif n.op == "call_method":
                self_arg, *rest = args
                self.env[n] = getattr(self_arg, n.target)(*rest, **kwargs)
            elif n.op == "get_attr":
                self.env[n] = self._attr(n)
            else:
                raise ValueError(f"cannot evaluate {n.op} node {n.name}")
        return [self.env[w] for w in wanted]


# ----------------------------------------------------------------------------------------------
# Probe


@dataclass
class _Hypothesis:
    roles: _Roles
    l2norm: bool
    transposed: bool
    step_labels: list[str]
    scale: float = 1.0
    error: float = math.inf
    head_out: torch.Tensor | None = None  # the op's output on the probe's first steps, canonical layout


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if out.shape != ref.shape:
        return math.inf
    if not torch.isfinite(out).all():
        return math.inf
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _probe_values(roles: _Roles, h0_shape, seed: int = 20261122) -> dict[fx.Node, torch.Tensor]:
    """Random inputs shaped and distributed for their roles (k of unit norm on average, a negative
    log-gate, beta in (0, 1)) in each input's own dtype and device."""
    values = {}
    gen = None

    def make(node, kind):
        nonlocal gen
        ev = _tensor_example(node)
        shape = concrete_shape(ev)
        if gen is None:
            gen = torch.Generator(device=ev.device).manual_seed(seed)
        if kind == "beta":
            x = torch.rand(shape, generator=gen, device=ev.device)
        elif kind == "g":
            x = -(0.02 + 0.13 * torch.rand(shape, generator=gen, device=ev.device))
        elif kind == "qk":
            # norms spread over [0.4, 1.3]: l2 normalisation changes them visibly, and beta |k|^2 < 2
            # keeps the recurrence stable over a chunk
            x = torch.randn(shape, generator=gen, device=ev.device) / math.sqrt(shape[-1])
            x = x / x.norm(dim=-1, keepdim=True) * (0.4 + 0.9 * torch.rand(shape[:-1] + (1,), generator=gen,
                                                                             device=ev.device))
        else:
            x = torch.randn(shape, generator=gen, device=ev.device)
            if kind == "h0":
                x = x / math.sqrt(h0_shape[-2])
        return x.to(ev.dtype)

    for i in (roles.q, roles.k):
        values[i.node] = make(i.node, "qk")
    widths = {_shape(roles.q.node)[-1], _shape(roles.v.node)[-1]}
    values[roles.v.node] = make(roles.v.node, "qk" if len(widths) == 1 else "v")
    if roles.beta is not None:
        values[roles.beta.node] = make(roles.beta.node, "beta")
    if roles.g is not None:
        values[roles.g.node] = make(roles.g.node, "g")
    if roles.h0 is not None:
        values[roles.h0] = make(roles.h0, "h0")
    return values


def _reference(h: _Hypothesis, values: dict, start: int, stop: int | None, state_shape,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's math (plain-PyTorch reference, float64) on tokens [start, stop) of the probe values,
    from `state` (op layout) or else the probe's initial state: output in the op layout with scale
    1, final state in the op layout."""
    from ..kernels.delta_rule.reference import chunk_delta_rule_ref

    r, E = h.roles, _Eager()

    def op_layout(i: _Input):
        x = _to_op(values[i.node], i.labels, r.nb, E).double()
        return x[:, start:stop]

    q, k, v = op_layout(r.q), op_layout(r.k), op_layout(r.v)
    beta = op_layout(r.beta) if r.beta is not None else torch.ones(v.shape[:-1], dtype=v.dtype, device=v.device)
    g = op_layout(r.g) if r.g is not None else None
    h0 = state
    if h0 is None and r.h0 is not None and start == 0:
        h0 = _state_to_op(values[r.h0], r.nb, h.transposed, E).double()
    # The token loop is the faster reference for short prefixes, the chunked one for long inputs.
    if q.shape[1] <= NAIVE_REFERENCE_TOKENS:
        return _token_recurrence(q, k, v, beta, g, h0, h.l2norm)
    return chunk_delta_rule_ref(q, k, v, beta, g, gate=r.gate, scale=1.0, initial_state=h0,
                                output_final_state=True, use_qk_l2norm_in_kernel=h.l2norm,
                                chunk_size=OP_CHUNK_SIZE)


def _token_recurrence(q, k, v, beta, g, h0, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token, scale 1, op layout ([B, T, H, D]; v, beta, g with HV heads),
    with batched matrix products: the probe's reference for short spans (einsum's per-call planning
    costs more than the arithmetic at these sizes)."""
    from ..kernels.delta_rule.reference import l2norm as l2

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if l2norm:
        q, k = l2(q), l2(k)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    state = torch.zeros(B, HV, K, V, dtype=q.dtype, device=q.device) if h0 is None else h0.clone()
    outs = []
    for t in range(T):
        if g is not None:
            decay = g[:, t].exp()
            state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        k_t = k[:, t, :, None, :]                                      # [B, HV, 1, K]
        error = v[:, t, :, None, :] - k_t @ state                      # [B, HV, 1, V]
        state = state + k_t.transpose(-1, -2) @ (beta[:, t, :, None, None] * error)
        outs.append((q[:, t, :, None, :] @ state)[:, :, 0])
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V)
    return o, state


def _canonical_out(o_op: torch.Tensor, nb: int) -> tuple[torch.Tensor, list[str]]:
    labels = [f"b{i}" for i in range(nb)] + ["t", "e"]
    return _out_from_op(o_op, labels, nb, _Eager()), labels


def _relabel(x: torch.Tensor, src: list[str], dst: list[str]) -> torch.Tensor:
    if "t" in src and "t" not in dst:
        x = x.select(src.index("t"), 0)
        src = [lab for lab in src if lab != "t"]
    return x.permute(*[src.index(lab) for lab in dst])


def _step_tokens(j: int, span: int, T: int) -> tuple[int, int]:
    return j * span, min((j + 1) * span, T)


def _expected_step(o_can: torch.Tensor, can_labels, j: int, span: int, T: int, step_labels, length: int):
    """The op's output for step j in the step output's layout (zero-padded past T, as a padded
    chunk's outputs are discarded anyway)."""
    a, b = _step_tokens(j, span, T)
    t_axis = can_labels.index("t")
    piece = o_can.narrow(t_axis, a, b - a)
    if b - a < length:
        pad_shape = list(piece.shape)
        pad_shape[t_axis] = length - (b - a)
        piece = torch.cat([piece, piece.new_zeros(pad_shape)], dim=t_axis)
    return _relabel(piece, can_labels, step_labels)


def _snap_scale(s: float, key_dim: int, tol: float, constants: set[float]) -> float:
    """The fitted scale, snapped to the constant the code most likely wrote (K^-0.5, a literal of
    the region, or a product of two) when within the probe's tolerance."""
    base = {1.0, key_dim ** -0.5, 1.0 / key_dim} | {c for c in constants if c != 0}
    base |= {1.0 / c for c in base}
    candidates = base | {a * b for a in base for b in base}
    best = min(candidates, key=lambda c: abs(s - c))
    return best if abs(s - best) <= tol * abs(best) else s


class _Probe:
    """Compile-time evaluation of one candidate against the op's math (see the module docstring)."""

    def __init__(self, loop: _Loop, region: _Region, gm: fx.GraphModule, idx: _Index, tol: float):
        self.loop, self.region, self.gm, self.idx, self.tol = loop, region, gm, idx, tol
        self.batch = region.state_shape[:-2]
        self.constants = {float(a) for n in region.nodes if n.op in ("call_function", "call_method") and
                          _plain(idx.name(n)) in ("mul", "div") for a in n.args
                          if isinstance(a, (int, float)) and not isinstance(a, bool)}

    # -- the first steps, from the region

    def head(self, values: dict) -> tuple[_Evaluator, list[torch.Tensor], torch.Tensor, int]:
        loop = self.loop
        ev = _Evaluator(self.gm, self.idx, self.region, values)
        if loop.kind == "scan":
            init, xs, extra = loop.scan_inputs
            ev.run([a for a in init + xs + extra if isinstance(a, fx.Node)])
            env = ev.env
            state = env[init[0]] if isinstance(init[0], fx.Node) else init[0]
            x_vals = [env[x] for x in xs]
            extra_vals = [env[a] if isinstance(a, fx.Node) else a for a in extra]
            m = min(PROBE_SCAN_STEPS, loop.steps)
            outs = []
            for t in range(m):
                res = loop.body(state, *[x[t] for x in x_vals], *extra_vals)
                state, y = res[0], res[1]
                outs.append(y)
            return ev, outs, state, m
        m = min(PROBE_HEAD_STEPS, loop.steps - 1)
        wanted = loop.outputs[:m] + [loop.states[m - 1]]
        got = ev.run(wanted)
        return ev, got[:m], got[m], m

    def choose(self, options: list[_Roles], l2_options) -> tuple[_Hypothesis, dict, _Evaluator, int, int]:
        """Evaluate the first steps once per value assignment and pick the hypothesis (roles, l2norm,
        state orientation, step output layout, fitted scale) that reproduces them."""
        loop = self.loop
        state_shape = self.region.state_shape
        best: _Hypothesis | None = None
        best_ctx = None
        groups: dict[tuple, list[_Roles]] = defaultdict(list)
        for r in options:
            groups[(id(r.beta), id(r.g), r.h0)].append(r)
        for roles_group in groups.values():
            values = _probe_values(roles_group[0], state_shape)
            ev, outs, state, m = self.head(values)
            step_shape = tuple(outs[0].shape)
            step_readings = _out_labels(step_shape, self.batch, None, "per-step output")
            span = 1
            for r in roles_group:
                for labels in step_readings:
                    if loop.kind == "scan" and "t" in labels:
                        continue  # a scan over chunks: its stacked outputs have two time axes
                    span = step_shape[labels.index("t")] if "t" in labels else 1
                    if (loop.steps - 1) * span >= r.T or loop.steps * span < r.T:
                        continue
                    tokens = min(m * span, r.T)
                    for transposed in self._orientations(r, state_shape):
                        for l2 in l2_options:
                            h = _Hypothesis(r, l2, transposed, labels)
                            self._score(h, values, outs, state, m, span, tokens)
                            if best is None or h.error < best.error:
                                best, best_ctx = h, (values, ev, m, span)
        if best is None:
            raise Refusal(f"the loop's {loop.steps} steps do not cover the inputs' {options[0].T} tokens "
                          f"in equal spans")
        values, ev, m, span = best_ctx
        return best, values, ev, m, span

    def _orientations(self, r: _Roles, state_shape) -> list[bool]:
        key_dim, value_dim = _shape(r.k.node)[-1], _shape(r.v.node)[-1]
        out = []
        if state_shape[-2:] == (key_dim, value_dim):
            out.append(False)
        if state_shape[-2:] == (value_dim, key_dim):
            out.append(True)
        return out

    def _score(self, h: _Hypothesis, values, outs, state, m, span, tokens) -> None:
        r = h.roles
        try:
            o_op, s_op = _reference(h, values, 0, tokens, self.region.state_shape)
        except (RuntimeError, ValueError, TypeError):
            return
        o_can, can_labels = _canonical_out(o_op, r.nb)
        h.head_out = o_can
        expected = [_expected_step(o_can, can_labels, j, span, r.T, h.step_labels, outs[j].shape[
            h.step_labels.index("t")] if "t" in h.step_labels else 1) for j in range(m)]
        got = torch.cat([o.double().flatten() for o in outs])
        exp = torch.cat([e.flatten() for e in expected])
        den = float((exp * exp).sum())
        if den == 0 or not torch.isfinite(got).all():
            return
        scale = float((got * exp).sum()) / den
        key_dim = _shape(r.k.node)[-1]
        h.scale = _snap_scale(scale, key_dim, max(self.tol, 1e-4), self.constants)
        s_exp = _state_from_op(s_op, r.nb, h.transposed, _Eager())
        h.error = max(_rel(got, exp * h.scale), _rel(state, s_exp))

    # -- the rest: the last step from a random state, random values for the steps in between, the
    #    assembly after the loop

    def verify(self, h: _Hypothesis, values: dict, ev: _Evaluator, m: int, span: int) -> float:
        """Run the rest of the region with random values standing in for the outputs of the steps
        after the first m (and for the state entering the last step), and compare what reaches the
        graph with the op's math: the first steps' outputs, the random values where they belong, the
        last step computed by the op from that state, and the final state."""
        loop, r, E = self.loop, h.roles, _Eager()
        T = r.T
        can_labels = [f"b{i}" for i in range(r.nb)] + ["t", "e"]
        value_dim = _shape(r.v.node)[-1]
        device = _tensor_example(r.v.node).device
        gen = torch.Generator(device=device).manual_seed(7)
        expected = torch.zeros(*self.batch, T, value_dim, dtype=torch.float64, device=device)
        head_tokens = min(m * span, T)
        expected[..., :head_tokens, :] = h.head_out[..., :head_tokens, :] * h.scale
        checked = [(0, head_tokens)]
        final_expected = None

        def random_piece(tokens: int, dtype: torch.dtype) -> torch.Tensor:
            x = torch.randn(*self.batch, tokens, value_dim, generator=gen, device=device)
            return x.to(dtype).double()

        if loop.kind == "scan":
            ys_dtype = self._dtype_of_scan_output()
            tail = random_piece(T - head_tokens, ys_dtype)
            expected[..., head_tokens:, :] = tail
            ys = _relabel(expected, can_labels, ["t"] + h.step_labels).to(ys_dtype)
            state_dtype = self._dtype_of(loop.scan_inputs[0][0]) or torch.float32
            state = torch.randn(self.region.state_shape, generator=gen, device=device).to(state_dtype)
            ev.env[loop.scan] = (state, ys)
            final_expected = state
            wanted = [loop.out] + ([loop.final] if loop.final is not None else [])
        else:
            n = loop.steps
            for j in range(m, n - 1):
                o_j = loop.outputs[j]
                a, b = _step_tokens(j, span, T)
                piece = random_piece(b - a, _tensor_example(o_j).dtype)
                expected[..., a:b, :] = piece
                length = _shape(o_j)[h.step_labels.index("t")] if "t" in h.step_labels else 1
                ev.env[o_j] = _expected_step(piece, can_labels, 0, span, b - a, h.step_labels, length).to(
                    _tensor_example(o_j).dtype)
            prev = loop.states[n - 2]
            if n - 2 >= m:
                ev.env[prev] = (torch.randn(self.region.state_shape, generator=gen, device=device) /
                                math.sqrt(self.region.state_shape[-2])).to(_tensor_example(prev).dtype)
            (s_prev,) = ev.run([prev])
            a = (n - 1) * span
            o_last, s_last = _reference(h, values, a, T, self.region.state_shape,
                                        state=_state_to_op(s_prev, r.nb, h.transposed, E).double())
            expected[..., a:, :] = _canonical_out(o_last, r.nb)[0] * h.scale
            checked.append((a, T))
            final_expected = _state_from_op(s_last, r.nb, h.transposed, E)
            wanted = [loop.out, loop.final]
        got = ev.run(wanted, read_pos=loop.end)
        out_val = got[0]
        errors, best_out = [], math.inf
        for labels in _out_labels(tuple(out_val.shape), self.batch, T, "loop's output"):
            exp = _relabel(expected, can_labels, labels)
            err = _rel(out_val, exp)
            t_axis = labels.index("t")
            for lo, hi in checked:
                if hi > lo:
                    err = max(err, _rel(out_val.narrow(t_axis, lo, hi - lo), exp.narrow(t_axis, lo, hi - lo)))
            if err < best_out:
                best_out, self.out_labels = err, labels
        errors.append(best_out)
        if loop.final is not None and len(got) > 1:
            errors.append(_rel(got[1], final_expected))
        return max(errors)

    def _dtype_of(self, n):
        ev = _tensor_example(n)
        return None if ev is None else ev.dtype

    def _dtype_of_scan_output(self):
        ev = _example(self.loop.scan)
        if isinstance(ev, (list, tuple)) and len(ev) > 1 and isinstance(ev[1], torch.Tensor):
            return ev[1].dtype
        return torch.float32


# ----------------------------------------------------------------------------------------------
# Rewrite


def _rewrite(gm: fx.GraphModule, idx: _Index, loop: _Loop, region: _Region, h: _Hypothesis,
             out_labels: list[str], fake_mode: Any) -> fx.Node:
    from .. import lowering  # noqa: F401  (registers the op)

    graph = gm.graph
    r = h.roles
    last_leaf = max(region.leaves, key=lambda n: idx.pos[n]) if region.leaves else None
    insert_after = last_leaf
    if insert_after is None:
        raise Refusal("the region has no inputs")
    first_use = min([idx.pos[u] for u in loop.out_users + loop.final_users], default=math.inf)
    if idx.pos[insert_after] >= first_use:
        raise Refusal("an input of the recurrence is defined after the loop's output is used")
    E = _Emitter(graph, loop.anchor, fake_mode)
    with graph.inserting_before(insert_after.next):
        q = _to_op(r.q.node, r.q.labels, r.nb, E)
        k = _to_op(r.k.node, r.k.labels, r.nb, E)
        v = _to_op(r.v.node, r.v.labels, r.nb, E)
        dtypes = {_tensor_example(x).dtype for x in (q, k, v)}
        if len(dtypes) > 1:
            q, k, v = (E.cast(x, torch.float32) for x in (q, k, v))
        if r.beta is not None:
            beta = _to_op(r.beta.node, r.beta.labels, r.nb, E)
        else:
            first = E.call(operator.getitem, v, (Ellipsis, 0))
            beta = E.call(torch.ones_like, first)
        g = _to_op(r.g.node, r.g.labels, r.nb, E) if r.g is not None else None
        h0 = _state_to_op(r.h0, r.nb, h.transposed, E) if r.h0 is not None else None
        final_needed = bool(loop.final_users)
        # Keep the forward's intra-chunk matrices for the backward when the graph will be differentiated.
        keep = keeps_intermediates(*(_tensor_example(x) for x in (q, k, v, beta, g, h0) if x is not None))
        result = E.call(torch.ops.hccompile.chunk_delta_rule.default, q, k, v, beta, g, h0, None, None, None,
                        r.gate, float(h.scale), final_needed, bool(h.l2norm), None, OP_CHUNK_SIZE, keep)
        o = E.call(operator.getitem, result, 0)
        o = _out_from_op(o, out_labels, r.nb, E)
        want = _tensor_example(loop.out)
        if want is not None:
            o = E.cast(o, want.dtype)
        state = None
        if final_needed:
            state = E.call(operator.getitem, result, 1)
            state = _state_from_op(state, r.nb, h.transposed, E)
            want_state = _tensor_example(loop.final)
            if want_state is None and loop.kind == "scan":
                want_state = _tensor_example(loop.scan_inputs[0][0])
            if want_state is not None:
                state = E.cast(state, want_state.dtype)
    idx.place(E.created, insert_after)
    out_users = set(loop.out_users)
    loop.out.replace_all_uses_with(o, delete_user_cb=lambda u: u in out_users)
    if state is not None:
        final_users = set(loop.final_users)
        loop.final.replace_all_uses_with(state, delete_user_cb=lambda u: u in final_users)
    for n in sorted(region.nodes, key=lambda x: idx.pos.get(x, -1), reverse=True):
        if n.graph is graph and not _is_erased(n) and not n.users and n.op not in ("placeholder", "output"):
            graph.erase_node(n)
    return result


# ----------------------------------------------------------------------------------------------
# The pass


def _state_shape(loop: _Loop) -> tuple[int, ...]:
    if loop.kind == "scan":
        init = loop.scan_inputs[0][0]
        shape = _shape(init) if isinstance(init, fx.Node) else None
    else:
        shape = _shape(loop.states[0])
    if shape is None or len(shape) < 2:
        raise Refusal("the carried state is not a tensor of at least two dims")
    return shape


def _check_dtypes(roles: _Roles) -> None:
    for name, item in (("q", roles.q), ("k", roles.k), ("v", roles.v)):
        dtype = _tensor_example(item.node).dtype
        if dtype not in SUPPORTED_DTYPES:
            raise Refusal(f"{name} has dtype {dtype}; the kernels take float16, bfloat16 or float32")
        width = _shape(item.node)[-1]
        if width > MAX_HEAD_DIM:
            raise Refusal(f"{name}: head dim {width} exceeds the kernels' maximum {MAX_HEAD_DIM}")
    if _shape(roles.q.node) != _shape(roles.k.node) or roles.q.labels != roles.k.labels:
        raise Refusal(f"q {list(_shape(roles.q.node))} and k {list(_shape(roles.k.node))} differ in shape or layout")
    if roles.nb == 2:
        bq, bv = _shape(roles.q.node), _shape(roles.v.node)
        b0q, b0v = bq[roles.q.labels.index("b0")], bv[roles.v.labels.index("b0")]
        if b0q != b0v:
            raise Refusal("q and v differ in the first batch axis (only heads may be grouped)")


def _has_l2norm_ops(region: _Region, idx: _Index) -> bool:
    return any(_plain(idx.name(n)) in ("rsqrt", "normalize", "norm", "vector_norm", "sqrt") for n in region.nodes
               if n.op in ("call_function", "call_method"))


def lower_loop(loop: _Loop, gm: fx.GraphModule, idx: _Index, ctx: PassContext) -> dict[str, Any]:
    """Analyse, prove and replace one loop; returns the match details. Raises Refusal."""
    if loop.kind == "unrolled":
        _analyse_unrolled(loop, idx)
    state_shape = _state_shape(loop)
    region = _build_region(loop, idx, state_shape)
    out_shape = _shape(loop.out)
    if out_shape is None:
        raise Refusal(f"the loop's output {_describe(loop.out)} is not a tensor")
    options = _assign_roles(loop, region, idx, out_shape[-1])
    _check_dtypes(options[0])
    if not ctx.config.probe:
        raise Refusal("probe=False: this pass identifies the scale, l2 normalisation and the roles of "
                      "q, k and v numerically, so it does not lower without the probe")
    dtype = _tensor_example(options[0].v.node).dtype
    tol = probe_tolerance(dtype, ctx.config)
    probe = _Probe(loop, region, gm, idx, tol)
    l2_options = (False, True) if _has_l2norm_ops(region, idx) else (False,)
    with torch.no_grad():
        try:
            h, values, ev, m, span = probe.choose(options, l2_options)
            if not h.error <= tol:
                raise Refusal(_mismatch_reason(h, tol, "first steps"))
            err = probe.verify(h, values, ev, m, span)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            raise Refusal(f"probe impossible: {type(e).__name__}: {e}") from e
    if not err <= tol:
        raise Refusal(_mismatch_reason(h, tol, "whole loop", err))
    r = h.roles
    anchor_name = loop.anchor.name
    result = _rewrite(gm, idx, loop, region, h, probe.out_labels, ctx.fake_mode)
    return {
        "node": anchor_name,
        "replacement": result.name,
        "form": _form(loop, span),
        "gate": r.gate,
        "steps": loop.steps,
        "tokens": r.T,
        "scale": h.scale,
        "use_qk_l2norm_in_kernel": h.l2norm,
        "initial_state": r.h0 is not None,
        "final_state": bool(loop.final_users),
        "grouped_heads": _shape(r.q.node)[r.q.labels.index("b1")] != _shape(r.v.node)[r.v.labels.index("b1")]
        if r.nb == 2 else False,
        "layout": {"q": r.q.labels, "v": r.v.labels, "out": probe.out_labels},
        "region_nodes": len(region.nodes),
        "probe_rel_err": max(h.error, err),
        **({"lengths": unrolled_loop_note(loop.steps, f"hccompile.{_PUBLIC_OP[r.gate]}")}
           if loop.kind == "unrolled" else {}),
    }


_PUBLIC_OP = {"none": "chunk_delta_rule", "scalar": "chunk_gated_delta_rule", "channel": "chunk_kda"}


def _form(loop: _Loop, span: int) -> str:
    if loop.kind == "scan":
        return "scan"
    return "recurrent" if span == 1 else f"chunked (chunk {span})"


def _mismatch_reason(h: _Hypothesis, tol: float, where: str, err: float | None = None) -> str:
    err = h.error if err is None else err
    what = {"none": "delta rule", "scalar": "gated delta rule (scalar gate)",
            "channel": "gated delta rule (per-channel gate)"}[h.roles.gate]
    return (f"probe mismatch ({where}): the loop differs from the {what} by relative RMS {err:.3g} "
            f"(tolerance {tol:g}) under every role assignment tried; a different update rule (e.g. linear "
            f"attention S += k v^T, a sign flip, a gate without exp) or a non-causal form")


def find_loops(gm: fx.GraphModule, idx: _Index) -> list[_Loop]:
    loops = _group_loops(_find_families(idx), idx)
    for n in gm.graph.nodes:
        if _is_scan(n):
            loops.append(_Loop("scan", n, 0))
    loops.sort(key=lambda lp: idx.pos[lp.anchor])
    return loops


@register_pass
class DeltaRulePass(GraphPass):
    name = "delta_rule"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        idx = _Index(gm.graph)
        changed = False
        for loop in find_loops(gm, idx):
            if _is_erased(loop.anchor):
                continue  # inside a loop replaced already
            where = loop.anchor.name
            try:
                if loop.kind == "scan":
                    loop = _analyse_scan(loop.anchor, gm, idx)
                details = lower_loop(loop, gm, idx, ctx)
            except NotARecurrence as e:
                record.notes.append(f"{PATTERN}: {e}")
                continue
            except Refusal as e:
                record.refuse(PATTERN, str(e), node=where)
                continue
            record.match(PATTERN, **details)
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
