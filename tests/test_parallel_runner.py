"""tests/parallel.py, the multi-process pytest runner used on the GPU machine."""
import subprocess
import sys
from pathlib import Path

from parallel import deal

RUNNER = Path(__file__).with_name("parallel.py")


def test_deal_is_round_robin_and_drops_empty_groups():
    assert deal(list("abcde"), 2) == [["a", "c", "e"], ["b", "d"]]
    assert deal(["a"], 3) == [["a"]]


def run_runner(tmp_path, *args):
    return subprocess.run([sys.executable, str(RUNNER), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_runner_reports_every_worker_and_fails_when_one_fails(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('x', range(5))\n"
        "def test_square(x):\n"
        "    assert x * x >= 0\n"
        "def test_broken():\n"
        "    assert 1 == 2\n")
    result = run_runner(tmp_path, "-n", "3", "--log-dir", "logs", "test_sample.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "6 tests over 3 workers" in result.stdout
    assert result.stdout.count("worker ") == 3
    assert "FAILED test_sample.py::test_broken" in result.stdout
    ids = sorted(sum(((tmp_path / "logs" / f"worker{i}.ids").read_text().split() for i in range(3)), []))
    assert len(ids) == 6 and len(set(ids)) == 6

    (tmp_path / "test_sample.py").write_text("def test_ok():\n    pass\n")
    result = run_runner(tmp_path, "-n", "2", "test_sample.py", "--", "-x")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 tests over 1 workers" in result.stdout and "1 passed" in result.stdout
