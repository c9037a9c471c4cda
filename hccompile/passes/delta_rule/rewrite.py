"""The one graph edit: the op call after the last input, with layout conversions around it, and the
region erased. Kept apart so that every stage before it only reads the graph."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from ...lowering.delta_rule import keeps_intermediates
from ..fx_match import Refusal
from ..emit import GraphEmitter
from .vocabulary import _Index, _is_erased, _tensor_example
from .loops import _Loop
from .region import _Region
from .emit import _out_from_op, _state_from_op, _state_to_op, _to_op
from .probe import OP_CHUNK_SIZE, _Hypothesis


# ----------------------------------------------------------------------------------------------
# Rewrite


def _rewrite(gm: fx.GraphModule, idx: _Index, loop: _Loop, region: _Region, h: _Hypothesis,
             out_labels: list[str], fake_mode: Any) -> fx.Node:
    graph = gm.graph
    r = h.roles
    last_leaf = max(region.leaves, key=lambda n: idx.pos[n]) if region.leaves else None
    insert_after = last_leaf
    if insert_after is None:
        raise Refusal("the region has no inputs")
    first_use = min([idx.pos[u] for u in loop.out_users + loop.final_users], default=math.inf)
    if idx.pos[insert_after] >= first_use:
        raise Refusal("an input of the recurrence is defined after the loop's output is used")
    E = GraphEmitter(graph, fake_mode, {"stack_trace": loop.anchor.meta.get("stack_trace")})
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
            first = E.getitem(v, (Ellipsis, 0))
            beta = E.call(torch.ones_like, first)
        g = _to_op(r.g.node, r.g.labels, r.nb, E) if r.g is not None else None
        h0 = _state_to_op(r.h0, r.nb, h.transposed, E) if r.h0 is not None else None
        final_needed = bool(loop.final_users)
        # Keep the forward's intra-chunk matrices for the backward when the graph will be differentiated.
        keep = keeps_intermediates(*(_tensor_example(x) for x in (q, k, v, beta, g, h0) if x is not None))
        result = E.op("chunk_delta_rule", q, k, v, beta, g, h0, None, None, None,
                      r.gate, float(h.scale), final_needed, bool(h.l2norm), None, OP_CHUNK_SIZE, keep)
        o = E.getitem(result, 0)
        o = _out_from_op(o, out_labels, r.nb, E)
        want = _tensor_example(loop.out)
        if want is not None:
            o = E.cast(o, want.dtype)
        state = None
        if final_needed:
            state = E.getitem(result, 1)
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
