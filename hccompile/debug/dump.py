"""Writes what each compiled graph went through into a dump directory.

Layout: <dump_dir>/graph_<id>/ holds
  00_dynamo_graph.py                  the graph Dynamo handed us
  <stage>.<pass>.<graph>.before.py    each pass's input, readable code
  <stage>.<pass>.<graph>.after.py     each pass's output
  aot_<forward|backward|inference>.py the graphs AOTAutograd handed Inductor
  inductor_<...>_code.py              Inductor's generated code
  report.json, report.md
and <dump_dir>/depyf/ holds depyf's decompiled Dynamo bytecode for each transformed frame.
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
_depyf_hooks: dict[str, Any] = {}


def install_depyf_hook(root: str) -> bool:
    """Write depyf's decompilation of every frame Dynamo transforms from now on (the current frame
    included: Dynamo calls bytecode hooks after the backend returns). Returns False without depyf."""
    root = os.path.abspath(root)
    with _depyf_lock:
        if root in _depyf_hooks:
            return True
        try:
            import depyf
            from torch._dynamo.convert_frame import register_bytecode_hook
        except ImportError:
            log.warning("hccompile: depyf is not installed; dumps will lack decompiled sources")
            return False
        out = os.path.join(root, "depyf")
        os.makedirs(out, exist_ok=True)
        counter = [0]

        def hook(old_code, new_code):
            idx = counter[0]
            counter[0] += 1
            name = f"__transformed_code_{idx}_for_{old_code.co_name}.py"
            try:
                src = depyf.decompile(new_code)
            except Exception as e:  # noqa: BLE001 - decompilation is advisory; never break compile
                src = f"# depyf could not decompile {old_code.co_name}: {e}\n"
            try:
                orig = depyf.decompile(old_code)
            except Exception:  # noqa: BLE001
                orig = None
            with open(os.path.join(out, name), "w") as f:
                f.write(src)
            if orig:
                with open(os.path.join(out, f"__original_code_{idx}_{old_code.co_name}.py"), "w") as f:
                    f.write(orig)
            return None

        _depyf_hooks[root] = register_bytecode_hook(hook)
        return True
