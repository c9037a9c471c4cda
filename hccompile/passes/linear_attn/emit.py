"""The replacement (layout permutes, the decay vector, the op call), written once as a builder against
the shared emitter (passes/emit.py) so that the probe (eager tensors) and the rewrite (FX nodes)
cannot disagree about what replaces the region; and the kernels' limits a candidate must meet before
either runs."""
from __future__ import annotations

import math
import operator
from typing import Any

import torch

from ...lowering.lightning import keeps_states
from .. import fx_match as M
from ..emit import Emitter
from ..fx_match import Refusal
from .forms import MAX_HEAD_DIM, SUPPORTED_DTYPES
from .vocabulary import _shape
from .quadratic import TABLE, Candidate, Operand


def _op_plan(cand: Candidate) -> tuple[str | None, str | None]:
    """Which source batch labels become the op's batch and head dims (None: a new size-1 dim)."""
    batch = sorted(lab for lab in cand.q.labels if lab.startswith("b"))
    head = cand.head_label
    if head is None:
        if len(batch) == 2:
            return batch[0], batch[1]
        return (batch[0] if batch else None), None
    others = [b for b in batch if b != head]
    return (others[0] if others else None), head


def _to_op_layout(em: Emitter, x: Any, labels: list[str], feat: str, plan: tuple) -> Any:
    """[source dims] -> [B, T, H, D] for the op."""
    time = "t" if "t" in labels else "s"
    order = [lab for lab in (plan[0], time, plan[1], feat) if lab is not None]
    x = em.method("permute", x, [labels.index(lab) for lab in order])
    if plan[0] is None:
        x = em.method("unsqueeze", x, 0)
    if plan[1] is None:
        x = em.method("unsqueeze", x, 2)
    return x


def _from_op_layout(em: Emitter, o: Any, out_labels: list[str], plan: tuple) -> Any:
    cur = [plan[0] or "<batch>", "t", plan[1] or "<head>", "e"]
    if plan[1] is None:
        o = em.method("squeeze", o, 2)
        cur.pop(2)
    if plan[0] is None:
        o = em.method("squeeze", o, 0)
        cur.pop(0)
    return em.method("permute", o, [cur.index(lab) for lab in out_labels])


def _emit_decay(em: Emitter, cand: Candidate, q4: Any) -> Any:
    heads = em.size(q4, 2)
    decay = cand.decay
    if decay is None:  # a no-decay form routed to lightning_attn
        return em.method("new_zeros", q4, [heads], dtype=torch.float32)
    gamma = None
    for node, log in decay.heads:
        if log == TABLE:  # γ_h = log D[..., t=1, s=0], in D's own dims (aligned to the right)
            lead = len(cand.p_labels) - len(_shape(node))
            ti, si = cand.p_labels.index("t") - lead, cand.p_labels.index("s") - lead
            entry = em.input(node)
            for dim, index in sorted(((ti, 1), (si, 0)), reverse=True):
                entry = em.method("select", entry, dim, index)
            x = em.call(torch.log, em.method("to", em.method("reshape", entry, -1), torch.float32))
            gamma = x if gamma is None else em.call(operator.mul, gamma, x)
            continue
        x = em.method("to", em.method("reshape", em.input(node), -1), torch.float32)
        if log:
            x = em.call(torch.log, x)
        gamma = x if gamma is None else em.call(operator.mul, gamma, x)
    if gamma is None:
        return em.method("new_full", q4, [heads], decay.coeff, dtype=torch.float32)
    if decay.coeff != 1.0:
        gamma = em.call(operator.mul, gamma, decay.coeff)
    return em.method("contiguous", em.method("expand", gamma, heads))


def _attention(em: Emitter, op_name: str, q: Any, k: Any, v: Any, scale: float, decay: Any) -> Any:
    if em.eager:
        # the probe's side is the op itself in fp32: O(T) memory, unlike a quadratic reference at
        # long T; the graph calls it in the inputs' dtype
        q, k, v = (t.float().contiguous() for t in (q, k, v))
        if decay is not None:
            decay = decay.float().contiguous()
    if op_name == "causal_linear_attn":
        return em.op("causal_linear_attn", q, k, v, scale)
    # Keep the forward's segment states for the backward when the graph will be differentiated.
    keep = not em.eager and keeps_states(*(em.example(x) for x in (q, k, v)), None, None)
    return em.getitem(em.op("lightning_attn", q, k, v, decay, None, scale, False, None, keep), 0)


def build(cand: Candidate, em: Emitter, q: Any, k: Any, v: Any) -> Any:
    plan = _op_plan(cand)
    q4 = _to_op_layout(em, q, cand.q.labels, "d", plan)
    k4 = _to_op_layout(em, k, cand.k.labels, "d", plan)
    v4 = _to_op_layout(em, v, cand.v.labels, "e", plan)
    op_name = cand.op
    decay = _emit_decay(em, cand, q4) if op_name == "lightning_attn" else None
    o4 = _attention(em, op_name, q4, k4, v4, cand.scale, decay)
    for node, how in cand.scale_nodes:  # linear in the scores: the output carries the factor
        o4 = em.call(operator.mul if how == "mul" else operator.truediv, o4, em.input(node))
    return _from_op_layout(em, o4, cand.out_labels, plan)


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
