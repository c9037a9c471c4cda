"""The quadratic form O = c·tril(QKᵀ)V read from the graph's structure alone, and the Candidate that
every form fills in. Kept apart from the numbers (decay, probe) so that a match only says what is
multiplied with what through which masks, and shared with the other forms, which reuse its operand
walk and its reading of einsum and matmul."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import fx_match as M
from ..fx_match import Refusal
from .forms import PATTERN, PATTERN_CUMSUM, PATTERN_DECAY, PATTERN_LOOP, lowering_op
from .vocabulary import _other, _shape

_PASSTHROUGH = ("cast", "contiguous")


# ---------------------------------------------------------------------------------------------
# Candidates


@dataclass
class Operand:
    """A tensor entering the pattern: its source node and a label per source dim."""

    node: fx.Node
    labels: list[str]


TABLE = "table"  # a precomputed decay-mask buffer D = exp(γ_h (t−s)) (HF MiniMax's diagonal_decay)


@dataclass
class Decay:
    """γ_h = coeff · Π heads, each head factor a node (or its log) with one value per head or
    one for all; `values` is γ evaluated on the real example inputs."""

    heads: list[tuple[fx.Node, bool | str]]  # (node, take the log), or (D, TABLE): γ = log D[t=1, s=0]
    coeff: float
    values: torch.Tensor


@dataclass
class Candidate:
    anchor: fx.Node
    q: Operand | None = None
    k: Operand | None = None
    v: Operand | None = None
    out_labels: list[str] = field(default_factory=list)
    scale: float = 1.0
    region: list[fx.Node] = field(default_factory=list)  # nodes the replacement may make dead
    form: str = "quadratic"
    p_labels: list[str] = field(default_factory=list)  # the score matrix's dims (quadratic)
    score_shape: tuple[int, ...] | None = None
    mask_factors: list[fx.Node] = field(default_factory=list)  # tensors multiplying the scores
    # scalar graph values multiplying (or dividing) the scores, e.g. a float attribute that
    # dynamic=True turned into a symbol (`self.scale` -> `.item()`): applied to the op's output
    scale_nodes: list[tuple[fx.Node, str]] = field(default_factory=list)
    mask_conditions: list[Any] = field(default_factory=list)  # conditions of where/masked_fill
    decay: Decay | None = None
    head_label: str | None = None  # the batch label along which the decay varies
    mutations: list[fx.Node] = field(default_factory=list)  # setitem nodes (block loop)
    insert_before: fx.Node | None = None
    blocks: int = 1

    @property
    def pattern(self) -> str:
        if self.form == "block_loop":
            return PATTERN_LOOP
        if self.form == "cumulative":
            return PATTERN_CUMSUM
        return PATTERN_DECAY if self.decay is not None else PATTERN

    @property
    def op(self) -> str:
        return lowering_op(self.form, self.decay is not None)


def _batch_labels(n: int) -> list[str]:
    return [f"b{i}" for i in range(n)]


def _walk_operand(node: Any, labels: list[str], cand: Candidate) -> Operand:
    """Follow permutations, constant scalings and contiguous() back to the operand's source."""
    while True:
        if not isinstance(node, fx.Node):
            raise Refusal(f"operand {node!r} is not a tensor")
        perm = M.permutation_of(node)
        if perm is not None:
            src, p = perm
            src_labels = [""] * len(labels)
            for i, d in enumerate(p):
                src_labels[d] = labels[i]
            cand.region.append(node)
            node, labels = src, src_labels
            continue
        k = M.kind(node)
        if k in ("mul", "div"):
            a, b = node.args[0], _other(node)
            c = M.scalar(b) if isinstance(a, fx.Node) else M.scalar(a)
            if c is not None and (k == "mul" or isinstance(a, fx.Node)):
                cand.scale *= c if k == "mul" else 1.0 / c
                cand.region.append(node)
                node = a if isinstance(a, fx.Node) else b
                continue
        if k == "contiguous":  # not casts: computing in a lower precision than asked is wrong
            cand.region.append(node)
            node = node.args[0]
            continue
        return Operand(node, labels)


