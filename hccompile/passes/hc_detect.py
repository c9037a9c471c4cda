"""Find mHC hyper-connections in a Dynamo graph by what they compute, not by names.

Anchor: a Sinkhorn-Knopp chain — at least two rounds of alternating `m / m.sum(d, keepdim=True)`
over the last two dims. From it, back to the projection `v·φ` of the flattened stream v (and the
stream x that v views); forward from that projection to the σ mappings. A σ mapping whose product
partner is a view of x is H_pre (its product is the aggregate y = H_pre·x, the sublayer's input); the
other is H_post, whose product partner is the sublayer output f. The Sinkhorn result H_res mixes x
(`mixed`), and the residual add of `mixed` and H_post·f is the next stream x'. Layers chain when one
layer's x' is the next layer's x (through views).

Also recognised (the spellings of the public `hyper-connections` package, whose mHC folds the
streams into the batch): Sinkhorn steps written `F.normalize(m, p=1, dim=d)` on a positive start;
a projection written as an einsum with a parameter, or two projections of the same input (one for
H_pre and H_res, one for H_post); the stream normalised per stream before the projection
(`F.normalize(x, dim=-1) · γ`, RMS or layer norm over C: recorded as `stream_norm`); H_pre and H_res
concatenated and mixed with the stream in one product whose output is sliced into the aggregate and
the mixed streams (`combined`); `dropout(p=0)` between layers (an identity).

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
from .fx_match import Refusal
from .base import GraphPass, PassContext, register_pass

PATTERN = "mhc_layer"
MIN_SINKHORN_ROUNDS = 2

# What the walks look through between the stream and its mappings: layout, and a broadcast.
_VIEW_METHODS = M.LAYOUT_METHODS | {"expand"}
_VIEW_FUNCTIONS = M.LAYOUT_FUNCTIONS
_PRODUCTS = {"matmul", "einsum"}


_DROPOUTS = {torch.nn.functional.dropout, torch.dropout}


def is_identity_dropout(node: Any) -> bool:
    """`F.dropout(x, p=0.0)` (or with training=False), not in place: returns x's values (ATen's
    dropout returns its input when p == 0 or not training), e.g. the `hyper-connections` package's
    `nn.Dropout(0.)` after every residual add."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _DROPOUTS:
        return False
    if node.target is torch.dropout:
        p, train, inplace = M.arg(node, 1, "p"), M.arg(node, 2, "train"), False
    else:
        p, train, inplace = M.arg(node, 1, "p", 0.5), M.arg(node, 2, "training", True), \
            M.arg(node, 3, "inplace", False)
    if inplace is not False:
        return False
    return M.scalar(p) == 0.0 or train is False


