"""Block-level recompute for mHC hyper-connections (seed 000), from the layers hc_detect found.

For each block of consecutive hyper-connection layers the plan keeps only the block's input stream,
every sublayer output f and the per-token values the stream is reduced to for the mappings (the
projection and the norm r: n²+2n+1 values per token, see mapping_inputs; a projection written as
an einsum or matmul is rebuilt instead, see copies_operand; where each stream is normalised
before the projections, as in the `hyper-connections` package, that norm's output is kept, see
HCRecomputePass); every other
hyper-connection intermediate (H_pre, H_post, H_res and its Sinkhorn chain, the aggregate y, the
mixed residual, the post-distribution, the residual adds, the streams inside the block) is rebuilt
in backward. Attention and MLP (the
sublayers) are never recomputed, but for their elementwise activations (an MLP's GELU), rebuilt from
the pre-activation the backward keeps anyway (option hc_recompute_include_activation).

Mechanism: Dynamo-graph nodes are tagged `meta["recompute"] = MUST_RECOMPUTE` with one
`ac_graph_id` per block (tags propagate to the joint graph, where the partitioner honours them).
A block's input (the previous block's output) is tagged MUST_SAVE: left to the partitioner, which
saves a tagged node whose users belong to another block, it was not saved on CUDA once the fused ops
were traced into their kernel launches, and every block's output was rebuilt from the embedding at
the start of the backward (session 37). Each f is tagged MUST_SAVE. Random ops are
never tagged: a dropout inside the sublayer sits before f, which is saved, so masks are never
replayed and gradients equal the non-recompute run exactly.

When hc_fuse ran first, the layers' fields point at its custom ops (mapping, aggregate, post), which
sit in the same regions and are tagged the same way: custom ops are saved unless tagged.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..compat import size_hint
from . import fx_match as M
from .base import GraphPass, PassContext, register_pass
from .hc_detect import HCLayer, chain_layers, current_layers, view_root

_NORMS = {torch.rms_norm, torch.layer_norm, torch.nn.functional.layer_norm,
          torch.nn.functional.rms_norm, torch.group_norm, torch.nn.functional.group_norm}
# elementwise activations as Dynamo records them (nn modules are inlined to these)
_ACTIVATIONS = {torch._C._nn.gelu, torch.nn.functional.gelu, torch.nn.functional.silu, torch.nn.functional.relu,
                torch.relu, torch.tanh, torch.sigmoid, torch.nn.functional.mish, torch._C._nn.silu}


def sublayer_activations(interior: set[fx.Node]) -> set[fx.Node]:
    """The elementwise activations inside a sublayer whose input the sublayer also keeps (an MLP's
    pre-activation, which its backward needs): rebuilt in backward from that input, they need not
    be saved beside it. Measured on CPU (MHCGPT, C128 S128): 4.57 -> 3.52 MB saved per step, the
    gradients bit-identical; on the GPU the rebuild is one pointwise op fused into the backward."""
    return {n for n in interior if n.op == "call_function" and n.target in _ACTIVATIONS
            and len(n.all_input_nodes) == 1 and n.all_input_nodes[0] in interior}


def default_block_length(n: int, num_layers: int) -> int:
    """The paper's optimum L_r* ≈ √(n·L/(n+2)) sublayers per block."""
    return max(1, round(math.sqrt(n * num_layers / (n + 2))))


def sublayer_interior(layer: HCLayer) -> set[fx.Node]:
    """Nodes strictly between y and f: the attention/MLP itself."""
    return (M.downstream(layer.aggregate) & M.upstream(layer.f)) - {layer.aggregate, layer.f}


def _numel(node: fx.Node) -> int | None:
    t = M.example(node)
    return size_hint(t.numel()) if isinstance(t, torch.Tensor) else None


