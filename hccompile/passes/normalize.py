"""One spelling per operation, before any pass matches: the normalising pre-pass.

Python gives one operation many spellings, and Dynamo records each as written: `a @ b`,
`a.matmul(b)`, `torch.bmm(a, b)`; `x.transpose(-1, -2)`, `x.mT`, `x.swapaxes(-1, -2)`; `x.permute(0, 2, 1)`,
`x.permute((0, 2, 1))`; `x.float()`, `x.to(torch.float32)`. This pass rewrites each node of those
families, in place, into one form:

    matrix product    torch.matmul(a, b)
    transpose         torch.transpose(x, dim0, dim1)       (also .mT, .T and .t() of a matrix)
    permute           torch.permute(x, [dims])
    float cast        x.to(dtype)                          (.float(), .half(), .bfloat16(), .double())
    einsum product    torch.matmul(a', b')                 (a two-operand einsum that is a batched
                                                            matrix product; the operands and the
                                                            result transposed or permuted where the
                                                            index order needs it)

A node is rewritten only where the two spellings are the same function of the same operands:
no keyword arguments beyond the canonical ones, no `out=`, `.T`/`.t()` only of a 2-D tensor (where
they are a transpose; `.t()` of a vector is the vector), `bmm` only of two 3-D tensors. Everything
else stays as written (views stay views, in-place ops stay in place: their aliasing is part of what
the graph means). The node keeps its name, position, users and metadata (its example value is the
same tensor), so reports and the later passes name it as before.

An einsum is rewritten only where it is a batched matrix product: `torch.einsum(eq, a, b)` or
`einsum(eq, [a, b])` with an explicit `->`, no label twice in one term, every batch label in both
operands and the output, exactly one contracted label (in both operands, not in the output), exactly
one free label per operand (in the output), `...` covering the same number of dims in both operands
and kept in the output, and the batch and contracted sizes equal in both operands (provably, for
symbolic sizes: no size-1 broadcast). `einsum('bthd,bshd->bhts', q, k)` becomes
`matmul(transpose(q, 1, 2), permute(k, [0, 2, 3, 1]))`: of the forms with the operands in either
order (`'bhjd,bhid->bhij'` is q @ kᵀ) and the batch dims in the output's, a's or b's order, the one
with the fewest permutes; a permutation that swaps two dims is written `torch.transpose` (the last
two: `(x, -2, -1)`, as `k.mT` normalises); of equals, one that leaves the result in the matmul's
order. The einsum node becomes the last node of the product (the matmul, or the permute of its
result into the einsum's output order), keeping its name, users and metadata but for its example
value (recomputed: the einsum's shape and dtype, or the einsum stays); the operands' permutes and a
matmul before an output permute are new nodes with the einsum's metadata and their own example
values. Diagonals (`'bii->bi'`), outer
products, sums over one operand's label, two or more contracted labels, three operands, implicit
output (no `->`) and broadcast sizes stay einsums.

Why a pass and not only a vocabulary: `fx_match.kind` reads every spelling as one op for the
matchers, but a graph rewritten once means a matcher written against the canonical form is right
for every spelling, and the dump shows the graph the matchers saw. `disable_passes=("normalize",)`
turns it off (each matcher still reads the other spellings).
"""
from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from ..compat import view_attribute
from .base import GraphPass, PassContext, register_pass
from . import fx_match as M
from .emit import GraphEmitter


class Canonical(NamedTuple):
    """A node's canonical form: op ("call_function" or "call_method"), target, args; no kwargs."""

    op: str
    target: Any
    args: tuple


_PRODUCT_FUNCTIONS = (operator.matmul, torch.matmul, torch.bmm)
_PRODUCT_METHODS = ("matmul", "bmm", "__matmul__")
_SWAP_FUNCTIONS = (torch.transpose, torch.swapaxes, torch.swapdims)
_SWAP_METHODS = ("transpose", "swapaxes", "swapdims")
_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                 "double": torch.float64}


