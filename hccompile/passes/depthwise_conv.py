"""Depthwise 1-d convolutions with a short kernel, written as a sum of shifted slices.

The short causal convolution in front of linear-attention and delta-rule layers (HF's
`causal_conv1d_fn` torch path, FLA's ShortConvolution fallback: `F.conv1d(x, w[:, None], b,
padding=K - 1, groups=C)`) pins the sequence length: Inductor's convolution backward lowering
(torch 2.13, kernel/conv.py) guards the input-gradient strides to integers, so a graph compiled for
one T is recompiled for every other. As K shifted multiply-adds the same function is pointwise
work that Inductor fuses into one kernel in each direction and keeps symbolic in T.

Matched: conv1d on a [B, C, L] input with weight [C, 1, K], groups == C, stride 1, dilation 1,
integer padding, K <= MAX_KERNEL. Anything else (channel mixing, strides, "same" padding) is left
to Inductor, and the report says why.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import fx_match as M
from .base import GraphPass, PassContext, register_pass

MAX_KERNEL = 8  # beyond this a convolution kernel beats K passes over the input
PATTERN = "depthwise_conv1d"


def _int(value: Any) -> int | None:
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, int) else None


def _refusal(node: fx.Node) -> str | None:
    x, w = M.example(M.arg(node, 0, "input")), M.example(M.arg(node, 1, "weight"))
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return "input or weight has no example value"
    if x.dim() != 3 or w.dim() != 3:
        return f"not a batched 1-d convolution (input {x.dim()}-d, weight {w.dim()}-d)"
    channels, per_group, kernel = w.shape
    groups = M.arg(node, 6, "groups", 1)
    if not all(isinstance(s, int) for s in (channels, per_group, kernel)) or not isinstance(groups, int):
        return "weight shape or groups not static"
    if per_group != 1 or groups != channels or x.shape[1] != channels:
        return f"not depthwise (groups {groups}, weight {tuple(w.shape)}, input channels {x.shape[1]})"
    if kernel > MAX_KERNEL:
        return f"kernel size {kernel} > {MAX_KERNEL}"
    if _int(M.arg(node, 3, "stride", 1)) != 1 or _int(M.arg(node, 5, "dilation", 1)) != 1:
        return "stride or dilation is not 1"
    if _int(M.arg(node, 4, "padding", 0)) is None:
        return f"padding {M.arg(node, 4, 'padding', 0)!r} is not an integer"
    return None


def _emit(graph: fx.Graph, node: fx.Node, fake_mode: Any) -> fx.Node:
    x, w, bias = M.arg(node, 0, "input"), M.arg(node, 1, "weight"), M.arg(node, 2, "bias")
    padding = _int(M.arg(node, 4, "padding", 0))
    kernel = M.example(w).shape[2]

    def call(target, *args):
        new = graph.call_function(target, args)
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        new.meta["example_value"] = M.fake_value(new, fake_mode)
        return new

    padded = call(torch.constant_pad_nd, x, (padding, padding)) if padding else x
    out = None
    for j in range(kernel):
        # out[..., t] += w[:, 0, j] * padded[..., t + j]; the slice ends K - 1 - j before the end
        stop = j - (kernel - 1) if j < kernel - 1 else None
        shifted = call(operator.getitem, padded, (slice(None), slice(None), slice(j, stop)))
        tap = call(operator.getitem, w, (slice(None), 0, slice(j, j + 1)))
        term = call(operator.mul, shifted, tap)
        out = term if out is None else call(operator.add, out, term)
    if bias is not None:
        out = call(operator.add, out, call(operator.getitem, bias, (slice(None), None)))
    return out


@register_pass
class DepthwiseConvPass(GraphPass):
    name = "depthwise_conv"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in (torch.conv1d, F.conv1d):
                continue
            reason = _refusal(node)
            if reason:
                record.refuse(PATTERN, reason, node=node.name)
                continue
            kernel = M.example(M.arg(node, 1, "weight")).shape[2]
            with gm.graph.inserting_before(node):
                out = _emit(gm.graph, node, ctx.fake_mode)
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
            record.match(PATTERN, node=node.name, kernel=kernel)
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
