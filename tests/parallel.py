"""Run pytest over several worker processes and write one report of the whole run.

On the GPU machine most of a kernel test's time is Triton compiling its specialisations (about
20 s per delta-rule case), which is CPU work: N processes compile N cases at once. The test ids are
collected once, cut into small chunks (neighbouring ids of one file stay together, so a chunk reuses
the kernels it compiled), and a pool of N workers takes the next chunk whenever one finishes, so a
slow chunk does not hold back the rest. A crash (an illegal memory access ends a CUDA process)
costs only its chunk: its unreported tests count as errors. Usage, from the repository root:

    python tests/parallel.py -n 8 tests/kernels/test_delta_rule_chunk.py tests/test_delta_rule_ops.py
    python tests/parallel.py -n 4 tests/kernels -- -m gpu        # after --: options for every worker
    python tests/parallel.py -n 12 --gpu-memory-gib 5.5 --report suite.txt --commit SHA tests
    python tests/parallel.py -n 28 --gpus 2 tests                # worker i sees only GPU i mod 2,
                                                                 # a multi_gpu test sees both

With --gpu-memory-gib each worker's CUDA caching allocator is capped at that many GiB
(HCCOMPILE_TEST_GPU_MEMORY_GIB, read by tests/conftest.py): the stated bound every test must fit.
--report writes the suite file: first line `commit <sha> <UTC date> <device> torch <v> triton <v>`,
one line per failure, error and skip (with its reason), last line the summary.
Exits non-zero if any test failed or errored. Full logs: <log-dir>/worker<i>.log.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path


# Written next to the collection's logs and loaded with -p: it lists each collected id with its
# markers, so one collection gives both the ids and the multi_gpu ones.
_MARKERS_PLUGIN = """
import json, os
def shared_fixtures(item):
    # the module- and class-scoped fixtures the test function asks for by name, keyed by instance
    keys = []
    for name in getattr(getattr(item, "_fixtureinfo", None), "argnames", ()):
        defs = item._fixtureinfo.name2fixturedefs.get(name) or ()
        scope = str(getattr(defs[-1], "scope", "")) if defs else ""
        if scope.endswith("module"):
            keys.append(item.nodeid.split("::")[0] + "::" + name)
        elif scope.endswith("class"):
            keys.append(item.nodeid.rsplit("::", 1)[0] + "::" + name)
    return keys
def pytest_collection_finish(session):
    with open(os.environ["PARALLEL_COLLECTED"], "w") as f:
        json.dump([[item.nodeid, sorted({m.name for m in item.iter_markers()}), shared_fixtures(item)]
                   for item in session.items], f)
"""


def collect(paths: list[str], extra: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """{test id: (its marker names, the module/class fixtures it shares)}, in collection order."""
    with tempfile.TemporaryDirectory(prefix="parallel-collect-") as folder:
        (Path(folder) / "parallel_collect_plugin.py").write_text(_MARKERS_PLUGIN)
        listing = Path(folder) / "collected.json"
        env = {**os.environ, "PARALLEL_COLLECTED": str(listing),
               "PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))}
        result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 "-p", "parallel_collect_plugin", *extra, *paths],
                                capture_output=True, text=True, env=env)
        if result.returncode == 5:  # pytest's "no tests collected"
            return {}
        if result.returncode != 0 or not listing.exists():
            raise SystemExit(f"collection failed (exit {result.returncode}):\n{result.stdout[-3000:]}"
                             f"{result.stderr[-3000:]}")
        return {test_id: (markers, shared) for test_id, markers, shared in json.loads(listing.read_text())}


def file_of(test_id: str) -> str:
    return test_id.split("::")[0]


@dataclass
class Durations:
    """Seconds of an earlier run: per test id (its JUnit time) and per test of each file (a chunk's
    wall time over its test count, process start included), for ids the run did not have. A file
    without a record counts as the slowest file on record: new files are often slow (on the H100,
    2026-11-25, the unrecorded client tests ran last and left a ~100 s tail)."""
    tests: dict[str, float] = field(default_factory=dict)
    files: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, path: str | Path | None) -> "Durations":
        if not path or not Path(path).exists():
            return cls()
        data = json.loads(Path(path).read_text())
        if "files" in data or "tests" in data:
            return cls(tests=data.get("tests", {}), files=data.get("files", {}))
        return cls(files=data)   # the first format: {file: seconds per test}

    def expected(self, test_id: str) -> float:
        if test_id in self.tests:
            return self.tests[test_id]
        return self.files.get(file_of(test_id), max(self.files.values(), default=1.0))

    def __bool__(self) -> bool:
        return bool(self.tests or self.files)


def sharing_groups(shared: dict[str, list[str]]) -> dict[str, list[str]]:
    """{test id: every id (in collection order) that shares a module- or class-scoped fixture with it,
    directly or through another}, for the ids that share one. `shared`: {test id: fixture keys}."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x
    for test_id, keys in shared.items():
        for key in keys:
            parent[root(test_id)] = root("fixture " + key)
    members: dict[str, list[str]] = {}
    for test_id in shared:
        if shared[test_id]:
            members.setdefault(root(test_id), []).append(test_id)
    return {test_id: group for group in members.values() if len(group) > 1 for test_id in group}


