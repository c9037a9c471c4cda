"""Writes what each compiled graph went through into a dump directory.

Layout: <dump_dir>/graph_<id>/ holds
  00_dynamo_graph.py                  the graph Dynamo handed us
  <stage>.<pass>.<graph>.before.py    each pass's input, readable code
  <stage>.<pass>.<graph>.after.py     each pass's output
  aot_<forward|backward|inference>.py the graphs AOTAutograd handed Inductor
  inductor_<...>_code.py              Inductor's generated code
  report.json, report.md
and <dump_dir>/depyf/ holds depyf's decompiled Dynamo bytecode of each frame whose graphs were compiled
with this dump_dir (install_depyf_hook), and of no other.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from typing import Any

import torch.fx as fx

log = logging.getLogger("hccompile")


def graph_code(g: fx.Graph | fx.GraphModule) -> str:
    if isinstance(g, fx.GraphModule):
        try:
            return g.print_readable(print_output=False)
        except Exception:  # noqa: BLE001 - readable form is best effort; the raw code always exists
            return g.code
    return g.python_code("self").src


class Dumper:
    def __init__(self, root: str, graph_id: int):
        self.root = os.path.abspath(root)
        self.dir = os.path.join(self.root, f"graph_{graph_id:03d}")
        os.makedirs(self.dir, exist_ok=True)

    def write(self, name: str, text: str | None) -> str | None:
        if text is None:
            return None
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        path = os.path.join(self.dir, safe)
        with open(path, "w") as f:
            f.write(text)
        return path

    def graph(self, name: str, g: Any) -> None:
        self.write(name, graph_code(g))

    def report(self, report: Any) -> None:
        self.write("report.json", json.dumps(report.to_json(), indent=2, default=repr))
        self.write("report.md", report.to_markdown())


_depyf_lock = threading.Lock()
_depyf_handle: Any = None  # the one bytecode hook, registered on first use and never removed
_depyf_requests: dict[Any, set[str]] = {}  # (compile id, code) -> dump roots that asked in that compile
_depyf_counters: dict[str, int] = {}  # dump root -> files written so far (their index)


def _current_compile(code: Any = None) -> Any:
    """A key for the frame compile running now: Dynamo's compile id (frame id, recompile count)
    and the frame's code object (ids restart after torch._dynamo.reset(); the pair does not repeat
    while a request is pending), or None outside a Dynamo compile. The bytecode hook passes the
    code it was given; the backend's call finds it on the instruction translator tracing it."""
    try:
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        if compile_id is None:
            return None
        if code is None:
            from torch._dynamo.symbolic_convert import InstructionTranslator

            code = InstructionTranslator.current_tx().f_code
    except (ImportError, AttributeError):  # no translator: not inside a Dynamo frame compile
        return None
    return compile_id, code


def install_depyf_hook(root: str) -> bool:
    """Write depyf's decompilation of the frame Dynamo is compiling now into <root>/depyf/.

    Dynamo calls bytecode hooks once per frame, after the backend has returned, with the compile
    context of that frame still current. The hook is registered once, globally, but only writes for
    compiles that asked: this call (from the backend, for a graph of the frame) files the request
    under the current compile's key, the hook takes it off when that frame's bytecode arrives. A
    later compile (another frame, a recompile without dump_dir, backend="inductor") has no request
    and is not dumped; nor is a frame from which Dynamo hands the backend no graph. Outside a
    Dynamo compile (the backend called by hand) nothing is decompiled. Returns False without depyf."""
    global _depyf_handle
    root = os.path.abspath(root)
    with _depyf_lock:
        try:
            import depyf  # noqa: F401
            from torch._dynamo.convert_frame import register_bytecode_hook
        except ImportError:
            log.warning("hccompile: depyf is not installed; dumps will lack decompiled sources")
            return False
        key = _current_compile()
        if key is None:
            return True
        os.makedirs(os.path.join(root, "depyf"), exist_ok=True)
        _depyf_requests.setdefault(key, set()).add(root)
        if _depyf_handle is None:
            _depyf_handle = register_bytecode_hook(_depyf_hook)
        return True


def _depyf_hook(old_code, new_code):
    key = _current_compile(old_code)
    with _depyf_lock:
        roots = _depyf_requests.pop(key, None) if key is not None else None
        if not roots:
            return None
        # requests of frames whose compile failed after our backend returned never get their
        # hook call: drop them here, so they cannot outlive their compile for long
        _depyf_requests.clear()
        indices = {}
        for root in roots:
            indices[root] = _depyf_counters.get(root, 0)
            _depyf_counters[root] = indices[root] + 1
    import depyf

    try:
        src = depyf.decompile(new_code)
    except Exception as e:  # noqa: BLE001 - decompilation is advisory; never break compile
        src = f"# depyf could not decompile {old_code.co_name}: {e}\n"
    try:
        orig = depyf.decompile(old_code)
    except Exception:  # noqa: BLE001
        orig = None
    for root, idx in indices.items():
        out = os.path.join(root, "depyf")
        try:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, f"__transformed_code_{idx}_for_{old_code.co_name}.py"), "w") as f:
                f.write(src)
            if orig:
                with open(os.path.join(out, f"__original_code_{idx}_{old_code.co_name}.py"), "w") as f:
                    f.write(orig)
        except OSError as e:  # a dump must never break the compile
            log.warning("hccompile: could not write depyf sources under %s: %s", out, e)
    return None
