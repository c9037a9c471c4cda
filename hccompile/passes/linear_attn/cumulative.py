"""The cumulative form o_t = q_t · Σ_{s≤t} k_s v_sᵀ, matched from its cumsum, and its non-causal
relative q·(KᵀV), recognised only to say in the report why it is left alone. Kept apart because it
shares nothing with the quadratic form's structure beyond the operand walk: no score matrix, no
mask, a state contracted with q instead."""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from .. import fx_match as M
from ..fx_match import Refusal
from .forms import _NotThisPattern
from .vocabulary import _kind, _other, _shape
from .facts import _Facts
from .quadratic import Candidate, _einsum_roles, _leads_to_product, _walk_operand


# ---------------------------------------------------------------------------------------------
# The cumulative form: cumsum over time of k⊗v, contracted with q


def _unsqueezed(node: Any) -> tuple[Any, list[int | None]]:
    """(source, positions): node's dims are the source's with size-1 dims inserted; positions[i]
    is the source dim of node dim i, or None for an inserted one."""
    shape = _shape(node)
    if shape is None:
        return node, []
    k = _kind(node)
    if k == "unsqueeze":
        src, pos = _unsqueezed(node.args[0])
        dim = M.arg(node, 1, "dim")
        if not isinstance(dim, int):
            return node, list(range(len(shape)))
        dim %= len(shape)
        return src, pos[:dim] + [None] + pos[dim:]
    if k == "getitem" and isinstance(node.args[1], tuple) and \
            all(i is None or i is Ellipsis or i == slice(None) for i in node.args[1]):
        src, pos = _unsqueezed(node.args[0])
        items = list(node.args[1])
        n_real = sum(i is not None for i in items if i is not Ellipsis)
        if Ellipsis in items:
            at = items.index(Ellipsis)
            items = items[:at] + [slice(None)] * (len(pos) - n_real) + items[at + 1:]
        items += [slice(None)] * (len(pos) - sum(i is not None for i in items))
        out, j = [], 0
        for i in items:
            if i is None:
                out.append(None)
            else:
                out.append(pos[j])
                j += 1
        return src, out
    return node, list(range(len(shape)))


def _broadcast_labels(a: Any, b: Any, rank: int) -> tuple[list[str], Any, list[str], Any, list[str]]:
    """Labels for an elementwise product of two unsqueezed tensors of result rank `rank`:
    x{p} for a dim both carry, 'fa'/'fb' for a dim only one carries."""
    sa, pa = _unsqueezed(a)
    sb, pb = _unsqueezed(b)
    if not isinstance(sa, fx.Node) or not isinstance(sb, fx.Node):
        raise Refusal("operand of the outer product is not a tensor")
    oa, ob = rank - len(pa), rank - len(pb)
    labels, la, lb = [], [None] * len(_shape(sa)), [None] * len(_shape(sb))
    for p in range(rank):
        da = pa[p - oa] if p >= oa else None
        db = pb[p - ob] if p >= ob else None
        if da is not None and db is not None:
            lab = f"x{p}"
        elif da is not None:
            lab = "fa"
        elif db is not None:
            lab = "fb"
        else:
            raise Refusal("the product has a dim neither operand carries")
        labels.append(lab)
        if da is not None:
            la[da] = lab
        if db is not None:
            lb[db] = lab
    if labels.count("fa") != 1 or labels.count("fb") != 1 or None in la or None in lb:
        raise Refusal("not an outer product over one feature dim each")
    return labels, sa, la, sb, lb


