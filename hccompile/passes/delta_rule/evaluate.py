"""Running the user's region at compile time on probe values, in graph order with in-place writes
honoured: how the probe learns what the code computes without trusting its spelling."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ...compat import concrete_shape, size_hint
from .. import fx_match as M
from .vocabulary import _Index, _example
from .region import _Region


# ----------------------------------------------------------------------------------------------
# Evaluation of the region at compile time


class _Evaluator:
    """Evaluates region nodes on probe values, in graph order, mutations included."""

    def __init__(self, gm: fx.GraphModule, idx: _Index, region: _Region, inputs: dict[fx.Node, Any]):
        self.gm, self.idx, self.region = gm, idx, region
        # placeholders come in `inputs` or as stand-ins, never from the example inputs
        self.evaluator = M.Evaluator(gm, outside=self._outside)
        self.env: dict[fx.Node, Any] = self.evaluator.env
        self.env.update(inputs)

    def _outside(self, n: fx.Node) -> Any:
        """A stand-in for a node outside the region, or for a number (a size, a SymInt), else
        NotImplemented: the node is run."""
        if n not in self.region.nodes:
            return self._standin(n)
        ev = _example(n)
        if isinstance(ev, (torch.SymInt, torch.SymFloat)) or (n.op != "placeholder" and isinstance(ev, (int, float))
                                                               and not isinstance(ev, bool)):
            return self._standin(n)
        return NotImplemented

    def _standin(self, n: fx.Node) -> Any:
        """Value for a node outside the region (read for metadata only): NaN-filled, so a data use
        poisons the probe instead of passing it."""
        ev = _example(n)
        if isinstance(ev, torch.Tensor):
            t = torch.empty(concrete_shape(ev), dtype=ev.dtype, device=ev.device)
            return t.fill_(float("nan")) if t.is_floating_point() else t.zero_()
        if isinstance(ev, (torch.SymInt, int)):
            return size_hint(ev)
        if isinstance(ev, (torch.SymFloat, float)):
            return float(ev.node.hint) if isinstance(ev, torch.SymFloat) else ev
        if n.op == "get_attr":
            return M.attribute(self.gm, n.target)
        raise ValueError(f"cannot stand in for {n.name}")

    def run(self, wanted: list[fx.Node], read_pos: float | None = None) -> list[Any]:
        """Values of `wanted` as read at `read_pos` (default: right after each node), i.e. with the
        in-place writes to their storage that happen before that point."""
        def reads(n: fx.Node) -> list[fx.Node]:
            ins = list(n.all_input_nodes)
            return ins + [m for a in ins for m in self.idx.mutators_before(a, self.idx.pos[n])]

        starts = list(wanted)
        for w in wanted:
            starts += self.idx.mutators_before(w, self.idx.pos[w] + 0.5 if read_pos is None else read_pos)
        # Values already known are not recomputed; nodes outside the region are stood in for, not entered.
        needed = set(M.walk(starts, reads, skip=self.env.__contains__, stop=lambda n: n not in self.region.nodes))
        self.evaluator.run(sorted(needed, key=lambda x: self.idx.pos[x]))
        return [self.env[w] for w in wanted]
