"""The pass interface and registry."""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

STAGES = ("dynamo", "joint", "post_grad")

_REGISTRY: dict[str, type["GraphPass"]] = {}


@dataclasses.dataclass
class PassContext:
    config: Any  # hccompile.config.HCConfig
    example_inputs: list[Any]
    fake_mode: Any = None
    graph_name: str = "dynamo"
    report: Any = None  # hccompile.debug.report.GraphReport


class GraphPass:
    """One FX pass. Dynamo-stage passes get the GraphModule; joint and post-grad passes get the
    fx.Graph that Inductor hands its custom-pass hooks. `run` returns True when it changed the graph
    and records what it matched and refused on `record`."""

    name: ClassVar[str]
    stage: ClassVar[str]

    def run(self, graph_or_module: Any, ctx: PassContext, record: Any) -> bool:
        raise NotImplementedError


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    if cls.stage not in STAGES:
        raise ValueError(f"pass {cls.__name__}: stage must be one of {STAGES}, got {cls.stage!r}")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"pass name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def registered_passes() -> dict[str, type[GraphPass]]:
    return dict(_REGISTRY)


def node_count(g: torch.fx.Graph) -> int:
    return len(g.nodes)


def unrolled_loop_note(iterations: int, op: str) -> str:
    """The report's `lengths` entry for a lowered loop that Dynamo unrolled: the op replaces the
    iterations, but the guard Dynamo put on their count stays (a pass runs after it), so a length
    with another count compiles a new graph; `op` ("hccompile.chunk_kda") serves every length."""
    return (f"one graph per trip count: Dynamo unrolled this loop ({iterations} iterations) before the pass "
            f"ran, so a length with another count compiles a new graph; for one graph at every length call "
            f"{op} (FLA's arguments, [B, T, H, D]) in place of the loop")
