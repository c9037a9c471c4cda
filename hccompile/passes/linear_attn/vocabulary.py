"""What each node does, in the words every later stage uses (fx_match's kinds): which ops create a
tensor, write into one or read only its shape, and which are pure. Kept apart so that the matchers,
the evaluator and the dead-code sweeps classify a node the same way."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ...compat import concrete_shape
from .. import fx_match as M


_CREATION_FNS = {torch.zeros, torch.ones, torch.empty, torch.full, torch.zeros_like, torch.ones_like,
                 torch.empty_like, torch.full_like, torch.arange, torch.clone, torch.tensor,
                 torch.eye}
_CREATION_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "clone"}
_SHAPE_ONLY_METHODS = {"size", "dim", "numel", "new_zeros", "new_ones", "new_empty", "new_full",
                       "new_tensor"}
_SHAPE_ONLY_FNS = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}

_kind = M.kind  # one vocabulary for every pass (fx_match's spellings)
_mutation_target = M.mutated_operand  # the tensor an in-place node writes into, or None


def _alive(node: Any, g: fx.Graph) -> bool:
    """Still in the graph (erase_node leaves `node.graph` set)."""
    return isinstance(node, fx.Node) and node.graph is g and not getattr(node, "_erased", False)


def _other(node: fx.Node) -> Any:
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("other")


def _shape(node: Any) -> tuple[int, ...] | None:
    ev = M.example(node)
    return concrete_shape(ev) if isinstance(ev, torch.Tensor) else None


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
