"""Lower plain-PyTorch causal linear attention, O = c·tril(QKᵀ)V, to `hccompile::causal_linear_attn`.

Pattern: a product `P @ V` (matmul/bmm/einsum) whose left operand P comes from a product `Q @ Kᵀ`
through a causal mask (tril, masked_fill, where, or a multiplied 0/1 mask) and constant scalings.
Q, K and V may reach the products through transposes/permutes (any [B,H,T,D]/[B,T,H,D]/[BH,T,D]
layout) and constant scalings. Every structural match is then proven on random probe inputs: the
matched region, evaluated at compile time with the graph's real masks and buffers, must equal the
replacement. Anything else is refused with the reason, and the graph is left to Inductor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..compat import concrete_shape
from . import fx_match as M
from .base import GraphPass, PassContext, register_pass

PATTERN = "causal_linear_attn"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_PASSTHROUGH = ("cast", "contiguous")


class Refusal(Exception):
    pass


@dataclass
class Operand:
    """A tensor entering the pattern: its source node and a label per source dim."""

    node: fx.Node
    labels: list[str]


@dataclass
class Candidate:
    anchor: fx.Node
    q: Operand | None = None
    k: Operand | None = None
    v: Operand | None = None
    out_labels: list[str] = field(default_factory=list)
    scale: float = 1.0
    region: list[fx.Node] = field(default_factory=list)  # nodes the replacement makes dead


def _batch_labels(n: int) -> list[str]:
    return [f"b{i}" for i in range(n)]


def _walk_operand(node: Any, labels: list[str], cand: Candidate) -> Operand:
    """Follow permutations, constant scalings and casts back to the operand's source."""
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
            a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
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
    if not isinstance(eq, str) or len(ops) != 2 or "..." in eq or "->" not in eq:
        raise Refusal(f"einsum {eq!r}: only explicit two-operand equations are matched")
    return eq.replace(" ", ""), ops


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


def _walk_scores(p: Any, cand: Candidate) -> tuple[fx.Node, bool]:
    """From the left operand of P@V back to QKᵀ; returns (qk node, whether a mask was applied)."""
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
            masked, node = True, node.args[0]
        elif k == "where":
            cond, x, y = node.args[0], M.arg(node, 1, "input"), M.arg(node, 2, "other")
            if M.scalar(y) == 0.0 and isinstance(x, fx.Node):
                node = x
            elif M.scalar(x) == 0.0 and isinstance(y, fx.Node):
                node = y
            else:
                raise Refusal("where() without a zero branch is not a causal mask")
            masked = True
        elif k in ("mul", "div"):
            a, b = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
            ca, cb = M.scalar(a), M.scalar(b)
            if cb is not None and isinstance(a, fx.Node):
                cand.scale *= cb if k == "mul" else 1.0 / cb
                node = a
            elif ca is not None and k == "mul" and isinstance(b, fx.Node):
                cand.scale *= ca
                node = b
            elif k == "div":
                raise Refusal("division by a tensor (a normaliser) between QKᵀ and V")
            else:
                # score * mask: the side that leads back to a product is the score.
                side = _leads_to_product(a), _leads_to_product(b)
                if side == (True, False):
                    node = a
                elif side == (False, True):
                    node = b
                else:
                    raise Refusal("product of two score-like tensors between QKᵀ and V")
                masked = True
        elif k in _PASSTHROUGH:
            node = node.args[0]
        else:
            raise Refusal(f"{M.describe(node)} between QKᵀ and V is not part of linear attention")


def _leads_to_product(node: Any, depth: int = 8) -> bool:
    """Does `node` come from a matrix product through mask/scale/layout ops only?"""
    if not isinstance(node, fx.Node) or depth == 0:
        return False
    k = M.kind(node)
    if k in ("matmul", "einsum"):
        return True
    if k in ("tril", "triu", "softmax", "masked_fill", "cast", "contiguous", "transpose", "permute",
             "mT"):
        return _leads_to_product(node.args[0], depth - 1)
    if k in ("where", "mul", "div"):
        return any(_leads_to_product(a, depth - 1) for a in node.args)
    return False


