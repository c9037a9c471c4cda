"""Layout conversions between an input's own axes and the op's [B, T, H(, D)], written once against a
small interface so that the probe (eager tensors) and the rewrite (FX nodes) cannot disagree about
a layout."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .. import fx_match as M
from ..fx_match import Refusal
from .vocabulary import _example


# ----------------------------------------------------------------------------------------------
# Layout conversions, written once for the probe (eager) and the rewrite (FX nodes)


class _Eager:
    def permute(self, x, perm):
        return x.permute(*perm)

    def unsqueeze(self, x, d):
        return x.unsqueeze(d)

    def squeeze(self, x, d):
        return x.squeeze(d)

    def transpose(self, x):
        return x.transpose(-1, -2)

    def cast(self, x, dtype):
        return x.to(dtype)


class _Emitter:
    def __init__(self, graph: fx.Graph, meta_source: fx.Node, fake_mode: Any):
        self.graph = graph
        self.meta_source = meta_source
        self.fake_mode = fake_mode
        self.created: list[fx.Node] = []

    def _node(self, kind: str, target: Any, args: tuple) -> fx.Node:
        if kind == "method":
            node = self.graph.call_method(target, args)
        else:
            node = self.graph.call_function(target, args)
        node.meta["stack_trace"] = self.meta_source.meta.get("stack_trace")
        node.meta["example_value"] = M.fake_value(node, self.fake_mode)
        self.created.append(node)
        return node

    def permute(self, x, perm):
        return x if list(perm) == list(range(len(perm))) else self._node("method", "permute", (x, *perm))

    def unsqueeze(self, x, d):
        return self._node("method", "unsqueeze", (x, d))

    def squeeze(self, x, d):
        return self._node("method", "squeeze", (x, d))

    def transpose(self, x):
        return self._node("method", "transpose", (x, -1, -2))

    def cast(self, x, dtype):
        ev = _example(x)
        if isinstance(ev, torch.Tensor) and ev.dtype == dtype:
            return x
        return self._node("method", "to", (x, dtype))

    def call(self, target, *args):
        return self._node("function", target, args)


_OP_ORDER = ("b0", "t", "b1", "d")


def _to_op(x, labels: list[str], nb: int, E) -> Any:
    """A per-token input, labelled axis by axis, to the op's [B, T, H(, D)] layout."""
    order = [lab for lab in _OP_ORDER if lab in labels]
    x = E.permute(x, [labels.index(lab) for lab in order])
    if nb == 0:
        x = E.unsqueeze(x, 0)
    if nb <= 1:
        x = E.unsqueeze(x, 2)
    return x


def _state_to_op(x, nb: int, transposed: bool, E) -> Any:
    if transposed:
        x = E.transpose(x)
    for _ in range(2 - nb):
        x = E.unsqueeze(x, 0)
    return x


def _state_from_op(x, nb: int, transposed: bool, E) -> Any:
    for _ in range(2 - nb):
        x = E.squeeze(x, 0)
    return E.transpose(x) if transposed else x


def _out_from_op(o, labels: list[str], nb: int, E) -> Any:
    """The op's output [B, T, HV, V] to a layout labelled with b0, b1, t, e."""
    if nb <= 1:
        o = E.squeeze(o, 2)
    if nb == 0:
        o = E.squeeze(o, 0)
    cur = {2: ["b0", "t", "b1", "e"], 1: ["b0", "t", "e"], 0: ["t", "e"]}[nb]
    return E.permute(o, [cur.index(lab) for lab in labels])


def _out_labels(shape: tuple[int, ...], batch: tuple[int, ...], T: int | None, what: str) -> list[list[str]]:
    """Readings of an output (or one step's output) as batch axes in order, time, value width."""
    core = shape[:-1]
    nb = len(batch)
    readings = []
    if len(core) == nb and tuple(core) == tuple(batch):
        return [[f"b{i}" for i in range(nb)] + ["e"]]
    if len(core) == nb + 1:
        for t in range(len(core)):
            rest = core[:t] + core[t + 1:]
            if tuple(rest) == tuple(batch) and (T is None or core[t] == T):
                labels = [f"b{i}" for i in range(nb)]
                labels.insert(t, "t")
                readings.append(labels + ["e"])
    if not readings:
        raise Refusal(f"the {what} has shape {list(shape)}; expected the state's batch axes "
                      f"{list(batch)} plus time and the value width")
    return readings