def _outer_product(x: fx.Node) -> tuple[list[str], Any, list[str], Any, list[str]]:
    k = _kind(x)
    if k == "einsum":
        eq, (a, b) = _einsum_roles(x)
        ins, out = eq.split("->")
        la, lb = ins.split(",")
        if set(out) != set(la) | set(lb) or len(set(la) - set(lb)) != 1 or \
                len(set(lb) - set(la)) != 1 or len(set(out)) != len(out):
            raise Refusal(f"einsum {eq!r} before the cumsum is not an outer product k⊗v")
        name = {}
        for p, c in enumerate(out):
            name[c] = "fa" if c not in lb else "fb" if c not in la else f"x{p}"
        return [name[c] for c in out], a, [name[c] for c in la], b, [name[c] for c in lb]
    if k == "mul":
        return _broadcast_labels(x.args[0], _other(x), len(_shape(x)))
    raise Refusal(f"the cumsum sums {M.describe(x)}, not an outer product k⊗v")


def _contraction(state: fx.Node, labels: list[str]) -> tuple[fx.Node, Any, list[str], str, list[str]]:
    """Find the contraction of the cumulative state with q: (anchor, q source, q labels,
    contracted feature label, output labels)."""
    while True:
        users = list(state.users)
        if len(users) != 1:
            raise Refusal("the cumulative k⊗v state has several users")
        (u,) = users
        if _kind(u) not in ("cast", "contiguous"):
            break
        state = u
    k = _kind(u)
    rank = len(labels)
    if k == "einsum":
        eq, (a, b) = _einsum_roles(u)
        ins, out = eq.split("->")
        l0, l1 = ins.split(",")
        if b is state:
            lq, ls, qsrc = l0, l1, a
        elif a is state:
            lq, ls, qsrc = l1, l0, b
        else:
            raise Refusal("einsum does not read the state")
        if len(ls) != rank or len(set(ls)) != rank:
            raise Refusal(f"einsum {eq!r} does not index every dim of the state once")
        name = dict(zip(ls, labels))
        contracted = [c for c in lq if c in ls and c not in out]
        if len(contracted) != 1 or name[contracted[0]] not in ("fa", "fb") or \
                any(c not in ls for c in lq) or any(c not in ls for c in out) or \
                sorted(out + contracted[0]) != sorted(ls) or len(set(lq)) != len(lq):
            raise Refusal(f"einsum {eq!r} is not a contraction of q with the state over one "
                          f"feature dim")
        feat = name[contracted[0]]
        other = "fb" if feat == "fa" else "fa"
        if other in [name[c] for c in lq]:
            raise Refusal("q carries both feature dims of the state")
        return u, qsrc, [name[c] for c in lq], feat, [name[c] for c in out]
    if k == "mul":
        qside = u.args[1] if u.args[0] is state else u.args[0]
        if _shape(u) != _shape(state):
            raise Refusal("q broadcasts the state to a larger shape")
        sq, pq = _unsqueezed(qside)
        if not isinstance(sq, fx.Node):
            raise Refusal("q is not a tensor")
        off = rank - len(pq)
        ql = [None] * len(_shape(sq))
        carried = set()
        for p in range(rank):
            d = pq[p - off] if p >= off else None
            if d is not None:
                ql[d] = labels[p]
                carried.add(labels[p])
        reducers = list(u.users)
        if len(reducers) != 1 or _kind(reducers[0]) != "sum":
            raise Refusal("q ⊙ state is not summed over a feature dim")
        red = reducers[0]
        dim = M.arg(red, 1, "dim")
        if M.arg(red, 2, "keepdim", False) or not isinstance(dim, int):
            raise Refusal("q ⊙ state is summed with keepdim or over several dims")
        feat = labels[dim % rank]
        if feat not in ("fa", "fb") or feat not in carried or None in ql or \
                carried != set(labels) - {"fb" if feat == "fa" else "fa"}:
            raise Refusal("q ⊙ state is not summed over q's feature dim")
        return red, sq, ql, feat, [lab for i, lab in enumerate(labels) if i != dim % rank]
    if k == "matmul" and u.args[1] is state:
        sq, pq = _unsqueezed(u.args[0])
        if len(pq) != rank or pq[-2] is not None or pq[-1] is None or \
                labels[-2] not in ("fa", "fb") or labels[-1] not in ("fa", "fb"):
            raise Refusal("matmul with the state is not q[..., None, :] @ state[..., d, e]")
        ql = [None] * len(_shape(sq))
        for p in range(rank):
            if pq[p] is not None:
                ql[pq[p]] = labels[p] if p < rank - 1 else labels[-2]
        squeezes = list(u.users)
        if len(squeezes) != 1 or _kind(squeezes[0]) != "squeeze" or \
                not isinstance(M.arg(squeezes[0], 1, "dim"), int) or \
                M.arg(squeezes[0], 1, "dim") % rank != rank - 2 or None in ql:
            raise Refusal("q[..., None, :] @ state is not squeezed back")
        return squeezes[0], sq, ql, labels[-2], labels[:-2] + [labels[-1]]
    raise Refusal(f"the cumulative k⊗v state feeds {M.describe(u)} ({u.name}), not a contraction "
                  f"with q (a normaliser or another op in between)")


