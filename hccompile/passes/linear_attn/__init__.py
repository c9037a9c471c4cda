"""Lower plain-PyTorch causal linear attention, with or without a constant per-head decay, to our ops.

Forms recognised (each in [B,H,T,D], [B,T,H,D] or flattened [BH,T,D] layouts, `@`/matmul/bmm or
einsum, the scale anywhere on the way):

* quadratic, ``O = c·tril(QKᵀ)V`` — a product `P @ V` whose left operand comes from `Q @ Kᵀ` through
  a causal mask (tril, masked_fill, where, or a multiplied 0/1 mask) and constant scalings;
* quadratic with a decay, ``O = c·(QKᵀ ⊙ D)V`` with ``D[h,t,s] = exp(γ_h (t−s))`` for s ≤ t, 0 above
  the diagonal — the decay matrix built the ways real code builds it (arange and an outer
  difference, exp or pow, masked with tril/where/masked_fill/-inf/nan_to_num; lightning attention's,
  RetNet's, MiniMax's constructions) from a per-head γ that is a buffer, a constant or any tensor that
  is not computed from q/k/v and needs no gradient;
* the block loop of lightning attention 2's reference (Dynamo unrolls it): per block an
  intra-block masked product plus an inter-block `Q·KV` with a carried KV state, with or without
  decay, assembled by torch.cat or by writing slices of an output buffer; the whole region becomes
  one op;
* the cumulative form ``o_t = q_t · Σ_{s≤t} k_s v_sᵀ`` — a cumsum over time of k⊗v (einsum or
  broadcasting) contracted with q (einsum, broadcast-and-sum, or matmul).

Every structural match is then proven on random probe inputs: the matched region, evaluated at
compile time with the graph's real masks and buffers, must equal the replacement. The decay is
also checked on its own: the evaluated decay matrix must be exp(γ_h (t−s)) below the diagonal for
the γ that the rewritten graph will compute. Anything else is refused with the reason, and the
graph is left to Inductor.

Which op each form lowers to is decided in one place, `OP_FOR_FORM` / `lowering_op`.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..compat import concrete_shape, size_hint
from . import fx_match as M
from .fx_match import Refusal
from .base import GraphPass, PassContext, register_pass, unrolled_loop_note

# Report pattern names, one per recognised form.
PATTERN = "causal_linear_attn"              # quadratic, no decay (the original name)
PATTERN_DECAY = "decayed_linear_attn"       # quadratic with a per-head decay
PATTERN_LOOP = "block_loop_linear_attn"     # lightning-attention-2 style block loop
PATTERN_CUMSUM = "cumulative_linear_attn"   # cumsum of k⊗v contracted with q

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
_PASSTHROUGH = ("cast", "contiguous")

# ---------------------------------------------------------------------------------------------
# Which op each form lowers to. `causal_linear_attn` is the quadratic-tile kernel without decay;
# `lightning_attn` is the chunked kernel with a per-head decay (decay 0 when the form has none).
# Decay forms can only go to lightning_attn. The integrator sets the no-decay entries after the
# GPU benchmarks.
OP_FOR_FORM: dict[str, str] = {
    "quadratic": "lightning_attn",
    "quadratic_decay": "lightning_attn",
    "block_loop": "lightning_attn",
    "block_loop_decay": "lightning_attn",
    "cumulative": "lightning_attn",
}
_OPS = ("causal_linear_attn", "lightning_attn")


def lowering_op(form: str, has_decay: bool) -> str:
    """The op a recognised form is rewritten to (see OP_FOR_FORM)."""
    key = f"{form}_decay" if has_decay else form
    if key not in OP_FOR_FORM:
        raise ValueError(f"form {key!r} has no entry in OP_FOR_FORM ({sorted(OP_FOR_FORM)})")
    op = OP_FOR_FORM[key]
    if op not in _OPS:
        raise ValueError(f"OP_FOR_FORM[{key!r}] = {op!r}: must be one of {_OPS}")
    if has_decay and op != "lightning_attn":
        raise ValueError(f"OP_FOR_FORM[{key!r}] = {op!r}: only lightning_attn takes a decay")
    return op


class _NotThisPattern(Refusal):
    """Not even a candidate: nothing to report."""


# ---------------------------------------------------------------------------------------------
# Spellings beyond fx_match's

_EXTRA: dict[str, tuple[tuple[Any, ...], tuple[str, ...]]] = {
    "exp": ((torch.exp,), ("exp",)),
    "pow": ((torch.pow, operator.pow), ("pow", "__pow__")),
    "neg": ((torch.neg, torch.negative, operator.neg), ("neg", "negative", "__neg__")),
    "add": ((operator.add, torch.add, operator.iadd), ("add", "__add__", "add_")),
    "cumsum": ((torch.cumsum,), ("cumsum",)),
    "sum": ((torch.sum,), ("sum",)),
    "cat": ((torch.cat, torch.concat, torch.concatenate), ()),
    "setitem": ((operator.setitem,), ()),
    "getitem": ((operator.getitem,), ()),
    "unsqueeze": ((torch.unsqueeze,), ("unsqueeze",)),
    "squeeze": ((torch.squeeze,), ("squeeze",)),
    "narrow": ((torch.narrow,), ("narrow",)),
    "split": ((torch.split,), ("split",)),
    "view": ((torch.reshape,), ("view", "reshape", "expand", "expand_as", "view_as", "reshape_as")),
    "nan_to_num": ((torch.nan_to_num,), ("nan_to_num",)),
    "sub": ((operator.sub, torch.sub, torch.subtract), ("sub", "subtract", "__sub__")),
}
_EXTRA_FN = {f: k for k, (fns, _) in _EXTRA.items() for f in fns}
_EXTRA_METHOD = {m: k for k, (_, ms) in _EXTRA.items() for m in ms}

_CREATION_FNS = {torch.zeros, torch.ones, torch.empty, torch.full, torch.zeros_like, torch.ones_like,
                 torch.empty_like, torch.full_like, torch.arange, torch.clone, torch.tensor,
                 torch.eye}
_CREATION_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "clone"}
_SHAPE_ONLY_METHODS = {"size", "dim", "numel", "new_zeros", "new_ones", "new_empty", "new_full",
                       "new_tensor"}
_SHAPE_ONLY_FNS = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}
_INPLACE_FNS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def _kind(node: Any) -> str | None:
    k = M.kind(node)
    if k is not None or not isinstance(node, fx.Node):
        return k
    if node.op == "call_function":
        return _EXTRA_FN.get(node.target)
    if node.op == "call_method":
        return _EXTRA_METHOD.get(node.target)
    return None


def _mutation_target(node: fx.Node) -> Any:
    """The tensor an in-place node writes into, or None."""
    if node.op == "call_function" and node.target not in _OPERATORS:
        name = getattr(node.target, "__name__", "")
        if node.target in _INPLACE_FNS or (name.endswith("_") and not name.startswith("_")):
            return node.args[0] if node.args else None
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
        return node.args[0]
    return None


def _alive(node: Any, g: fx.Graph) -> bool:
    """Still in the graph (erase_node leaves `node.graph` set)."""
    return isinstance(node, fx.Node) and node.graph is g and not getattr(node, "_erased", False)


def _other(node: fx.Node) -> Any:
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("other")


def _shape(node: Any) -> tuple[int, ...] | None:
    ev = M.example(node)
    return concrete_shape(ev) if isinstance(ev, torch.Tensor) else None


# ---------------------------------------------------------------------------------------------
# Facts about the graph, computed once per run (linear in its size)


def _source_name(node: fx.Node) -> str:
    src = getattr(node, "_dynamo_source", None)
    if src is None:
        return ""
    name = getattr(src, "name", "")
    return str(name() if callable(name) else name)


def _is_module_state(node: fx.Node) -> bool:
    """A placeholder that Dynamo lifted from module state (buffer, parameter, attribute) or a
    global, as opposed to a forward argument."""
    name = _source_name(node)
    return (name.startswith("L['self']") or name.startswith("G[") or "_buffers[" in name
            or "_parameters[" in name)


def _value_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs whose values (not just shape, dtype or device) flow into `node`."""
    if node.op == "call_method":
        if node.target in ("to", "type_as"):
            return [node.args[0]] if isinstance(node.args[0], fx.Node) else []
        if node.target in _SHAPE_ONLY_METHODS:
            return []
    if node.op == "call_function":
        if node.target in _SHAPE_ONLY_FNS:
            return []
        if node.target is getattr and len(node.args) == 2 and node.args[1] in (
                "shape", "dtype", "device", "ndim", "is_cuda"):
            return []
    return node.all_input_nodes


