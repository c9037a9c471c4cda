"""`hccompile.explain(model, *example_inputs)`: the report, without a dump directory."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from .debug.report import Report


def explain(model: Any, *args: Any, options: dict[str, Any] | None = None, mode: str | None = None,
            backward: bool = True, dynamic: bool | None = None, **kwargs: Any) -> Report:
    """Compile `model` with the hc backend on these inputs and return what every pass did.

    With `backward=True` (default) and a differentiable output, the backward graph is compiled too
    (gradients are taken with torch.autograd.grad, so no `.grad` field of the model is touched).
    Inductor's caches are off for this compile, so every pass runs and reports.
    """
    from . import backend as hc

    with collect_reports() as report:
        options = {"force_disable_caches": True, **(options or {})}
        cfg = hc.resolve(options, mode)
        compiled = torch.compile(model, backend=functools.partial(_backend, cfg=cfg),
                                 dynamic=dynamic)
        out = compiled(*args, **kwargs)
        if backward:
            leaves = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
            wrt = [p for p in _params(model)] + [a for a in _tensors((args, kwargs)) if a.requires_grad]
            if leaves and wrt:
                torch.autograd.grad(sum(t.float().sum() for t in leaves), wrt, allow_unused=True)
    return report


@contextlib.contextmanager
def collect_reports() -> Iterator[Report]:
    """The report of every graph that backend="hc" compiles inside the block, in this thread (a
    compile served whole from Dynamo's cache adds nothing)."""
    from . import backend as hc

    report = Report([])
    stack = hc._collect.__dict__.setdefault("stack", [])
    stack.append(report.graphs)
    try:
        yield report
    finally:  # by identity: list.remove would take the first equal (e.g. empty) list of a nested block
        del stack[next(i for i, graphs in enumerate(stack) if graphs is report.graphs)]


def _backend(gm, example_inputs, *, cfg):
    from .backend import compile_graph

    return compile_graph(gm, example_inputs, cfg)


def _params(model: Any) -> list[torch.Tensor]:
    if isinstance(model, torch.nn.Module):
        return [p for p in model.parameters() if p.requires_grad]
    return []


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


_backend.__hccompile_backend__ = True  # hccompile.substitutes applies under explain too
