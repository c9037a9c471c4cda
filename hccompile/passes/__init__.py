"""FX passes, one module per pass (a file, or a package split by idea such as `delta_rule/`). Adding a
pass: write `passes/<name>.py` with a class decorated by `@register_pass` whose `name` is the
module's name, then put that name in PIPELINE below, at the place its stage should run it, with the
reason for that place."""
from __future__ import annotations

import importlib

from .base import GraphPass, PassContext, register_pass, registered_passes

# The passes of each stage, in the order they run. A pass registered elsewhere and not listed here
# runs after the listed ones of its stage, in registration order.
PIPELINE: dict[str, tuple[str, ...]] = {
    "dynamo": (
        "substitutes",     # reports what Dynamo already traced as our ops, before anything rewrites
        "normalize",       # one spelling per operation (products, transposes, permutes, casts) for every matcher
        "hc_detect",       # finds the hyper-connection layers ...
        "hc_fuse",         # ... and fuses their ops, before recompute plans around the fused ones
        "hc_project",      # after hc_fuse: the fused mappings' projection and norm statistic in one op
        "delta_rule",      # before linear_attn: a chunked delta rule holds masked products it would try
        "htree",           # before linear_attn: the htree region holds matrix products it would inspect
        "linear_attn",
        "depthwise_conv",  # after the attention passes: its shifted slices are not a loop of theirs
        "recompute",       # after every pass that emits our ops: block recompute plans around them
        "saved_views",     # last: views feeding every op, with the tags recompute set kept
    ),
    "joint": (),
    "post_grad": (
        "op_inventory",    # the ops (and our kernels' launches) in the graph Inductor lowers
    ),
}

PASS_MODULES = tuple(name for names in PIPELINE.values() for name in names)

_loaded = False


def _load() -> None:
    global _loaded
    if not _loaded:
        for mod in PASS_MODULES:
            importlib.import_module(f"{__name__}.{mod}")
        _loaded = True


def passes_for_stage(stage: str) -> list[type[GraphPass]]:
    _load()
    registry = registered_passes()
    listed = [registry[name] for name in PIPELINE.get(stage, ())]
    for cls in listed:
        if cls.stage != stage:
            raise ValueError(f"PIPELINE lists pass {cls.name!r} under {stage!r}, but its stage is {cls.stage!r}")
    return listed + [p for p in registry.values() if p.stage == stage and p not in listed]


def all_pass_names() -> list[str]:
    _load()
    return sorted(registered_passes())


def pass_source_files() -> tuple[str, ...]:
    """Every source file the passes depend on, for the Inductor cache key (CustomGraphPass.uuid)."""
    import glob
    import os

    _load()
    here = os.path.dirname(os.path.abspath(__file__))
    pkg = os.path.dirname(here)
    # recursive: a pass split into a package (passes/delta_rule/) keys on each of its modules
    files = glob.glob(os.path.join(here, "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(pkg, "lowering", "*.py"))
    files += [os.path.join(pkg, "config.py"), os.path.join(pkg, "backend.py")]
    # The probes run the kernels and their references.
    files += glob.glob(os.path.join(pkg, "kernels", "**", "*.py"), recursive=True)
    return tuple(sorted(f for f in files if os.path.exists(f)))


__all__ = ["GraphPass", "PassContext", "register_pass", "passes_for_stage", "all_pass_names",
           "pass_source_files", "PASS_MODULES", "PIPELINE"]