def chunk(ids: list[str], size: int, durations: Durations | None = None,
          seconds: float | None = None, across_files: bool = False,
          groups: dict[str, list[str]] | None = None) -> list[list[str]]:
    """Consecutive ids of one file (of several with across_files: fewer processes to start, each
    importing torch and compiling anew), at most `size` per chunk, in collection order. With `durations`
    and `seconds`, a chunk also closes before its expected time would pass `seconds`: a file of slow
    tests becomes several chunks that run at once instead of one that ends the run alone (on two
    H200s, 2026-11-27, six test_hc_fuse tests made one 1018 s chunk, the run's last).

    `groups` (sharing_groups): tests that share a module-scoped fixture make one chunk of their own,
    whatever its size and time, placed where the first of them is: split, each process would build
    the fixture again (on the H200, 2026-11-29, test_hc_passes' mhc_runs was built three times,
    ~250 s each)."""
    groups = groups or {}
    chunks: list[list[str]] = []
    spent = 0.0
    present, placed, closed = set(ids), set(), False
    for test_id in ids:
        if test_id in groups:
            if test_id not in placed:
                members = [i for i in groups[test_id] if i in present]
                placed.update(members)
                chunks.append(members)
                closed = True  # the next test starts a chunk
            continue
        cost = durations.expected(test_id) if durations and seconds else 0.0
        joins = chunks and not closed and (across_files or file_of(chunks[-1][0]) == file_of(test_id))
        closed = False
        if joins and len(chunks[-1]) < size and (not seconds or spent + cost <= seconds):
            chunks[-1].append(test_id)
            spent += cost
        else:
            chunks.append([test_id])
            spent = cost
    return chunks


def longest_first(chunks: list[list[str]], durations: Durations | dict[str, float]) -> list[list[str]]:
    """Chunks in decreasing expected time, so that the slowest start first and none is left alone at
    the end (a greedy longest-processing-time schedule)."""
    if not isinstance(durations, Durations):
        durations = Durations(files=durations)

    def expected(group: list[str]) -> float:
        return sum(durations.expected(test_id) for test_id in group)
    return sorted(chunks, key=expected, reverse=True)


def chunk_seconds(ids: list[str], durations: Durations, workers: int) -> float | None:
    """The time a chunk may be expected to take: a third of a worker's share of the whole run, so that
    the schedule can even out; a test slower than that is a chunk of its own."""
    if not durations:
        return None
    return sum(durations.expected(test_id) for test_id in ids) / (3 * workers)


def junit_key(test_id: str) -> tuple[str, str]:
    """(classname, name) as pytest's JUnit XML spells the test `test_id`."""
    path, *parts = test_id.split("::")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("/", "."), *parts[:-1]]), parts[-1]


@dataclass
class Outcome:
    test_id: str
    status: str            # passed, failed, error, skipped
    message: str = ""
    seconds: float | None = None   # JUnit's time (setup, call and teardown); None: no JUnit record


def read_junit(xml_path: Path, ids: list[str]) -> dict[str, Outcome]:
    """Outcomes of `ids` found in one worker's JUnit file (missing ones are left out)."""
    if not xml_path.exists():
        return {}
    try:
        root = ElementTree.parse(xml_path).getroot()
    except ElementTree.ParseError:
        return {}
    wanted = {junit_key(i): i for i in ids}
    outcomes: dict[str, Outcome] = {}
    for case in root.iter("testcase"):
        test_id = wanted.get((case.get("classname", ""), case.get("name", "")))
        if test_id is None:
            continue
        status, message = "passed", ""
        for tag in ("skipped", "failure", "error"):   # later tags win: an error in teardown after a failure
            element = case.find(tag)
            if element is not None:
                status = {"skipped": "skipped", "failure": "failed", "error": "error"}[tag]
                text_lines = (element.text or "").strip().splitlines()
                message = element.get("message") or (text_lines[-1] if text_lines else "")
        try:
            seconds = float(case.get("time", 0.0))
        except ValueError:
            seconds = 0.0
        outcomes[test_id] = Outcome(test_id, status, " ".join(message.split())[:300], seconds)
    return outcomes


_PROGRESS = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?$")
_PROGRESS_STATUS = {".": "passed", "F": "failed", "E": "error", "s": "skipped", "x": "skipped", "X": "passed"}


