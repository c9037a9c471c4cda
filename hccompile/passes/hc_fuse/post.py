"""The post: the mixing H_res·x (or H_resᵀ·x) plus H_post·f and the residual add. Which way the
mixing indexes H_res is read off the product's labels and the views (and, for H_pre and H_res
applied in one product, the concatenation and the slice) between H_res and the product: shapes
alone cannot tell H_res·x from H_resᵀ·x."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import fx_match as M
from ..emit import Emitter
from ..fx_match import Refusal
from ..hc_detect import HCLayer, is_view
from .views import _shape, _sym_shape, _transform, map_index, view_chain
from .layout import StreamLayout, _canonical_stream, _tokens2, reshape_to


# ----------------------------------------------------------------------------------------
# post


@dataclass
class PostPlan:
    layout: StreamLayout
    transpose_res: bool
    h_res: fx.Node
    h_post: fx.Node
    f: fx.Node
    x_out: fx.Node


def _product_operands(product: fx.Node) -> list[Any]:
    if M.kind(product) == "einsum":
        ops = list(product.args[1:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        return ops
    return [a for a in product.args[:2]]


def _einsum_terms(product: fx.Node) -> tuple[list[str], str] | None:
    """The einsum's operand terms and output term with each `...` written out as one character per
    dim (right-aligned across the terms, as einsum broadcasts them), or None."""
    eq = product.args[0]
    ops = _product_operands(product)
    if not isinstance(eq, str) or "->" not in eq:
        return None
    ins, out = eq.replace(" ", "").split("->")
    terms = ins.split(",")
    if len(terms) != len(ops):
        return None
    fill = "0123456789"
    widths = []
    expanded = []
    for term, op in zip(terms, ops):
        if "..." not in term:
            expanded.append(term)
            continue
        k = len(_shape(op)) - (len(term) - 3)
        if k < 0 or k > len(fill):
            return None
        widths.append(k)
        expanded.append(term.replace("...", fill[len(fill) - k:]))
    if "..." in out:
        k = max(widths, default=0)
        out = out.replace("...", fill[len(fill) - k:])
    return expanded, out


def _operand_labels(product: fx.Node, operand: fx.Node) -> tuple[int, int, int] | None:
    """For a product using `operand` as the mixing matrix: (dim of operand that indexes the
    output stream, dim that is contracted, dim of the product's output that the output stream
    is)."""
    k = M.kind(product)
    if k == "matmul":
        nd = len(_shape(operand))
        out_nd = len(_shape(product))
        if product.args[0] is operand:
            return nd - 2, nd - 1, out_nd - 2
        if product.args[1] is operand:
            return nd - 1, nd - 2, out_nd - 1
        return None
    if k == "einsum":
        ops = _product_operands(product)
        terms = _einsum_terms(product)
        if terms is None or len(ops) != 2:
            return None
        (la, lb), out = terms
        if ops[0] is not operand and ops[1] is not operand:
            return None
        mine, other = (la, lb) if ops[0] is operand else (lb, la)
        sizes = dict(zip(mine, _shape(operand)))
        # size-1 dims (the package's fraction dims) are neither contracted nor a stream
        contracted = [c for c in mine if c in other and c not in out and sizes[c] != 1]
        out_stream = [c for c in mine if c in out and c not in other and sizes[c] != 1]
        if len(contracted) != 1 or len(out_stream) != 1:
            return None
        return mine.index(out_stream[0]), mine.index(contracted[0]), out.index(out_stream[0])
    return None


def _is_cat(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (torch.cat,
                                                                                       torch.concat)


def _leads_to(target: fx.Node, node: Any, depth: int = 16) -> bool:
    """`node` is `target` seen through views and concatenations."""
    for _ in range(depth):
        if node is target:
            return True
        if _is_cat(node):
            return any(_leads_to(target, p, depth) for p in node.args[0])
        if not is_view(node):
            return False
        node = node.args[0]
    return False


def _index_in(target: fx.Node, node: Any, idx: torch.Tensor, depth: int = 16
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Indices [K, ndim] of `node` -> (the same elements as indices of `target`, which rows come
    from target at all), back through views and concatenations; None if target is not reached."""
    if not _leads_to(target, node, depth):
        return None
    valid = torch.ones(idx.shape[0], dtype=torch.bool)
    for _ in range(depth):
        if node is target:
            return idx, valid
        if _is_cat(node):
            dim = M.arg(node, 1, "dim", 0) % len(_shape(node))
            offset = 0
            for part in node.args[0]:
                width = _shape(part)[dim]
                if _leads_to(target, part, depth):
                    valid = valid & (idx[:, dim] >= offset) & (idx[:, dim] < offset + width)
                    idx = idx.clone()
                    idx[:, dim] = (idx[:, dim] - offset).clamp(0, width - 1)
                    node = part
                    break
                offset += width
            continue
        idx = map_index([node], idx)
        node = node.args[0]
    return None