def is_view(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and (node.target in _VIEW_FUNCTIONS or is_identity_dropout(node))


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


def normalize_l1_parts(node: Any) -> tuple[fx.Node, int, float] | None:
    """node = F.normalize(m, p=1, dim=d[, eps]) = m / max(Σ_d |m|, eps) -> (m, d, eps)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or \
            node.target is not torch.nn.functional.normalize:
        return None
    m, p, dim = node.args[0], M.arg(node, 1, "p", 2.0), M.arg(node, 2, "dim", 1)
    eps = M.arg(node, 3, "eps", 1e-12)
    if not isinstance(m, fx.Node) or M.scalar(p) != 1.0 or not isinstance(dim, int) or \
            M.scalar(eps) is None or M.arg(node, 4, "out") is not None:
        return None
    nd = M.ndim(m)
    return m, dim % nd if nd else dim, M.scalar(eps)


def norm_step_parts(node: Any) -> tuple[fx.Node, int, float] | None:
    """node = m / (m.sum(d, keepdim=True) [+ eps]) -> (m, d, eps), d made non-negative; also
    F.normalize(m, p=1, dim=d) (eps there is a floor, max(Σ, eps): normalize_l1_parts tells)."""
    parts = normalize_l1_parts(node)
    if parts is not None:
        return parts
    if M.kind(node) != "div" or len(node.args) < 2 or node.kwargs:
        return None
    m, den = node.args[0], node.args[1]
    if not isinstance(m, fx.Node) or not isinstance(den, fx.Node):
        return None
    eps = 0.0
    if den.op == "call_function" and den.target in (operator.add, torch.add) \
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


def _is_positive_start(node: Any) -> bool:
    """exp(·), softmax(·) or either plus a positive constant: F.normalize(p=1) divides by Σ|m|,
    which is the Sinkhorn step's Σ m only on a positive matrix."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target in (operator.add, torch.add) and len(node.args) == 2:
        a, b = node.args
        if M.scalar(b) is not None and M.scalar(b) > 0:
            return _is_positive_start(a)
        if M.scalar(a) is not None and M.scalar(a) > 0:
            return _is_positive_start(b)
        return False
    if (node.op == "call_function" and node.target is torch.exp) or \
            (node.op == "call_method" and node.target == "exp"):
        return True
    return M.kind(node) == "softmax" and getattr(node.target, "__name__", node.target) == "softmax"


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
        if any(normalize_l1_parts(n) is not None for n in chain[1:]) and not _is_positive_start(src):
            continue  # Σ|m| is not Σ m: not a Sinkhorn normalisation of a signed matrix
        if len(chain) - 1 >= 2 * MIN_SINKHORN_ROUNDS and nd and dims == {nd - 1, nd - 2}:
            chains.append(chain)
    return chains


def _is_param(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def _operands(node: fx.Node) -> list[Any]:
    """The tensor operands of a product: einsum's after the equation (or in one list)."""
    if M.kind(node) == "einsum":
        ops = list(node.args[1:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        return ops
    return list(node.args[:2])


def _is_projection(n: fx.Node) -> bool:
    """A linear, or a matmul/einsum of two tensors one of which is a graph input (a parameter,
    through views)."""
    if n.op == "call_function" and n.target in (torch._C._nn.linear, torch.nn.functional.linear):
        return True
    if M.kind(n) in ("matmul", "einsum"):
        ops = _operands(n)
        return len(ops) == 2 and all(isinstance(a, fx.Node) for a in ops) and \
            any(_is_param(view_root(a)) for a in ops)
    return False


def projection_input(proj: fx.Node) -> fx.Node:
    """The activation operand of a projection: the one that is not a parameter, or the first
    (a stream that is itself a graph input reads as one too)."""
    if M.kind(proj) not in ("matmul", "einsum"):
        return proj.args[0]
    ops = [a for a in _operands(proj) if isinstance(a, fx.Node)]
    acts = [a for a in ops if not _is_param(view_root(a))]
    return acts[0] if len(acts) == 1 else ops[0]


def _projection_of(start: fx.Node, max_depth: int = 15) -> fx.Node | None:
    """Nearest ancestor that is a linear/matmul/einsum with a parameter operand: the v·φ
    projection."""
    def activations(n: fx.Node) -> list[fx.Node]:
        return [a for a in n.all_input_nodes if not _is_param(a)]

    return next((n for n in M.walk(start, activations, max_depth=max_depth) if _is_projection(n)), None)


_STREAM_NORMS = {torch.rms_norm, torch.nn.functional.rms_norm, torch.layer_norm,
                 torch.nn.functional.layer_norm}


def _numel_of(node: Any) -> int | None:
    ev = M.example(node)
    return ev.numel() if isinstance(ev, torch.Tensor) else None


def stream_norm_of(v: fx.Node) -> tuple[fx.Node, str, fx.Node] | None:
    """If the projection's input is a norm of each stream over C (before the projection, as in
    the `hyper-connections` package: `F.normalize(x, dim=-1) · √C · (γ + 1)`), the norm's input
    and a description; else None. Steps back through casts/views and multiplications by
    broadcast factors (scales, γ)."""
    node = v
    for _ in range(8):
        while is_view(node):
            node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
        if node.op == "call_function" and node.target is torch.nn.functional.normalize:
            p, dim = M.arg(node, 1, "p", 2.0), M.arg(node, 2, "dim", 1)
            nd = M.ndim(node)
            if M.scalar(p) == 2.0 and isinstance(dim, int) and nd and dim % nd == nd - 1:
                return node.args[0], "F.normalize(x_i, dim=-1) (L2 over C, per stream)", node
            return None
        if node.op == "call_function" and node.target in _STREAM_NORMS:
            return (node.args[0], f"{getattr(node.target, '__name__', node.target)} over C, per stream",
                    node)
        if M.kind(node) == "mul" and len(node.args) == 2 and not node.kwargs:
            full = _numel_of(node)
            big = [a for a in node.args if isinstance(a, fx.Node) and _numel_of(a) == full]
            if len(big) != 1:
                return None
            node = big[0]
            continue
        return None
    return None


def sibling_projections(proj: fx.Node) -> list[fx.Node]:
    """proj and every other projection of the same input (through casts/views), e.g. H_post's
    own `normed @ w` beside the einsum that gives H_pre and H_res."""
    root = view_root(projection_input(proj))
    found = [proj]
    # depth-first: the order found is the order of the σ mappings, which a refusal names
    for n in M.walk(root, lambda n: [u for u in n.users if is_view(u)], depth_first=True):
        found += [u for u in n.users if not is_view(u) and u is not proj and _is_projection(u)
                  and view_root(projection_input(u)) is root]
    return list(dict.fromkeys(found))


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
    # the view of the stream the mapping reads: the flattened v of v·φ, or, with a per-stream norm
    # before the projection (`stream_norm` says which), that norm's input [tokens.., n, C]
    v: fx.Node | None = None
    projs: list[fx.Node] = field(default_factory=list)  # proj and its sibling projections
    stream_norm: str | None = None
    norm_node: fx.Node | None = None  # that per-stream norm (its output is stream-sized)
    combined: bool = False  # H_pre and H_res applied in one product, sliced into agg and mixed
    notes: list[str] = field(default_factory=list)
    # what passes/hc_fuse/ replaced with fused ops ("mapping", "aggregate", "post"); it also
    # points the fields above at the new nodes (h_pre/h_post/h_res: the mapping op's outputs,
    # mixed/post: the post op, x_out and aggregate: the values that replaced them)
    fused: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"layer": self.index, "x": self.x.name, "y": self.aggregate.name, "f": self.f.name,
                "x_out": self.x_out.name, "h_pre": self.h_pre.name, "h_post": self.h_post.name,
                "h_res": self.h_res.name, "sinkhorn_rounds": (len(self.sinkhorn) - 1) // 2,
                "stream_norm": self.stream_norm, "combined": self.combined}


def _is_add(node: Any) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target in (operator.add, torch.add)) or
        (node.op == "call_method" and node.target == "add"))


def _reduced_over_streams(product: fx.Node, what: str) -> fx.Node:
    """A `mul` product is reduced by the sum that follows it (`(h.unsqueeze(-1) * x).sum(-2)`)."""
    if M.kind(product) != "mul":
        return product
    users = list(product.users)
    if len(users) == 1 and users[0].op in ("call_method", "call_function") and \
            getattr(users[0].target, "__name__", users[0].target) == "sum":
        return users[0]
    raise Refusal(f"{what} is not reduced over the streams")


def _split_combined(product: fx.Node, n: int) -> tuple[fx.Node, fx.Node]:
    """H_pre and H_res concatenated and applied in one product (the `hyper-connections` package:
    `einsum(cat(H_pre, H_res), x)` gives n + 1 outputs per token, then `[..., 0, :]` is the
    aggregate and `[..., 1:, :]` the mixed streams): (aggregate slice, mixed slice)."""
    total = _numel_of(product)
    agg = mixed = None
    for u in product.users:
        if not (u.op == "call_function" and u.target is operator.getitem):
            raise Refusal(f"H_pre and H_res share the product {product.name}, whose use "
                          f"{u.name} is not a slice of it")
        k = _numel_of(u)
        if total is None or k is None:
            continue
        if k * (n + 1) == total and agg is None:
            agg = u
        elif k * (n + 1) == total * n and mixed is None:
            mixed = u
    if agg is None or mixed is None:
        raise Refusal(f"H_pre and H_res share the product {product.name}, which is not sliced into "
                      f"the aggregate (1 of {n + 1} outputs) and the mixed streams ({n} of {n + 1})")
    return agg, mixed


def _residual_add(mixed: fx.Node, post: fx.Node, max_depth: int = 11) -> fx.Node | None:
    """The add of a view of `mixed` and a view of `post`, searched forward through views."""
    def adds_post(u: fx.Node) -> bool:
        args = [a for a in u.args if isinstance(a, fx.Node)]
        return any(view_root(a) is mixed for a in args) and any(_derives_from(a, post) or a is post for a in args)

    def views(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if is_view(u) and not _is_add(u)]

    for node in M.walk(mixed, views, max_depth=max_depth):
        for u in node.users:
            if _is_add(u) and adds_post(u):
                return u
    return None


def _match_layer(chain: list[fx.Node], index: int) -> HCLayer:
    proj = _projection_of(chain[0])
    if proj is None:
        raise Refusal("no projection v·φ found upstream of the Sinkhorn chain")
    v = projection_input(proj)
    normed = stream_norm_of(v)
    stream_norm = norm_node = None
    if normed is not None:
        v, stream_norm, norm_node = normed
    x = view_root(v)

    def sigmoids_of(projs: list[fx.Node]) -> list[fx.Node]:
        found = [n for p in projs for n in M.walk(p, M.users, max_depth=6) if n is not p and
                 (n.op == "call_function" and n.target in (torch.sigmoid, torch.nn.functional.sigmoid) or
                  (n.op == "call_method" and n.target == "sigmoid"))]
        return list(dict.fromkeys(found))

    projs = [proj]
    sigmoids = sigmoids_of(projs)
    if len(sigmoids) != 2:  # H_post from a projection of its own (the hyper-connections package)
        projs = sibling_projections(proj)
        sigmoids = sigmoids_of(projs)
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
        if _derives_from(other, x, depth=16):
            h_pre, agg = s, node
        else:
            h_post, post, f = s, node, view_root(other)
    if h_pre is None or h_post is None:
        raise Refusal("could not tell H_pre (meets the stream) from H_post (meets the sublayer output)")
    h_res = chain[-1]
    found = _product_partner(h_res)
    if found is None or not _derives_from(found[1], x, depth=16):
        raise Refusal("H_res does not mix the stream x")
    mixed = found[0]
    combined = mixed is agg
    if combined:
        ev = M.example(h_res)
        if not isinstance(ev, torch.Tensor) or ev.dim() < 2:
            raise Refusal(f"H_res {h_res.name} has no [.., n, n] example value")
        agg, mixed = _split_combined(mixed, int(ev.shape[-1]))
    else:
        agg = _reduced_over_streams(agg, "H_pre·x")
        mixed = _reduced_over_streams(mixed, "H_res·x")
    # the residual add joins mixed and post (either through views)
    x_out = _residual_add(mixed, post)
    if x_out is None:
        raise Refusal("no residual add of H_res·x and H_post·f")
    return HCLayer(index, x, proj, chain, h_pre, h_post, h_res, agg, mixed, post, f, x_out,
                   v=v, projs=projs, stream_norm=stream_norm, norm_node=norm_node, combined=combined)


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
