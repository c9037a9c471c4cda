"""Finding the loop again in a flat graph. Dynamo unrolls `for t in range(T)` into T copies of one
step, so the loop is recovered from the slices it reads, proven to be one step repeated, and its
state and output located; a `scan` is unpacked instead. This is where graph shapes are handled;
what the loop computes is left to the probe."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from .. import fx_match as M
from ..fx_match import Refusal, walk
from .vocabulary import _Index, _POSITIONAL, _POST, _describe, _mutated_operand, _name, _shape

# Nodes an iteration may compute for the next one before reading its slices (S = S.clone() ...).
MAX_ROTATION = 8


class NotARecurrence(Exception):
    """A loop that carries no state: not a candidate at all (recorded as a note)."""


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


def _find_families(idx: _Index) -> list[_Family]:
    groups: dict[tuple, list[tuple[float, Any, fx.Node, tuple]]] = defaultdict(list)
    for n in idx.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        for base, axis, kind, value, mask in M.index_entries(n):
            if kind == "new":
                continue
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


def _run_between(a: fx.Node, b: fx.Node) -> list[fx.Node]:
    """The nodes from `a` up to, not including, `b` (which follows it) in graph order."""
    out, n = [], a
    while n is not b:
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

    # Values computed from this loop's slices (directly or through earlier such values): what a
    # recurrence hands on. Constants an iteration prepares for the next one (a position mask built
    # before the next slices are read) are not.
    first = _run_between(anchors[0], anchors[1])
    second = _run_between(anchors[1], anchors[2]) if n_steps > 2 else _walk(anchors[1], len(first))
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

    starts = [back(a, shift) for a in anchors]
    iterations = [_run_between(starts[j], starts[j + 1]) for j in range(n_steps - 1)]
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
        def views_before(a: fx.Node) -> list[fx.Node]:
            return [u for u in a.users if idx.pos.get(u, math.inf) < start and idx.base_of(u) is buffer]

        aliases = set(walk(buffer, views_before))
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
