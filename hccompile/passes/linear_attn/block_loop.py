"""Lightning attention 2's block loop, which Dynamo unrolls into one quadratic match per block. Kept
apart because the blocks are found by the quadratic matcher one by one; what is added here is the
proof that they slice the same q, k, v, tile time and are assembled into one output, so that the
whole loop becomes one op instead of one op per block."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from .. import fx_match as M
from ..fx_match import Refusal
from .vocabulary import _is_fresh, _kind, _other, _shape
from .facts import _Facts
from .quadratic import Candidate, Operand, _walk_operand


# ---------------------------------------------------------------------------------------------
# The block loop (lightning attention 2's reference, unrolled by Dynamo)


def _time_slice(node: Any) -> tuple[fx.Node, int, int, int] | None:
    """(source, dim, start, stop) when `node` is a contiguous slice of `source` along one dim (an
    index, narrow, or a piece of split: fx_match.index_entries), seen through casts and contiguous()."""
    while _kind(node) in ("cast", "contiguous"):
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    entries = M.index_entries(node)
    if len(entries) != 1 or entries[0].kind != "slice":
        return None
    src, dim, _, bounds, _ = entries[0]
    shape = _shape(src)
    if shape is None:
        return None
    dim %= len(shape)
    start, stop, _ = slice(*bounds).indices(shape[dim])
    return src, dim, start, stop


def _operand_time_slice(op: Operand, time: str) -> tuple[fx.Node, int, int] | None:
    sl = _time_slice(op.node)
    if sl is None:
        return None
    src, dim, start, stop = sl
    if op.labels[dim] != time:
        return None
    return src, start, stop


def _assembly(cand: Candidate) -> tuple[str, fx.Node, fx.Node, list[str], float] | None:
    """Follow a block's output to where the blocks are assembled: ("cat", cat node, piece, labels,
    post scale) or ("setitem", setitem node, piece, labels, post scale)."""
    node, labels, post = cand.anchor, list(cand.out_labels), 1.0
    for _ in range(8):
        users = list(node.users)
        if len(users) != 1:
            return None
        (u,) = users
        k = _kind(u)
        if k == "cat":
            return "cat", u, node, labels, post
        if k == "setitem" and u.args[2] is node:
            return "setitem", u, node, labels, post
        perm = M.permutation_of(u)
        if perm is not None:
            labels = [labels[d] for d in perm[1]]
        elif k == "add":
            other = u.args[1] if u.args[0] is node else u.args[0]
            if _shape(other) != _shape(node):
                return None
        elif k in ("cast", "contiguous"):
            pass
        elif k in ("mul", "div") and M.scalar(_other(u)) is not None and u.args[0] is node:
            c = M.scalar(_other(u))
            post *= c if k == "mul" else 1.0 / c
        else:
            return None
        node = u
    return None


def _group_block_loops(cands: list[Candidate], facts: _Facts) -> tuple[list[Candidate],
                                                                       list[tuple[Candidate, str]]]:
    """Group intra-block matches that slice the same q, k, v along time and are assembled by one
    cat / one output buffer into block-loop candidates. Returns (loops, refused loops)."""
    groups: dict[tuple, list[tuple[int, int, Candidate, tuple]]] = {}
    for cand in cands:
        sq = _operand_time_slice(cand.q, "t")
        sk = _operand_time_slice(cand.k, "s")
        sv = _operand_time_slice(cand.v, "s")
        if sq is None or sk is None or sv is None or not (sq[1:] == sk[1:] == sv[1:]):
            continue
        asm = _assembly(cand)
        if asm is None:
            continue
        kind, node, piece, labels, post = asm
        target = node if kind == "cat" else node.args[0]
        key = (sq[0], sk[0], sv[0], tuple(cand.q.labels), tuple(cand.k.labels),
               tuple(cand.v.labels), target)
        groups.setdefault(key, []).append((sq[1], sq[2], cand, asm))
    loops, refused = [], []
    for (q_src, k_src, v_src, ql, kl, vl, target), blocks in groups.items():
        blocks.sort(key=lambda b: b[0])
        try:
            loops.append(_block_loop(q_src, k_src, v_src, list(ql), list(kl), list(vl), target,
                                     blocks, facts))
        except Refusal as r:
            refused.append((blocks[0][2], str(r)))
    return loops, refused


def _block_loop(q_src, k_src, v_src, ql, kl, vl, target, blocks, facts: _Facts) -> Candidate:
    first = blocks[0][2]
    kind, _, _, labels, post = blocks[0][3]
    time_size = _shape(q_src)[ql.index("t")]
    expect = 0
    for start, stop, cand, asm in blocks:
        if start != expect:
            raise Refusal(f"blocks do not tile the sequence: a block starts at {start}, expected "
                          f"{expect}")
        expect = stop
        if asm[3] != labels or not math.isclose(asm[4], post, rel_tol=1e-12):
            raise Refusal("blocks disagree on the output layout or scaling")
        if not math.isclose(cand.scale, first.scale, rel_tol=1e-12):
            raise Refusal("blocks disagree on the scale")
        if (cand.decay is None) != (first.decay is None) or cand.head_label != first.head_label:
            raise Refusal("blocks disagree on the decay")
        if cand.decay is not None and not torch.allclose(cand.decay.values, first.decay.values,
                                                         rtol=1e-6, atol=0):
            raise Refusal("blocks disagree on the decay values")
    if expect != time_size:
        raise Refusal(f"blocks cover {expect} of {time_size} positions")
    loop = Candidate(anchor=target, form="block_loop", out_labels=list(labels),
                     decay=first.decay, head_label=first.head_label, blocks=len(blocks))
    loop.q = _walk_operand(q_src, ql, loop)
    loop.k = _walk_operand(k_src, kl, loop)
    loop.v = _walk_operand(v_src, vl, loop)
    loop.scale *= first.scale * post
    if kind == "cat":
        cat = target
        pieces = [asm[2] for _, _, _, asm in blocks]
        listed = cat.args[0] if cat.args else cat.kwargs.get("tensors")
        dim = M.arg(cat, 1, "dim", 0)
        if list(listed) != pieces:
            raise Refusal("torch.cat joins other tensors than the blocks, or in another order")
        if not isinstance(dim, int) or dim % len(labels) != labels.index("t"):
            raise Refusal("torch.cat does not join the blocks along time")
    else:
        buf = target
        writes = [asm[1] for _, _, _, asm in blocks]
        shape = _shape(buf)
        if not _is_fresh(buf) or shape is None or len(shape) != len(labels):
            raise Refusal("the blocks are written into a tensor that is not created in the graph")
        for (start, stop, _, asm) in blocks:
            items = M.index_items(asm[1].args[1], len(shape))
            if items is None or any(kind != "slice" for _, kind, _, _ in items):
                raise Refusal("an output write is not a slice")
            if len(items) != 1 or items[0][0] != labels.index("t") or \
                    slice(*items[0][2]).indices(shape[items[0][0]])[:2] != (start, stop):
                raise Refusal("an output write does not cover its block's positions along time")
        facts.refresh_order()
        last = max(writes, key=facts.order.__getitem__)
        for u in buf.users:
            if u not in writes and facts.order[u] < facts.order[last]:
                raise Refusal(f"{u.name} reads the output buffer before every block is written")
        loop.mutations = writes
        loop.insert_before = last.next
    return loop