def _ndim(value: Any) -> int | None:
    example = value.meta.get("example_value") if isinstance(value, fx.Node) else None
    return example.dim() if isinstance(example, torch.Tensor) else None


def _is_dim(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _product(node: fx.Node) -> Canonical | None:
    function = node.op == "call_function" and node.target in _PRODUCT_FUNCTIONS
    method = node.op == "call_method" and node.target in _PRODUCT_METHODS
    if not (function or method) or node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    if node.target in (torch.bmm, "bmm") and not (_ndim(a) == 3 and _ndim(b) == 3):
        return None
    return Canonical("call_function", torch.matmul, (a, b))


def _transpose(node: fx.Node) -> Canonical | None:
    attribute = view_attribute(node)
    if attribute == "mT":
        return Canonical("call_function", torch.transpose, (node.args[0], -2, -1))
    if attribute == "T" or (node.op == "call_method" and node.target == "t" and len(node.args) == 1):
        if node.kwargs or _ndim(node.args[0]) != 2:
            return None
        return Canonical("call_function", torch.transpose, (node.args[0], 0, 1))
    function = node.op == "call_function" and node.target in _SWAP_FUNCTIONS
    method = node.op == "call_method" and node.target in _SWAP_METHODS
    if not (function or method) or node.kwargs or len(node.args) != 3:
        return None
    x, dim0, dim1 = node.args
    if not (_is_dim(dim0) and _is_dim(dim1)):
        return None
    return Canonical("call_function", torch.transpose, (x, dim0, dim1))


def _permute(node: fx.Node) -> Canonical | None:
    if node.kwargs or len(node.args) < 2:
        return None
    if node.op == "call_function" and node.target is torch.permute:
        return None  # canonical already, whether its dims are a list or a tuple
    if node.op == "call_method" and node.target == "permute":
        x, *rest = node.args
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
    else:
        return None
    if not all(_is_dim(d) for d in dims):
        return None
    return Canonical("call_function", torch.permute, (x, list(dims)))


def _cast(node: fx.Node) -> Canonical | None:
    if node.op != "call_method" or node.target not in _CAST_METHODS or node.kwargs or len(node.args) != 1:
        return None
    return Canonical("call_method", "to", (node.args[0], _CAST_METHODS[node.target]))


_EINSUM_FUNCTIONS = (torch.einsum, torch.functional.einsum)


class EinsumProduct(NamedTuple):
    """A two-operand einsum that is a batched matrix product out = a' @ b', where
    a' = a.permute(perm_a) is [batch..., free_a, contracted], b' = b.permute(perm_b) is
    [batch..., contracted, free_b] and out = (a' @ b').permute(perm_out); a permutation that is the
    identity is None. `a` and `b` are the einsum's operands, in its order or swapped."""

    a: fx.Node
    b: fx.Node
    perm_a: list[int] | None
    perm_b: list[int] | None
    perm_out: list[int] | None
    equation: str


def _einsum_terms(equation: str, ranks: tuple[int, int]) -> tuple[list[list[str]], list[str]] | None:
    """The labels of each operand and of the output, each `...` written out as one label per dim
    ("...0", "...1", ...); None where the equation is not an explicit one whose ellipses cover the
    same dims in both operands."""
    equation = equation.replace(" ", "")
    if equation.count("->") != 1:
        return None  # implicit output: its order (and which labels are summed) is einsum's rule
    ins, out = equation.split("->")
    terms = ins.split(",")
    if len(terms) != 2:
        return None
    spans = set()
    for term, rank in zip(terms, ranks):
        if "..." in term:
            spans.add(rank - (len(term) - 3))
    if len(spans) > 1 or any(n < 0 for n in spans) or ("..." in out and not spans):
        return None  # ellipses of different lengths broadcast
    span = spans.pop() if spans else 0

    def labels(term: str) -> list[str] | None:
        if term.count("...") > 1:
            return None
        head, dots, tail = term.partition("...")
        if not all(c.isascii() and c.isalpha() for c in head + tail):
            return None
        return list(head) + ([f"...{i}" for i in range(span)] if dots else []) + list(tail)

    found = [labels(t) for t in (*terms, out)]
    if any(f is None for f in found):
        return None
    (la, lb, lo) = found
    if (len(la), len(lb)) != tuple(ranks):
        return None
    return [la, lb], lo


def _same_size(x: Any, y: Any) -> bool:
    """x == y for sizes that may be symbolic, proved without adding a guard."""
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(x == y))


