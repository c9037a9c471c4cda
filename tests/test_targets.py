"""benchmarks/targets.py on hand-written result rows (CPU, standard library only: it runs as a
plain `python3` subprocess, as a user would), and once on the committed benchmarks/results/."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "targets.py"

C1024 = "L4 C1024 H16 B4 S2048 bfloat16 dropout 0.1 sinkhorn 20"
H100 = "NVIDIA H100 80GB HBM3"


def module():
    spec = importlib.util.spec_from_file_location("benchmark_targets", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def run(*args, results: Path | None = None):
    cmd = [sys.executable, str(SCRIPT), *args]
    if results is not None:
        cmd += ["--results", str(results)]
    return subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", timeout=120)


def lines_of(*args, results: Path) -> dict[tuple[str, str, str], dict]:
    out = run("--json", *args, results=results)
    assert out.returncode in (0, 1), out.stderr
    return {(line["family"], line["target"], line["issue"]): line for line in json.loads(out.stdout)}


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def mhc_row(variant: str, step: float, peak: float, compile_s: float, **extra) -> dict:
    return {"date": "2026-12-01", "device": H100, "shape": C1024, "variant": variant, "step_ms": step,
            "peak_gib": peak, "compile_s": compile_s, **extra}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """n4/n1 at C=1024: memory 1.1x (met), step 3x (not met), compile 1.5x (met); nothing at C=4096."""
    write(tmp_path / "mhc_2026-12-01_h100.jsonl", [
        mhc_row("n1-inductor", 10.0, 1.0, 10.0, commit="abc123def4567890"),
        mhc_row("n4-hc-block", 30.0, 1.1, 15.0, commit="abc123def4567890"),
    ])
    return tmp_path


def test_met_not_met_and_missing(results):
    lines = lines_of("--family", "mhc", results=results)
    memory = lines[("mhc", "memory n4 hc / n1 inductor, C1024 L4 B4", "3, 18")]
    assert memory["status"] == "met" and memory["measured"] == pytest.approx(1.1)
    assert (memory["date"], memory["device"], memory["commit"]) == ("2026-12-01", "H100 80GB HBM3", "abc123def456")
    assert lines[("mhc", "compile n4 hc / n1 inductor, C1024 L4 B4", "3, 18")]["status"] == "met"
    step = lines[("mhc", "step n4 hc / n1 inductor, C1024 L4 B4", "3")]
    assert step["status"] == "not met" and step["measured"] == pytest.approx(3.0)
    missing = lines[("mhc", "memory n4 hc / n1 inductor, C4096 L2 B2", "18")]
    assert missing["status"] == "no result" and missing["measured_text"] == "—"

    table = run("--family", "mhc", results=results).stdout
    row = next(line for line in table.splitlines() if "memory n4 hc / n1 inductor, C1024" in line)
    assert row.split()[0] == "mhc" and "1.1×" in row and "≤ 1.3×" in row and " met " in row
    assert "2026-12-01" in row and "H100 80GB HBM3" in row and "abc123def456" in row
    missing_row = next(line for line in table.splitlines() if "memory n4 hc / n1 inductor, C4096" in line)
    assert "—" in missing_row and "no result" in missing_row


def test_a_row_without_commit_prints_question_mark(tmp_path):
    write(tmp_path / "mhc_2026-12-01_h100.jsonl", [mhc_row("n1-inductor", 10.0, 1.0, 10.0),
                                                   mhc_row("n4-hc-block", 11.0, 1.1, 15.0)])
    line = lines_of("--family", "mhc", results=tmp_path)[("mhc", "step n4 hc / n1 inductor, C1024 L4 B4", "3")]
    assert line["commit"] == "?" and line["status"] == "met"


def test_floor_target_reads_floor_ms(tmp_path):
    write(tmp_path / "mhc_2026-12-01_h100.jsonl", [mhc_row("n1-inductor", 10.0, 1.0, 10.0),
                                                   mhc_row("n4-hc-block", 12.0, 1.1, 15.0, floor_ms=1.6)])
    line = lines_of("--family", "mhc", results=tmp_path)[("mhc", "excess / floor, C1024 L4 B4", "18")]
    assert line["measured"] == pytest.approx(2.0 / 1.6) and line["status"] == "met"


def test_newest_result_wins_and_ratios_stay_in_one_run(tmp_path):
    write(tmp_path / "mhc_2026-11-30_h100.jsonl", [mhc_row("n1-inductor", 10.0, 1.0, 10.0),
                                                   mhc_row("n4-hc-block", 50.0, 1.0, 10.0)])
    # Newer file: run "a" is complete (step 2x); run "b" after it has only the n4 row, which must not
    # be paired with run a's n1 row.
    newer = [mhc_row("n1-inductor", 10.0, 1.0, 10.0, date="2026-12-02", run="a"),
             mhc_row("n4-hc-block", 20.0, 1.0, 10.0, date="2026-12-02", run="a"),
             mhc_row("n4-hc-block", 99.0, 1.0, 10.0, date="2026-12-02", run="b")]
    write(tmp_path / "mhc_2026-12-02_h100.jsonl", newer)
    line = lines_of("--family", "mhc", results=tmp_path)[("mhc", "step n4 hc / n1 inductor, C1024 L4 B4", "3")]
    assert line["measured"] == pytest.approx(2.0) and line["date"] == "2026-12-02"
    assert line["sources"] == ["mhc_2026-12-02_h100.jsonl:2", "mhc_2026-12-02_h100.jsonl:1"]


def test_other_devices_and_error_rows_do_not_count(tmp_path):
    write(tmp_path / "mhc_2026-12-01_h100.jsonl", [
        mhc_row("n1-inductor", 10.0, 1.0, 10.0),
        mhc_row("n4-hc-block", 20.0, 1.0, 10.0),
        mhc_row("n4-hc-block", 5.0, 1.0, 10.0, device="NVIDIA A100-SXM4-80GB"),
        {**mhc_row("n4-hc-block", 1.0, 1.0, 10.0), "error": "RuntimeError: boom"},
    ])
    line = lines_of("--family", "mhc", results=tmp_path)[("mhc", "step n4 hc / n1 inductor, C1024 L4 B4", "3")]
    assert line["measured"] == pytest.approx(2.0)


def test_rows_measured_with_the_backward_on_the_calling_thread_do_not_count(tmp_path):
    """--backward-on-caller rows are a diagnostic's condition: even the newest, they set no target."""
    write(tmp_path / "mhc_2026-12-01_h100.jsonl", [
        mhc_row("n1-inductor", 10.0, 1.0, 10.0),
        mhc_row("n4-hc-block", 20.0, 1.0, 10.0, backward_thread="device"),
        mhc_row("n4-hc-block", 11.0, 1.0, 10.0, backward_thread="caller"),
    ])
    line = lines_of("--family", "mhc", results=tmp_path)[("mhc", "step n4 hc / n1 inductor, C1024 L4 B4", "3")]
    assert line["measured"] == pytest.approx(2.0)


