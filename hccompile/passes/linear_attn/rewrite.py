"""Putting the replacement into the graph and erasing what it left unread. Kept apart because erasing
is where a wrong assumption would corrupt the user's program: only nodes nothing reads, in-place
writes only into tensors the graph created, and in the final sweep only kinds known to be pure."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import fx_match as M
from ..base import PassContext
from ..emit import GraphEmitter
from .vocabulary import (_CREATION_FNS, _CREATION_METHODS, _OPERATORS, _alive, _impurity, _is_fresh,
                         _kind, _mutation_target)
from .facts import _Facts
from .quadratic import Candidate
from .emit import build


def rewrite(cand: Candidate, gm: fx.GraphModule, ctx: PassContext, facts: _Facts,
            region: list[fx.Node]) -> fx.Node:
    g = gm.graph
    em = GraphEmitter(g, ctx.fake_mode, {"stack_trace": cand.anchor.meta.get("stack_trace")})
    with g.inserting_before(cand.insert_before or cand.anchor):
        out = build(cand, em, cand.q.node, cand.k.node, cand.v.node)
        want = M.example(cand.anchor)
        if isinstance(want, torch.Tensor):
            out = em.cast(out, want.dtype)
    if cand.mutations:  # an output buffer written block by block: its later readers read `out`
        writes = set(cand.mutations)
        for user in list(cand.anchor.users):
            if user not in writes:
                user.replace_input_with(cand.anchor, out)
        for n in cand.mutations:
            g.erase_node(n)
    else:
        cand.anchor.replace_all_uses_with(out)
    _erase_dead(g, [cand.anchor] + cand.region + region, facts)
    return out


def _erase_dead(g: fx.Graph, nodes: list[fx.Node], facts: _Facts) -> None:
    """Erase the nodes that nothing reads any more, consumers first. An in-place write is erased
    only when nothing reads its target after it and the target was created in the graph."""
    facts.refresh_order()
    alive = [n for n in set(nodes) if _alive(n, g) and n in facts.order]
    for n in sorted(alive, key=facts.order.__getitem__, reverse=True):
        if n.users or n.op not in ("call_function", "call_method"):
            continue
        target = _mutation_target(n)
        if target is not None:
            if not _is_fresh(target):
                continue
            if any(facts.order.get(u, -1) > facts.order[n] for u in target.users if u is not n):
                continue
        elif _impurity(n) or n.is_impure():
            continue
        g.erase_node(n)


_PURE_FNS = _CREATION_FNS | _OPERATORS | {
    operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne, operator.truediv,
    operator.floordiv, torch.abs, torch.clamp, torch.clamp_min, torch.log, torch.stack, torch.flip}
_PURE_METHODS = _CREATION_METHODS | {"abs", "clamp", "clamp_min", "log", "flip", "bool", "size"}


def _sweep_dead(g: fx.Graph) -> None:
    """Erase unread nodes of the kinds this pass knows to be pure (e.g. a block loop's last state
    update, which fed only the next block). One sweep, consumers first."""
    for n in reversed(list(g.nodes)):
        if n.users or n.op not in ("call_function", "call_method"):
            continue
        known = _kind(n) is not None or (n.op == "call_function" and n.target in _PURE_FNS) or \
            (n.op == "call_method" and n.target in _PURE_METHODS)
        if known and _mutation_target(n) is None and not _impurity(n) and not n.is_impure():
            g.erase_node(n)