def _permutation(have: list[str], want: list[str]) -> list[int] | None:
    perm = [have.index(label) for label in want]
    return None if perm == list(range(len(perm))) else perm


def einsum_product(node: fx.Node) -> EinsumProduct | None:
    """The batched matrix product `node` computes, when it is a two-operand einsum that is one."""
    if node.op != "call_function" or node.target not in _EINSUM_FUNCTIONS or node.kwargs or not node.args:
        return None
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or len(operands) != 2:
        return None
    a, b = operands
    ea, eb = (o.meta.get("example_value") if isinstance(o, fx.Node) else None for o in (a, b))
    if not (isinstance(ea, torch.Tensor) and isinstance(eb, torch.Tensor)):
        return None
    terms = _einsum_terms(equation, (ea.dim(), eb.dim()))
    if terms is None:
        return None
    (la, lb), lo = terms
    if len(set(la)) != len(la) or len(set(lb)) != len(lb) or len(set(lo)) != len(lo):
        return None  # a diagonal, or an output label twice
    batch = [c for c in lo if c in la and c in lb]
    contracted = [c for c in la if c in lb and c not in lo]
    free_a = [c for c in la if c not in lb]
    free_b = [c for c in lb if c not in la]
    if len(contracted) != 1 or len(free_a) != 1 or len(free_b) != 1:
        return None
    if not (set(la) == set(batch) | set(contracted) | set(free_a)
            and set(lb) == set(batch) | set(contracted) | set(free_b)
            and set(lo) == set(batch) | set(free_a) | set(free_b)):
        return None  # a label summed over one operand only, or an output label from nowhere
    size_a, size_b = dict(zip(la, ea.shape)), dict(zip(lb, eb.shape))
    if not all(_same_size(size_a[c], size_b[c]) for c in batch + contracted):
        return None  # a size-1 dim broadcast (or a size the example values cannot prove equal)
    # the form with the fewest permutes: the operands in their order or swapped (aᵀbᵀ = (ba)ᵀ: out
    # 'bji' from a 'bid' and b 'bjd' is b @ aᵀ), the batch dims in the output's order, a's or b's;
    # of equals one without a permute of the result (the einsum node is then the matmul, which a
    # matcher walking back from a mask reaches), then the first
    best = None
    for x, lx, fx_, y, ly, fy in ((a, la, free_a, b, lb, free_b), (b, lb, free_b, a, la, free_a)):
        for order in (batch, [c for c in la if c in batch], [c for c in lb if c in batch]):
            perms = (_permutation(lx, order + fx_ + contracted), _permutation(ly, order + contracted + fy),
                     _permutation(order + fx_ + fy, lo))
            cost = (sum(p is not None for p in perms), perms[2] is not None)
            if best is None or cost < best[0]:
                best = (cost, EinsumProduct(x, y, *perms, equation))
    return best[1]


def _permute_call(perm: list[int]) -> tuple[Any, tuple]:
    """torch.transpose where `perm` swaps two dims (the last two as -2, -1), else torch.permute."""
    moved = [i for i, p in enumerate(perm) if p != i]
    if len(moved) == 2:
        n = len(perm)
        d0, d1 = moved
        return torch.transpose, ((-2, -1) if (d0, d1) == (n - 2, n - 1) else (d0, d1))
    return torch.permute, (list(perm),)