class _Facts:
    """Per-run facts: graph order, which forward inputs each node's value depends on, and a
    memoising evaluator for the constant parts (masks, decays) on the real example inputs."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.gm, self.ctx = gm, ctx
        self.graph = gm.graph
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.data_bits: dict[fx.Node, int] = {}
        for n in self.placeholders:
            if isinstance(M.example(n), torch.Tensor) and not _is_module_state(n):
                self.data_bits[n] = 1 << len(self.data_bits)
        self._deps: dict[fx.Node, int] = {}
        self.order: dict[fx.Node, int] = {}
        self.refresh_order()
        for n in self.graph.nodes:
            self.deps(n)
        self._memo: dict[fx.Node, Any] = {}

    def clear_memo(self) -> None:
        self._memo.clear()

    def refresh_order(self) -> None:
        self.order = {n: i for i, n in enumerate(self.graph.nodes)}

    def deps(self, node: Any) -> int:
        """Bit mask of the forward inputs (not module state) whose values reach `node`."""
        if not isinstance(node, fx.Node):
            return 0
        if node in self._deps:
            return self._deps[node]
        todo = [node]
        while todo:
            n = todo[-1]
            if n in self._deps:
                todo.pop()
                continue
            ins = _value_inputs(n)
            missing = [i for i in ins if i not in self._deps]
            if missing:
                todo.extend(missing)
                continue
            todo.pop()
            bits = self.data_bits.get(n, 0)
            for i in ins:
                bits |= self._deps[i]
            self._deps[n] = bits
        return self._deps[node]

    def inputs_read(self, wanted: list[fx.Node], stop: set[fx.Node]) -> list[str]:
        """Names of the forward inputs whose values reach `wanted` other than through `stop`."""
        seen, found, stack = set(), [], list(wanted)
        while stack:
            n = stack.pop()
            if n in seen or n in stop:
                continue
            seen.add(n)
            if n in self.data_bits:
                found.append(n.name)
            stack.extend(_value_inputs(n))
        return sorted(found)

    def input_names(self, bits: int) -> list[str]:
        return [n.name for n, b in self.data_bits.items() if bits & b]

    # -- evaluation ----------------------------------------------------------------------------
    def value(self, node: Any) -> Any:
        """The value of a node that depends on no forward input other than through shapes,
        on the real example inputs (memoised)."""
        if not isinstance(node, fx.Node):
            return node
        values, _ = self.evaluate([node], memo=True)
        return values[0]

    def region(self, wanted: list[fx.Node], stop: set[fx.Node]) -> list[fx.Node]:
        """The nodes `wanted` depends on, not looking past `stop`, in graph order."""
        needed: list[fx.Node] = []
        seen: set[fx.Node] = set()
        stack = list(wanted)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in stop:
                continue
            needed.append(n)
            stack.extend(n.all_input_nodes)
        if any(n not in self.order for n in needed):
            self.refresh_order()
        needed.sort(key=self.order.__getitem__)
        return needed

    def evaluate(self, wanted: list[fx.Node], overrides: dict[fx.Node, Any] | None = None,
                 memo: bool = False) -> tuple[list[Any], list[fx.Node]]:
        """Evaluate what `wanted` needs, with `overrides` standing in for some nodes and the real
        example inputs for placeholders. Refuses (ValueError) random work, and in-place writes
        into anything but a tensor created in the evaluated region. Returns the values and, with
        memo=False, the evaluated nodes too."""
        overrides = dict(overrides or {})
        needed = self.region(wanted, stop=set(overrides) | (set(self._memo) if memo else set()))
        env: dict[fx.Node, Any] = overrides

        def load(a: Any) -> Any:
            return fx.node.map_arg(a, lambda n: env[n] if n in env else self._memo[n])

        for n in needed:
            target = _mutation_target(n)
            if target is not None:
                if memo or not _is_fresh(target):
                    raise ValueError(f"the region writes in place into {M.describe(target)} "
                                     f"({n.name})")
            else:
                why = _impurity(n)
                if why:
                    raise ValueError(f"probe region contains a {why}")
            if n.op == "placeholder":
                value = self.ctx.example_inputs[self.placeholders.index(n)]
                if isinstance(value, torch.SymInt):
                    value = size_hint(value)
                if isinstance(value, torch.Tensor) and M._is_fake(value):
                    raise ValueError("example inputs are fake tensors; cannot probe")
                env[n] = value
            elif n.op == "get_attr":
                obj: Any = self.gm
                for part in n.target.split("."):
                    obj = getattr(obj, part)
                env[n] = obj
            elif n.op == "call_function":
                env[n] = n.target(*load(n.args), **load(n.kwargs))
            elif n.op == "call_method":
                self_arg, *rest = load(n.args)
                env[n] = getattr(self_arg, n.target)(*rest, **load(n.kwargs))
            else:
                raise ValueError(f"cannot evaluate {n.op} node {n.name}")
            if memo:
                self._memo[n] = env[n]
        values = [env[w] if w in env else self._memo[w] for w in wanted]
        return values, needed


_OPERATORS = {operator.and_, operator.or_, operator.xor, operator.not_, operator.invert}


def _impurity(node: fx.Node) -> str | None:
    if node.op == "call_function" and node.target in _OPERATORS:
        return None  # `a & b`, not an in-place op despite the trailing underscore
    return M.is_impure(node)


def _is_fresh(node: Any) -> bool:
    """Was this tensor created inside the graph (so writing into it touches no input)?"""
    while isinstance(node, fx.Node):
        if node.op == "call_function" and node.target in _CREATION_FNS:
            return True
        if node.op == "call_method" and node.target in _CREATION_METHODS:
            return True
        k = _kind(node)
        if k in ("cast", "contiguous") or _mutation_target(node) is not None:
            node = node.args[0]
            continue
        return False
    return False


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


# ---------------------------------------------------------------------------------------------
# Masks and decays of the quadratic form


# The decay checks read the leading WINDOW x WINDOW corner of the evaluated matrices: enough to
# identify γ·(t−s), without float64 copies of a [H, T, T] matrix at long T.
WINDOW = 256


def _aligned(value: Any, rank: int, ti: int, si: int) -> torch.Tensor:
    """value as float64 on the CPU, rank `rank` (leading size-1 dims), cut to the leading WINDOW
    positions along t and s."""
    value = torch.as_tensor(value).detach()
    if value.dim() > rank:
        raise Refusal(f"a mask of rank {value.dim()} multiplies scores of rank {rank}")
    value = value.reshape((1,) * (rank - value.dim()) + tuple(value.shape))
    value = value.narrow(ti, 0, min(WINDOW, value.shape[ti])).narrow(si, 0, min(WINDOW, value.shape[si]))
    return value.to("cpu", torch.float64)


def _aligned_shape(node: Any, rank: int) -> tuple[int, ...]:
    shape = _shape(node) if isinstance(node, fx.Node) else ()
    if shape is None:
        raise Refusal(f"{M.describe(node)} has no tensor example value")
    if len(shape) > rank:
        raise Refusal(f"a mask of rank {len(shape)} multiplies scores of rank {rank}")
    return (1,) * (rank - len(shape)) + tuple(shape)


@dataclass
class _Term:
    """An exponent coeff · Π heads · Π positions, each factor a graph node."""

    coeff: float = 1.0
    heads: list[tuple[fx.Node, bool]] = field(default_factory=list)
    positions: list[fx.Node] = field(default_factory=list)


class _DecayAnalysis:
    """Reads γ off a tensor D that multiplies the scores: D = c · exp(γ_h (t−s)) on and below the
    diagonal, with 0/1 masks, nan_to_num and views around it."""

    def __init__(self, cand: Candidate, facts: _Facts, qkv_deps: int):
        self.cand, self.facts, self.qkv_deps = cand, facts, qkv_deps
        self.rank = len(cand.p_labels)
        self.ti, self.si = cand.p_labels.index("t"), cand.p_labels.index("s")
        self.weight = 1.0
        self.terms: list[_Term] = []

    # classification of a tensor by how it broadcasts against the scores
    def _per_head(self, node: fx.Node) -> bool:
        shape = _aligned_shape(node, self.rank)
        return shape[self.ti] == 1 and shape[self.si] == 1

    def _per_position(self, node: fx.Node) -> bool:
        shape = _aligned_shape(node, self.rank)
        return all(s == 1 for i, s in enumerate(shape) if i not in (self.ti, self.si))

    def _is_binary(self, node: fx.Node) -> bool:
        if not self._per_position(node) or self.facts.deps(node) & self.qkv_deps:
            return False
        value = self.facts.value(node)
        if not isinstance(value, torch.Tensor):
            return False
        return bool(((value == 0) | (value == 1)).all())

    def weight_factor(self, node: Any) -> None:
        """Walk a factor of D (outside the exponent)."""
        if not isinstance(node, fx.Node):
            c = M.scalar(node)
            if c is None:
                raise Refusal(f"decay mask: factor {node!r} is not a number")
            self.weight *= c
            return
        k = _kind(node)
        if k == "exp":
            self.terms.append(self.exponent(node.args[0], _Term()))
        elif k == "pow":
            base, expo = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["exponent"]
            term = self.exponent(expo, _Term())
            if isinstance(base, fx.Node):
                if not self._per_head(base):
                    raise Refusal("decay mask: the base of the power varies with position")
                self._check_head(base)
                term.heads.append((base, True))
            else:
                b = M.scalar(base)
                if b is None or b <= 0:
                    raise Refusal(f"decay mask: power of a non-positive base {base!r}")
                term.coeff *= math.log(b)
            self.terms.append(term)
        elif k in ("mul",):
            self.weight_factor(node.args[0])
            self.weight_factor(_other(node))
        elif k == "div" and M.scalar(_other(node)) is not None:
            self.weight /= M.scalar(_other(node))
            self.weight_factor(node.args[0])
        elif k in ("tril", "triu", "nan_to_num", "cast", "contiguous", "view", "unsqueeze",
                   "getitem"):
            if k == "getitem" and not isinstance(node.args[1], (tuple, slice, type(None))):
                raise Refusal("decay mask: indexing is not a slice")
            self.weight_factor(node.args[0])
        elif k == "masked_fill":
            if M.scalar(M.arg(node, 2, "value")) != 0.0:
                raise Refusal("decay mask: masked_fill with a non-zero value outside the exponent")
            self.weight_factor(node.args[0])
        elif k == "where":
            x, y = M.arg(node, 1, "input"), M.arg(node, 2, "other")
            if M.scalar(y) == 0.0:
                self.weight_factor(x)
            elif M.scalar(x) == 0.0:
                self.weight_factor(y)
            else:
                raise Refusal("decay mask: where() without a zero branch")
        elif self._is_binary(node):
            return  # a 0/1 (causal) mask; the probe checks which entries it keeps
        elif self._is_table(node):
            # γ is read off the table, and the whole table is compared with exp(γ (t−s)) below
            self.terms.append(_Term(heads=[(node, TABLE)]))
        else:
            self._refuse_leaf(node, "is not part of a decay mask exp(γ·(t−s))")

    def _is_table(self, node: fx.Node) -> bool:
        """A constant tensor (a buffer: no graph input behind it) with extent along t and s."""
        return not self.facts.deps(node) and self._table_shape_ok(node)

    def _table_shape_ok(self, node: fx.Node) -> bool:
        shape = _aligned_shape(node, self.rank)
        value = self.facts.value(node)
        return shape[self.ti] >= 2 and shape[self.si] >= 2 and isinstance(value, torch.Tensor) \
            and not value.requires_grad and bool(torch.isfinite(value).all())

    def exponent(self, node: Any, term: _Term) -> _Term:
        """Decompose the exponent into coeff · per-head factors · position factors."""
        if not isinstance(node, fx.Node):
            c = M.scalar(node)
            if c is None:
                raise Refusal(f"decay exponent: {node!r} is not a number")
            term.coeff *= c
            return term
        k = _kind(node)
        if k == "neg":
            term.coeff = -term.coeff
            return self.exponent(node.args[0], term)
        if k == "mul":
            self.exponent(node.args[0], term)
            return self.exponent(_other(node), term)
        if k == "div" and M.scalar(_other(node)) is not None:
            term.coeff /= M.scalar(_other(node))
            return self.exponent(node.args[0], term)
        if k == "where":
            x, y = M.arg(node, 1, "input"), M.arg(node, 2, "other")
            cond = node.args[0]
            if self.facts.deps(cond) & self.qkv_deps:
                raise Refusal("decay exponent: masked by a condition on q/k/v (data-dependent)")
            if isinstance(x, fx.Node) and M.scalar(y) is not None:
                return self.exponent(x, term)
            if isinstance(y, fx.Node) and M.scalar(x) is not None:
                return self.exponent(y, term)
        if k in ("cast", "contiguous"):
            return self.exponent(node.args[0], term)
        if self._per_head(node):  # no extent along t or s (a scalar tensor is a head factor too)
            self._check_head(node)
            term.heads.append((node, False))
            return term
        if self._per_position(node):
            bits = self.facts.deps(node)
            if bits:
                raise Refusal(f"decay exponent: the positions depend on the input(s) "
                              f"{self.facts.input_names(bits)}")
            term.positions.append(node)
            return term
        if k == "masked_fill":
            return self.exponent(node.args[0], term)
        self._refuse_leaf(node, "varies along heads and positions at once: not a per-head "
                                "constant γ·(t−s)")
        raise AssertionError  # unreachable

    def _check_head(self, node: fx.Node) -> None:
        if self.facts.deps(node) & self.qkv_deps:
            raise Refusal(f"decay {M.describe(node)} ({node.name}) is computed from q/k/v "
                          f"(data-dependent decay): not a per-head constant")
        ev = M.example(node)
        if isinstance(ev, torch.Tensor) and ev.requires_grad:
            raise Refusal(f"decay {node.name} requires grad (a trainable decay); the lowered op "
                          f"treats the decay as a constant")

    def _refuse_leaf(self, node: fx.Node, why: str) -> None:
        bits = self.facts.deps(node)
        if bits & self.qkv_deps:
            raise Refusal(f"decay mask: {node.name} is computed from q/k/v (data-dependent decay)")
        raise Refusal(f"decay mask: {M.describe(node)} ({node.name}) {why}")

    # the numeric side
    def gamma(self) -> Decay:
        if not self.terms:
            raise Refusal("the scores are multiplied by a tensor that is neither a 0/1 mask nor "
                          "a decay exp(γ·(t−s)) (a per-head or tensor scale?)")
        if len(self.terms) > 1:
            raise Refusal("decay mask with more than one exponential factor")
        (term,) = self.terms
        table = any(mode == TABLE for _, mode in term.heads)
        if not term.positions and not table:
            raise Refusal("decay exponent does not depend on the positions t, s")
        distance = self._position_factor(term.positions) if term.positions else 1.0
        heads = [(n, log) for n, log in term.heads]
        gamma = torch.tensor([term.coeff * distance], dtype=torch.float64)
        for node, log in heads:
            if log == TABLE:
                d = _aligned(self.facts.value(node), self.rank, self.ti, self.si)
                value = d.narrow(self.ti, 1, 1).narrow(self.si, 0, 1).log().reshape(-1)
                gamma = gamma * value
                continue
            value = self.facts.value(node)
            value = torch.as_tensor(value).detach().to("cpu", torch.float64).reshape(-1)
            if log:
                value = value.log()
            if gamma.numel() > 1 and value.numel() > 1 and value.numel() != gamma.numel():
                raise Refusal("decay factors disagree on the number of heads")
            gamma = gamma * value
        return Decay(heads=heads, coeff=term.coeff * distance, values=gamma)

    def _position_factor(self, nodes: list[fx.Node]) -> float:
        """The position part must be c'·(t−s) on and below the diagonal; returns c'."""
        value = None
        for n in nodes:
            v = _aligned(self.facts.value(n), self.rank, self.ti, self.si)
            value = v if value is None else value * v
        rest = [i for i in range(self.rank) if i not in (self.ti, self.si)]
        grid = value.permute(rest + [self.ti, self.si]).reshape(-1, value.shape[self.ti],
                                                                 value.shape[self.si])[0]
        t_len, s_len = grid.shape
        if t_len < 2 or s_len < 2:
            if t_len == s_len == 1 and float(grid[0, 0]) == 0.0:
                return 1.0  # one position: only exp(γ·0) = 1 is used, whatever γ is
            raise Refusal(f"decay: a {t_len}x{s_len} decay matrix cannot be exp(γ·(t−s))")
        t = torch.arange(t_len, dtype=torch.float64)[:, None]
        s = torch.arange(s_len, dtype=torch.float64)[None, :]
        causal = (s <= t).expand(t_len, s_len)
        dist = (t - s).expand(t_len, s_len)[causal]
        got = grid[causal]
        if not torch.isfinite(got).all():
            raise Refusal("decay exponent is not finite on or below the diagonal")
        c = float((got * dist).sum() / (dist * dist).sum())
        err = float((got - c * dist).norm() / max(float((c * dist).norm()), 1e-30))
        dtype = M.example(nodes[0]).dtype if isinstance(M.example(nodes[0]), torch.Tensor) \
            else torch.float32
        if c == 0.0 or not err <= M.probe_tolerance(dtype, self.facts.ctx.config) * 1e-1:
            raise Refusal(f"decay exponent is not proportional to (t−s) below the diagonal "
                          f"(relative misfit {err:.3g}): a per-position or windowed decay")
        return c


def _analyse_masks(cand: Candidate, facts: _Facts, qkv_deps: int) -> None:
    """Sort the tensors multiplying the scores into 0/1 masks and at most one decay; for a decay,
    find γ and check the evaluated decay matrix against exp(γ·(t−s))."""
    for c in cand.mask_conditions:
        bits = facts.deps(c)
        if bits & qkv_deps:
            raise Refusal("the mask is computed from q/k/v (a data-dependent mask): not causal "
                          "linear attention")
        if bits:
            raise Refusal(f"the mask is read from the forward input(s) {facts.input_names(bits)}: "
                          f"its values may change from call to call")
    decays = []
    rank = len(cand.p_labels)
    # a block of one position (a loop's ragged last block): every factor looks per-head there
    shape = cand.score_shape or ()
    one_position = len(shape) == rank and \
        shape[cand.p_labels.index("t")] == shape[cand.p_labels.index("s")] == 1
    for f in cand.mask_factors:
        if not isinstance(f, fx.Node):
            raise Refusal(f"mask factor {f!r} is not a tensor")
        bits = facts.deps(f)
        if bits & qkv_deps:
            raise Refusal(f"the scores are multiplied by {f.name}, computed from q/k/v "
                          f"(a data-dependent mask or decay)")
        analysis = _DecayAnalysis(cand, facts, qkv_deps)
        if analysis._per_head(f) and not one_position:
            raise Refusal(f"the scores are multiplied by {f.name}, which has no extent along "
                          f"time (a per-head or tensor scale): not matched")
        if analysis._is_binary(f):
            if bits:
                raise Refusal(f"the mask is read from the forward input(s) "
                              f"{facts.input_names(bits)}: its values may change from call to call")
            continue
        if not analysis._per_position(f) and not one_position:
            value = facts.value(f)
            if isinstance(value, torch.Tensor) and bool(((value == 0) | (value == 1)).all()):
                raise Refusal(f"the scores are multiplied by a 0/1 mask {f.name} that varies along "
                              f"batch or heads (a padding mask?): not matched")
        decays.append(f)
    if not decays:
        return
    if len(decays) > 1:
        raise Refusal("the scores are multiplied by more than one non-0/1 tensor")
    (f,) = decays
    analysis = _DecayAnalysis(cand, facts, qkv_deps)
    analysis.weight_factor(f)
    decay = analysis.gamma()
    if not math.isfinite(analysis.weight) or analysis.weight == 0.0:
        raise Refusal(f"decay mask weight {analysis.weight}")
    cand.scale *= analysis.weight

    # Evaluate D and compare with weight·exp(γ (t−s)) on and below the diagonal, per head.
    d = _aligned(facts.value(f), rank, analysis.ti, analysis.si)
    rest = [i for i in range(rank) if i not in (analysis.ti, analysis.si)]
    # the head dim: where the γ factors vary, else where D varies
    varying = {i for node, _ in decay.heads for i in rest if _aligned_shape(node, rank)[i] > 1}
    if len(varying) > 1:
        raise Refusal("the decay varies along two batch dims: not one decay per head")
    head_pos = varying.pop() if varying else None
    for i in rest:
        if i != head_pos and d.shape[i] > 1:
            first = d.narrow(i, 0, 1)
            if torch.equal(torch.nan_to_num(d), torch.nan_to_num(first.expand_as(d))):
                d = first
            elif head_pos is None:
                head_pos = i
            else:
                raise Refusal("the decay varies along a batch dim other than the heads")
    gamma = decay.values
    heads = d.shape[head_pos] if head_pos is not None else 1
    if gamma.numel() > 1 and heads not in (1, gamma.numel()):
        raise Refusal(f"decay has {gamma.numel()} values for {heads} heads")
    grid = d.permute(rest + [analysis.ti, analysis.si]).reshape(-1, d.shape[analysis.ti],
                                                                d.shape[analysis.si])
    t_len, s_len = grid.shape[-2:]
    t = torch.arange(t_len, dtype=torch.float64)[:, None]
    s = torch.arange(s_len, dtype=torch.float64)[None, :]
    causal = (s <= t).expand(t_len, s_len)
    expected = torch.exp(gamma.reshape(-1, 1, 1) * (t - s))
    grid, expected = torch.broadcast_tensors(grid, expected)
    got = grid[:, causal] / analysis.weight
    want = expected[:, causal]
    err = M.rel_rms_error(got, want)
    dtype = M.example(f).dtype if isinstance(M.example(f), torch.Tensor) else torch.float32
    if not err <= M.probe_tolerance(dtype, facts.ctx.config):
        raise Refusal(f"decay mask is not exp(γ_h·(t−s)) below the diagonal for the γ read off its "
                      f"construction (relative error {err:.3g}): wrong orientation, or not a "
                      f"per-head constant decay")
    if (gamma > 0).any():
        raise Refusal(f"decay grows with distance (log-decay {float(gamma.max()):.4g} > 0): wrong "
                      f"sign or orientation of the decay mask")
    if head_pos is not None:
        cand.head_label = cand.p_labels[head_pos]
    cand.decay = decay
    cand.mask_factors = [f]


# ---------------------------------------------------------------------------------------------
# The replacement, written once for both uses: the eager emitter runs it on probe inputs, the FX
# emitter inserts it into the graph.


class _Eager:
    def __init__(self, facts: _Facts):
        self.facts = facts

    def input(self, node: fx.Node) -> Any:
        return self.facts.value(node)

    def method(self, name: str, x: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(x, name)(*args, **kwargs)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def size(self, x: torch.Tensor, dim: int) -> int:
        return x.shape[dim]

    def attention(self, op_name: str, q: Any, k: Any, v: Any, scale: float, decay: Any) -> Any:
        # the op itself, in fp32: O(T) memory, unlike a quadratic reference at long T
        from .. import lowering  # noqa: F401  (registers the ops)

        q, k, v = (t.float().contiguous() for t in (q, k, v))
        if op_name == "causal_linear_attn":
            return torch.ops.hccompile.causal_linear_attn(q, k, v, scale)
        return torch.ops.hccompile.lightning_attn(q, k, v, decay.float().contiguous(), None, scale,
                                                  False)[0]


class _Fx:
    def __init__(self, graph: fx.Graph, ctx: PassContext, stack_trace: Any):
        self.graph, self.ctx, self.stack_trace = graph, ctx, stack_trace

    def _node(self, node: fx.Node) -> fx.Node:
        node.meta["stack_trace"] = self.stack_trace
        node.meta["example_value"] = M.fake_value(node, self.ctx.fake_mode)
        return node

    def input(self, node: fx.Node) -> fx.Node:
        return node

    def method(self, name: str, x: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self._node(self.graph.call_method(name, (x, *args), kwargs))

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self._node(self.graph.call_function(fn, args, kwargs))

    def size(self, x: fx.Node, dim: int) -> Any:
        size = M.example(x).shape[dim]
        return size if isinstance(size, int) else self.method("size", x, dim)

    def attention(self, op_name: str, q: Any, k: Any, v: Any, scale: float, decay: Any) -> fx.Node:
        from .. import lowering  # noqa: F401  (registers the ops)

        if op_name == "causal_linear_attn":
            return self.call(torch.ops.hccompile.causal_linear_attn.default, q, k, v, scale)
        out = self.call(torch.ops.hccompile.lightning_attn.default, q, k, v, decay, None, scale, False)
        return self.call(operator.getitem, out, 0)


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


def _to_op_layout(em: Any, x: Any, labels: list[str], feat: str, plan: tuple) -> Any:
    """[source dims] -> [B, T, H, D] for the op."""
    time = "t" if "t" in labels else "s"
    order = [lab for lab in (plan[0], time, plan[1], feat) if lab is not None]
    x = em.method("permute", x, [labels.index(lab) for lab in order])
    if plan[0] is None:
        x = em.method("unsqueeze", x, 0)
    if plan[1] is None:
        x = em.method("unsqueeze", x, 2)
    return x


def _from_op_layout(em: Any, o: Any, out_labels: list[str], plan: tuple) -> Any:
    cur = [plan[0] or "<batch>", "t", plan[1] or "<head>", "e"]
    if plan[1] is None:
        o = em.method("squeeze", o, 2)
        cur.pop(2)
    if plan[0] is None:
        o = em.method("squeeze", o, 0)
        cur.pop(0)
    return em.method("permute", o, [cur.index(lab) for lab in out_labels])


def _emit_decay(em: Any, cand: Candidate, q4: Any) -> Any:
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


def build(cand: Candidate, em: Any, q: Any, k: Any, v: Any) -> Any:
    plan = _op_plan(cand)
    q4 = _to_op_layout(em, q, cand.q.labels, "d", plan)
    k4 = _to_op_layout(em, k, cand.k.labels, "d", plan)
    v4 = _to_op_layout(em, v, cand.v.labels, "e", plan)
    op_name = cand.op
    decay = _emit_decay(em, cand, q4) if op_name == "lightning_attn" else None
    o4 = em.attention(op_name, q4, k4, v4, cand.scale, decay)
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


def probe(cand: Candidate, facts: _Facts) -> tuple[float, list[fx.Node]]:
    """Relative RMS error between the matched region and the replacement on random inputs;
    also returns the region's nodes. The region must read no forward input but q, k, v (and
    masks, which the probe uses with their real values, as the original pass did)."""
    gen = None
    inputs: dict[fx.Node, torch.Tensor] = {}
    for op in (cand.q, cand.k, cand.v):
        ev = M.example(op.node)
        if gen is None:
            gen = torch.Generator(device=ev.device).manual_seed(20261122)
        inputs[op.node] = torch.randn(concrete_shape(ev), generator=gen, device=ev.device,
                                      dtype=torch.float32).to(ev.dtype)
    if len(inputs) != 3:
        raise Refusal("q, k and v are not three distinct tensors")
    if cand.mutations:
        wanted = list(cand.mutations) + [cand.anchor]
    else:
        wanted = [cand.anchor]
    with torch.no_grad():
        values, region = facts.evaluate(wanted, inputs)
        region_out = values[-1]
        ref = build(cand, _Eager(facts), inputs[cand.q.node], inputs[cand.k.node],
                    inputs[cand.v.node])
    if tuple(region_out.shape) != tuple(ref.shape):
        raise Refusal(f"probe: region output shape {tuple(region_out.shape)} differs from the "
                      f"replacement's {tuple(ref.shape)}")
    return M.rel_rms_error(region_out, ref), region


def _diagnose(cand: Candidate, facts: _Facts) -> str:
    """Why a quadratic candidate failed its probe: read the effective weights (scores = 1)."""
    if cand.form != "quadratic":
        return ""
    try:
        qk = next(n for n in cand.region if M.kind(n) in ("matmul", "einsum"))
        ones = torch.ones(concrete_shape(M.example(qk)), dtype=M.example(qk).dtype,
                          device=M.example(qk).device)
        p = cand.anchor.args[0] if M.kind(cand.anchor) == "matmul" else _einsum_roles(cand.anchor)[1][0]
        (w,), _ = facts.evaluate([p], {qk: ones})
        ti, si = cand.p_labels.index("t"), cand.p_labels.index("s")
        w = w.detach().double().movedim((ti, si), (-2, -1))
        t_len, s_len = w.shape[-2:]
        future = torch.ones(t_len, s_len, dtype=torch.bool, device=w.device).triu(1)
        if (w[..., future] != 0).any():
            return " (the mask keeps entries above the diagonal: not causal, or the wrong orientation)"
        if (w.diagonal(dim1=-2, dim2=-1) == 0).any():
            return " (the mask drops the diagonal)"
    except Exception:  # noqa: BLE001 - a diagnosis is advisory
        return ""
    return ""


def rewrite(cand: Candidate, gm: fx.GraphModule, ctx: PassContext, facts: _Facts,
            region: list[fx.Node]) -> fx.Node:
    g = gm.graph
    em = _Fx(g, ctx, cand.anchor.meta.get("stack_trace"))
    with g.inserting_before(cand.insert_before or cand.anchor):
        out = build(cand, em, cand.q.node, cand.k.node, cand.v.node)
        want = M.example(cand.anchor)
        if isinstance(want, torch.Tensor) and want.dtype != M.example(out).dtype:
            out = em.method("to", out, want.dtype)
    if cand.mutations:  # an output buffer written block by block: its later readers read `out`
        writes = set(cand.mutations)
        for user in list(cand.anchor.users):
            if user not in writes:
                user.replace_input_with(cand.anchor, out)
        for n in cand.mutations:
            g.erase_node(n)
    else:
        cand.anchor.replace_all_uses_with(out)
    _erase_dead(g, [cand.anchor] + cand.region + region, facts)
    return out


def _erase_dead(g: fx.Graph, nodes: list[fx.Node], facts: _Facts) -> None:
    """Erase the nodes that nothing reads any more, consumers first. An in-place write is erased
    only when nothing reads its target after it and the target was created in the graph."""
    facts.refresh_order()
    alive = [n for n in set(nodes) if _alive(n, g) and n in facts.order]
    for n in sorted(alive, key=facts.order.__getitem__, reverse=True):
        if n.users or n.op not in ("call_function", "call_method"):
            continue
        target = _mutation_target(n)
        if target is not None:
            if not _is_fresh(target):
                continue
            if any(facts.order.get(u, -1) > facts.order[n] for u in target.users if u is not n):
                continue
        elif _impurity(n) or n.is_impure():
            continue
        g.erase_node(n)


_PURE_FNS = _CREATION_FNS | _OPERATORS | {
    operator.ge, operator.gt, operator.le, operator.lt, operator.eq, operator.ne, operator.truediv,
    operator.floordiv, torch.abs, torch.clamp, torch.clamp_min, torch.log, torch.stack, torch.flip}
_PURE_METHODS = _CREATION_METHODS | {"abs", "clamp", "clamp_min", "log", "flip", "bool", "size"}


def _sweep_dead(g: fx.Graph) -> None:
    """Erase unread nodes of the kinds this pass knows to be pure (e.g. a block loop's last state
    update, which fed only the next block). One sweep, consumers first."""
    for n in reversed(list(g.nodes)):
        if n.users or n.op not in ("call_function", "call_method"):
            continue
        known = _kind(n) is not None or (n.op == "call_function" and n.target in _PURE_FNS) or \
            (n.op == "call_method" and n.target in _PURE_METHODS)
        if known and _mutation_target(n) is None and not _impurity(n) and not n.is_impure():
            g.erase_node(n)


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


def _qkv_deps(cand: Candidate, facts: _Facts) -> int:
    return facts.deps(cand.q.node) | facts.deps(cand.k.node) | facts.deps(cand.v.node)


# ---------------------------------------------------------------------------------------------
# The block loop (lightning attention 2's reference, unrolled by Dynamo)


def _index_tuple(index: Any, rank: int) -> list[Any] | None:
    """A getitem index as one entry per dim (slices only), or None."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is None or not isinstance(i, (slice, type(Ellipsis))) for i in items):
        return None
    if sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (rank - len(items) + 1) + items[at + 1:]
    return items + [slice(None)] * (rank - len(items))


