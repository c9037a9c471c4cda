"""One spelling per operation, before any pass matches: the normalising pre-pass.

Python gives one operation many spellings, and Dynamo records each as written: `a @ b`,
`a.matmul(b)`, `torch.bmm(a, b)`; `x.transpose(-1, -2)`, `x.mT`, `x.swapaxes(-1, -2)`; `x.permute(0, 2, 1)`,
`x.permute((0, 2, 1))`; `x.float()`, `x.to(torch.float32)`. This pass rewrites each node of those
families, in place, into one form:

    matrix product    torch.matmul(a, b)
    transpose         torch.transpose(x, dim0, dim1)       (also .mT, .T and .t() of a matrix)
    permute           torch.permute(x, [dims])
    float cast        x.to(dtype)                          (.float(), .half(), .bfloat16(), .double())

A node is rewritten only where the two spellings are the same function of the same operands:
no keyword arguments beyond the canonical ones, no `out=`, `.T`/`.t()` only of a 2-D tensor (where
they are a transpose; `.t()` of a vector is the vector), `bmm` only of two 3-D tensors. Everything
else stays as written (views stay views, in-place ops stay in place: their aliasing is part of what
the graph means). The node keeps its name, position, users and metadata (its example value is the
same tensor), so reports and the later passes name it as before.

Why a pass and not only a vocabulary: `fx_match.kind` reads every spelling as one op for the
matchers, but a graph rewritten once means a matcher written against the canonical form is right
for every spelling, and the dump shows the graph the matchers saw. `disable_passes=("normalize",)`
turns it off (each matcher still reads the other spellings).
"""
from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from ..compat import view_attribute
from .base import GraphPass, PassContext, register_pass


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
    nodes of each original spelling it rewrote (a node already canonical is not counted)."""
    rewritten: dict[str, dict[str, int]] = {}
    for node in gm.graph.nodes:
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
