"""The `hccompile` console script: --version, help, doctor, explain, bench, and one-line errors for
bad arguments (issue 23). In-process through hccompile.cli.main, plus one run of the real entry."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from hccompile import cli, doctor

ROOT = pathlib.Path(__file__).parents[1]


def run_cli(argv, capsys):
    """(exit status, stdout, stderr) of hccompile.cli.main(argv), SystemExit included."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_version_and_help(capsys):
    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.startswith("hccompile 0.1.0 (torch ") and torch.__version__ in out
    rc, out, _ = run_cli(["--help"], capsys)
    assert rc == 0
    for command in ("demo", "doctor", "explain", "bench"):
        assert re.search(rf"^  {command} +\S", out, flags=re.M), out
        rc, sub, _ = run_cli([command, "--help"], capsys)
        assert rc == 0 and sub.startswith(f"usage: hccompile {command}"), sub
    rc, _, err = run_cli([], capsys)
    assert rc == 2 and "commands:" in err


def test_every_option_has_help(capsys):
    for command in ("demo", "doctor", "explain", "bench"):
        _, text, _ = run_cli([command, "--help"], capsys)
        options = text[text.index("options:"):]
        # an option line without help text ends at its metavar: "  --seq SEQ"
        bare = [line for line in options.splitlines()
                if re.fullmatch(r"\s+(-\S+)( [A-Z_:]+)?(, -\S+( [A-Z_:]+)?)?", line)]
        assert not bare, (command, bare)


BAD = [
    (["frob"], "hccompile: error: unknown command 'frob'"),
    (["demo", "--seq", "0"], "hccompile demo: error: argument --seq: must be at least 1, got 0"),
    (["demo", "--iters", "x"], "hccompile demo: error: argument --iters: expected a positive integer, got 'x'"),
    (["demo", "--dim", "30", "--heads", "4"], "hccompile demo: error: --dim 30 is not a multiple of --heads 4"),
    (["demo", "--device", "mps"], "hccompile demo: error: argument --device: 'mps': hccompile runs on cpu or cuda"),
    (["demo", "--device", "nonsense"], "hccompile demo: error: argument --device: not a device"),
    (["explain"], "hccompile explain: error: the following arguments are required"),
    (["explain", "no_such_file.py:model"], "hccompile explain: error: no such file: no_such_file.py"),
    (["explain", "no_such_module_xyz:model"], "hccompile explain: error: no module named 'no_such_module_xyz'"),
    (["explain", "model"], "hccompile explain: error: expected FILE.py:ATTR or module:ATTR"),
    (["explain", "hccompile.nn:NoSuchModel"], "hccompile explain: error: hccompile.nn has no attribute"),
    (["bench", "--ops", "linear,foo"], "hccompile bench: error: --ops: unknown foo"),
    (["bench", "--seq", "-4"], "hccompile bench: error: argument --seq: must be at least 1, got -4"),
    (["bench", "--dim", "512"], "hccompile bench: error: --dim: at most 256"),
    (["doctor", "--bogus"], "hccompile doctor: error: unrecognized arguments: --bogus"),
]
if not torch.cuda.is_available():
    BAD += [(["demo", "--device", "cuda"], "hccompile demo: error: argument --device: 'cuda': CUDA is not "
                                          "available here"),
            (["bench", "--device", "cuda:0"], "hccompile bench: error: argument --device: 'cuda:0': CUDA is not "
                                             "available here")]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_give_one_line(argv, message, capsys):
    rc, out, err = run_cli(argv, capsys)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(message), err


