"""How the stream tensor x holds [T1, T2, n, C] in memory, found once per layer and shared by the
post and the aggregate: the fused ops read x through this strided view and write the new stream in
x's own memory order, so the graph around them stays as it was. The conversions to the canonical
view are here too, builders against the shared emitter (passes/emit.py), so that the post and the
aggregate cannot disagree about them."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...compat import size_hint
from .. import fx_match as M
from ..emit import Emitter
from ..fx_match import Refusal
from ..hc_detect import HCLayer, is_view
from .views import (_ravel, _same_shape, _same_size, _sample_indices, _shape, _static, _sym_shape,
                    map_index, view_chain)


# ----------------------------------------------------------------------------------------
# the stream layout: x as [T1, T2, n, C] in some memory order


ORDERS = [(0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3)] + [
    p for p in itertools.permutations(range(4)) if p not in ((0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3))]


@dataclass
class StreamLayout:
    """x (node) holds the canonical [T1, T2, n, C] stream with its dims in memory order `order`:
    x.reshape([sizes[d] for d in order]).permute(inverse) is the canonical view."""

    x: fx.Node
    sizes: tuple[int, int, int, int]
    order: tuple[int, ...]
    lead: tuple[int, ...]          # the projection's token dims (1 or 2 of them)
    sym_sizes: tuple[Any, ...] = ()  # sizes with SymInt token dims under dynamic shapes
    proj: fx.Node | None = None      # has the token dims as its leading dims

    @property
    def mem_shape(self) -> list[int]:
        return [self.sizes[d] for d in self.order]

    @property
    def sym_mem_shape(self) -> tuple[Any, ...]:
        return tuple(self.sym_sizes[d] for d in self.order)


def _per_stream_view(v: fx.Node, n: int) -> tuple[int, int, int]:
    """v holds [tokens.., 1.., n, C] (the input of a per-stream norm): (token dims, ones, C)."""
    shape = _shape(v)
    if len(shape) < 3 or shape[-2] != n:
        raise Refusal(f"{v.name}: the per-stream norm's input {shape} is not [tokens.., n, C]")
    if not _static(_sym_shape(v)[-1]):
        raise Refusal("the stream width C is symbolic")
    k = len(shape) - 2
    while k > 0 and shape[k - 1] == 1 and k > 1:
        k -= 1
    return k, len(shape) - 2 - k, shape[-1]


def stream_layout(layer: HCLayer, n: int) -> StreamLayout:
    """How the stream tensor holds [T1, T2, n, C], found from the view of it the mapping reads:
    the flattened v = vec(x) of the projection, or the input of a per-stream norm
    ([tokens.., n, C], the `hyper-connections` package)."""
    per_stream = layer.stream_norm is not None
    v = layer.v if layer.v is not None else layer.proj.args[0]
    if per_stream:
        n_lead, ones, C = _per_stream_view(v, n)
        token_node = v
        lead = _shape(v)[:n_lead]
    else:
        token_node = layer.proj
        lead = _shape(layer.proj)[:-1]
    if len(lead) not in (1, 2):
        raise Refusal(f"the projection has {len(lead)} token dims (1 or 2 are fused)")
    if not per_stream:
        nc = _shape(v)[-1]
        if not _static(_sym_shape(v)[-1]):
            raise Refusal("the flattened stream width n·C is symbolic")
        if nc % n:
            raise Refusal(f"flattened stream width {nc} is not a multiple of n={n}")
        C = nc // n
    T1, T2 = (1, lead[0]) if len(lead) == 1 else lead
    sizes = (T1, T2, n, C)
    sym_lead = _sym_shape(token_node)[:len(lead)]
    sym_sizes = ((1,) + sym_lead if len(lead) == 1 else sym_lead) + (n, C)
    canon = _sample_indices(sizes)
    v_idx = torch.stack([canon[:, 1]] if len(lead) == 1 else [canon[:, 0], canon[:, 1]], 1)
    if per_stream:  # v[t.., 0.., j, c]
        zeros = torch.zeros(canon.shape[0], ones, dtype=torch.int64)
        v_idx = torch.cat([v_idx, zeros, canon[:, 2:4]], 1)
    else:  # v[t, j·C + c]: the flattened stream is stream-major, as vec(x) of x ∈ R^{n×C}
        v_idx = torch.cat([v_idx, (canon[:, 2] * C + canon[:, 3])[:, None]], 1)
    candidates, node = [v], v
    # not past an identity dropout (the probe cannot evaluate it) nor past a view that reads a
    # second tensor (`y.type_as(f)`: the probe would have to evaluate f's region too)
    while is_view(node) and not _reads_other_tensor(node) and \
            (node.op != "call_function" or node.target not in _DROPOUTS):
        node = node.args[0]
        candidates.append(node)
    found = []
    for cand in reversed(candidates):  # most upstream first
        shape = _shape(cand)
        if torch.Size(shape).numel() != T1 * T2 * n * C:
            continue
        chain = view_chain(cand, v)
        try:
            flat = _ravel(map_index(chain, v_idx), shape)
        except Refusal:
            continue
        for order in ORDERS:
            want = _ravel(canon[:, list(order)], tuple(sizes[d] for d in order))
            if torch.equal(flat, want):
                found.append(StreamLayout(cand, sizes, order, lead, sym_sizes, token_node))
                break
    if not found:
        raise Refusal("the flattened stream v is not a view of a [tokens, n, C] stream tensor")
    # The new stream is written in the memory order of x and viewed back as x_out: take the
    # stream tensor shaped like x_out (the model's own residual layout, not some intermediate
    # view of it, e.g. the previous layer's fused output before its reshape).
    like_out = [lay for lay in found if _same_shape(_sym_shape(lay.x), _sym_shape(layer.x_out))]
    return (like_out or found)[0]


_DROPOUTS = {torch.nn.functional.dropout, torch.dropout}


def _reads_other_tensor(node: fx.Node) -> bool:
    """A view op with a tensor argument besides its input (type_as, view_as, expand_as...)."""
    return any(isinstance(a, fx.Node) and isinstance(M.example(a), torch.Tensor)
               for a in list(node.args[1:]) + list(node.kwargs.values()))


def _inverse(order) -> list[int]:
    return [list(order).index(d) for d in range(len(order))]


# ----------------------------------------------------------------------------------------
# the canonical views the post and aggregate builders start from


def _canonical_stream(layout: StreamLayout, em: Emitter, x):
    x = reshape_to(em, x, _sym_shape(layout.x), layout.sym_mem_shape, layout)
    if tuple(layout.order) != (0, 1, 2, 3):
        x = em.method("permute", x, tuple(_inverse(layout.order)))
    return x


def _tokens2(layout: StreamLayout, em: Emitter, t, node: fx.Node, tail: tuple[int, ...]):
    """A mapping value [lead..., *tail] -> [T1, T2, *tail]. Any other shape holding the same
    values in token-major order (the `hyper-connections` package's H_pre is [1, B, S, 1, n, 1])
    is reshaped; the probe checks the order."""
    src = _sym_shape(node)
    if len(layout.lead) == 1 and _same_shape(src, tuple(layout.sym_sizes[1:2]) + tail):
        return em.method("unsqueeze", t, 0)
    want = tuple(layout.sym_sizes[:2]) + tail
    if _same_shape(src, want):
        return t
    return reshape_to(em, t, src, want, layout)


def reshape_to(em: Emitter, x, src: tuple, dst: tuple, layout: StreamLayout):
    """x, of shape `src`, as shape `dst` with the same element order."""
    if _same_shape(src, dst):
        return x
    if em.eager:
        # probe tensors have concrete sizes: one reshape. The graph's steps below exist to keep
        # symbolic token sizes symbolic, which a reshape to the hints would pin.
        return em.method("reshape", x, [size_hint(s) for s in dst])
    d = 0
    for sg, dg in _regroup(src, dst):
        if len(sg) > 1:
            x = em.method("flatten", x, d, d + len(sg) - 1)
        if not sg:
            for _ in dg:
                x = em.method("unsqueeze", x, d)
        elif not dg:
            x = em.method("squeeze", x, d)
            continue
        elif len(dg) > 1:
            sizes = [dst[k] for k in dg]
            symbolic = [s for s in sizes if not _static(s)]
            x = em.method("unflatten", x, d, tuple(_size_arg(em, layout, s, len(symbolic) == 1)
                                                   for s in sizes))
        d += len(dg)
    return x


def _regroup(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Consecutive groups of src and dst dims with equal products (by hints): the flatten /
    unflatten steps that turn one shape into the other in the same element order."""
    hs, hd = [size_hint(s) for s in src], [size_hint(s) for s in dst]
    groups, i, j = [], 0, 0
    while i < len(hs) or j < len(hd):
        a, b, ps, pd = i, j, 1, 1
        if i < len(hs):
            ps, i = ps * hs[i], i + 1
        if j < len(hd):
            pd, j = pd * hd[j], j + 1
        while ps != pd:
            if ps < pd and i < len(hs):
                ps, i = ps * hs[i], i + 1
            elif pd < ps and j < len(hd):
                pd, j = pd * hd[j], j + 1
            else:
                raise Refusal(f"cannot regroup shape {tuple(hs)} as {tuple(hd)}")
        groups.append((list(range(a, i)), list(range(b, j))))
    return groups


def _size_arg(em: Emitter, layout: StreamLayout, size: Any, only_symbolic: bool) -> Any:
    """An unflatten size: the int, -1 for the one symbolic size of a group, or a size node of the
    projection (whose leading dims are the token dims)."""
    if _static(size):
        return int(size)
    if only_symbolic:
        return -1
    if layout.proj is not None:
        for k, s in enumerate(_sym_shape(layout.proj)[:-1]):
            if _same_size(s, size):
                return em.method("size", layout.proj, k)
    raise Refusal(f"no source for the symbolic size {size}")
