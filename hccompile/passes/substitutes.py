"""Reports the library functions that Dynamo traced as our ops (hccompile.substitutes) for this
graph: each substituted call as a match with the probe's error, each call traced as written as a
refusal with the reason. The substitution itself happens while Dynamo traces, before any pass;
disabling this pass (`disable_passes=("substitutes",)`) turns it off."""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..substitutes import take_decisions
from .base import GraphPass, PassContext, register_pass


@register_pass
class SubstitutesPass(GraphPass):
    name = "substitutes"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        for decision in take_decisions():
            details = {"client": decision["client"], "config": list(decision["config"])}
            if decision["substituted"]:
                record.match("substitute", probe_error=decision["error"], **details)
            else:
                record.refuse("substitute", decision["reason"], **details)
        return False