def _time_slice(node: Any) -> tuple[fx.Node, int, int, int] | None:
    """(source, dim, start, stop) when `node` is a contiguous slice of `source` along one dim,
    seen through casts and contiguous()."""
    while _kind(node) in ("cast", "contiguous"):
        node = node.args[0]
    if not isinstance(node, fx.Node):
        return None
    k = _kind(node)
    if k == "getitem":
        src, index = node.args
        if _kind(src) == "split":
            return _split_piece(src, index)
        shape = _shape(src)
        if shape is None:
            return None
        items = _index_tuple(index, len(shape))
        if items is None or len(items) != len(shape):
            return None
        sliced = [(d, s) for d, s in enumerate(items) if s != slice(None)]
        if len(sliced) != 1:
            return None
        d, s = sliced[0]
        if s.step not in (None, 1) or not all(isinstance(x, (int, type(None))) for x in (s.start, s.stop)):
            return None
        start, stop, _ = s.indices(shape[d])
        return src, d, start, stop
    if k == "narrow":
        src = node.args[0]
        dim, start, length = (M.arg(node, i, name) for i, name in ((1, "dim"), (2, "start"), (3, "length")))
        shape = _shape(src)
        if shape is None or not all(isinstance(x, int) for x in (dim, start, length)):
            return None
        return src, dim % len(shape), start, start + length
    return None


