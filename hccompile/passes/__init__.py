"""FX passes, one file per pass. Adding a pass: write `passes/<name>.py` with a class decorated by
`@register_pass`, then add its module name to `PASS_MODULES` below."""
from __future__ import annotations

import importlib

from .base import GraphPass, PassContext, register_pass, registered_passes

PASS_MODULES = (
    "substitutes",
    "depthwise_conv",
    "hc_detect",
    "hc_fuse",
    "delta_rule",
    "htree",
    "linear_attn",
    "recompute",
    "saved_views",
    "op_inventory",
)

_loaded = False


def _load() -> None:
    global _loaded
    if not _loaded:
        for mod in PASS_MODULES:
            importlib.import_module(f"{__name__}.{mod}")
        _loaded = True


def passes_for_stage(stage: str) -> list[type[GraphPass]]:
    _load()
    return sorted((p for p in registered_passes().values() if p.stage == stage), key=lambda p: p.order)


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
    files = glob.glob(os.path.join(here, "*.py")) + glob.glob(os.path.join(pkg, "lowering", "*.py"))
    files += [os.path.join(pkg, "config.py"), os.path.join(pkg, "backend.py")]
    # The probes run the kernels and their references.
    files += glob.glob(os.path.join(pkg, "kernels", "**", "*.py"), recursive=True)
    return tuple(sorted(f for f in files if os.path.exists(f)))


__all__ = ["GraphPass", "PassContext", "register_pass", "passes_for_stage", "all_pass_names",
           "pass_source_files", "PASS_MODULES"]