def read_progress(log_text: str, ids: list[str], why: str) -> dict[str, Outcome]:
    """Outcomes of a chunk killed before pytest wrote its JUnit file, from its `-q` progress lines in
    the worker's log (one character per test, in order; other lines, such as a faulthandler dump, are
    skipped): the tests it reported keep their outcome, the next one was running (an error, `why`),
    the rest never ran."""
    marks = "".join(m.group(1) for m in map(_PROGRESS.match, log_text.splitlines()) if m)
    outcomes = {test_id: Outcome(test_id, _PROGRESS_STATUS[mark], "from the progress line of a killed chunk")
                for test_id, mark in zip(ids, marks)}
    for position, test_id in enumerate(ids[len(marks):]):
        outcomes[test_id] = Outcome(test_id, "error", why if position == 0 else f"not run: {why}")
    return outcomes


@dataclass
class Run:
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done_chunks: int = 0
    file_seconds: dict[str, float] = field(default_factory=dict)   # wall time of each file's chunks
    file_tests: dict[str, int] = field(default_factory=dict)

    def durations(self) -> dict[str, dict[str, float]]:
        """What the next run's --durations reads (see Durations)."""
        return {"files": {f: round(self.file_seconds[f] / self.file_tests[f], 2) for f in sorted(self.file_seconds)},
                "tests": {i: round(o.seconds, 2) for i, o in sorted(self.outcomes.items()) if o.seconds is not None}}


def worker_env(env: dict[str, str], slot: int, gpus: int) -> dict[str, str]:
    """Worker `slot`'s environment: with several GPUs, only GPU slot mod gpus is visible to it, so the
    workers (each a whole suite's worth of CUDA contexts and compiles) spread evenly over the cards and
    every test still runs on its process's cuda:0."""
    if gpus <= 1:
        return env
    return {**env, "CUDA_VISIBLE_DEVICES": str(slot % gpus)}