def match(anchor: fx.Node) -> Candidate:
    """Structural match at a value product. Raises Refusal with the reason."""
    cand = Candidate(anchor=anchor)
    p_node, p_labels, v_node, v_labels, out_labels = _product_roles(anchor, ("t", "s"), ("s", "e"),
                                                                    ("t", "e"), batch_from="left")
    qk, masked = _walk_scores(p_node, cand)
    q_node, q_labels, kt_node, kt_labels, s_labels = _product_roles(qk, ("t", "d"), ("d", "s"),
                                                                    ("t", "s"))
    if s_labels != p_labels:
        raise Refusal(f"score dims {s_labels} do not line up with the value product's {p_labels}")
    if not masked:
        raise Refusal("no causal mask between QKᵀ and V (non-causal linear attention)")
    cand.region.append(qk)
    cand.q = _walk_operand(q_node, q_labels, cand)
    cand.k = _walk_operand(kt_node, kt_labels, cand)
    cand.v = _walk_operand(v_node, v_labels, cand)
    cand.out_labels = out_labels
    return cand


def _check_shapes(cand: Candidate) -> None:
    def size(op: Operand, label: str) -> int:
        return M.example(op.node).shape[op.labels.index(label)]

    eq = M.example(cand.q.node), M.example(cand.k.node), M.example(cand.v.node)
    if any(not isinstance(e, torch.Tensor) for e in eq):
        raise Refusal("operand without a tensor example value")
    dtypes = {e.dtype for e in eq}
    if len(dtypes) != 1:
        raise Refusal(f"q, k, v dtypes differ: {sorted(map(str, dtypes))}")
    (dtype,) = dtypes
    if dtype not in SUPPORTED_DTYPES:
        raise Refusal(f"dtype {dtype} is not supported by the kernels (float16, bfloat16, float32)")
    nb = len([lab for lab in cand.q.labels if lab.startswith("b")])
    if nb > 2:
        raise Refusal(f"{nb} batch dims (at most 2 are matched)")
    for lab in cand.q.labels:
        if lab.startswith("b") and not (size(cand.q, lab) == size(cand.k, lab) == size(cand.v, lab)):
            raise Refusal(f"batch dim {lab} differs between q, k and v (GQA is not matched here)")
    for name, op, lab in (("q/k", cand.q, "d"), ("v", cand.v, "e")):
        d = size(op, lab)
        # on a symbolic head dim this comparison adds a guard: a larger head dim recompiles
        # and is refused then, instead of reaching the kernel
        if d > MAX_HEAD_DIM:
            raise Refusal(f"{name}: head dim {d} exceeds the kernels' maximum {MAX_HEAD_DIM}")
    if not math.isfinite(cand.scale):
        raise Refusal(f"scale {cand.scale} is not finite")


def _to_op_layout(x: Any, labels: list[str], feat: str, nb: int, emit) -> Any:
    """[source dims] -> [B, T, H, D] for the op."""
    if nb == 2:
        order = ["b0", "t" if "t" in labels else "s", "b1", feat]
        x = emit("permute", x, [labels.index(lab) for lab in order])
    else:
        order = (["b0"] if nb == 1 else []) + ["t" if "t" in labels else "s", feat]
        x = emit("permute", x, [labels.index(lab) for lab in order])
        if nb == 0:
            x = emit("unsqueeze", x, 0)
        x = emit("unsqueeze", x, 2)
    return x


def _from_op_layout(o: Any, out_labels: list[str], nb: int, emit) -> Any:
    if nb == 2:
        cur = ["b0", "t", "b1", "e"]
    else:
        o = emit("squeeze", o, 2)
        cur = ["b0", "t", "e"]
        if nb == 0:
            o = emit("squeeze", o, 0)
            cur = ["t", "e"]
    return emit("permute", o, [cur.index(lab) for lab in out_labels])


def build(cand: Candidate, emit, q: Any, k: Any, v: Any) -> Any:
    """The replacement, written once for both uses: `emit` either applies torch ops eagerly (probe)
    or inserts FX nodes (rewrite)."""
    nb = len([lab for lab in cand.q.labels if lab.startswith("b")])
    q4 = _to_op_layout(q, cand.q.labels, "d", nb, emit)
    k4 = _to_op_layout(k, cand.k.labels, "d", nb, emit)
    v4 = _to_op_layout(v, cand.v.labels, "e", nb, emit)
    o4 = emit("op", q4, k4, v4, cand.scale)
    return _from_op_layout(o4, cand.out_labels, nb, emit)


def _eager_emit(what: str, x: Any, *args: Any) -> Any:
    if what == "op":
        # the op itself, in fp32: O(T) memory, unlike a quadratic reference at long T
        from ..lowering.linear_attn import causal_linear_attn_op

        k, v, scale = args
        return causal_linear_attn_op(x.float().contiguous(), k.float().contiguous(),
                                     v.float().contiguous(), scale)
    if what == "permute":
        return x.permute(*args[0])
    return getattr(x, what)(*args)