def test_device_diagnostic_reads_another_device_and_is_refused_with_check(tmp_path):
    """--device REGEX reads the rows of another GPU (an H200 session's) where a target names the
    H100; never with --check, which judges on the targets' own devices."""
    h200 = "NVIDIA H200"
    write(tmp_path / "mhc_2026-12-01_h200.jsonl", [mhc_row("n1-inductor", 10.0, 1.0, 10.0, device=h200),
                                                   mhc_row("n4-hc-block", 15.0, 1.0, 10.0, device=h200)])
    key = ("mhc", "step n4 hc / n1 inductor, C1024 L4 B4", "3")
    assert lines_of("--family", "mhc", results=tmp_path)[key]["status"] == "no result"
    line = lines_of("--family", "mhc", "--device", "H200", results=tmp_path)[key]
    assert line["measured"] == pytest.approx(1.5) and line["device"] == "H200"
    refused = run("--device", "H200", "--check", results=tmp_path)
    assert refused.returncode == 2 and "--device" in refused.stderr and refused.stdout == ""


def test_family_filter(results):
    lines = lines_of("--family", "mhc", results=results)
    assert lines and {family for family, _, _ in lines} == {"mhc"}
    lines = lines_of("--family", "mhc,host", results=results)
    assert {family for family, _, _ in lines} == {"mhc", "host"}
    everything = lines_of(results=results)
    assert {family for family, _, _ in everything} == set(module().FAMILIES)


def test_unknown_family_is_one_clear_error(results):
    out = run("--family", "mhc,nope", results=results)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and "'nope'" in out.stderr and "mhc" in out.stderr