def match_cumulative(cumsum: fx.Node) -> Candidate:
    x = cumsum.args[0]
    rank = M.ndim(cumsum)
    dim = M.arg(cumsum, 1, "dim")
    if not isinstance(x, fx.Node) or rank is None or not isinstance(dim, int):
        raise Refusal("cumsum without a tensor input and a constant dim")
    try:
        labels, a, la, b, lb = _outer_product(x)
    except Refusal as r:
        raise _NotThisPattern(str(r)) from None
    dim %= rank
    if labels[dim] in ("fa", "fb"):
        raise Refusal("the cumsum runs along a feature dim, not time")
    time = labels[dim]
    anchor, qsrc, ql, feat, out = _contraction(cumsum, labels)
    # names: batch labels in the state's order, t for time, d/e for the features
    rename, nb = {}, 0
    for lab in labels:
        if lab == time:
            rename[lab] = "t"
        elif lab == feat:
            rename[lab] = "d"
        elif lab in ("fa", "fb"):
            rename[lab] = "e"
        else:
            rename[lab] = f"b{nb}"
            nb += 1
    cand = Candidate(anchor=anchor, form="cumulative")
    cand.region += [n for n in (cumsum, x, *anchor.args) if isinstance(n, fx.Node)]
    k_src, k_lab, v_src, v_lab = (a, la, b, lb) if feat == "fa" else (b, lb, a, la)
    cand.q = _walk_operand(qsrc, [rename[lab] for lab in ql], cand)
    cand.k = _walk_operand(k_src, [rename[lab] for lab in k_lab], cand)
    cand.v = _walk_operand(v_src, [rename[lab] for lab in v_lab], cand)
    cand.out_labels = [rename[lab] for lab in out]
    for name, op in (("q", cand.q), ("k", cand.k), ("v", cand.v)):
        if "t" not in op.labels:
            raise Refusal(f"{name} has no time dim")
    return cand


def _noncausal_state(node: fx.Node, facts: _Facts) -> str | None:
    """q · (kᵀv): a contraction with a state that sums k⊗v over all positions."""
    k = M.kind(node)
    if k == "matmul":
        a, s = node.args[0], node.args[1]
    elif k == "einsum":
        try:
            _, (a, s) = _einsum_roles(node)
        except Refusal:
            return None
        if M.kind(a) in ("matmul", "einsum"):
            a, s = s, a
    else:
        return None
    if M.kind(s) not in ("matmul", "einsum") or _leads_to_product(a):
        return None
    if M.kind(s) == "matmul":
        inner = list(s.args[:2])
    else:
        try:
            _, inner = _einsum_roles(s)
        except Refusal:
            return None
    if not isinstance(a, fx.Node) or not facts.deps(a) or \
            not all(isinstance(i, fx.Node) and facts.deps(i) for i in inner):
        return None
    return ("q·(KᵀV): the k⊗v state sums over every position, with no cumsum or causal mask "
            "(non-causal linear attention)")
