"""Block-level recompute for mHC hyper-connections (seed 000), from the layers hc_detect found.

For each block of consecutive hyper-connection layers the plan keeps only the block's input stream
and every sublayer output f; every hyper-connection intermediate (norm r, projection, H_pre, H_post,
H_res and its Sinkhorn chain, the aggregate y, the mixed residual, the post-distribution, the
residual adds, the streams inside the block) is rebuilt in backward. Attention and MLP (the
sublayers) are never recomputed.

Mechanism: Dynamo-graph nodes are tagged `meta["recompute"] = MUST_RECOMPUTE` with one
`ac_graph_id` per block (tags propagate to the joint graph, where the partitioner honours them);
AOTAutograd's partitioner saves a tagged node whose users belong to another block, which is how a
block's output becomes the next block's saved input. Each f is tagged MUST_SAVE. Random ops are
never tagged: a dropout inside the sublayer sits before f, which is saved, so masks are never
replayed and gradients equal the non-recompute run exactly.

When hc_fuse ran first, the layers' fields point at its custom ops (mapping, aggregate, post), which
sit in the same regions and are tagged the same way: custom ops are saved unless tagged.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from . import fx_match as M
from .base import GraphPass, PassContext, register_pass
from .hc_detect import HCLayer, chain_layers, current_layers, view_root

_NORMS = {torch.rms_norm, torch.layer_norm, torch.nn.functional.layer_norm,
          torch.nn.functional.rms_norm, torch.group_norm, torch.nn.functional.group_norm}


def default_block_length(n: int, num_layers: int) -> int:
    """The paper's optimum L_r* ≈ √(n·L/(n+2)) sublayers per block."""
    return max(1, round(math.sqrt(n * num_layers / (n + 2))))


def _forward_closure(start: fx.Node) -> set[fx.Node]:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _backward_closure(end: fx.Node) -> set[fx.Node]:
    seen, todo = {end}, [end]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def sublayer_interior(layer: HCLayer) -> set[fx.Node]:
    """Nodes strictly between y and f: the attention/MLP itself."""
    return (_forward_closure(layer.aggregate) & _backward_closure(layer.f)) - {layer.aggregate, layer.f}


def plan_blocks(seq: list[HCLayer], mode: str, block: int | None) -> list[list[HCLayer]]:
    n = M.example(seq[0].h_res).shape[-1] if M.example(seq[0].h_res) is not None else 4
    size = 1 if mode == "layer" else (block or default_block_length(int(n), len(seq)))
    return [seq[i:i + size] for i in range(0, len(seq), size)]


@register_pass
class HCRecomputePass(GraphPass):
    name = "recompute"
    stage = "dynamo"
    order = 200

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        cfg = ctx.config
        if cfg.hc_recompute == "off":
            record.notes.append("hc_recompute='off': plan left to the partitioner")
            return False
        layers = current_layers(gm)
        if not layers:
            return False
        next_id = 1 + max((n.meta.get("ac_graph_id", 0) for n in gm.graph.nodes), default=0)
        plan = []
        for seq in chain_layers(layers):
            for blk in plan_blocks(seq, cfg.hc_recompute, cfg.hc_recompute_block):
                start, end = view_root(blk[0].x), blk[-1].x_out
                region = (_forward_closure(start) & _backward_closure(end)) - {start}
                keep: set[fx.Node] = set()
                for layer in blk:
                    interior = sublayer_interior(layer)
                    keep |= interior | {layer.f}
                    if cfg.hc_recompute_include_norm:
                        first = [n for n in interior if n.op == "call_function" and n.target in _NORMS
                                 and view_root(n.args[0]) is view_root(layer.aggregate)]
                        keep -= set(first)
                    if not cfg.hc_recompute_include_bda and layer is not blk[-1]:
                        keep.add(layer.x_out)
                recomputed = []
                for n in region - keep:
                    if n.op in ("placeholder", "get_attr", "output") or M.is_impure(n):
                        continue
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    n.meta["ac_graph_id"] = next_id
                    recomputed.append(n)
                for layer in blk:
                    layer.f.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                    layer.f.meta["ac_graph_id"] = next_id
                    if not cfg.hc_recompute_include_bda and layer is not blk[-1]:
                        layer.x_out.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                        layer.x_out.meta["ac_graph_id"] = next_id
                plan.append({"block": next_id, "layers": [l.index for l in blk],
                             "saved": [start.name] + [l.f.name for l in blk],
                             "recomputed_nodes": len(recomputed)})
                record.match("hc_block_recompute", node=end.name, block=next_id,
                             layers=[l.index for l in blk], input=start.name,
                             saved_sublayer_outputs=[l.f.name for l in blk],
                             recomputed_nodes=len(recomputed))
                next_id += 1
        if ctx.report is not None:
            ctx.report.recompute_plan = plan
        return bool(plan)
