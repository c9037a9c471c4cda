"""Views feeding our ops are rebuilt in backward, not saved.

Every hccompile op saves its tensor inputs for its backward, and these are often views (the
[B, T, H·D] -> [B, T, H, D] reshape of a projection, a permute). A saved view becomes an output of
the forward graph, and Inductor (torch 2.13) orders an output view's strides without its shape
environment: with a symbolic length and a batch of 1, strides such as (32·s, 32, 16, 1) cannot be
sorted ("cannot determine truth value of Relational: 1 < s27"), so the rewritten graph failed to
compile under dynamic shapes and hc fell back to plain Inductor. Tagging the views MUST_RECOMPUTE
makes the partitioner save the tensor they view instead and replay the (free) views in backward.
Nodes another pass already tagged (block recompute) keep their tags.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from . import fx_match as M
from .base import GraphPass, PassContext, register_pass


def _is_our_op(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target.namespace == "hccompile"


@register_pass
class SavedViewsPass(GraphPass):
    name = "saved_views"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        views: list[fx.Node] = []
        for node in gm.graph.nodes:
            if _is_our_op(node):
                for arg in node.all_input_nodes:
                    views += [v for v in M.view_chain(arg) if "recompute" not in v.meta and v not in views]
        if not views:
            return False
        ac_id = 1 + max((n.meta.get("ac_graph_id", 0) for n in gm.graph.nodes), default=0)
        for view in views:
            view.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            view.meta["ac_graph_id"] = ac_id
        record.notes.append(f"{len(views)} view(s) feeding hccompile ops replayed in backward: "
                            + ", ".join(v.name for v in views))
        return True
