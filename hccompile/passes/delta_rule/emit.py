"""Layout conversions between an input's own axes and the op's [B, T, H(, D)], written once as
builders against the shared emitter (passes/emit.py), so that the probe (eager tensors) and the
rewrite (FX nodes) cannot disagree about a layout."""
from __future__ import annotations

from typing import Any

from ..emit import Emitter
from ..fx_match import Refusal


def _permute(E: Emitter, x, perm) -> Any:
    # the identity is no permute: the graph gets no node for it
    return x if list(perm) == list(range(len(perm))) else E.method("permute", x, *perm)


_OP_ORDER = ("b0", "t", "b1", "d")


def _to_op(x, labels: list[str], nb: int, E: Emitter) -> Any:
    """A per-token input, labelled axis by axis, to the op's [B, T, H(, D)] layout."""
    order = [lab for lab in _OP_ORDER if lab in labels]
    x = _permute(E, x, [labels.index(lab) for lab in order])
    if nb == 0:
        x = E.method("unsqueeze", x, 0)
    if nb <= 1:
        x = E.method("unsqueeze", x, 2)
    return x


def _state_to_op(x, nb: int, transposed: bool, E: Emitter) -> Any:
    if transposed:
        x = E.method("transpose", x, -1, -2)
    for _ in range(2 - nb):
        x = E.method("unsqueeze", x, 0)
    return x


def _state_from_op(x, nb: int, transposed: bool, E: Emitter) -> Any:
    for _ in range(2 - nb):
        x = E.method("squeeze", x, 0)
    return E.method("transpose", x, -1, -2) if transposed else x


def _out_from_op(o, labels: list[str], nb: int, E: Emitter) -> Any:
    """The op's output [B, T, HV, V] to a layout labelled with b0, b1, t, e."""
    if nb <= 1:
        o = E.method("squeeze", o, 2)
    if nb == 0:
        o = E.method("squeeze", o, 0)
    cur = {2: ["b0", "t", "b1", "e"], 1: ["b0", "t", "e"], 0: ["t", "e"]}[nb]
    return _permute(E, o, [cur.index(lab) for lab in labels])


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
