"""The graph edits: the replacement inserted before the values it replaces, their uses redirected,
what only they used erased, and hc_detect's layer record pointed at the new nodes (the recompute
pass tags by it). Kept apart so that every stage before it only reads the graph."""
from __future__ import annotations

import operator

import torch.fx as fx

from .. import fx_match as M
from ..base import PassContext
from ..emit import GraphEmitter
from ..hc_detect import HCLayer, view_root
from .mapping import MappingPlan, _earliest, _late_inputs, build_mapping
from .post import PostPlan, build_post
from .aggregate import AggregatePlan, build_aggregate


# ----------------------------------------------------------------------------------------
# rewrite


def _dead_code(g: fx.Graph, old: list[fx.Node], keep: set[fx.Node]) -> int:
    """Erase the replaced nodes and whatever only they used, up to `keep`."""
    def kept(node: fx.Node) -> bool:
        return node in keep or node.op in ("placeholder", "output", "get_attr")

    region = set(M.walk(old, M.inputs, skip=kept))
    order = {n: i for i, n in enumerate(g.nodes)}
    erased = 0
    for node in sorted((n for n in region if n in order), key=order.__getitem__, reverse=True):
        if not node.users and not M.is_impure(node):
            g.erase_node(node)
            erased += 1
    return erased


def _tag(node: fx.Node, layer: int, role: str) -> None:
    node.meta["hc"] = {"layer": layer, "role": role}


# what the new nodes take over from the node they are inserted at
_INHERITED_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


def _emitter(gm: fx.GraphModule, ctx: PassContext, meta_from: fx.Node) -> GraphEmitter:
    return GraphEmitter(gm.graph, ctx.fake_mode,
                        {key: meta_from.meta[key] for key in _INHERITED_META if key in meta_from.meta})


def _tag_created(em: GraphEmitter, layer: int) -> None:
    """Every new node carries an `hc` role, which the recompute pass tags by: the op's name, the
    mapping's three outputs by theirs, `size` or `view` for the rest."""
    for node in em.created:
        if node.op == "call_method":
            role = "size" if node.target == "size" else "view"
        elif node.target is operator.getitem:
            role = ("h_pre", "h_post", "h_res")[node.args[1]]
        else:
            role = node.target.overloadpacket.__name__
        _tag(node, layer, role)


def rewrite_mapping(plan: MappingPlan, layer: HCLayer, gm: fx.GraphModule, ctx: PassContext
                    ) -> list[fx.Node]:
    g = gm.graph
    anchor = _earliest(g, plan.values)
    for node in _late_inputs(g, plan.alphas + plan.biases, anchor):
        anchor.prepend(node)  # graph order kept among them; they read parameters only
    em = _emitter(gm, ctx, anchor)
    with g.inserting_before(anchor):
        outs = build_mapping(plan, em, plan.proj, plan.r, plan.alphas, plan.biases)
    _tag_created(em, layer.index)
    op = next(n for n in em.created if n.meta["hc"]["role"] == "mhc_mapping")
    _tag(op, layer.index, "mapping")
    for old, new in zip(plan.values, outs):
        old.replace_all_uses_with(new)
    keep = {plan.proj, plan.r, *[a for a in plan.alphas if a is not None],
            *[b for b in plan.biases if b is not None]}
    _dead_code(g, plan.values + [layer.h_pre, layer.h_post, layer.sinkhorn[-1]], keep)
    layer.h_pre, layer.h_post, layer.h_res = outs
    return outs


def rewrite_post(plan: PostPlan, layer: HCLayer, layers: list[HCLayer], gm: fx.GraphModule,
                 ctx: PassContext) -> fx.Node:
    g = gm.graph
    old = plan.x_out
    em = _emitter(gm, ctx, old)
    with g.inserting_before(old):
        new = build_post(plan, em, plan.layout.x, plan.h_res, plan.h_post, plan.f)
    _tag_created(em, layer.index)
    op = next(n for n in em.created if n.meta["hc"]["role"] == "mhc_post")
    _tag(op, layer.index, "post")
    _tag(new, layer.index, "x_out")
    old.replace_all_uses_with(new)
    _dead_code(g, [old, layer.mixed, layer.post],
               {plan.layout.x, plan.h_res, plan.h_post, plan.f, layer.aggregate})
    for other in layers:  # the next layer's stream input is this layer's output
        if other.x is old:
            other.x = view_root(new)
    layer.x_out, layer.mixed, layer.post = new, op, op
    return new


def rewrite_aggregate(plan: AggregatePlan, layer: HCLayer, gm: fx.GraphModule, ctx: PassContext
                      ) -> fx.Node:
    g = gm.graph
    old = plan.node
    em = _emitter(gm, ctx, old)
    with g.inserting_before(old):
        new = build_aggregate(plan, em, plan.layout.x, plan.h_pre)
    _tag_created(em, layer.index)
    _tag(new, layer.index, "aggregate")
    old.replace_all_uses_with(new)
    _dead_code(g, [old], {plan.layout.x, plan.h_pre, layer.mixed})
    layer.aggregate = new
    return new
