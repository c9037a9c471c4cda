"""The layering the README promises, read from the source: data flows graph -> passes -> lowering ->
kernels, and no two parts of hccompile import each other (imports inside functions count too)."""
from __future__ import annotations

import ast

import pytest
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


# --- kernels Inductor can copy ------------------------------------------------------------------
def _kernel_modules():
    import importlib
    import pkgutil

    import hccompile.kernels as kernels

    for info in pkgutil.walk_packages(kernels.__path__, "hccompile.kernels."):
        yield importlib.import_module(info.name)


def misnamed_jit_calls(modules) -> list[str]:
    """Calls, inside @triton.jit functions, to another @triton.jit function under a name other than
    its own (`from .._triton import dot as _dot`). Inductor copies a traced kernel's source into its
    output code with the source of each function it calls, and that source defines `dot`, not
    `_dot`: the kernel then fails to compile on the GPU (NameError) though it runs everywhere else."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    jit = (JITFunction, InterpretedFunction)  # under TRITON_INTERPRET=1, @triton.jit makes the second
    found = []
    for module in modules:
        for owner_name, owner in vars(module).items():
            if not isinstance(owner, jit) or owner.fn.__module__ != module.__name__:
                continue
            for name in owner.fn.__code__.co_names:
                callee = owner.fn.__globals__.get(name)
                if isinstance(callee, jit) and callee.fn.__name__ != name:
                    found.append(f"{module.__name__}.{owner_name} calls {callee.fn.__name__} as {name}")
    return sorted(set(found))


def test_kernels_call_jit_functions_by_their_own_names():
    modules = list(_kernel_modules())
    assert len(modules) > 10
    assert not misnamed_jit_calls(modules)


def defaulted_constexprs(modules) -> list[str]:
    """tl.constexpr parameters with a default value, in @triton.jit functions. A launch through
    wrap_triton that leaves one at its default compiles into Inductor code whose launcher takes one
    argument more than the call gives: on the H100 (torch 2.11) `launcher() missing 1 required
    positional argument: '_grid_2'` (session 24: R2's output kernel failed every compiled GDN and KDA
    graph so), while eager launches and the CPU suite ran. Every launch names every constexpr instead."""
    pytest.importorskip("triton")
    import inspect

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    jit = (JITFunction, InterpretedFunction)
    found = []
    for module in modules:
        for owner_name, owner in vars(module).items():
            if not isinstance(owner, jit) or owner.fn.__module__ != module.__name__:
                continue
            for param in inspect.signature(owner.fn).parameters.values():
                if param.default is not inspect.Parameter.empty and "constexpr" in str(param.annotation):
                    found.append(f"{module.__name__}.{owner_name}: {param.name} = {param.default!r}")
    return sorted(set(found))


def test_no_kernel_constexpr_has_a_default():
    modules = list(_kernel_modules())
    assert len(modules) > 10
    assert not defaulted_constexprs(modules)


def test_a_defaulted_constexpr_is_found():
    """The check above can fail."""
    import types

    triton = pytest.importorskip("triton")
    module = types.ModuleType("defaulted")
    source = ("import triton\nimport triton.language as tl\n"
              "@triton.jit\ndef kernel(x, MODE: tl.constexpr = False):\n    pass\n")
    path = Path(__file__).with_name("_defaulted_kernel_tmp.py")
    try:
        path.write_text(source)  # triton.jit reads the function's source from its file
        exec(compile(source, str(path), "exec"), module.__dict__)
    finally:
        path.unlink(missing_ok=True)
    module.kernel.fn.__module__ = module.__name__ = "defaulted"
    assert defaulted_constexprs([module]) == ["defaulted.kernel: MODE = False"]


def test_a_misnamed_jit_call_is_found():
    """The check above can fail: a module calling `dot` as `_dot` is reported."""
    import types

    triton = pytest.importorskip("triton")
    from hccompile.kernels._triton import dot

    module = types.ModuleType("misnamed")
    source = ("import triton\nimport triton.language as tl\n"
              "@triton.jit\ndef kernel(x, P: tl.constexpr, U: tl.constexpr):\n    return _dot(x, x, P, U)\n")
    module.__dict__["_dot"] = dot
    path = Path(__file__).with_name("_misnamed_kernel_tmp.py")
    try:
        path.write_text(source)  # triton.jit reads the function's source from its file
        exec(compile(source, str(path), "exec"), module.__dict__)
    finally:
        path.unlink(missing_ok=True)
    module.kernel.fn.__module__ = module.__name__ = "misnamed"
    assert misnamed_jit_calls([module]) == ["misnamed.kernel calls dot as _dot"]