def test_check_exit_codes(tmp_path, results):
    assert run("--family", "mhc", "--check", results=results).returncode == 1  # not met and no result
    assert run("--family", "compile", "--check", results=tmp_path).returncode == 1  # no result only
    write(tmp_path / "compile_2026-12-01_h100.jsonl", [
        {"bench": "compile", "model": "GatedDeltaNet(hidden 1024) plain", "backend": "hc", "T": t,
         "compile_s": 12.0, "date": "2026-12-01", "device": H100} for t in (2048, 8192)] + [
        {"bench": "compile", "model": "HF Kimi-Linear KDA layer", "backend": "hc", "T": t, "compile_s": s,
         "date": "2026-12-01", "device": H100} for t, s in ((2048, 20.0), (4096, 25.0))] + [
        {"bench": "graphs", "model": m, "lengths": [96, 160, 288], "dynamic": True, "graphs": 1, "lowered": True,
         "date": "2026-12-01", "device": "cpu"} for m in ("GatedDeltaNet", "HF Qwen3-Next GDN")])
    out = run("--family", "compile", "--check", results=tmp_path)
    assert out.returncode == 0, out.stdout
    kimi = lines_of("--family", "compile", results=tmp_path)[
        ("compile", "HF Kimi-Linear KDA under hc, compile at any T", "21")]
    assert kimi["measured"] == pytest.approx(25.0) and kimi["measured_text"] == "25 s (T=4096)"
    # One module not lowered: the graphs target fails.
    write(tmp_path / "compile_2026-12-02_cpu.jsonl", [
        {"bench": "graphs", "model": "HF MiniMax lightning", "lengths": [96, 160, 288], "graphs": 1, "lowered": False,
         "date": "2026-12-02"}])
    assert run("--family", "compile", "--check", results=tmp_path).returncode == 1


def test_optional_targets_without_result_do_not_fail_check(tmp_path):
    rows = []
    for tokens in (65536, 262144):
        for op in ("gdn", "kda"):
            for layout in ("one", "several"):
                base = {"date": "2026-12-01", "device": "NVIDIA H100 80GB HBM3", "world": 2, "tokens": tokens,
                        "op": op, "layout": layout}
                rows += [{**base, "variant": "1gpu-hc", "fwd_bwd_ms": 10.0},
                         {**base, "variant": "cp2-hc-all_gather", "fwd_bwd_ms": 5.2},
                         {**base, "variant": "cp2-fla", "fwd_bwd_ms": 6.0}]
    write(tmp_path / "cp_2026-12-01_h100x2.jsonl", rows)
    lines = lines_of("--family", "cp", results=tmp_path)
    cp4 = [line for line in lines.values() if "CP4" in line["target"]]
    assert cp4 and all(line["status"] == "no result" and line["optional"] for line in cp4)
    assert all(line["status"] == "met" for line in lines.values() if not line["optional"])
    assert run("--family", "cp", "--check", results=tmp_path).returncode == 0


def test_host_text_profiles_are_read(tmp_path):
    profile = tmp_path / "profiles" / "host_delta_2026-12-01_h100.txt"
    profile.parent.mkdir()
    profile.write_text("gdn B4T4096H16D128: wall 6.183 ms/step, host enqueue 0.4 ms/step\n  cProfile lines\n"
                       "kda B4T4096H16D128: wall 8.934 ms/step, host enqueue 2.326 ms/step\n")
    lines = lines_of("--family", "host", results=tmp_path)
    gdn, kda = lines[("host", "host time, GDN fwd+bwd", "24")], lines[("host", "host time, KDA fwd+bwd", "24")]
    assert gdn["status"] == "met" and gdn["measured"] == pytest.approx(0.4) and gdn["date"] == "2026-12-01"
    assert kda["status"] == "not met" and kda["sources"] == ["profiles/host_delta_2026-12-01_h100.txt:3"]


def test_real_results_print_every_target_once():
    targets = module().TARGETS
    keys = [(t.family, t.name, t.issue) for t in targets]
    assert len(keys) == len(set(keys))
    out = run()
    assert out.returncode == 0, out.stderr
    body = out.stdout.splitlines()
    rows = body[2:2 + len(targets)]  # header, rule, one line per target, blank, summary
    assert len(rows) == len(targets) and body[2 + len(targets)] == ""
    assert body[-1].startswith(f"{len(targets)} targets:")
    for line, target in zip(rows, targets):
        assert line.split()[0] == target.family and target.name in line
        assert any(status in line for status in (" met ", " not met ", "no result"))
    lines = lines_of(results=ROOT / "benchmarks" / "results")
    assert list(lines) == keys
    measured = [line for line in lines.values() if line["status"] != "no result"]
    assert measured and all(line["date"] and line["device"] and line["commit"] for line in measured)