def mapping_inputs(layer: HCLayer, region: set[fx.Node]) -> set[fx.Node]:
    """Where the stream is reduced to per-token values on its way to the mappings: the
    projection (n²+2n values per token) and the stream's norm. These are kept, not rebuilt.

    They cost a few bytes per token (4·C·n bytes would be the stream), and a reduction or a
    matmul rebuilt in backward may land in a kernel that sums in another order than the
    forward's, which changes the gradients' last bits: measured on the H100, bf16 block
    recompute of the folded layout changed 39 of 42 gradients. Everything after them (the
    mappings, Sinkhorn, the aggregate, the post-distribution, the residual adds) is pointwise or
    one of the fused ops, and is rebuilt bit for bit."""
    y, h_res = M.example(layer.aggregate), M.example(layer.h_res)
    if not isinstance(y, torch.Tensor) or not isinstance(h_res, torch.Tensor) or y.dim() == 0:
        return set()
    n = size_hint(h_res.shape[-1])
    limit = size_hint(y.numel()) // max(size_hint(y.shape[-1]), 1) * (n * n + 2 * n + 1)

    def small(node: fx.Node) -> bool:
        numel = _numel(node)
        return numel is not None and numel <= limit

    def large(node: fx.Node) -> bool:
        numel = _numel(node)
        if numel is None and isinstance(M.example(node), (tuple, list)):
            # an op of several outputs (hc_project's mhc_project: the projection and Σ v²): its
            # outputs, read through getitem, reduce what it reads
            return any(large(a) for a in node.all_input_nodes)
        return numel is not None and numel > limit

    ancestors = set()
    for h in (layer.h_pre, layer.h_post, layer.h_res):
        ancestors |= M.upstream(h)
    kept = {node for node in ancestors & region
            if node.op in ("call_function", "call_method") and small(node)
            and any(large(a) for a in node.all_input_nodes)}
    return kept | {n for node in kept for n in _per_token_chain(node, ancestors & region, small)}


