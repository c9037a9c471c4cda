"""tests/parallel.py, the multi-process pytest runner used on the GPU machine."""
import json
import os
import subprocess
import sys
from pathlib import Path

from parallel import chunk, junit_key, longest_first

RUNNER = Path(__file__).with_name("parallel.py")


def test_chunks_keep_one_file_and_a_size_limit():
    ids = ["a.py::t1", "a.py::t2", "a.py::t3", "b.py::t1", "c.py::K::t[x]"]
    assert chunk(ids, 2) == [["a.py::t1", "a.py::t2"], ["a.py::t3"], ["b.py::t1"], ["c.py::K::t[x]"]]
    assert junit_key("tests/kernels/test_x.py::TestA::test_b[1-2]") == ("tests.kernels.test_x.TestA", "test_b[1-2]")
    # longest expected first; the unknown file c.py counts as the slowest on record (30 s per test):
    # c's 3 tests (90 s), then a's and c's single tests (30 s each), then b's 2 x 5 s
    groups = [["a.py::1"], ["b.py::1", "b.py::2"], ["c.py::1", "c.py::2", "c.py::3"], ["c.py::4"]]
    order = longest_first(groups, {"a.py": 30.0, "b.py": 5.0})
    assert order[0] == groups[2] and order[-1] == groups[1], order
    assert longest_first(groups, {"a.py": 0.1, "b.py": 0.2, "c.py": 9.0})[0] == groups[2]
    assert longest_first(groups, {}) == [groups[2], groups[1], groups[0], groups[3]]


def run_runner(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, str(RUNNER), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_runner_reports_every_outcome_and_fails_when_one_fails(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('x', range(5))\n"
        "def test_square(x):\n"
        "    assert x * x >= 0\n"
        "def test_broken():\n"
        "    assert 1 == 2\n"
        "@pytest.fixture\n"
        "def bad():\n"
        "    raise RuntimeError('setup broke')\n"
        "def test_setup_error(bad):\n"
        "    pass\n"
        "def test_skipped():\n"
        "    pytest.skip('no widget here')\n"
        "def test_crash():\n"
        "    os._exit(3)\n")
    report = tmp_path / "out" / "suite.txt"
    result = run_runner(tmp_path, "-n", "3", "--chunk", "2", "--log-dir", "logs", "--report", str(report),
                        "--commit", "abc123", "test_sample.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "9 tests in 5 chunks over 3 workers" in result.stdout
    assert "FAILED test_sample.py::test_broken" in result.stdout
    ids = sorted(sum(((tmp_path / "logs" / f"chunk{i:04d}.ids").read_text().split() for i in range(5)), []))
    assert len(ids) == 9 and len(set(ids)) == 9
    lines = report.read_text().splitlines()
    assert lines[0].startswith("commit abc123 ") and " torch " in lines[0] and " triton " in lines[0]
    assert any(line.startswith("FAILED test_sample.py::test_broken - ") for line in lines)
    assert any(line.startswith("ERROR test_sample.py::test_setup_error - ") for line in lines)
    assert any(line.startswith("SKIPPED test_sample.py::test_skipped - ") and "no widget here" in line
               for line in lines)
    # a crash leaves no JUnit file: its tests count as errors, none is lost
    crashed = [line for line in lines if line.startswith("ERROR") and "exited with code 3" in line]
    assert any("test_crash" in line for line in crashed), lines
    assert lines[-1].startswith("5 passed, 1 skipped, 1 failed, 2 errors in "), lines[-1]
    durations = json.loads((tmp_path / "logs" / "durations.json").read_text())
    assert list(durations) == ["test_sample.py"] and durations["test_sample.py"] > 0

    # each worker compiles in its own process: no Inductor compile pool per worker
    (tmp_path / "test_sample.py").write_text(
        "import os\ndef test_ok():\n    assert os.environ['TORCHINDUCTOR_COMPILE_THREADS'] == '1'\n")
    result = run_runner(tmp_path, "-n", "2", "test_sample.py", "--", "-x")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 tests in 1 chunks over 1 workers" in result.stdout and "1 passed" in result.stdout


def test_workers_spread_over_the_gpus(tmp_path):
    """--gpus N: worker i sees only GPU i mod N (each test then runs on its process's cuda:0);
    without it the inherited CUDA_VISIBLE_DEVICES stays."""
    (tmp_path / "test_gpus.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_which(i):\n"
        "    with open(os.environ['SEEN'], 'a') as f:\n"
        "        f.write(os.environ.get('CUDA_VISIBLE_DEVICES', '-') + '\\n')\n")
    seen = tmp_path / "seen.txt"
    env_patch = {"SEEN": str(seen), "CUDA_VISIBLE_DEVICES": "inherited"}
    result = run_runner(tmp_path, "-n", "4", "--chunk", "1", "--gpus", "2", "test_gpus.py", env=env_patch)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(set(seen.read_text().split())) == ["0", "1"]
    seen.unlink()
    result = run_runner(tmp_path, "-n", "4", "--chunk", "1", "test_gpus.py", env=env_patch)
    assert result.returncode == 0, result.stdout + result.stderr
    assert set(seen.read_text().split()) == {"inherited"}
