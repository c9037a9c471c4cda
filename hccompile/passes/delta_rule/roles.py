"""Which input is q, k, v, beta, g or h0, read from shapes and use (the input that reaches an exp is
the gate; q is the one the state does not depend on). Shapes can leave several assignments open:
this gives the candidates, the probe picks one."""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import permutations

import torch.fx as fx

from ..fx_match import Refusal, walk
from .vocabulary import _EXP, _GATE_PATH, _Index, _data_operands, _describe, _is_scan, _name, _plain, _shape
from .loops import _Loop
from .region import _Region, _TokenLayout, _token_layouts

# Forward walks that classify an input stop after this many nodes.
GATE_WALK_LIMIT = 512


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
    def reads(n: fx.Node) -> list[fx.Node]:
        inputs = _data_operands(n) if n.op in ("call_function", "call_method") else []
        if idx is None:
            return inputs
        return inputs + [m for a in inputs for m in idx.mutators_before(a, idx.pos.get(n, math.inf))]

    return any(n is source for n in walk(node, reads, stop=lambda n: n not in within))


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