def run_chunks(chunks: list[list[str]], workers: int, extra: list[str], log_dir: Path, env: dict[str, str],
               chunk_timeout: float, total: int, gpus: int = 1, every_gpu: frozenset[str] = frozenset()) -> Run:
    """Runs the chunks over `workers` processes; a chunk of ids in `every_gpu` sees all the GPUs."""
    work: queue.Queue = queue.Queue()
    for index, group in enumerate(chunks):
        work.put((index, group))
    run = Run()
    start = time.monotonic()

    def worker(slot: int) -> None:
        slot_env = worker_env(env, slot, gpus)
        with open(log_dir / f"worker{slot}.log", "a") as log:
            while True:
                try:
                    index, group = work.get_nowait()
                except queue.Empty:
                    return
                xml = log_dir / f"chunk{index:04d}.xml"
                (log_dir / f"chunk{index:04d}.ids").write_text("\n".join(group) + "\n")
                log.write(f"\n===== chunk {index}: {len(group)} tests =====\n")
                log.flush()
                command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
                           f"--junitxml={xml}", *extra, *group]
                log_path = log_dir / f"worker{slot}.log"
                began, log_start = time.monotonic(), log_path.stat().st_size
                try:
                    code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                          env=env if group[0] in every_gpu else slot_env,
                                          timeout=chunk_timeout).returncode
                    why = f"worker exited with code {code} before reporting this test (see worker{slot}.log)"
                    found = read_junit(xml, group)
                except subprocess.TimeoutExpired:
                    why = (f"running when chunk {index} was killed after {chunk_timeout:.0f} s "
                           f"(see worker{slot}.log)")
                    log.flush()
                    with open(log_path, "rb") as text:
                        text.seek(log_start)
                        found = read_progress(text.read().decode(errors="replace"), group, why)
                with run.lock:
                    test_file = file_of(group[0])
                    run.file_seconds[test_file] = run.file_seconds.get(test_file, 0.0) + time.monotonic() - began
                    run.file_tests[test_file] = run.file_tests.get(test_file, 0) + len(group)
                    for test_id in group:
                        run.outcomes[test_id] = found.get(test_id) or Outcome(test_id, "error", why)
                    run.done_chunks += 1
                    bad = sum(o.status in ("failed", "error") for o in run.outcomes.values())
                    print(f"[{time.monotonic() - start:6.0f} s] {len(run.outcomes)}/{total} tests, "
                          f"{run.done_chunks}/{len(chunks)} chunks, {bad} failed or errors", flush=True)

    threads = [threading.Thread(target=worker, args=(slot,)) for slot in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return run


def summary(outcomes: list[Outcome], seconds: float) -> str:
    count = {status: sum(o.status == status for o in outcomes) for status in ("passed", "skipped", "failed", "error")}
    return (f"{count['passed']} passed, {count['skipped']} skipped, {count['failed']} failed, "
            f"{count['error']} errors in {seconds:.0f} s")


def environment_line(commit: str) -> str:
    probe = ("import torch, triton; d = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'; "
             "print(d.replace(' ', '_'), torch.__version__, triton.__version__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split()
    device, torch_version, triton_version = (out + ["unknown"] * 3)[:3]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"commit {commit} {date} {device} torch {torch_version} triton {triton_version}"


def write_report(path: Path, commit: str, outcomes: list[Outcome], seconds: float, workers: int,
                 memory_gib: float | None) -> None:
    lines = [environment_line(commit),
             f"# {workers} workers" + (f", GPU memory bound {memory_gib} GiB per worker" if memory_gib else "")]
    order = {"failed": 0, "error": 1, "skipped": 2}
    for o in sorted((o for o in outcomes if o.status != "passed"), key=lambda o: (order[o.status], o.test_id)):
        lines.append(f"{o.status.upper()} {o.test_id} - {o.message}")
    lines.append(summary(outcomes, seconds))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--workers", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=6, help="tests per pytest process (default 6)")
    parser.add_argument("--chunk-timeout", type=float, default=1800, help="seconds before a chunk is killed")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="cap each worker's CUDA allocator at this many GiB")
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs to spread the workers over: worker i sees only GPU i mod N (default 1: "
                             "CUDA_VISIBLE_DEVICES as inherited)")
    parser.add_argument("--report", default=None, help="write the suite report to this file")
    parser.add_argument("--commit", default=None, help="the commit the tree holds (required with --report)")
    parser.add_argument("--durations", default=None,
                        help="JSON of an earlier run's seconds per test (each run writes its own to "
                             "<log-dir>/durations.json): chunks are cut to even expected times and the "
                             "slowest start first")
    parser.add_argument("--across-files", action="store_true",
                        help="chunks may hold tests of consecutive files (the CPU suite: 29 processes instead "
                             "of 58 on its 2026-11-27 times; the GPU suite too, where each process start costs ~27 s)")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("paths", nargs="+")
    options = parser.parse_args(argv)
    if options.workers < 1:
        parser.error(f"--workers must be >= 1, got {options.workers}")
    if options.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {options.gpus}")
    if options.chunk < 1:
        parser.error(f"--chunk must be >= 1, got {options.chunk}")
    if options.report and not options.commit:
        parser.error("--report needs --commit SHA (a copied tree may have no .git to read it from)")
    start = time.monotonic()
    collected = collect(options.paths, extra)
    ids = list(collected)
    groups = sharing_groups({i: shared for i, (_, shared) in collected.items()})
    if not ids:
        print("no tests collected")
        return 0
    log_dir = Path(options.log_dir or tempfile.mkdtemp(prefix="pytest-parallel-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    durations = Durations.read(options.durations)
    # With several GPUs each worker sees one; tests marked multi_gpu get chunks of their own that see
    # them all (they start processes over the GPUs themselves).
    every_gpu = frozenset(i for i, (markers, _) in collected.items() if options.gpus > 1 and "multi_gpu" in markers)
    seconds = chunk_seconds(ids, durations, options.workers)
    chunks = (chunk([i for i in ids if i not in every_gpu], options.chunk, durations, seconds, options.across_files,
                    groups)
              + chunk([i for i in ids if i in every_gpu], options.chunk, groups=groups))
    if durations:
        chunks = longest_first(chunks, durations)
    workers = min(options.workers, len(chunks))
    print(f"{len(ids)} tests in {len(chunks)} chunks over {workers} workers; logs in {log_dir}", flush=True)
    env = dict(os.environ)
    # Inductor compiles in a pool of subprocesses sized to the machine's cores, in every worker: 14
    # workers on 16 cores may start 16 compile processes each, every one importing torch. The
    # workers are the parallelism here: each compiles in its own process (a caller's setting wins).
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # Likewise torch's CPU ops: each process would start a thread per core (the GPU machine's CPU
    # tests ran with 28 x 32 threads on 32 cores, 2026-11-27, load average 50).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    if options.gpu_memory_gib:
        env["HCCOMPILE_TEST_GPU_MEMORY_GIB"] = str(options.gpu_memory_gib)
    run = run_chunks(chunks, workers, extra, log_dir, env, options.chunk_timeout, len(ids), options.gpus, every_gpu)
    outcomes = [run.outcomes[i] for i in ids]
    seconds = time.monotonic() - start
    (log_dir / "durations.json").write_text(json.dumps(run.durations(), indent=1) + "\n")
    for o in outcomes:
        if o.status in ("failed", "error"):
            print(f"{o.status.upper()} {o.test_id} - {o.message}")
    print(summary(outcomes, seconds), flush=True)
    if options.report:
        write_report(Path(options.report), options.commit, outcomes, seconds, workers, options.gpu_memory_gib)
    return 1 if any(o.status in ("failed", "error") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
