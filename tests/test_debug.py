"""Dumps, reports, explain() and the log line."""
import json
import logging

import torch

import hccompile


def attn(q, k, v):
    return torch.tril(q @ k.transpose(-2, -1)) @ v


def softmax_attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), -1) @ v


def both(q, k, v):
    return attn(q, k, v) + softmax_attn(q, k, v)


def _inputs(grad=True):
    return [torch.randn(1, 2, 12, 8, requires_grad=grad) for _ in range(3)]


def test_dump_directory_contents(tmp_path):
    q, k, v = _inputs()
    out = torch.compile(both, backend="hc", options={"dump_dir": str(tmp_path)})(q, k, v)
    out.sum().backward()
    (g,) = tmp_path.glob("graph_*")  # ids count up across the process
    names = {p.name for p in g.iterdir()}
    for expected in ["00_dynamo_graph.py", "dynamo.linear_attn.dynamo.before.py",
                     "dynamo.linear_attn.dynamo.after.py", "aot_forward.py", "aot_backward.py",
                     "post_grad.op_inventory.forward.before.py", "post_grad.op_inventory.backward.after.py",
                     "inductor_forward_code.py", "inductor_backward_code.py", "report.json", "report.md"]:
        assert expected in names, sorted(names)
    before = (g / "dynamo.linear_attn.dynamo.before.py").read_text()
    after = (g / "dynamo.linear_attn.dynamo.after.py").read_text()
    assert "tril" in before and "hccompile.causal_linear_attn" not in before
    assert "hccompile.lightning_attn" in after
    assert "lightning_attn_backward" in (g / "aot_backward.py").read_text()

    report = json.loads((g / "report.json").read_text())
    la = [p for p in report["passes"] if p["name"] == "linear_attn"][0]
    assert la["changed"] and len(la["matches"]) == 1 and len(la["refusals"]) == 1
    assert "softmax" in la["refusals"][0]["reason"]
    assert report["lowered_ops"]["forward"] == ["hccompile.lightning_attn.default"]
    assert report["lowered_ops"]["backward"] == ["hccompile.lightning_attn_backward.default"]
    assert report["timings_s"]["inductor forward"] > 0
    md = (g / "report.md").read_text()
    assert "## Matched" in md and "## Refused" in md and "softmax" in md

    depyf_files = list((tmp_path / "depyf").glob("__transformed_code_*.py"))
    assert depyf_files, "depyf's decompiled Dynamo bytecode is missing"
    assert "__compiled_fn" in depyf_files[0].read_text()


def test_dump_via_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HCCOMPILE_DUMP", str(tmp_path))
    torch.compile(attn, backend="hc")(*_inputs(grad=False))
    (g,) = tmp_path.glob("graph_*")
    assert (g / "report.json").exists()


def test_explain_returns_report_without_dump_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = hccompile.explain(both, *_inputs())
    assert [m["pattern"] for m in report.matches] == ["causal_linear_attn"]
    assert any("softmax" in r["reason"] for r in report.refusals)
    g = report.graphs[0]
    assert g.lowered_ops.get("backward") == ["hccompile.lightning_attn_backward.default"] or \
        "backward" in g.cache_hits
    assert "## Matched" in str(report)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_info_log_line_per_graph(caplog):
    with caplog.at_level(logging.INFO, logger="hccompile"):
        torch.compile(attn, backend="hc")(*_inputs(grad=False))
    lines = [r.getMessage() for r in caplog.records if r.name == "hccompile" and r.levelno == logging.INFO]
    assert len(lines) == 1 and "matched causal_linear_attn×1" in lines[0] and "compile" in lines[0]


def _sine(x):
    return torch.sin(x) + 1


def _cosine(x):
    return torch.cos(x) * 2


def _tanh(x):
    return torch.tanh(x) - 1


def _exp(x):
    return torch.exp(x) / 3


def test_depyf_sources_only_for_the_compile_that_asked(tmp_path):
    """dump_dir's decompiled bytecode covers the frames compiled with that dump_dir, not every
    later compile of the process (the bytecode hook used to stay on for all of them, even for
    backend="inductor")."""
    first, second = tmp_path / "first", tmp_path / "second"
    x = torch.randn(4)
    torch.compile(_sine, backend="hc", options={"dump_dir": str(first)})(x)
    torch.compile(_cosine, backend="inductor")(x)
    torch.compile(_tanh, backend="hc")(x)
    torch.compile(_exp, backend="hc", options={"dump_dir": str(second)})(x)

    def written(root):
        return sorted(p.name for p in (root / "depyf").iterdir())

    assert written(first) == ["__original_code_0__sine.py", "__transformed_code_0_for__sine.py"]
    assert written(second) == ["__original_code_0__exp.py", "__transformed_code_0_for__exp.py"]
    assert len(list(first.glob("graph_*"))) == 1 and len(list(second.glob("graph_*"))) == 1
