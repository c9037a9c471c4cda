"""What a replacement makes dead: from what the loop reads, a walk back through the recurrence's own
machinery to tensors shaped like the op's inputs. Separate from role inference: this decides which
nodes go and which are inputs, not what each input means."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...compat import concrete_shape
from ..fx_match import Refusal, walk
from .vocabulary import (_ABSORB, _CREATE, _Index, _RANDOM, _data_operands, _describe, _example, _mutated_operand,
                         _plain, _tensor_example)
from .loops import _Loop


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
    # depth-first: the first input refused is the one the message names
    for n in walk(loop.externals, operands.__getitem__, stop=lambda n: status[n] == _LEAF, depth_first=True):
        if status[n] == _BAD:
            raise Refusal(f"the recurrence reads {_describe(n)}, which is neither a per-token input "
                          f"(the state's batch axes plus time) nor the initial state; e.g. a constant "
                          f"per-head decay or a parameter used inside the loop")
        if status[n] == _LEAF:
            leaves.append(n)
        else:
            region.add(n)
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