def _split_piece(split: fx.Node, index: Any) -> tuple[fx.Node, int, int, int] | None:
    src = split.args[0]
    size = M.arg(split, 1, "split_size_or_sections" if split.op == "call_function" else "split_size")
    dim = M.arg(split, 2, "dim", 0)
    shape = _shape(src)
    if shape is None or not isinstance(index, int) or not isinstance(dim, int):
        return None
    dim %= len(shape)
    if isinstance(size, int):
        start = index * size
        return src, dim, start, min(start + size, shape[dim])
    if isinstance(size, (list, tuple)) and all(isinstance(s, int) for s in size):
        return src, dim, sum(size[:index]), sum(size[:index + 1])
    return None


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
            items = _index_tuple(asm[1].args[1], len(shape))
            if items is None:
                raise Refusal("an output write is not a slice")
            sl = [(d, s) for d, s in enumerate(items) if s != slice(None)]
            if len(sl) != 1 or sl[0][0] != labels.index("t") or \
                    sl[0][1].step not in (None, 1) or \
                    sl[0][1].indices(shape[sl[0][0]])[:2] != (start, stop):
                raise Refusal("an output write does not cover its block's positions along time")
        facts.refresh_order()
        last = max(writes, key=facts.order.__getitem__)
        for u in buf.users:
            if u not in writes and facts.order[u] < facts.order[last]:
                raise Refusal(f"{u.name} reads the output buffer before every block is written")
        loop.mutations = writes
        loop.insert_before = last.next
    return loop


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