def _einsum_roles(node: fx.Node) -> tuple[str, list[fx.Node]]:
    eq = node.args[0]
    ops = list(node.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if not isinstance(eq, str) or len(ops) != 2 or "->" not in eq:
        raise Refusal(f"einsum {eq!r}: only two-operand equations with '->' are matched")
    eq = eq.replace(" ", "")
    if "..." in eq:
        eq = _expand_ellipsis(eq, [M.ndim(o) for o in ops])
    return eq, ops


def _expand_ellipsis(eq: str, ranks: list[int | None]) -> str:
    """'...nd,...md->...nm' with operands of rank 4 -> 'ABnd,ABmd->ABnm' (same-rank ellipses only)."""
    ins, out = eq.split("->")
    specs = ins.split(",")
    counts = set()
    for spec, rank in zip(specs, ranks):
        if "..." in spec:
            if rank is None:
                raise Refusal(f"einsum {eq!r}: operand without a rank")
            counts.add(rank - (len(spec) - 3))
    if len(counts) != 1 or min(counts) < 0:
        raise Refusal(f"einsum {eq!r}: ellipses of different lengths (broadcasting) are not matched")
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq][:counts.pop()]
    fill = "".join(free)
    return ",".join(sp.replace("...", fill) for sp in specs) + "->" + out.replace("...", fill)


def _product_roles(node: fx.Node, left_role: tuple[str, str], right_role: tuple[str, str],
                   out_role: tuple[str, str], batch_from: str = "out"
                   ) -> tuple[fx.Node, list[str], fx.Node, list[str], list[str]]:
    """Label the dims of a product's operands and output.

    For matmul, left is [..., left_role], right [..., right_role], out [..., out_role]; for einsum
    the equation decides. Batch dims are labelled b0, b1, ... in the order they have in the output
    (batch_from="out") or in the left operand ("left"), so that the score product and the value
    product agree on names whatever order each einsum writes.
    """
    k = M.kind(node)
    if k == "matmul":
        a, b = node.args[0], node.args[1]
        na, nb, no = M.ndim(a), M.ndim(b), M.ndim(node)
        if na is None or nb is None or na != nb or na < 2:
            raise Refusal("matmul operands of different ranks (broadcast) are not matched")
        ea, eb = M.example(a), M.example(b)
        if list(ea.shape[:-2]) != list(eb.shape[:-2]):
            raise Refusal("matmul with broadcast batch dims is not matched")
        batch = _batch_labels(na - 2)
        return a, batch + list(left_role), b, batch + list(right_role), batch + list(out_role)
    if k == "einsum":
        eq, (a, b) = _einsum_roles(node)
        ins, out = eq.split("->")
        la, lb = ins.split(",")
        contracted = (set(la) & set(lb)) - set(out)
        only_a = [c for c in out if c in la and c not in lb]
        only_b = [c for c in out if c in lb and c not in la]
        batch = [c for c in (out if batch_from == "out" else la) if c in out and c in la and c in lb]
        if len(contracted) != 1 or len(only_a) != 1 or len(only_b) != 1 or \
                len(set(la)) != len(la) or len(set(lb)) != len(lb) or \
                set(la) != set(batch) | contracted | set(only_a) or \
                set(lb) != set(batch) | contracted | set(only_b):
            raise Refusal(f"einsum {eq!r} is not a batched matrix product")
        name = {c: f"b{i}" for i, c in enumerate(batch)}
        (ca,) = contracted
        name[ca] = left_role[1]
        name[only_a[0]] = left_role[0]
        name[only_b[0]] = right_role[1]
        return a, [name[c] for c in la], b, [name[c] for c in lb], [name[c] for c in out]
    raise Refusal(f"{M.describe(node)} is not a matrix product")