def _getitem_slice(node: fx.Node, dim: int) -> tuple[int, int] | None:
    """(start, stop) of `base[index]` along `dim`, every other dim taken whole; else None."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return None
    base, index = node.args
    nd = len(_shape(base))
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (nd - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (nd - len(index))
    if len(index) != nd:
        return None
    for d, i in enumerate(index):
        if d == dim:
            continue
        if i != slice(None):
            return None
    i = index[dim]
    size = _shape(base)[dim]
    if isinstance(i, int):
        return None
    if not isinstance(i, slice) or i.step not in (None, 1):
        return None
    start, stop, _ = i.indices(size)
    return start, stop


def _mixing_orientation(mixed: fx.Node, product: fx.Node, h_res: fx.Node, n: int,
                        combined: bool) -> bool:
    """Whether the mixing computes H_resᵀ·x (True) or H_res·x (False), read off the product's
    labels and the views (and, for H_pre and H_res applied in one product, the concatenation and
    the slice) between H_res and the product's operand."""
    if M.kind(product) not in ("matmul", "einsum"):
        raise Refusal(f"{mixed.name}: the mixing is not a matmul/bmm/einsum ({M.describe(product)})")
    for operand in _product_operands(product):
        if not isinstance(operand, fx.Node):
            continue
        dims = _operand_labels(product, operand)
        if dims is None:
            continue
        out_dim, in_dim, product_dim = dims
        start = 0
        if combined:
            sl = _getitem_slice(mixed, product_dim)
            if sl is None or sl[1] - sl[0] != n:
                raise Refusal(f"{mixed.name}: the mixed streams are not one slice of {n} outputs of "
                              f"the product {product.name}")
            start = sl[0]
        idx = torch.zeros(2, len(_shape(operand)), dtype=torch.int64)
        idx[0, out_dim], idx[0, in_dim] = start + 0, 1      # A[out=0, in=1]
        idx[1, out_dim], idx[1, in_dim] = start + 1, 0      # A[out=1, in=0]
        found = _index_in(h_res, operand, idx)
        if found is None:
            continue
        src, valid = found
        if not bool(valid.all()):
            raise Refusal(f"{mixed.name}: the mixed streams do not come from H_res's part of the "
                          f"product {product.name}")
        pq = [tuple(r) for r in src[:, -2:].tolist()]
        if pq == [(0, 1), (1, 0)]:
            return False
        if pq == [(1, 0), (0, 1)]:
            return True
        raise Refusal(f"{mixed.name}: cannot tell how the mixing indexes H_res")
    raise Refusal(f"{mixed.name}: the mixing product's H_res operand is not a view of H_res, or the "
                  f"mixing has not one contracted stream dim ({M.describe(product)})")


def plan_post(layer: HCLayer, layout: StreamLayout, h_res: fx.Node, h_post: fx.Node) -> PostPlan:
    mixed = layer.mixed
    product = mixed.args[0] if layer.combined else mixed
    if not isinstance(product, fx.Node):
        raise Refusal(f"{mixed.name}: no mixing product")
    n = layout.sizes[2]
    transpose = _mixing_orientation(mixed, product, h_res, n, layer.combined)
    x_out = layer.x_out
    X = layout.x
    if M.example(x_out).dtype != M.example(X).dtype:
        raise Refusal(f"{x_out.name}: the new stream's dtype {M.example(x_out).dtype} differs from "
                      f"the stream's {M.example(X).dtype}")
    T1, T2, n, C = layout.sizes
    if torch.Size(_shape(x_out)).numel() != T1 * T2 * n * C:
        raise Refusal(f"{x_out.name}: the new stream has {_shape(x_out)}, not {layout.sizes} values")
    f = _f_in_token_order(layer)
    if M.example(f).dtype != M.example(X).dtype:
        raise Refusal(f"{f.name}: the sublayer output's dtype {M.example(f).dtype} differs from the "
                      f"stream's {M.example(X).dtype}")
    if torch.Size(_shape(f)).numel() != T1 * T2 * C:
        raise Refusal(f"{f.name}: sublayer output shape {_shape(f)} is not [tokens, C]")
    return PostPlan(layout, transpose, h_res, h_post, f, x_out)


def _f_in_token_order(layer: HCLayer) -> fx.Node:
    """The sublayer output as the post product pairs it with the streams: its operand, back through
    order-preserving reshapes only (a transpose on the way, e.g. [S, B, C] -> [B, S, C], stays)."""
    post = layer.post
    operands = [a for a in post.args if isinstance(a, fx.Node)]
    fo = [a for a in operands if view_chain(layer.f, a) is not None]
    if len(fo) != 1:
        return layer.f
    node = fo[0]
    while node is not layer.f:
        t = _transform(node)
        same_dtype = M.example(node.args[0]).dtype == M.example(node).dtype
        if t is None or t[0] not in ("reshape", "same") or not same_dtype:
            break
        node = node.args[0]
    return node


def build_post(plan: PostPlan, em: Emitter, x, h_res, h_post, f):
    lay = plan.layout
    n, C = lay.sizes[2], lay.sizes[3]
    x4 = _canonical_stream(lay, em, x)
    h4, hp = _tokens2(lay, em, h_res, plan.h_res, (n, n)), _tokens2(lay, em, h_post, plan.h_post, (n,))
    f3 = reshape_to(em, f, _sym_shape(plan.f), lay.sym_sizes[:2] + (C,), lay)
    out = em.op("mhc_post", x4, h4, hp, f3, plan.transpose_res, list(lay.order))
    if tuple(lay.order) != (0, 1, 2, 3):
        out = em.method("permute", out, tuple(lay.order))
    return reshape_to(em, out, lay.sym_mem_shape, _sym_shape(plan.x_out), lay)