# ---------------------------------------------------------------------------------------------
# The pass


@register_pass
class LinearAttentionPass(GraphPass):
    name = "linear_attn"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        g = gm.graph
        facts = _Facts(gm, ctx)
        lead_memo: dict = {}
        changed = False
        anchors = [n for n in g.nodes if _is_candidate_anchor(n, lead_memo)]

        # 1. structural matches of the quadratic form (no probe yet), grouped into block loops
        structural = []
        for anchor in anchors:
            try:
                cand = match(anchor, lead_memo)
                _analyse_masks(cand, facts, _qkv_deps(cand, facts))
                structural.append(cand)
            except (Refusal, ValueError):
                pass  # reported when the anchor is matched on its own below
        loops, refused_loops = _group_block_loops(structural, facts)
        facts.clear_memo()  # masks can be large: keep them only while one candidate needs them
        for cand, reason in refused_loops:
            record.refuse(PATTERN_LOOP, reason, node=cand.anchor.name)
        for loop in loops:
            if not all(_alive(n, g) for n in (loop.anchor, loop.q.node, loop.k.node, loop.v.node)):
                continue
            changed |= self._lower(loop, gm, ctx, facts, record)

        # 2. every other quadratic anchor on its own (matched again: earlier rewrites may have
        #    replaced its inputs)
        for anchor in anchors:
            if not _alive(anchor, g):
                continue  # erased by an earlier rewrite
            facts.clear_memo()
            cand = None
            try:
                cand = match(anchor, lead_memo)
                _analyse_masks(cand, facts, _qkv_deps(cand, facts))
            except (Refusal, ValueError) as r:
                pattern = PATTERN_DECAY if cand is not None and cand.mask_factors else PATTERN
                why = str(r) if isinstance(r, Refusal) else f"probe impossible: {r}"
                record.refuse(pattern, why, node=anchor.name)
                continue
            changed |= self._lower(cand, gm, ctx, facts, record)

        # 3. the cumulative form, and non-causal q·(KᵀV) for the report
        for node in list(g.nodes):
            if not _alive(node, g):
                continue
            if _kind(node) == "cumsum" and _kind(node.args[0]) in ("einsum", "mul"):
                try:
                    cand = match_cumulative(node)
                except _NotThisPattern:
                    continue  # a cumsum of something else than k⊗v: nothing to report
                except Refusal as r:
                    record.refuse(PATTERN_CUMSUM, str(r), node=node.name)
                    continue
                changed |= self._lower(cand, gm, ctx, facts, record)
            elif M.kind(node) in ("matmul", "einsum"):
                why = _noncausal_state(node, facts)
                if why:
                    record.refuse(PATTERN_CUMSUM, why, node=node.name)
        if changed:
            _sweep_dead(g)
            g.lint()
            gm.recompile()
        return changed

    @staticmethod
    def _lower(cand: Candidate, gm: fx.GraphModule, ctx: PassContext, facts: _Facts,
               record: Any) -> bool:
        where = cand.anchor.name
        try:
            _check_shapes(cand)
            op_name = cand.op
            err = None
            wanted = list(cand.mutations) + [cand.anchor]
            region = facts.region(wanted, stop={cand.q.node, cand.k.node, cand.v.node})
            if cand.form == "block_loop":
                others = facts.inputs_read(wanted, stop={cand.q.node, cand.k.node, cand.v.node})
                if others:
                    raise Refusal(f"the block loop reads {others}, forward input(s) other than q, "
                                  f"k, v (an initial state?)")
            if ctx.config.probe:
                err, region = probe(cand, facts)
                dtype = M.example(cand.q.node).dtype
                tol = M.probe_tolerance(dtype, ctx.config)
                if not err <= tol:
                    raise Refusal(f"probe mismatch: the region differs from the {cand.form} "
                                  f"form's replacement by relative RMS {err:.3g} (tolerance "
                                  f"{tol:g}); the mask is not causal lower-triangular or the math "
                                  f"differs{_diagnose(cand, facts)}")
        except Refusal as r:
            record.refuse(cand.pattern, str(r), node=where)
            return False
        except ValueError as e:  # from the evaluator: impure or unevaluable region
            record.refuse(cand.pattern, f"probe impossible: {e}", node=where)
            return False
        out = rewrite(cand, gm, ctx, facts, region)
        details = {"form": cand.form, "op": op_name, "replacement": out.name,
                   "layout": {"q": cand.q.labels, "k": cand.k.labels, "v": cand.v.labels,
                              "out": cand.out_labels},
                   "scale": cand.scale, "probe_rel_err": err}
        if cand.decay is not None:
            details["decay"] = [round(float(x), 6) for x in cand.decay.values[:16]]
        if cand.form == "block_loop":
            details["blocks"] = cand.blocks
            details["lengths"] = unrolled_loop_note(cand.blocks, f"hccompile.{op_name}")
        record.match(cand.pattern, node=where, **details)
        return True