def test_run_stamp_gives_date_commit_and_run(monkeypatch):
    targets = module()
    monkeypatch.setenv("HCCOMPILE_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    stamp = targets.run_stamp()
    assert stamp["commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert len(stamp["date"]) == 10 and str(os.getpid()) in stamp["run"]
    assert set(stamp) == {"date", "commit", "run"}


def test_run_stamp_marks_a_commit_whose_hccompile_differs(tmp_path, monkeypatch):
    """On the device the working tree is copied over a .git that can be older: HEAD then names
    code that was not measured, and the stamp says so."""

    targets = module()
    monkeypatch.delenv("HCCOMPILE_COMMIT", raising=False)

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "hccompile").mkdir()
    (tmp_path / "hccompile" / "x.py").write_text("a = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "one")
    clean = targets.run_stamp(tmp_path)["commit"]
    assert len(clean) == 40 and "+" not in clean
    (tmp_path / "hccompile" / "x.py").write_text("a = 2\n")
    assert targets.run_stamp(tmp_path)["commit"] == clean + "+dirty"


def test_the_newest_run_wins_within_a_date_whatever_the_files_are_named(tmp_path):
    """Files named by commit sort arbitrarily: two runs on one date are ordered by run_stamp's run id
    (it starts with the UTC time), and a model whose name merely contains "kimi" is not HF's layer."""
    def rows(run, seconds):
        return [{"bench": "compile", "model": "HF Kimi-Linear KDA", "backend": "hc", "T": 96, "compile_s": seconds,
                 "date": "2026-12-01", "device": H100, "run": run},
                {"bench": "compile", "model": "hccompile.nn KimiDeltaAttention (plain)", "backend": "hc", "T": 96,
                 "compile_s": 99.0, "date": "2026-12-01", "device": H100, "run": run}]
    write(tmp_path / "compile_2026-12-01_h100_aaaaaaa.jsonl", rows("20261201T120000-2", 12.0))  # later run
    write(tmp_path / "compile_2026-12-01_h100_fffffff.jsonl", rows("20261201T090000-1", 40.0))
    kimi = lines_of("--family", "compile", results=tmp_path)[
        ("compile", "HF Kimi-Linear KDA under hc, compile at any T", "21")]
    assert kimi["measured"] == pytest.approx(12.0), kimi


def test_rounds_count_by_the_least_favourable(tmp_path):
    """A run that repeats its rows in rounds (delta_rule.py --rounds) gives one ratio per round, and the
    least favourable one counts: FLA's host-bound B4 step swings between rounds, and a target met in
    one round only is not met."""
    def delta(impl, ms, round_):
        return {"date": "2026-12-01", "device": H100, "run": "r1", "bench": "kernel", "op": "GDN", "impl": impl,
                "shape": "B4 T4096 H16 D128", "fwd_bwd_ms": ms, "round": round_}
    write(tmp_path / "delta_rule_2026-12-01_h100.jsonl",
          [delta("ours", 2.0, 0), delta("FLA", 3.5, 0), delta("ours", 2.0, 1), delta("FLA", 2.5, 1)])
    lines = lines_of("--family", "delta_rule", results=tmp_path)
    strict = lines[("delta_rule", "GDN fwd+bwd ours / FLA, B4 T4096 H16 D128", "20")]
    loose = lines[("delta_rule", "GDN fwd+bwd ours / FLA, B4 T4096 H16 D128", "5")]
    assert strict["measured"] == pytest.approx(0.8) and strict["status"] == "not met"   # 0.571 in round 0 alone
    assert loose["measured"] == pytest.approx(0.8) and loose["status"] == "met"
    assert "least favourable of 2 rounds" in strict["measured_text"]
    assert sorted(strict["sources"]) == ["delta_rule_2026-12-01_h100.jsonl:3", "delta_rule_2026-12-01_h100.jsonl:4"]

    # for a goal from below (≥), the smallest round counts
    mod = module()
    rows = [mod.Row({"round": r, "role": role, "ms": ms, "date": "2026-12-01"}, "x.jsonl", i)
            for i, (r, role, ms) in enumerate([(0, "a", 4.0), (0, "b", 1.0), (1, "a", 2.0), (1, "b", 1.0)])]
    target = mod.Target("t", "a / b", "0", mod.ratio({"role": "a"}, {"role": "b"}, "ms"), ">=", 3.0)
    (line,) = mod.evaluate([target], {"x.jsonl": rows})
    assert line["measured"] == pytest.approx(2.0) and line["status"] == "not met"