_VALUE_META = ("example_value", "val", "tensor_meta")


def _rewrite_einsum(gm: fx.GraphModule, node: fx.Node, product: EinsumProduct) -> bool:
    """Rewrites einsum `node` as `product` in place (see the module's docstring); False, with the
    graph as it was, where the new nodes' example values cannot be computed or do not have the
    einsum's shape and dtype."""
    g = gm.graph
    emit = GraphEmitter(g, None, {k: v for k, v in node.meta.items() if k not in _VALUE_META})

    def permuted(x: fx.Node, perm: list[int] | None) -> fx.Node:
        if perm is None:
            return x
        target, dims = _permute_call(perm)
        return emit.call(target, x, *dims)

    old = node.meta.get("example_value")
    try:
        with g.inserting_before(node):
            a, b = permuted(product.a, product.perm_a), permuted(product.b, product.perm_b)
            if product.perm_out is None:
                form = Canonical("call_function", torch.matmul, (a, b))
            else:
                target, dims = _permute_call(product.perm_out)
                form = Canonical("call_function", target, (emit.call(torch.matmul, a, b), *dims))
        # the einsum node itself becomes `form`: its value, computed as for a created node
        value = M.fake_value(SimpleNamespace(op=form.op, target=form.target, args=form.args, kwargs={}))
        ok = (all(isinstance(n.meta["example_value"], torch.Tensor) for n in emit.created)
              and isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor) and value.dtype == old.dtype
              and value.dim() == old.dim() and all(_same_size(x, y) for x, y in zip(value.shape, old.shape)))
    except Exception:  # an example value that cannot be computed: the einsum stays as written
        ok = False
    if not ok:
        for new in reversed(emit.created):
            g.erase_node(new)
        return False
    node.op, node.target, node.args, node.kwargs = form.op, form.target, form.args, {}
    node.meta["example_value"] = value
    return True


_FAMILIES = (("matrix product", _product), ("transpose", _transpose), ("permute", _permute), ("cast", _cast))


def canonical(node: fx.Node) -> tuple[str, Canonical] | None:
    """(family, canonical form) of `node` when it is a spelling this pass rewrites, else None."""
    for family, form in _FAMILIES:
        found = form(node)
        if found is not None:
            return family, found
    return None


def _spelling(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    attribute = view_attribute(node)
    if attribute is not None:
        return f".{attribute}"
    if node.target is operator.matmul:
        return "@"  # operator.matmul's own name would read as torch.matmul
    return getattr(node.target, "__name__", str(node.target))


def normalize(gm: fx.GraphModule) -> dict[str, dict[str, int]]:
    """Rewrites every node of gm that canonical() names, in place; returns, per family, how many
    nodes of each original spelling it rewrote (a node already canonical is not counted; an einsum
    counts as `einsum('its equation')` under "matrix product")."""
    rewritten: dict[str, dict[str, int]] = {}
    for node in gm.graph.nodes:
        product = einsum_product(node)
        if product is not None:
            if _rewrite_einsum(gm, node, product):
                counts = rewritten.setdefault("matrix product", {})
                spelling = f"einsum({product.equation!r})"
                counts[spelling] = counts.get(spelling, 0) + 1
            continue
        found = canonical(node)
        if found is None:
            continue
        family, form = found
        if (node.op, node.target, tuple(node.args)) == (form.op, form.target, form.args):
            continue
        spelling = _spelling(node)
        node.op, node.target = form.op, form.target
        node.args, node.kwargs = form.args, {}
        counts = rewritten.setdefault(family, {})
        counts[spelling] = counts.get(spelling, 0) + 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten


@register_pass
class NormalizePass(GraphPass):
    name = "normalize"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        rewritten = normalize(gm)
        for family, counts in rewritten.items():
            spellings = ", ".join(f"{n} x {spelling}" for spelling, n in sorted(counts.items()))
            record.notes.append(f"{family}: {spellings} -> one spelling")
        return bool(rewritten)
