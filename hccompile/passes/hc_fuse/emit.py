"""One small interface between the builders (build_mapping, build_post, build_aggregate) and what
they build: `emit` either runs each step eagerly on probe tensors or inserts it as an FX node, so
that what the probe proves is what the rewrite inserts."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ...compat import size_hint
from .. import fx_match as M
from ..fx_match import Refusal
from ..base import PassContext
from .views import _same_shape, _same_size, _static, _sym_shape
from .layout import StreamLayout


# ----------------------------------------------------------------------------------------
# emit: the same builders run eagerly (probe) or insert FX nodes (rewrite)


def _op(name: str):
    from ... import lowering  # noqa: F401
    from ...lowering import mhc  # noqa: F401  (registers the ops)

    return getattr(torch.ops.hccompile, name).default


def eager_emit(what: str, *args):
    if what.startswith("op:"):
        return _op(what[3:])(*args)
    if what == "getitem":
        return args[0][args[1]]
    x, *rest = args
    if what == "permute":
        return x.permute(*rest[0])
    if what == "reshape_to":
        src, dst = rest
        return x if _same_shape(src, dst) else x.reshape([size_hint(s) for s in dst])
    return getattr(x, what)(*rest)


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


class GraphEmitter:
    def __init__(self, gm: fx.GraphModule, ctx: PassContext, layer: int, meta_from: fx.Node,
                 layout: StreamLayout | None = None):
        self.g, self.ctx, self.layer, self.meta_from = gm.graph, ctx, layer, meta_from
        self.layout = layout
        self.nodes: list[fx.Node] = []

    def _size_arg(self, size: Any, only_symbolic: bool) -> Any:
        """An unflatten size: the int, -1 for the one symbolic size of a group, or a size node of
        the projection (whose leading dims are the token dims)."""
        if _static(size):
            return int(size)
        if only_symbolic:
            return -1
        lay = self.layout
        if lay is not None and lay.proj is not None:
            for k, s in enumerate(_sym_shape(lay.proj)[:-1]):
                if _same_size(s, size):
                    return self("size", lay.proj, k)
        raise Refusal(f"no source for the symbolic size {size}")

    def reshape_to(self, x: fx.Node, src: tuple, dst: tuple) -> fx.Node:
        if _same_shape(src, dst):
            return x
        d = 0
        for sg, dg in _regroup(src, dst):
            if len(sg) > 1:
                x = self("flatten", x, d, d + len(sg) - 1)
            if not sg:
                for _ in dg:
                    x = self("unsqueeze", x, d)
            elif not dg:
                x = self("squeeze", x, d)
                continue
            elif len(dg) > 1:
                sizes = [dst[k] for k in dg]
                symbolic = [s for s in sizes if not _static(s)]
                x = self("unflatten", x, d, tuple(self._size_arg(s, len(symbolic) == 1)
                                                  for s in sizes))
            d += len(dg)
        return x

    def __call__(self, what: str, *args) -> fx.Node:
        if what == "reshape_to":
            return self.reshape_to(*args)
        if what.startswith("op:"):
            node = self.g.call_function(_op(what[3:]), tuple(args))
            role = what[3:]
        elif what == "getitem":
            node = self.g.call_function(operator.getitem, tuple(args))
            role = ("h_pre", "h_post", "h_res")[args[1]]
        else:
            node = self.g.call_method(what, tuple(args))
            role = "size" if what == "size" else "view"
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        node.meta["example_value"] = M.fake_value(node, self.ctx.fake_mode)
        node.meta["hc"] = {"layer": self.layer, "role": role}
        self.nodes.append(node)
        return node
