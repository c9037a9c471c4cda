"""tests/parallel.py, the multi-process pytest runner used on the GPU machine."""
import json
import os
import subprocess
import sys
from pathlib import Path

from parallel import Durations, chunk, chunk_seconds, junit_key, longest_first, sharing_groups

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


def test_chunks_cut_by_expected_seconds_and_ordered_by_test_times():
    """A file of slow tests becomes several chunks; a test's own time beats its file's average; a
    test slower than the cut is a chunk of its own; the first durations format still reads."""
    durations = Durations(tests={"a.py::slow": 100.0, "a.py::t1": 10.0, "a.py::t2": 10.0, "b.py::t1": 1.0},
                          files={"a.py": 30.0, "b.py": 1.0})
    ids = ["a.py::t1", "a.py::slow", "a.py::t2", "a.py::t3", "b.py::t1", "b.py::t2"]
    assert durations.expected("a.py::t3") == 30.0 and durations.expected("c.py::x") == 30.0
    assert chunk(ids, 6, durations, 40.0) == [["a.py::t1"], ["a.py::slow"], ["a.py::t2", "a.py::t3"],
                                              ["b.py::t1", "b.py::t2"]]
    assert chunk(ids, 6) == [ids[:4], ids[4:]]                     # no durations: by count only
    assert chunk_seconds(ids, durations, 2) == (10 + 100 + 10 + 30 + 1 + 1) / 6
    assert chunk_seconds(ids, Durations(), 2) is None
    order = longest_first(chunk(ids, 6, durations, 40.0), durations)
    assert order[0] == ["a.py::slow"] and order[-1] == ["b.py::t1", "b.py::t2"]
    # across_files: a chunk goes on into the next file while the count and the seconds allow.
    assert chunk(ids, 6, durations, 40.0, across_files=True) == [["a.py::t1"], ["a.py::slow"],
                                                                 ["a.py::t2", "a.py::t3"], ["b.py::t1", "b.py::t2"]]
    assert chunk(ids, 6, durations, 45.0, across_files=True) == [["a.py::t1"], ["a.py::slow"],
                                                                 ["a.py::t2", "a.py::t3", "b.py::t1", "b.py::t2"]]
    assert chunk(ids, 3, across_files=True) == [ids[:3], ids[3:]]
    assert Durations(files={"a.py": 2.0}).expected("a.py::x") == 2.0


def test_tests_sharing_a_module_fixture_make_one_chunk():
    """Tests that share a module- or class-scoped fixture (directly or through a chain) stay in one
    chunk, whatever the size and seconds limits, placed at the first of them; the rest chunk as before."""
    shared = {"a.py::t1": [], "a.py::slow1": ["a.py::runs"], "a.py::t2": [], "a.py::slow2": ["a.py::runs"],
              "a.py::mixed": ["a.py::runs", "a.py::other"], "a.py::other": ["a.py::other"], "b.py::t1": []}
    groups = sharing_groups(shared)
    members = ["a.py::slow1", "a.py::slow2", "a.py::mixed", "a.py::other"]
    assert set(groups) == set(members) and all(groups[i] == members for i in members)
    assert sharing_groups({"a.py::x": ["a.py::f"], "a.py::y": []}) == {}   # one user: nothing to keep together
    ids = list(shared)
    durations = Durations(tests={"a.py::slow1": 100.0, "a.py::slow2": 100.0})
    assert chunk(ids, 2, durations, 40.0, groups=groups) == [["a.py::t1"], members, ["a.py::t2"], ["b.py::t1"]]
    assert chunk(ids, 2, groups=groups) == [["a.py::t1"], members, ["a.py::t2"], ["b.py::t1"]]
    assert chunk(ids, 2, across_files=True, groups=groups) == [["a.py::t1"], members, ["a.py::t2", "b.py::t1"]]
    # a group member outside the ids given (the multi-GPU tests are chunked apart) stays out
    assert chunk(["a.py::slow1", "a.py::slow2"], 6, groups=groups) == [["a.py::slow1", "a.py::slow2"]]