def _per_token_chain(node: fx.Node, within: set[fx.Node], small: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """The per-token values computed from `node` alone on the way to the mappings (the norm
    r = sqrt(mean(v²) + ε) after its mean): each the only user of the one before, small,
    pointwise on it and constants. Kept too: rebuilt, each is a kernel launch of a few bytes
    per token before the mappings' recompute and again before their backward (16 launches a
    step at C1024, 4 layers), where keeping it costs as many bytes as the mean it starts from."""
    chain, cur = [], node
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if user not in within or user.op not in ("call_function", "call_method") or not small(user) \
                or M.is_impure(user) or any(a is not cur for a in user.all_input_nodes):
            break
        if not M.is_view(user):  # a view (hc_project's keepdim unsqueeze) is followed, not kept
            chain.append(user)
        cur = user
    return chain


def copies_operand(node: fx.Node) -> bool:
    """A mapping input that cannot be kept alone. A Dynamo node's tag lands on every ATen op it
    decomposes into; `einsum` decomposes into permutes and reshapes that copy an operand the
    batched matmul cannot view in its order, and `matmul` with a vector (or batched, broadcast
    operands) into a copy and a multiply-and-sum (or expands and a copy). Kept (MUST_SAVE), such a
    node keeps that stream-sized copy too: the `hyper-connections` package's `einsum(normed, φ)`
    and `normed @ w` kept two copies of the normalised stream per sublayer (measured on CPU:
    0.63x Inductor's saved bytes instead of 0.31x, before its norm was kept, see HCRecomputePass).
    These are rebuilt in backward with the rest of the block (the plan lists them as
    `rebuilt_per_token`). Kept: `linear` and a matmul of a contiguous activation with a 2-D
    parameter (one mm on a view, as the paper's v·φ), and the norm's reductions."""
    kind = M.kind(node)
    if kind == "einsum":
        return True
    if kind != "matmul":
        return False
    a, b = (M.example(x) for x in node.args[:2])
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return True
    return not (b.dim() == 2 and a.dim() >= 2 and a.is_contiguous())


def expansion_source(start: fx.Node) -> fx.Node:
    """The first block's input stream, when it is input_expand (the [tokens, C] embedding
    replicated to n streams by `repeat`, e.g. DeepSeek-style `h.unsqueeze(2).repeat(1, 1, n, 1)`
    or Megatron-style `x.repeat(1, 1, n)`): the tensor it replicates, so that the block keeps that
    (C per token, nothing when it is the graph's input) and rebuilds the copy (n·C per token) in
    backward. A copy, so rebuilt bit for bit. Views (`expand`) already lead back to it."""
    node = start
    is_repeat = (node.op == "call_method" and node.target == "repeat") or \
        (node.op == "call_function" and node.target is torch.Tensor.repeat)
    if is_repeat and isinstance(node.args[0], fx.Node):
        src = view_root(node.args[0])
        small, big = _numel(src), _numel(node)
        if small is not None and big is not None and small < big and not M.is_impure(node):
            return src
    return start


def plan_blocks(seq: list[HCLayer], mode: str, block: int | None) -> list[list[HCLayer]]:
    n = M.example(seq[0].h_res).shape[-1] if M.example(seq[0].h_res) is not None else 4
    size = 1 if mode == "layer" else (block or default_block_length(int(n), len(seq)))
    return [seq[i:i + size] for i in range(0, len(seq), size)]


@register_pass
class HCRecomputePass(GraphPass):
    """Tags each block (see the module docstring).

    A per-stream norm before the projections (the `hyper-connections` package's
    `F.normalize(x_i, dim=-1)·√C·(γ+1)`, hc_detect's `norm_node`) is kept, stream-sized as it is:
    rebuilt, its reductions into γ's gradient (over tokens and streams) read the stream in its own
    memory order ((b·n), t, C, folded) where the plan without recompute reads the normalised
    stream in the order the package permuted it to ((b, t, n, C)), so Inductor sums in another
    order: measured on CPU, the γ gradients of 3 of 4 layers differed in their last bits
    (relative 1e-7) with it rebuilt, none with it kept, at 0.47x Inductor's saved bytes instead
    of 0.31x."""

    name = "recompute"
    stage = "dynamo"

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
                start, end = expansion_source(view_root(blk[0].x)), blk[-1].x_out
                region = (M.downstream(start) & M.upstream(end)) - {start}
                keep: set[fx.Node] = set()
                kept_per_token: set[fx.Node] = set()
                for layer in blk:
                    kept_per_token |= mapping_inputs(layer, region)
                    interior = sublayer_interior(layer)
                    keep |= interior | {layer.f}
                    if cfg.hc_recompute_include_norm:
                        first = [n for n in interior if n.op == "call_function" and n.target in _NORMS
                                 and view_root(n.args[0]) is view_root(layer.aggregate)]
                        keep -= set(first)
                    if cfg.hc_recompute_include_activation:
                        keep -= sublayer_activations(interior)
                    if not cfg.hc_recompute_include_bda and layer is not blk[-1]:
                        keep.add(layer.x_out)
                rebuilt_per_token = {n for n in kept_per_token if copies_operand(n)}
                kept_per_token -= rebuilt_per_token
                kept_norms = {l.norm_node for l in blk if l.norm_node is not None and l.norm_node in region}
                # the partitioner decides at a multi-output op, not at its getitems: a kept getitem
                # whose op is tagged MUST_RECOMPUTE is rebuilt in the backward, the stream it reads
                # first (mhc_project at 50a79bc: a second projection per sublayer in the backward)
                kept_ops = {n.args[0] for n in kept_per_token | kept_norms
                            if M.kind(n) == "getitem" and isinstance(M.example(n.args[0]), (tuple, list))}
                keep |= kept_per_token | kept_norms | kept_ops
                recomputed = []
                for n in region - keep:
                    if n.op in ("placeholder", "get_attr", "output") or M.is_impure(n):
                        continue
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    n.meta["ac_graph_id"] = next_id
                    recomputed.append(n)
                for n in kept_per_token | kept_norms | kept_ops:
                    n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                    n.meta["ac_graph_id"] = next_id
                if start.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
                    # the previous block's output, this block's input: kept. The partitioner saves
                    # a tagged node with users in a later block, but on CUDA the fused ops are
                    # traced into their kernel launches, whose outputs it rebuilt: the whole stream
                    # chain, from the embedding, at the start of the backward (8 post launches a
                    # step at C1024, 4 layers, H200, every rebuilt stream alive at once)
                    start.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                for layer in blk:
                    layer.f.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                    layer.f.meta["ac_graph_id"] = next_id
                    if not cfg.hc_recompute_include_bda and layer is not blk[-1]:
                        layer.x_out.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                        layer.x_out.meta["ac_graph_id"] = next_id
                plan.append({"block": next_id, "layers": [l.index for l in blk],
                             "saved": [start.name] + [l.f.name for l in blk],
                             "kept_per_token": sorted(n.name for n in kept_per_token),
                             "rebuilt_per_token": sorted(n.name for n in rebuilt_per_token),
                             "kept_stream_norms": sorted(n.name for n in kept_norms),
                             "recomputed_nodes": len(recomputed)})
                record.match("hc_block_recompute", node=end.name, block=next_id,
                             layers=[l.index for l in blk], input=start.name,
                             saved_sublayer_outputs=[l.f.name for l in blk],
                             recomputed_nodes=len(recomputed))
                next_id += 1
        if ctx.report is not None:
            ctx.report.recompute_plan = plan
        return bool(plan)
