"""Records which hccompile ops reached each post-grad graph (forward, backward or inference), so
the report shows that a lowering holds in both directions. Changes nothing."""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..compat import launched_kernel
from ..lowering._launch import RUNTIME_CHECKS, launched_op
from .base import GraphPass, PassContext, register_pass


def graph_role(graph: fx.Graph) -> str:
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    has_tangents = any(n.startswith("tangents") for n in names)
    has_primals = any(n.startswith("primals") for n in names)
    if has_tangents and has_primals:
        return "joint"
    if has_tangents:
        return "backward"
    if has_primals:
        return "forward"
    return "inference"


def hccompile_ops(graph: fx.Graph) -> list[str]:
    """Our ops in a post-grad graph, in order, by the public op name: a call of the op (or of its
    `_host` twin: CPU, Triton's interpreter, float64), or, where AOTAutograd traced the op into
    its kernel launches (CUDA, lowering/_launch.py), every per_call-th launch of the op's own
    kernel."""
    ops: list[str] = []
    launches: dict[str, int] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        target = str(n.target)
        if target in RUNTIME_CHECKS:
            continue
        if target.startswith("hccompile."):
            ops.append(target.replace("_host.", ".", 1))
        else:
            name, per_call = launched_op(launched_kernel(n))
            if name:
                launches[name] = launches.get(name, 0) + 1
                if (launches[name] - 1) % per_call == 0:
                    ops.append(name)
    return ops


@register_pass
class OpInventoryPass(GraphPass):
    name = "op_inventory"
    stage = "post_grad"

    def run(self, graph: fx.Graph, ctx: PassContext, record: Any) -> bool:
        ops = hccompile_ops(graph)
        record.notes.append(f"{ctx.graph_name}: {', '.join(ops) if ops else 'no hccompile ops'}")
        ctx.report.lowered_ops.setdefault(ctx.graph_name, []).extend(ops)
        return False
