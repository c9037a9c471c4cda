"""What each pass saw, changed, matched and refused, per compiled graph."""
from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass
class PassRecord:
    name: str
    stage: str
    graph: str = ""  # which graph of the stage: "dynamo", "joint", "forward", "backward", "inference"
    nodes_before: int = 0
    nodes_after: int = 0
    changed: bool = False
    matches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    refusals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    time_s: float = 0.0
    error: str | None = None

    def match(self, pattern: str, **details: Any) -> None:
        self.matches.append({"pattern": pattern, **details})

    def refuse(self, pattern: str, reason: str, **details: Any) -> None:
        self.refusals.append({"pattern": pattern, "reason": reason, **details})


@dataclasses.dataclass
class GraphReport:
    graph_id: int
    passes: list[PassRecord] = dataclasses.field(default_factory=list)
    timings_s: dict[str, float] = dataclasses.field(default_factory=dict)
    lowered_ops: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # graph -> ops
    fallback: str | None = None
    cache_hits: list[str] = dataclasses.field(default_factory=list)  # graphs served from cache
    recompute_plan: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    saved_bytes: dict[str, Any] = dataclasses.field(default_factory=dict)  # from the forward graph
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Inductor settings hc chose for this graph, each with its reason (the user's own win)
    inductor_settings: dict[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
    dump_dir: str | None = None

    def add_time(self, stage: str, seconds: float) -> None:
        self.timings_s[stage] = self.timings_s.get(stage, 0.0) + seconds

    @property
    def matches(self) -> list[dict[str, Any]]:
        return [dict(m, **{"pass": p.name}) for p in self.passes for m in p.matches]

    @property
    def refusals(self) -> list[dict[str, Any]]:
        return [dict(r, **{"pass": p.name}) for p in self.passes for r in p.refusals]

    def to_json(self) -> dict[str, Any]:
        return {
            "graph_id": self.graph_id,
            "fallback": self.fallback,
            "cache_hits": self.cache_hits,
            "recompute_plan": self.recompute_plan,
            "saved_bytes": self.saved_bytes,
            "timings_s": self.timings_s,
            "lowered_ops": self.lowered_ops,
            "passes": [dataclasses.asdict(p) for p in self.passes],
            "config": _jsonable(self.config),
            "inductor_settings": {k: {"value": _jsonable(v), "reason": why}
                                  for k, (v, why) in self.inductor_settings.items()},
        }

    def summary_line(self) -> str:
        counts: dict[str, int] = {}
        for m in self.matches:
            counts[m["pattern"]] = counts.get(m["pattern"], 0) + 1
        matched = ", ".join(f"{k}×{v}" for k, v in sorted(counts.items())) or "nothing"
        total = sum(self.timings_s.values())
        text = (f"graph {self.graph_id}: matched {matched}; refused {len(self.refusals)}; "
                f"compile {total:.2f}s")
        if self.fallback:
            text += f"; FELL BACK to plain Inductor ({self.fallback})"
        return text

    def to_markdown(self) -> str:
        out = [f"# hccompile report — graph {self.graph_id}", ""]
        if self.fallback:
            out += [f"**Fell back to plain Inductor:** {self.fallback}", ""]
        out += ["## Matched", ""]
        if self.matches:
            for m in self.matches:
                details = ", ".join(f"{k}={v}" for k, v in m.items() if k not in ("pattern", "pass"))
                out.append(f"- `{m['pattern']}` ({m['pass']}): {details}")
        else:
            out.append("- nothing")
        out += ["", "## Refused", ""]
        if self.refusals:
            for r in self.refusals:
                where = f" at `{r['node']}`" if "node" in r else ""
                out.append(f"- `{r['pattern']}`{where} ({r['pass']}): {r['reason']}")
        else:
            out.append("- nothing")
        if self.lowered_ops:
            out += ["", "## hccompile ops in the compiled graphs", ""]
            for g, ops in self.lowered_ops.items():
                out.append(f"- {g}: {', '.join(ops) if ops else 'none'}")
        if self.recompute_plan:
            out += ["", "## Recompute plan", "", "| block | sublayers | saved | nodes recomputed |",
                    "|---|---|---|---|"]
            for b in self.recompute_plan:
                out.append(f"| {b['block']} | {b['layers']} | {', '.join(b['saved'])} | "
                           f"{b['recomputed_nodes']} |")
        if self.inductor_settings:
            out += ["", "## Inductor settings hc chose", ""]
            for key, (value, why) in self.inductor_settings.items():
                out.append(f"- `{key}={value!r}`: {why}")
        if self.saved_bytes:
            sb = self.saved_bytes
            out += ["", f"Saved for backward (forward graph): {sb['bytes'] / 2**20:.2f} MiB in "
                        f"{sb['tensors']} tensor(s), not counting inputs and parameters."]
        if self.cache_hits:
            out += ["", f"Served from Inductor's cache (post-grad passes did not run): "
                        f"{', '.join(self.cache_hits)}. Set dump_dir or force_disable_caches to see them."]
        out += ["", "## Passes", "", "| pass | stage | graph | nodes before → after | changed | time (ms) |",
                "|---|---|---|---|---|---|"]
        for p in self.passes:
            err = f" (error: {p.error})" if p.error else ""
            out.append(f"| {p.name} | {p.stage} | {p.graph} | {p.nodes_before} → {p.nodes_after} | "
                       f"{'yes' if p.changed else 'no'}{err} | {p.time_s * 1e3:.1f} |")
        out += ["", "## Compile time per stage", "", "| stage | seconds |", "|---|---|"]
        for k, v in self.timings_s.items():
            out.append(f"| {k} | {v:.3f} |")
        out.append("")
        return "\n".join(out)


class Report:
    """The reports of every graph compiled for one model (what `hccompile.explain` returns)."""

    def __init__(self, graphs: list[GraphReport]):
        self.graphs = graphs

    @property
    def matches(self) -> list[dict[str, Any]]:
        return [m for g in self.graphs for m in g.matches]

    @property
    def refusals(self) -> list[dict[str, Any]]:
        return [r for g in self.graphs for r in g.refusals]

    def to_json(self) -> dict[str, Any]:
        return {"graphs": [g.to_json() for g in self.graphs]}

    def to_markdown(self) -> str:
        return "\n".join(g.to_markdown() for g in self.graphs)

    def __str__(self) -> str:
        return self.to_markdown()

    def __repr__(self) -> str:
        return f"Report({len(self.graphs)} graph(s), {len(self.matches)} match(es), " \
               f"{len(self.refusals)} refusal(s))"


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        return repr(obj)
