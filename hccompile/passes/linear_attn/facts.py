"""What is known about the graph as a whole, computed once per run: its order, which forward inputs
each value depends on, and an evaluator on the real example inputs. Kept apart because every stage
asks these questions (is this mask constant? what is this decay's value? what does the region
compute on probe inputs?), and they must be answered linear in the graph size, not per candidate."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .. import fx_match as M
from ..base import PassContext
from .vocabulary import (_SHAPE_ONLY_FNS, _SHAPE_ONLY_METHODS, _impurity, _is_fresh,
                         _mutation_target)


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
        return sorted(n.name for n in M.walk(wanted, _value_inputs, skip=stop.__contains__) if n in self.data_bits)

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
        needed = list(M.walk(wanted, M.inputs, skip=stop.__contains__))
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

        def admit(n: fx.Node) -> None:
            target = _mutation_target(n)
            if target is not None:
                if memo or not _is_fresh(target):
                    raise ValueError(f"the region writes in place into {M.describe(target)} "
                                     f"({n.name})")
            else:
                why = _impurity(n)
                if why:
                    raise ValueError(f"probe region contains a {why}")

        # The memo serves memo=True only: with overrides every needed node is recomputed from them.
        evaluator = M.Evaluator(self.gm, self.ctx.example_inputs, admit=admit,
                                known=self._memo if memo else None, placeholders=self.placeholders)
        evaluator.env.update(overrides)
        evaluator.run(needed)
        if memo:
            self._memo.update((n, evaluator.env[n]) for n in needed)
        values = evaluator.values(wanted)
        return values, needed
