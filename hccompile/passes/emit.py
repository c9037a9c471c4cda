"""One replacement, two back ends. A pass writes what replaces a matched region once, as a builder
against `Emitter`, and runs that builder twice: with `EagerEmitter` on the probe's tensors (the
proof) and with `GraphEmitter` into the FX graph (the rewrite). What the probe proved is then what
the rewrite inserts; two copies of the replacement could drift apart with every test passing."""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from . import fx_match as M


class Emitter:
    """The interface builders are written against. A value is a tensor (eager) or an FX node (graph);
    Python constants (ints, dtypes, lists of them) are arguments either way.

    `eager` is there for the few steps that must differ: a builder branching on it says why."""

    eager: bool

    def input(self, node: fx.Node) -> Any:
        """A value of the matched graph, as the replacement reads it."""
        raise NotImplementedError

    def example(self, x: Any) -> Any:
        """The tensor `x` stands for, to decide on its dtype or shape: `x` itself eagerly, its example
        value in the graph."""
        raise NotImplementedError

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def method(self, name: str, x: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def getitem(self, x: Any, index: Any) -> Any:
        return self.call(operator.getitem, x, index)

    def op(self, name: str, *args: Any) -> Any:
        """torch.ops.hccompile.<name>.default on `args`."""
        from .. import lowering  # noqa: F401  (registers the ops)

        return self.call(getattr(torch.ops.hccompile, name).default, *args)

    def size(self, x: Any, dim: int) -> Any:
        """x.shape[dim]: an int where it is static, else (in the graph) a node reading it, so that the
        replacement serves every size the graph does."""
        size = self.example(x).shape[dim]
        return size if isinstance(size, int) else self.method("size", x, dim)

    def cast(self, x: Any, dtype: torch.dtype) -> Any:
        """x in `dtype`; nothing is emitted when it already is."""
        ev = self.example(x)
        if isinstance(ev, torch.Tensor) and ev.dtype == dtype:
            return x
        return self.method("to", x, dtype)


class EagerEmitter(Emitter):
    """Runs each step now, on tensors. `inputs` gives the value of a graph node the builder reads
    through `input` (the probe's stand-ins); builders handed all their tensors as arguments need none."""

    eager = True

    def __init__(self, inputs: Callable[[fx.Node], Any] | None = None):
        self._inputs = inputs

    def input(self, node: fx.Node) -> Any:
        if self._inputs is None:
            raise ValueError(f"no probe value for {node.name}: this emitter was given no inputs")
        return self._inputs(node)

    def example(self, x: Any) -> Any:
        return x

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def method(self, name: str, x: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(x, name)(*args, **kwargs)


class GraphEmitter(Emitter):
    """Inserts each step as a node at the graph's insertion point (the caller's
    `graph.inserting_before`). Every node gets `meta` (e.g. the replaced node's stack trace) and its
    fake example value, computed from its inputs', which later steps of the builder, later passes and
    AOT tracing read; `created` lists the nodes in the order they were made."""

    eager = False

    def __init__(self, graph: fx.Graph, fake_mode: Any, meta: dict[str, Any] | None = None):
        self.graph, self.fake_mode, self.meta = graph, fake_mode, dict(meta or {})
        self.created: list[fx.Node] = []

    def input(self, node: fx.Node) -> fx.Node:
        return node

    def example(self, x: Any) -> Any:
        return M.example(x)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        return self._inserted(self.graph.call_function(fn, args, kwargs))

    def method(self, name: str, x: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return self._inserted(self.graph.call_method(name, (x, *args), kwargs))

    def _inserted(self, node: fx.Node) -> fx.Node:
        # listed before its value is computed: a caller undoing a failed build erases `created`
        self.created.append(node)
        node.meta.update(self.meta)
        node.meta["example_value"] = M.fake_value(node, self.fake_mode)
        return node
