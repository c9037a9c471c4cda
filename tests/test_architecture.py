"""The layering the README promises, read from the source: data flows graph -> passes -> lowering ->
kernels, and no two parts of hccompile import each other (imports inside functions count too)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hccompile"


def _part(path: Path) -> str:
    """The top-level part of hccompile a file belongs to: its subpackage, or its module's name."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_parts(path: Path) -> set[str]:
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])  # ["hccompile", ...]
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                names = base + (node.module.split(".") if node.module else [])
                targets = [names] if node.module else [names + [alias.name] for alias in node.names]
            else:
                targets = [node.module.split(".")] if node.module else []
        elif isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        else:
            continue
        for target in targets:
            if len(target) > 1 and target[0] == "hccompile":
                parts.add(target[1])
    return parts


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        part = _part(path)
        graph.setdefault(part, set()).update(p for p in _imported_parts(path) if p != part)
    return graph


def test_no_two_parts_import_each_other():
    graph = import_graph()
    mutual = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets
                     if a in graph.get(b, set())} - {("__init__", p) for p in graph})
    assert not mutual, mutual


def test_data_flows_one_way():
    graph = import_graph()
    assert graph["kernels"] <= {"compat"}, graph["kernels"]        # kernels know nothing of FX
    assert graph["lowering"] <= {"compat", "kernels"}, graph["lowering"]
    for part in ("kernels", "lowering", "passes", "distributed"):
        assert "backend" not in graph[part], part


def test_the_reader_sees_a_cycle():
    """The check above can fail: a cycle written into a copy of the graph is found."""
    graph = import_graph()
    graph["kernels"] = graph["kernels"] | {"lowering"}
    mutual = {tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph.get(b, set())}
    assert ("kernels", "lowering") in mutual
