"""Index maps through view chains, and the shape helpers every stage shares. Layouts are found by
replaying the graph's own view ops on sampled indices rather than by naming layouts, so that every
chain of reshapes, permutes and expands is followed the same way by the layout search (layout.py)
and by the post's check of how the mixing indexes H_res (post.py)."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ...compat import concrete_shape
from .. import fx_match as M
from ..fx_match import Refusal
from ..hc_detect import is_view

_SEED = 20261122


# ----------------------------------------------------------------------------------------
# index maps through view chains


_SAME_INDEX_METHODS = M.CAST_METHODS | {"contiguous", "clone"}


def _sym_shape(node: Any) -> tuple[Any, ...]:
    """The example value's sizes: ints, or SymInts under dynamic shapes."""
    ev = M.example(node)
    if not isinstance(ev, torch.Tensor):
        raise Refusal(f"{getattr(node, 'name', node)} has no tensor example value")
    return tuple(ev.shape)


def _shape(node: Any) -> tuple[int, ...]:
    """Concrete sizes (a symbolic size by its hint, adding no guard). Decisions that must hold for
    every size compare _sym_shape instead."""
    return concrete_shape(M.example(node)) if isinstance(M.example(node), torch.Tensor) else \
        _sym_shape(node)


def _static(size: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return isinstance(size, int) or is_concrete_int(size)


def _same_size(a: Any, b: Any) -> bool:
    if _static(a) and _static(b):
        return int(a) == int(b)
    if _static(a) or _static(b):
        return False
    return a.node.expr == b.node.expr


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


def _transform(node: fx.Node) -> tuple | None:
    """How an index of `node` maps to an index of node.args[0], or None if unsupported."""
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    perm = M.permutation_of(node)
    if perm is not None:
        return ("permute", perm[1])
    name = node.target if node.op == "call_method" else None
    if name in M.RESHAPE_METHODS or (node.op == "call_function" and node.target in M.RESHAPE_FUNCTIONS):
        return ("reshape", _shape(src), _shape(node))
    if name == "expand":
        return ("expand", _shape(src), _shape(node))
    if name in _SAME_INDEX_METHODS:
        return ("same",) if _shape(src) == _shape(node) else None
    return None


def _ravel(idx: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.zeros(idx.shape[0], dtype=torch.int64)
    for d, size in enumerate(shape):
        flat = flat * size + idx[:, d]
    return flat


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(flat.shape[0], len(shape), dtype=torch.int64)
    for d in range(len(shape) - 1, -1, -1):
        out[:, d] = flat % shape[d]
        flat = flat // shape[d]
    return out


def view_chain(src: fx.Node, dst: fx.Node) -> list[fx.Node] | None:
    """The view nodes from src (exclusive) to dst (inclusive), or None if dst is not a view of src."""
    chain, node = [], dst
    while node is not src:
        if not is_view(node):
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def map_index(chain: list[fx.Node], idx: torch.Tensor) -> torch.Tensor:
    """Indices [K, ndim] of chain[-1] -> indices of the chain's source (chain[0].args[0])."""
    for node in reversed(chain):
        t = _transform(node)
        if t is None:
            raise Refusal(f"view op {M.describe(node)} ({node.name}) cannot be followed")
        if t[0] == "permute":
            perm = t[1]
            src_idx = torch.empty_like(idx)
            for i, d in enumerate(perm):
                src_idx[:, d] = idx[:, i]
            idx = src_idx
        elif t[0] == "reshape":
            idx = _unravel(_ravel(idx, t[2]), t[1])
        elif t[0] == "expand":
            in_shape, out_shape = t[1], t[2]
            lead = len(out_shape) - len(in_shape)
            idx = idx[:, lead:].clone()
            for d, size in enumerate(in_shape):
                if size == 1:
                    idx[:, d] = 0
    return idx


def _sample_indices(shape: tuple[int, ...], count: int = 96) -> torch.Tensor:
    """Corners, unit steps and random indices of `shape`."""
    rows = [[0] * len(shape), [s - 1 for s in shape]]
    for d, s in enumerate(shape):
        for v in (1, s - 1):
            if 0 < v < s:
                rows.append([v if i == d else 0 for i in range(len(shape))])
    gen = torch.Generator().manual_seed(_SEED)
    rand = torch.stack([torch.randint(0, max(1, s), (count,), generator=gen) for s in shape], 1)
    return torch.cat([torch.tensor(rows, dtype=torch.int64).reshape(-1, len(shape)), rand])