def test_a_shared_module_fixture_is_built_once(tmp_path):
    """End to end: the collection finds the module-scoped fixture (not a function-scoped or autouse one)
    and its users run in one process, so it is built once; the other tests are chunked by size."""
    (tmp_path / "test_shared.py").write_text(
        "import os, pytest\n"
        "@pytest.fixture(scope='module')\n"
        "def runs():\n"
        "    with open(os.environ['BUILT'], 'a') as f:\n"
        "        f.write('built\\n')\n"
        "    return 1\n"
        "@pytest.fixture(scope='module', autouse=True)\n"
        "def everywhere():\n"
        "    return 2\n"
        "@pytest.fixture\n"
        "def each():\n"
        "    return 3\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_uses(runs, i):\n"
        "    assert runs == 1\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_plain(each, i):\n"
        "    assert each == 3\n")
    built = tmp_path / "built.txt"
    result = run_runner(tmp_path, "-n", "3", "--chunk", "1", "--log-dir", "logs", "test_shared.py",
                        env={"BUILT": str(built)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8 tests in 5 chunks over 3 workers" in result.stdout, result.stdout
    assert built.read_text().split() == ["built"]


def test_durations_files_read_both_formats(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"a.py": 3.0}))
    assert Durations.read(old) == Durations(files={"a.py": 3.0})
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"files": {"a.py": 3.0}, "tests": {"a.py::t": 7.5}}))
    assert Durations.read(new).expected("a.py::t") == 7.5
    assert not Durations.read(tmp_path / "absent.json")


def run_runner(tmp_path, *args, env=None, drop=()):
    environment = {name: value for name, value in os.environ.items() if name not in drop}
    return subprocess.run([sys.executable, str(RUNNER), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**environment, **(env or {})})


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
    assert list(durations["files"]) == ["test_sample.py"] and durations["files"]["test_sample.py"] > 0
    assert "test_sample.py::test_square[0]" in durations["tests"]

    # each worker compiles in its own process: no Inductor compile pool per worker, and torch's CPU
    # threads are the machine's cores shared over the workers
    (tmp_path / "test_sample.py").write_text(
        "import os\ndef test_ok():\n    assert os.environ['TORCHINDUCTOR_COMPILE_THREADS'] == '1'\n"
        "    assert int(os.environ['OMP_NUM_THREADS']) == max(1, (os.cpu_count() or 1) // 1)\n")
    result = run_runner(tmp_path, "-n", "2", "test_sample.py", "--", "-x", drop=("OMP_NUM_THREADS",))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 tests in 1 chunks over 1 workers" in result.stdout and "1 passed" in result.stdout


def test_a_killed_chunk_keeps_the_outcomes_its_progress_line_shows(tmp_path):
    """A chunk past --chunk-timeout writes no JUnit file: the tests its progress line reported keep
    their outcome, the one running is an error that says so, the rest were not run."""
    (tmp_path / "test_slow.py").write_text(
        "import time, pytest\n"
        "def test_a():\n    pass\n"
        "def test_b():\n    assert 1 == 2\n"
        "def test_c():\n    pytest.skip('no')\n"
        "def test_hangs():\n    time.sleep(600)\n"
        "def test_after():\n    pass\n")
    report = tmp_path / "suite.txt"
    result = run_runner(tmp_path, "-n", "1", "--chunk", "10", "--chunk-timeout", "20", "--log-dir", "logs",
                        "--report", str(report), "--commit", "abc123", "test_slow.py")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = report.read_text().splitlines()
    assert any(line.startswith("FAILED test_slow.py::test_b - ") for line in lines), lines
    assert any(line.startswith("SKIPPED test_slow.py::test_c - ") for line in lines), lines
    assert any(line.startswith("ERROR test_slow.py::test_hangs - running when chunk 0 was killed after 20 s")
               for line in lines), lines
    assert any(line.startswith("ERROR test_slow.py::test_after - not run: ") for line in lines), lines
    assert lines[-1].startswith("1 passed, 1 skipped, 1 failed, 2 errors in "), lines[-1]


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


def test_multi_gpu_tests_see_every_gpu(tmp_path):
    """A test marked multi_gpu runs in a chunk that sees the GPUs as inherited; the others see one."""
    (tmp_path / "test_multi.py").write_text(
        "import os, pytest\n"
        "def record(name):\n"
        "    with open(os.environ['SEEN'], 'a') as f:\n"
        "        f.write(name + '=' + os.environ.get('CUDA_VISIBLE_DEVICES', '-') + '\\n')\n"
        "@pytest.mark.multi_gpu\n"
        "def test_both():\n"
        "    record('both')\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_one(i):\n"
        "    record('one')\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    multi_gpu: several GPUs\n")
    seen = tmp_path / "seen.txt"
    result = run_runner(tmp_path, "-n", "2", "--gpus", "2", "test_multi.py",
                        env={"SEEN": str(seen), "CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = seen.read_text().split()
    assert lines.count("both=0,1") == 1 and len(lines) == 4
    assert all(line in ("one=0", "one=1") for line in lines if line.startswith("one")), lines