def _walk_scores(p: Any, cand: Candidate, lead_memo: dict) -> tuple[fx.Node, bool]:
    """From the left operand of P@V back to QKᵀ; returns (qk node, whether a mask was applied).
    Tensors multiplying the scores are recorded in cand.mask_factors (0/1 masks or a decay)."""
    masked = False
    node = p
    while True:
        if not isinstance(node, fx.Node):
            raise Refusal("left operand of the value product is not a tensor")
        k = M.kind(node)
        if k in ("matmul", "einsum"):
            return node, masked
        if k == "softmax":
            raise Refusal("softmax between QKᵀ and V: softmax attention, not linear attention")
        cand.region.append(node)
        if k == "tril":
            diag = M.arg(node, 1, "diagonal", 0)
            if diag != 0:
                raise Refusal(f"tril(diagonal={diag}): the causal mask must keep the diagonal")
            masked, node = True, node.args[0]
        elif k == "triu":
            raise Refusal("triu mask keeps the future: anti-causal")
        elif k == "masked_fill":
            if M.scalar(M.arg(node, 2, "value")) != 0.0:
                raise Refusal("masked_fill with a non-zero value (e.g. -inf): not a linear-attention mask")
            cand.mask_conditions.append(M.arg(node, 1, "mask"))
            masked, node = True, node.args[0]
        elif k == "where":
            cond, x, y = node.args[0], M.arg(node, 1, "input"), M.arg(node, 2, "other")
            cand.mask_conditions.append(cond)
            if M.scalar(y) == 0.0 and isinstance(x, fx.Node):
                node = x
            elif M.scalar(x) == 0.0 and isinstance(y, fx.Node):
                node = y
            else:
                raise Refusal("where() without a zero branch is not a causal mask")
            masked = True
        elif k in ("mul", "div"):
            a, b = node.args[0], _other(node)
            ca, cb = M.scalar(a), M.scalar(b)
            if cb is not None and isinstance(a, fx.Node):
                cand.scale *= cb if k == "mul" else 1.0 / cb
                node = a
            elif ca is not None and k == "mul" and isinstance(b, fx.Node):
                cand.scale *= ca
                node = b
            elif _is_scalar_node(b) and isinstance(a, fx.Node):
                cand.scale_nodes.append((b, k))
                node = a
            elif _is_scalar_node(a) and k == "mul" and isinstance(b, fx.Node):
                cand.scale_nodes.append((a, k))
                node = b
            elif k == "div":
                raise Refusal("division by a tensor (a normaliser) between QKᵀ and V")
            else:
                # score * mask: the side that leads back to a product is the score.
                side = _leads_to_product(a, lead_memo), _leads_to_product(b, lead_memo)
                if side == (True, False):
                    node, factor = a, b
                elif side == (False, True):
                    node, factor = b, a
                else:
                    raise Refusal("product of two score-like tensors between QKᵀ and V")
                cand.mask_factors.append(factor)
                masked = True
        elif k in _PASSTHROUGH:
            node = node.args[0]
        else:
            raise Refusal(f"{M.describe(node)} between QKᵀ and V is not part of linear attention")


def _is_scalar_node(x: Any) -> bool:
    """A graph value that is a number, not a tensor (a SymFloat from a float attribute)."""
    return isinstance(x, fx.Node) and isinstance(M.example(x), (torch.SymFloat, torch.SymInt, float, int))


_LEAD_THROUGH = ("tril", "triu", "softmax", "masked_fill", "cast", "contiguous", "transpose",
                 "permute", "mT")


def _leads_to_product(node: Any, memo: dict | None = None, depth: int = 8) -> bool:
    """Does `node` come from a matrix product through mask/scale/layout ops only?"""
    if not isinstance(node, fx.Node) or depth == 0:
        return False
    key = (node, depth)
    if memo is not None and key in memo:
        return memo[key]
    k = M.kind(node)
    if k in ("matmul", "einsum"):
        out = True
    elif k in _LEAD_THROUGH:
        out = _leads_to_product(node.args[0], memo, depth - 1)
    elif k in ("where", "mul", "div"):
        out = any(_leads_to_product(a, memo, depth - 1) for a in node.args)
    else:
        out = False
    if memo is not None:
        memo[key] = out
    return out


def match(anchor: fx.Node, lead_memo: dict | None = None) -> Candidate:
    """Structural match of the quadratic form at a value product. Raises Refusal with the reason."""
    lead_memo = {} if lead_memo is None else lead_memo
    cand = Candidate(anchor=anchor)
    p_node, p_labels, v_node, v_labels, out_labels = _product_roles(anchor, ("t", "s"), ("s", "e"),
                                                                    ("t", "e"), batch_from="left")
    qk, masked = _walk_scores(p_node, cand, lead_memo)
    q_node, q_labels, kt_node, kt_labels, s_labels = _product_roles(qk, ("t", "d"), ("d", "s"),
                                                                    ("t", "s"))
    if s_labels != p_labels:
        raise Refusal(f"score dims {s_labels} do not line up with the value product's {p_labels}")
    if not masked:
        raise Refusal("no causal mask between QKᵀ and V (non-causal linear attention)")
    cand.p_labels = p_labels
    cand.score_shape = _shape(qk)
    cand.region.append(qk)
    cand.q = _walk_operand(q_node, q_labels, cand)
    cand.k = _walk_operand(kt_node, kt_labels, cand)
    cand.v = _walk_operand(v_node, v_labels, cand)
    cand.out_labels = out_labels
    return cand


def _is_candidate_anchor(node: fx.Node, lead_memo: dict) -> bool:
    """A product whose left operand came from another product (a QKᵀ-like score)."""
    k = M.kind(node)
    if k == "matmul":
        left = node.args[0]
    elif k == "einsum":
        try:
            _, ops = _einsum_roles(node)
        except Refusal:
            return False
        left = ops[0]
    else:
        return False
    return _leads_to_product(left, lead_memo)