def probe(cand: Candidate, gm: fx.GraphModule, ctx: PassContext) -> float:
    """Relative RMS error between the matched region and the replacement on random inputs."""
    gen = None
    inputs = {}
    for name, op in (("q", cand.q), ("k", cand.k), ("v", cand.v)):
        ev = M.example(op.node)
        shape = concrete_shape(ev)
        if gen is None:
            gen = torch.Generator(device=ev.device).manual_seed(20261122)
        inputs[op.node] = torch.randn(shape, generator=gen, device=ev.device, dtype=torch.float32
                                      ).to(ev.dtype)
    if len(inputs) != 3:
        raise Refusal("q, k and v are not three distinct tensors")
    with torch.no_grad():
        (region_out,) = M.evaluate(gm, [cand.anchor], inputs, ctx.example_inputs)
        ref = build(cand, _eager_emit, inputs[cand.q.node], inputs[cand.k.node], inputs[cand.v.node])
    if tuple(region_out.shape) != tuple(ref.shape):
        raise Refusal(f"probe: region output shape {tuple(region_out.shape)} differs from the "
                      f"replacement's {tuple(ref.shape)}")
    return M.rel_rms_error(region_out, ref)


def rewrite(cand: Candidate, gm: fx.GraphModule, ctx: PassContext) -> fx.Node:
    g = gm.graph
    from .. import lowering  # noqa: F401  (registers the op)

    op = torch.ops.hccompile.causal_linear_attn.default
    meta_src = cand.anchor.meta

    def emit(what: str, x: Any, *args: Any) -> fx.Node:
        if what == "op":
            node = g.call_function(op, (x, *args))
        else:
            node = g.call_method(what, (x, *args))
        node.meta["stack_trace"] = meta_src.get("stack_trace")
        node.meta["example_value"] = _fake_value(node, ctx)
        return node

    with g.inserting_before(cand.anchor):
        out = build(cand, emit, cand.q.node, cand.k.node, cand.v.node)
        want = M.example(cand.anchor)
        if isinstance(want, torch.Tensor) and want.dtype != M.example(out).dtype:
            out = emit("to", out, want.dtype)
    cand.anchor.replace_all_uses_with(out)
    # region is recorded users-before-producers, so one sweep frees whole chains
    for n in [cand.anchor] + cand.region:
        if n.graph is g and not n.users and n.op not in ("placeholder", "output"):
            g.erase_node(n)
    return out


def _fake_value(node: fx.Node, ctx: PassContext) -> Any:
    """Example value for a new node, computed in the fake mode of its own inputs (Dynamo graphs can
    hold values from more than one fake mode, e.g. for lifted parameters)."""
    args = fx.node.map_arg(node.args, lambda n: n.meta.get("example_value"))
    flat = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    # not detect_fake_mode(): it prefers the tracing context's mode, which can differ
    mode = next((a.fake_mode for a in flat if hasattr(a, "fake_mode")), None) or ctx.fake_mode
    if mode is None:
        return None
    with mode:
        if node.op == "call_function":
            return node.target(*args)
        self_arg, *rest = args
        return getattr(self_arg, node.target)(*rest)


def _is_candidate_anchor(node: fx.Node) -> bool:
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
    return _leads_to_product(left)


@register_pass
class LinearAttentionPass(GraphPass):
    name = "linear_attn"
    stage = "dynamo"
    order = 100

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        changed = False
        anchors = [n for n in gm.graph.nodes if _is_candidate_anchor(n)]
        for anchor in anchors:
            if anchor.graph is not gm.graph:
                continue  # erased by an earlier rewrite
            where = anchor.name
            try:
                cand = match(anchor)
                _check_shapes(cand)
                err = None
                if ctx.config.probe:
                    err = probe(cand, gm, ctx)
                    dtype = M.example(cand.q.node).dtype
                    tol = 1e-4 if dtype == torch.float32 else ctx.config.probe_tolerance
                    if not err <= tol:
                        raise Refusal(f"probe mismatch: the region differs from scale·tril(QKᵀ)V by "
                                      f"relative RMS {err:.3g} (tolerance {tol:g}); the mask is not "
                                      f"causal lower-triangular or the math differs")
            except Refusal as r:
                record.refuse(PATTERN, str(r), node=where)
                continue
            except ValueError as e:  # from the probe evaluator: impure or unevaluable region
                record.refuse(PATTERN, f"probe impossible: {e}", node=where)
                continue
            out = rewrite(cand, gm, ctx)
            record.match(PATTERN, node=where, replacement=out.name,
                         layout={"q": cand.q.labels, "k": cand.k.labels, "v": cand.v.labels,
                                 "out": cand.out_labels},
                         scale=cand.scale, probe_rel_err=err)
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