def test_console_entry_runs_without_traceback():
    """The real entry (python -m hccompile = the console script's main): a bad argument exits 2 with
    one line on stderr, before any model is built."""
    r = subprocess.run([sys.executable, "-m", "hccompile", "demo", "--seq", "0"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("hccompile demo: error: argument --seq")
    r = subprocess.run([sys.executable, "-m", "hccompile", "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("hccompile 0.1.0")


# ----------------------------------------------------------------------------------------
# doctor


def test_doctor_reports_this_machine(capsys):
    rc, out, _ = run_cli(["doctor"], capsys)
    assert rc == 0, out
    assert re.search(rf"^OK +torch +{re.escape(torch.__version__)} \(supported: >=2\.11,<2\.16\)", out, re.M)
    assert re.search(r"^OK +Python +3\.", out, re.M)
    assert re.search(r"^OK +NumPy", out, re.M) or re.search(r"NumPy +not installed", out)
    for family, module in doctor.FAMILIES:
        impl = __import__(module, fromlist=["implementation"]).implementation(
            "cuda" if torch.cuda.is_available() else "cpu",
            torch.bfloat16 if torch.cuda.is_available() else torch.float32)
        assert re.search(rf"^OK +{re.escape(family)} +{impl} on ", out, re.M), (family, out)
    if not torch.cuda.is_available():
        assert re.search(r"^INFO +GPU +no GPU", out, re.M)
    else:
        assert re.search(r"^OK +GPU 0 +.*compute capability \d+\.\d+", out, re.M)
    assert re.search(r'^OK +backend "hc" +registered', out, re.M)
    assert out.rstrip().splitlines()[-1].startswith("hccompile can run here")

    rc, out, _ = run_cli(["doctor", "--json"], capsys)
    facts = json.loads(out)
    assert rc == 0 and facts["facts"]["torch"] == torch.__version__ and facts["checks"]


def test_doctor_fails_on_unsupported_versions_and_warns_on_known_problems(capsys, monkeypatch):
    import numpy

    from hccompile.kernels import _triton

    if _triton.triton is None:
        pytest.skip("needs Triton")
    monkeypatch.setattr(doctor, "TESTED_RANGES", {"torch": ">=99.0,<100", "triton": ">=3.6,<3.10"})
    monkeypatch.setattr(_triton.triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.1")
    rc, out, _ = run_cli(["doctor"], capsys)
    assert rc == 1
    assert re.search(r"^FAIL +torch +.* is older than supported \(>=99\.0,<100\)", out, re.M)
    assert re.search(r"^WARN +Triton interpreter \+ NumPy +Triton 3\.6\.0's interpreter fails with NumPy "
                     r"2\.4\.1 \(triton-lang/triton#9171\)", out, re.M)
    assert out.rstrip().splitlines()[-1] == "broken: torch"

    monkeypatch.setattr(doctor, "TESTED_RANGES", {"torch": ">=2.11,<2.12", "triton": ">=3.6,<3.10"})
    checks, _ = doctor.gather()
    (torch_check,) = [c for c in checks if c.name == "torch"]
    if doctor.version_tuple(torch.__version__) >= (2, 12):
        assert torch_check.status == "WARN" and "newer than tested" in torch_check.detail


def test_tested_ranges_match_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    for name, spec in doctor.TESTED_RANGES.items():
        assert re.search(rf'"{name}{re.escape(spec)}"', text), (name, spec)


def test_version_ranges():
    assert doctor.in_range((2, 13, 0), ">=2.11,<2.16") and not doctor.in_range((2, 16, 0), ">=2.11,<2.16")
    assert not doctor.in_range((2, 10, 1), ">=2.11,<2.16") and doctor.version_tuple("2.13.0+cpu") == (2, 13, 0)
    assert doctor.version_tuple("3.8.0.dev20260101") == (3, 8, 0)


# ----------------------------------------------------------------------------------------
# explain

MODEL_FILE = '''
import torch

class Attn(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.tril(q @ k.transpose(-2, -1)) @ v

def example_inputs():
    return tuple(torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
'''

FACTORY_FILE = '''
import torch

def build():
    def attn(q, k, v):
        return torch.tril(q @ k.transpose(-2, -1)) @ v
    return attn, [torch.randn(1, 2, 16, 8) for _ in range(3)]

def not_a_pair():
    return 3

def broken():
    raise RuntimeError("weights not found\\nmore detail")

class Wrong(torch.nn.Module):
    def forward(self, x):
        return x @ torch.ones(3, 3)

def wrong_inputs():
    return (torch.ones(2, 4),)
'''


def test_explain_a_file_with_example_inputs(tmp_path, capsys):
    path = tmp_path / "cli_model_a.py"
    path.write_text(MODEL_FILE)
    rc, out, err = run_cli(["explain", f"{path}:Attn"], capsys)
    assert rc == 0, err
    assert "## Matched" in out and "causal_linear_attn" in out
    assert "- backward: hccompile.lightning_attn_backward.default" in out


def test_explain_a_module_factory_as_json(tmp_path, capsys, monkeypatch):
    (tmp_path / "cli_factory_b.py").write_text(FACTORY_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, out, err = run_cli(["explain", "cli_factory_b:build", "--json", "--no-backward", "-o", "strict=True"],
                           capsys)
    assert rc == 0, err
    report = json.loads(out)
    (graph,) = report["graphs"]
    assert "causal_linear_attn" in json.dumps(graph)


def test_explain_failures_are_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "cli_factory_c.py").write_text(FACTORY_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, _, err = run_cli(["explain", "cli_factory_c:not_a_pair"], capsys)
    assert rc == 2 and err.startswith("hccompile explain: error: cli_factory_c:not_a_pair() returned int")
    rc, _, err = run_cli(["explain", "cli_factory_c:broken"], capsys)
    assert rc == 1 and err == ("hccompile explain: loading cli_factory_c:broken failed: RuntimeError: weights not "
                               "found (--traceback for the traceback)\n")
    rc, _, err = run_cli(["explain", "cli_factory_c:Wrong", "--inputs", "wrong_inputs"], capsys)
    assert rc == 1 and err.startswith("hccompile explain: compiling failed: ") and err.count("\n") == 1, err
    with pytest.raises(RuntimeError, match="weights not found"):
        cli.main(["explain", "cli_factory_c:broken", "--traceback"])


# ----------------------------------------------------------------------------------------
# bench


def test_bench_table_and_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    rc, out, err = run_cli(["bench", "--ops", "linear,gdn", "--seq", "16", "--heads", "2", "--dim", "8",
                            "--iters", "1", "--json", str(path)], capsys)
    assert rc == 0, err
    assert re.findall(r"^\[\d/4\] (\w+): (\w+)", err, flags=re.M) == [
        ("linear", "plain"), ("linear", "hccompile"), ("gdn", "plain"), ("gdn", "hccompile")]
    assert "| op | implementation | fwd+bwd (ms) |" in out
    assert re.search(r"^\| gdn \| hccompile \(\S+\) \| [\d.]+ \| .* \| [\d.]+x \| [\d.e+-]+ \|$", out, re.M), out
    result = json.loads(path.read_text())
    assert [(r["op"], r["impl"]) for r in result["rows"]] == [
        ("linear", "plain"), ("linear", "hccompile"), ("gdn", "plain"), ("gdn", "hccompile")]
    # against eager PyTorch in the same dtype: bfloat16 on CUDA (both sides round), float32 on the CPU
    bound = 1e-3 if result["dtype"] == "float32" else 2e-2
    errs = {r["op"]: r["rel_err"] for r in result["rows"] if r["impl"] == "hccompile"}
    assert all(e < bound for e in errs.values()), (result["dtype"], errs)
