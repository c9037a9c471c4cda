"""The aggregate y = H_pre·x, the sublayer's input. Apart from the post, with which it shares only
the stream layout, so that each fusion is planned, proven and refused on its own."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import fx_match as M
from ..emit import Emitter
from ..fx_match import Refusal
from ..hc_detect import HCLayer
from .views import _shape, _sym_shape
from .layout import StreamLayout, _canonical_stream, _tokens2, reshape_to


# ----------------------------------------------------------------------------------------
# aggregate


@dataclass
class AggregatePlan:
    layout: StreamLayout
    h_pre: fx.Node
    node: fx.Node


def plan_aggregate(layer: HCLayer, layout: StreamLayout, h_pre: fx.Node) -> AggregatePlan:
    T1, T2, n, C = layout.sizes
    y = layer.aggregate
    if torch.Size(_shape(y)).numel() != T1 * T2 * C:
        raise Refusal(f"{y.name}: aggregate shape {_shape(y)} is not [tokens, C]")
    if M.example(y).dtype != M.example(layout.x).dtype:
        raise Refusal(f"{y.name}: the aggregate's dtype differs from the stream's")
    return AggregatePlan(layout, h_pre, y)


def build_aggregate(plan: AggregatePlan, em: Emitter, x, h_pre):
    lay = plan.layout
    x4 = _canonical_stream(lay, em, x)
    y = em.op("mhc_aggregate", x4, _tokens2(lay, em, h_pre, plan.h_pre, (lay.sizes[2],)))
    return reshape_to(em, y, lay.sym_sizes[:2] + (lay.sizes[3],), _sym_shape(plan.node), lay)
