"""Find mHC hyper-connections in a Dynamo graph by what they compute, not by names.

Anchor: a Sinkhorn-Knopp chain — at least two rounds of alternating `m / m.sum(d, keepdim=True)`
over the last two dims. From it, back to the projection `v·φ` of the flattened stream v (and the
stream x that v views); forward from that projection to the σ mappings. A σ mapping whose product
partner is a view of x is H_pre (its product is the aggregate y = H_pre·x, the sublayer's input); the
other is H_post, whose product partner is the sublayer output f. The Sinkhorn result H_res mixes x
(`mixed`), and the residual add of `mixed` and H_post·f is the next stream x'. Layers chain when one
layer's x' is the next layer's x (through views).

Every node of a found layer gets `node.meta["hc"] = {"layer": i, "role": ...}`; the recompute pass
reads those. Layers are recorded on the report; candidates that fail a step are refused with the
step that failed.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from . import fx_match as M
from .base import GraphPass, PassContext, register_pass

PATTERN = "mhc_layer"
MIN_SINKHORN_ROUNDS = 2

_VIEW_METHODS = {"view", "reshape", "flatten", "unflatten", "permute", "transpose", "contiguous",
                 "unsqueeze", "squeeze", "expand", "float", "to", "type_as", "half", "bfloat16",
                 "view_as", "reshape_as"}
_VIEW_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.permute, torch.transpose,
                   torch.unsqueeze, torch.squeeze, torch.Tensor.view}
_PRODUCTS = {"matmul", "einsum"}


def is_view(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS


def view_root(node: Any) -> Any:
    while is_view(node):
        node = node.args[0]
    return node


def _is_sum_keepdim(node: Any, src: fx.Node) -> int | None:
    """dim of `src.sum(dim, keepdim=True)`, else None."""
    if not isinstance(node, fx.Node):
        return None
    if (node.op == "call_method" and node.target == "sum") or \
            (node.op == "call_function" and node.target is torch.sum):
        if node.args[0] is not src or not node.kwargs.get("keepdim", len(node.args) > 2 and node.args[2]):
            return None
        dim = M.arg(node, 1, "dim")
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        return dim if isinstance(dim, int) else None
    return None


def norm_step_parts(node: Any) -> tuple[fx.Node, int, float] | None:
    """node = m / (m.sum(d, keepdim=True) [+ eps]) -> (m, d, eps), d made non-negative."""
    if M.kind(node) != "div" or len(node.args) < 2 or node.kwargs:
        return None
    m, den = node.args[0], node.args[1]
    if not isinstance(m, fx.Node) or not isinstance(den, fx.Node):
        return None
    eps = 0.0
    if M.kind(den) is None and den.op == "call_function" and den.target in (operator.add, torch.add) \
            and not den.kwargs:
        a, b = den.args[0], den.args[1]
        if isinstance(a, fx.Node) and M.scalar(b) is not None:
            den, eps = a, M.scalar(b)
    elif den.op == "call_method" and den.target == "add" and len(den.args) == 2 and not den.kwargs \
            and M.scalar(den.args[1]) is not None:
        den, eps = den.args[0], M.scalar(den.args[1])
    dim = _is_sum_keepdim(den, m)
    if dim is None:
        return None
    nd = M.ndim(m)
    return m, dim % nd if nd else dim, eps


def _norm_step(node: fx.Node) -> tuple[fx.Node, int] | None:
    """node = m / m.sum(d, keepdim=True) (optionally + eps in the denominator) -> (m, d)."""
    parts = norm_step_parts(node)
    return None if parts is None else parts[:2]


def find_sinkhorn_chains(graph: fx.Graph) -> list[list[fx.Node]]:
    """Each chain: [start, step1, step2, ...] with alternating normalisation dims."""
    steps = {n: s for n in graph.nodes if (s := _norm_step(n)) is not None}
    chains = []
    for node, (src, dim) in steps.items():
        if src in steps:
            continue  # not a chain head
        chain, cur, last_dim = [src, node], node, dim
        while True:
            nxt = [u for u in cur.users if u in steps and steps[u][0] is cur and steps[u][1] != last_dim]
            if len(nxt) != 1:
                break
            cur = nxt[0]
            last_dim = steps[cur][1]
            chain.append(cur)
        dims = {steps[n][1] for n in chain[1:]}
        nd = M.ndim(src)
        if len(chain) - 1 >= 2 * MIN_SINKHORN_ROUNDS and nd and dims == {nd - 1, nd - 2}:
            chains.append(chain)
    return chains


def _is_param(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def _projection_of(start: fx.Node, depth: int = 16) -> fx.Node | None:
    """Nearest ancestor that is a linear/matmul with a parameter operand: the v·φ projection."""
    frontier, seen = [start], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            if n.op == "call_function" and n.target in (torch._C._nn.linear, torch.nn.functional.linear):
                return n
            if M.kind(n) == "matmul" and any(_is_param(view_root(a)) for a in n.args[:2]):
                return n
            nxt.extend(a for a in n.all_input_nodes if not _is_param(a))
        frontier = nxt
    return None


def _descendants(node: fx.Node, depth: int) -> list[fx.Node]:
    out, frontier = [], [node]
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users]
        out.extend(frontier)
    return out


def _derives_from(node: Any, root: fx.Node, depth: int = 6) -> bool:
    """node reaches `root` through view-like ops only."""
    for _ in range(depth + 1):
        if node is root:
            return True
        if not is_view(node):
            return False
        node = node.args[0]
    return False


def _product_partner(start: fx.Node, depth: int = 6) -> tuple[fx.Node, Any] | None:
    """Follow a mapping forward through views/scalar ops to the first op that combines it with
    another tensor: returns (combining node, the other operand)."""
    cur = start
    for _ in range(depth):
        users = list(cur.users)
        if len(users) != 1:
            return None
        u = users[0]
        k = M.kind(u)
        tensor_args = [a for a in u.args if isinstance(a, fx.Node)]
        if k in _PRODUCTS or (k == "mul" and len(tensor_args) == 2):
            others = [a for a in (u.args[1:] if k == "einsum" else u.args) if isinstance(a, fx.Node) and a is not cur]
            if len(others) == 1:
                return u, others[0]
            return None
        cur = u
    return None


@dataclass
class HCLayer:
    index: int
    x: fx.Node             # stream input (root)
    proj: fx.Node
    sinkhorn: list[fx.Node]
    h_pre: fx.Node
    h_post: fx.Node
    h_res: fx.Node
    aggregate: fx.Node     # y = H_pre·x (product node, or the sum after a product)
    mixed: fx.Node         # H_res·x
    post: fx.Node          # H_post·f
    f: fx.Node             # sublayer output as H_post meets it (root through views)
    x_out: fx.Node         # residual add: mixed + post
    notes: list[str] = field(default_factory=list)
    # what passes/hc_fuse.py replaced with fused ops ("mapping", "aggregate", "post"); it also
    # points the fields above at the new nodes (h_pre/h_post/h_res: the mapping op's outputs,
    # mixed/post: the post op, x_out and aggregate: the values that replaced them)
    fused: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"layer": self.index, "x": self.x.name, "y": self.aggregate.name, "f": self.f.name,
                "x_out": self.x_out.name, "h_pre": self.h_pre.name, "h_post": self.h_post.name,
                "h_res": self.h_res.name, "sinkhorn_rounds": (len(self.sinkhorn) - 1) // 2}


class Refusal(Exception):
    pass


def _match_layer(chain: list[fx.Node], index: int) -> HCLayer:
    proj = _projection_of(chain[0])
    if proj is None:
        raise Refusal("no projection v·φ found upstream of the Sinkhorn chain")
    x = view_root(proj.args[0])
    sigmoids = [n for n in _descendants(proj, 6) if n.op == "call_function" and n.target in
                (torch.sigmoid, torch.nn.functional.sigmoid) or (n.op == "call_method" and n.target == "sigmoid")]
    sigmoids = list(dict.fromkeys(sigmoids))
    if len(sigmoids) != 2:
        raise Refusal(f"expected two σ mappings (H_pre, H_post) from the projection, found {len(sigmoids)}")
    h_pre = h_post = None
    agg = post = None
    f = None
    for s in sigmoids:
        found = _product_partner(s)
        if found is None:
            raise Refusal(f"σ mapping {s.name} is not combined with a tensor")
        node, other = found
        if _derives_from(other, x):
            h_pre, agg = s, node
        else:
            h_post, post, f = s, node, view_root(other)
    if h_pre is None or h_post is None:
        raise Refusal("could not tell H_pre (meets the stream) from H_post (meets the sublayer output)")
    if M.kind(agg) == "mul":  # mul then sum over the stream dim
        users = list(agg.users)
        if len(users) == 1 and users[0].op in ("call_method", "call_function") and \
                getattr(users[0].target, "__name__", users[0].target) == "sum":
            agg = users[0]
        else:
            raise Refusal("H_pre·x is not reduced over the streams")
    h_res = chain[-1]
    found = _product_partner(h_res)
    if found is None or not _derives_from(found[1], x):
        raise Refusal("H_res does not mix the stream x")
    mixed = found[0]
    # the residual add joins mixed and post (either through views)
    x_out = None
    for cand in _descendants(mixed, 4):
        if cand.op == "call_function" and cand.target in (operator.add, torch.add) or \
                (cand.op == "call_method" and cand.target == "add"):
            roots = {view_root(a) for a in cand.args if isinstance(a, fx.Node)}
            if view_root(mixed) in roots or mixed in roots:
                if any(_derives_from(a, post) or a is post for a in cand.args if isinstance(a, fx.Node)):
                    x_out = cand
                    break
    if x_out is None:
        raise Refusal("no residual add of H_res·x and H_post·f")
    return HCLayer(index, x, proj, chain, h_pre, h_post, h_res, agg, mixed, post, f, x_out)


def detect(graph: fx.Graph) -> tuple[list[HCLayer], list[tuple[str, str]]]:
    layers, refusals = [], []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for chain in sorted(find_sinkhorn_chains(graph), key=lambda c: order[c[0]]):
        try:
            layers.append(_match_layer(chain, len(layers)))
        except Refusal as r:
            refusals.append((chain[0].name, str(r)))
    return layers, refusals


def _live(node: Any, graph: fx.Graph) -> bool:
    return isinstance(node, fx.Node) and node.graph is graph and not getattr(node, "_erased", False)


def current_layers(gm: fx.GraphModule) -> list[HCLayer]:
    """The layers hc_detect (and hc_fuse) recorded on gm, or a fresh detection when there are none
    or they point at nodes no longer in the graph (a failed later pass was undone by rebuilding
    the graph)."""
    layers = gm.meta.get("hc_layers")
    g = gm.graph
    if layers is not None and all(_live(n, g) for l in layers
                                  for n in (l.x, l.proj, l.aggregate, l.f, l.x_out, l.h_res)):
        return layers
    layers, _ = detect(g)
    gm.meta["hc_layers"] = layers
    return layers


def chain_layers(layers: list[HCLayer]) -> list[list[HCLayer]]:
    """Group consecutive layers (x of one is x_out of the previous, through views)."""
    seqs: list[list[HCLayer]] = []
    for layer in layers:
        if seqs and view_root(layer.x) in (seqs[-1][-1].x_out, view_root(seqs[-1][-1].x_out)):
            seqs[-1].append(layer)
        else:
            seqs.append([layer])
    return seqs


@register_pass
class HCDetectPass(GraphPass):
    name = "hc_detect"
    stage = "dynamo"
    order = 10

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        layers, refusals = detect(gm.graph)
        for where, reason in refusals:
            record.refuse(PATTERN, reason, node=where)
        for layer in layers:
            record.match(PATTERN, node=layer.x_out.name, **layer.describe())
            roles = {"x": layer.x, "proj": layer.proj, "h_pre": layer.h_pre, "h_post": layer.h_post,
                     "h_res": layer.h_res, "aggregate": layer.aggregate, "mixed": layer.mixed,
                     "post": layer.post, "f": layer.f, "x_out": layer.x_out}
            for role, node in roles.items():
                node.meta.setdefault("hc", {}).update({"layer": layer.index, "role": role})
        gm.meta["hc_layers"] = layers
        if layers:
            seqs = chain_layers(layers)
            record.notes.append(f"{len(layers)} hyper-connection layer(s) in {len(seqs)} chain(s): "
                                f"{[len(s) for s in seqs]}")
        return False  # annotations only; the graph computes the same
