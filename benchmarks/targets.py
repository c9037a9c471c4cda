"""Every performance target of the project, checked against the raw results in benchmarks/results/.

    python3 benchmarks/targets.py                          # one line per target
    python3 benchmarks/targets.py --family mhc,host --check  # exit 1 unless every selected target is met
    python3 benchmarks/targets.py --json                   # the same, as JSON
    python3 benchmarks/targets.py --results DIR -v         # other results; -v names the rows used

Standard library only: no GPU, no torch. The targets are data (TARGETS below): family, name, the
issue they come from, how the measured value is computed from result rows, and the goal. Each
printed line gives family, target, measured value, goal, status (`met`, `not met`, `no result`),
and the date, device and commit of the rows it was computed from (`?` where a row does not say;
nothing is guessed). `no result` counts as not met for --check, except for the few targets marked
optional ("where lent": CP4), which --check skips until a result exists.

Which measurement
-----------------
Rows are read from every `*.jsonl` file directly under the results directory (one JSON object per
line) and from the text profiles `profiles/host_*.txt` (see "host" below). A target's value comes
from rows of ONE run: rows with a `run` field are grouped by it, otherwise by a per-script run
marker where the rows have one (lightning: `copy_gbs`, measured once per process; htree: `time`,
one stamp per process), otherwise the whole file is one run. Inside a run the last matching row of
each role wins (a file may hold several appended runs); where a run repeats its rows in rounds (a
`round` field, as benchmarks/delta_rule.py --rounds writes), a ratio is taken within each round and the
least favourable round's counts (the largest value for a ≤ goal, the smallest for a ≥ goal): a target is
met only when every round meets it, so a peer's noisy round cannot meet it alone. Rows with an `error` field never count.
Of all runs that yield a value, the newest wins: by date (the rows' `date`, else `time`[:10], else
the date in the file name), then by file name (natural order: `_run10` after `_run9`), then by
line. Targets that name a device (H100; H100/H200 for CP) ignore rows of other devices; rows
without a `device` field are accepted and print `?`.

Fields every row should carry (benchmark scripts: `from targets import run_stamp`; `row.update(
run_stamp())` adds the last three; torch-free)
- `date` (YYYY-MM-DD), `device` (torch.cuda.get_device_name()), `torch`, `triton`;
- `commit`: the full sha of the measured tree (run_stamp reads HCCOMPILE_COMMIT, else `git
  rev-parse HEAD`; a copied tree without .git must pass the sha in HCCOMPILE_COMMIT);
- `run`: one id per process (run_stamp: UTC time + pid), so that ratios never mix runs.

Row schema read by each family (fields beyond these are ignored)
-----------------------------------------------------------------
mhc (benchmarks/mhc.py; files `mhc*.jsonl`)
    {"variant": "n1-inductor" | "n4-hc-block" | "n4-hc-block-cg" | ..., "shape": "L4 C1024 H16 B4
     S2048 bfloat16 ...", "step_ms": float, "peak_gib": float, "compile_s": float}
    The shape is matched on its L, C, H, B, S tokens. Ratios are n4-hc-block over n1-inductor.
    Issue 18's floor: a `floor_ms` field (the bytes each hyper-connection op must move, counted from
    the ops' contracts, over the copy bandwidth measured in the same run) on any row of the run with
    that shape (the n4 row, or a row with "variant": "floor"); excess / floor =
    (n4-hc-block step_ms - n1-inductor step_ms) / floor_ms.
    Saved-for-backward bytes (issue 18; any `*.jsonl`, any device, CPU is fine):
    {"bench": "mhc_saved", "form": str, "hc_block_bytes": int, "inductor_bytes": int}; the value is
    the largest hc_block_bytes / inductor_bytes over the forms of the newest run.
lightning (benchmarks/lightning.py; files `lightning_2*.jsonl`, not lightning_tune)
    {"impl": "hccompile.lightning_attn" | "FLA ..." | "plain form, hc", "shape": "B4-T4096-H16-D128",
     "decay": bool, "fwd_ms": float, "fwd_bwd_ms": float, "floor_fwd_ms": float (ours' row),
     "copy_gbs": float (per process: the run marker)}
    First call (issue 20): `first_call_s` on ours' rows (seconds of the first forward+backward,
    compile included), optionally `first_call_compile_s` (Triton's own compile inside it),
    subtracted when present.
delta_rule (benchmarks/delta_rule.py; files `delta_rule_2*.jsonl`)
    {"bench": "kernel", "op": "GDN" | "KDA", "impl": "ours" | "FLA" | "plain hc" | "plain inductor",
     "shape": "B4 T4096 H16 D128", "fwd_bwd_ms": float, "first_call_s": float}
    `gate_in_kernel: true` marks KDA rows run with the gate computed in the kernel (issue 20's second
    KDA form); rows without it are the precomputed-gate form. The first-call target takes the
    largest first_call_s (minus `first_call_compile_s` when present) over ours' rows of the newest run.
htree (benchmarks/htree.py; files `htree*.jsonl`)
    {"impl": "htree" | "sdpa", "T": int, "mode": "fwd" | "fwd+bwd", "config": "default" | "seed",
     "B": 1, "HQ": 32, "H_kv": 4, "D": 128, "causal": false, "ms": float, "peak_mib": float,
     "time": "YYYY-MM-DDTHH:MM:SS" (per process: the run marker)}
    Speed-ups are SDPA ms / htree ms. Issue 19's memory goal reads `tree_mib` (the tree's own
    bytes) on the htree row; without it the tree counts as 0 (stricter).
cp (benchmarks/cp.py under torchrun; files `cp_*.jsonl`)
    {"op": "gdn" | "kda", "layout": "one" | "several", "tokens": int, "world": int,
     "variant": "1gpu-hc" | "cp2-hc-all_gather" (our default strategy; "cp2-hc" also accepted) |
     "cp2-fla" | "cp4-...", "fwd_bwd_ms": float}
compile (files `*.jsonl`)
    {"bench": "compile", "model": str, "backend": "hc" | "inductor", "T": int, "compile_s": float}
    The plain GDN layer's model name contains "GatedDeltaNet"; HF Kimi-Linear's contains "Kimi".
    The value is the largest compile_s over the lengths of the newest run ("at any T").
    One graph for every length (issue 21): {"bench": "graphs", "model": str, "lengths": [96, 160,
    288], "dynamic": true, "graphs": int, "lowered": bool}; the value is the largest graph count
    over the models of the newest run (a model not lowered counts as not met).
host (benchmarks/host_overhead.py; files `host*.jsonl`, and the text profiles
    `profiles/host_*.txt`, whose lines "gdn B4T4096H16D128: wall 6.183 ms/step, host enqueue
    2.876 ms/step" are read as rows with the date and device token of the file name)
    {"bench": "host", "op": "gdn" | "kda", "shape": str, "compiled": bool, "host_ms": float,
     "wall_ms": float}; rows with "compiled": false are skipped (the text profiles do not say).
    No family slower than before (issue 24): {"bench": "regression", "family": str,
    "before_ms": float, "after_ms": float}; the value is the largest after / before of the newest run.
    The mHC step without / with CUDA graphs reads mhc rows (n4-hc-block over n4-hc-block-cg).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

FAMILIES = ("mhc", "lightning", "delta_rule", "htree", "cp", "compile", "host")
RESULTS = Path(__file__).resolve().parent / "results"
H100 = r"H100"
H100_OR_H200 = r"H100|H200"


# --------------------------------------------------------------------------------------------- rows

@dataclass
class Row:
    data: dict
    file: str  # path relative to the results directory
    line: int  # 1-based

    def get(self, key, default=None):
        return self.data.get(key, default)

    @property
    def date(self) -> str:
        value = self.data.get("date") or str(self.data.get("time") or "")[:10]
        if value:
            return str(value)
        m = re.search(r"\d{4}-\d{2}-\d{2}", self.file)
        return m.group(0) if m else "?"

    def where(self) -> str:
        return f"{self.file}:{self.line}"


HOST_TEXT = re.compile(r"^(\w+) (\S+): wall ([\d.]+) ms/step, host enqueue ([\d.]+) ms/step")


def load(results: Path) -> tuple[dict[str, list[Row]], list[str]]:
    """file name -> rows, and warnings (lines that are not JSON objects; a line starting with '#' is a
    comment: where and how the rows were measured)."""
    files: dict[str, list[Row]] = {}
    warnings = []
    for path in sorted(results.glob("*.jsonl")):
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                if not text.strip() or text.startswith("#"):
                    continue
                try:
                    data = json.loads(text)
                except json.JSONDecodeError:
                    warnings.append(f"{path.name}:{number}: not JSON, skipped")
                    continue
                if isinstance(data, dict) and data.get("backward_thread", "device") != "device":
                    continue  # a diagnostic's condition (--backward-on-caller), not how users run
                if isinstance(data, dict):
                    rows.append(Row(data, path.name, number))
                else:
                    warnings.append(f"{path.name}:{number}: not a JSON object, skipped")
        files[path.name] = rows
    for path in sorted((results / "profiles").glob("host_*.txt")):
        name = f"profiles/{path.name}"
        m = re.search(r"(\d{4}-\d{2}-\d{2})_([A-Za-z0-9]+)", path.name)
        date, device = (m.group(1), f"{m.group(2)} (file name)") if m else ("?", "?")
        rows = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, text in enumerate(f, 1):
                hit = HOST_TEXT.match(text)
                if hit:
                    rows.append(Row({"bench": "host", "op": hit.group(1).lower(), "shape": hit.group(2),
                                     "wall_ms": float(hit.group(3)), "host_ms": float(hit.group(4)),
                                     "date": date, "device": device}, name, number))
        files[name] = rows
    return files, warnings


def natural(text: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def shape_tokens(text) -> dict[str, int]:
    """'L4 C1024 H16 B4 S2048 bfloat16' / 'B4-T4096-H16-D128' / 'B4T4096H16D128' -> {'B': 4, ...}:
    one-or-two-letter keys followed by digits."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(?<![A-Za-z])([A-Za-z]{1,2})(\d+)", str(text or ""))}


def shape_is(spec: str) -> Callable[[object], bool]:
    want = shape_tokens(spec)
    return lambda value: all(shape_tokens(value).get(k) == v for k, v in want.items())


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def matches(row: Row, cond: dict) -> bool:
    if "error" in row.data:
        return False
    for key, want in cond.items():
        value = row.get(key)
        if callable(want):
            if not want(value):
                return False
        elif isinstance(want, (set, frozenset, tuple, list)):
            if value not in want:
                return False
        elif value != want:
            return False
    return True


def pick(rows: list[Row], cond: dict, needs: Iterable[str] = ()) -> Row | None:
    """The last row of the run that matches cond and has a number in every field of needs."""
    for row in reversed(rows):
        if matches(row, cond) and all(number(row.get(k)) for k in needs):
            return row
    return None


# ------------------------------------------------------------------------------------- measurements

@dataclass
class Measured:
    value: float
    rows: list[Row]
    text: str | None = None  # shown instead of the formatted value
    detail: str | None = None  # shown after it, in parentheses (e.g. which length was the largest)
    rounds: list["Measured"] | None = None  # one value per round of the run; the least favourable counts


Compute = Callable[[list[Row]], "Measured | None"]


def ratio(num: dict, den: dict, field_num: str, field_den: str | None = None) -> Compute:
    """num[field_num] / den[field_den], one row each from the same run."""
    field_den = field_den or field_num

    def one(rows):
        a, b = pick(rows, num, [field_num]), pick(rows, den, [field_den])
        if a is None or b is None or b.get(field_den) == 0:
            return None
        return Measured(a.get(field_num) / b.get(field_den), [a, b])

    def compute(rows):
        rounds = sorted({row.get("round") for row in rows if row.get("round") is not None and matches(row, num)},
                        key=str)
        if len(rounds) < 2:
            return one(rows)
        each = [found for found in (one([row for row in rows if row.get("round") == r]) for r in rounds) if found]
        if not each:
            return None
        return Measured(each[-1].value, each[-1].rows, rounds=each)
    return compute


def value_of(cond: dict, key: str) -> Compute:
    def compute(rows):
        row = pick(rows, cond, [key])
        return None if row is None else Measured(row.get(key), [row])
    return compute


def largest(cond: dict, value: Callable[[Row], float | None], label: Callable[[Row], str] | None = None) -> Compute:
    """The largest value over every matching row of the run (e.g. compile time at any T)."""
    def compute(rows):
        used = [(v, r) for r in rows if matches(r, cond) for v in [value(r)] if v is not None]
        if not used:
            return None
        best, best_row = max(used, key=lambda pair: pair[0])
        detail = label(best_row) if label is not None else None
        text = None if math.isfinite(best) else f"not lowered ({detail or best_row.where()})"
        return Measured(best, [r for _, r in used], text, detail)
    return compute


def field_minus(key: str, minus: str) -> Callable[[Row], float | None]:
    def value(row):
        if not number(row.get(key)):
            return None
        return row.get(key) - (row.get(minus) if number(row.get(minus)) else 0.0)
    return value


def field_ratio(num: str, den: str) -> Callable[[Row], float | None]:
    def value(row):
        if not (number(row.get(num)) and number(row.get(den))) or row.get(den) == 0:
            return None
        return row.get(num) / row.get(den)
    return value


def mhc_excess_over_floor(shape: str) -> Compute:
    same = shape_is(shape)

    def compute(rows):
        n4 = pick(rows, {"variant": "n4-hc-block", "shape": same}, ["step_ms"])
        n1 = pick(rows, {"variant": "n1-inductor", "shape": same}, ["step_ms"])
        floor = pick(rows, {"shape": same}, ["floor_ms"])
        if n4 is not None and number(n4.get("floor_ms")):
            floor = n4
        if n4 is None or n1 is None or floor is None or floor.get("floor_ms") <= 0:
            return None
        excess = n4.get("step_ms") - n1.get("step_ms")
        return Measured(excess / floor.get("floor_ms"), [n4, n1] + ([floor] if floor not in (n4, n1) else []))
    return compute


def htree_memory_over_sdpa_plus_tree(cond: dict) -> Compute:
    def compute(rows):
        ours = pick(rows, {**cond, "impl": "htree"}, ["peak_mib"])
        dense = pick(rows, {**cond, "impl": "sdpa"}, ["peak_mib"])
        if ours is None or dense is None:
            return None
        tree = ours.get("tree_mib") if number(ours.get("tree_mib")) else 0.0
        if dense.get("peak_mib") + tree <= 0:
            return None
        return Measured(ours.get("peak_mib") / (dense.get("peak_mib") + tree), [ours, dense])
    return compute


def graphs_value(row: Row) -> float | None:
    # only runs over the target's own lengths count (a CPU run stops at 250: its C++ reductions
    # guard 16*B*T <= 4096 and would recompile at 288 for a reason that is not ours)
    if not number(row.get("graphs")) or list(row.get("lengths") or []) != [96, 160, 288]:
        return None
    return float(row.get("graphs")) if row.get("lowered", True) else math.inf


# ------------------------------------------------------------------------------------------ targets

@dataclass
class Target:
    family: str
    name: str
    issue: str
    compute: Compute
    op: str  # "<=", "<", ">=", ">"
    goal: float
    unit: str = "x"  # "x" (ratio), "ms", "s", "graphs"
    files: str = "*.jsonl"  # glob, relative to the results directory
    device: str | None = None  # regex a row's device must match (rows without one pass)
    run_key: str | None = None  # a field that marks one process when rows have no "run"
    optional: bool = False  # "where lent": no result does not fail --check
    rows_hint: str = ""  # one line: the rows this target needs (printed with --verbose when missing)

    def met(self, value: float) -> bool:
        return {"<=": value <= self.goal, "<": value < self.goal, ">=": value >= self.goal,
                ">": value > self.goal}[self.op]

    def goal_text(self) -> str:
        sign = {"<=": "≤", "<": "<", ">=": "≥", ">": ">"}[self.op]
        return f"{sign} {fmt(self.goal, self.unit)}"


def fmt(value: float, unit: str) -> str:
    # Three significant digits, so that a value next to its goal (0.549 against 0.55) reads right.
    if unit == "x":
        return f"{value:.3g}×"
    if unit == "ms":
        return f"{value:.3g} ms"
    if unit == "s":
        return f"{value:.3g} s"
    if unit == "graphs":
        return f"{value:g} graph" + ("" if value == 1 else "s")
    return f"{value:g}"


def build_targets() -> list[Target]:
    t: list[Target] = []

    # mHC (issue 3: BENCHMARKS.md's first tables; issue 18: both configurations, floor, saved bytes)
    configs = {"C1024 L4 B4": "L4 C1024 H16 B4 S2048", "C4096 L2 B2": "L2 C4096 H32 B2 S2048"}
    mhc = dict(files="mhc*.jsonl", device=H100)
    for label, shape in configs.items():
        same = shape_is(shape)
        n4, n1 = {"variant": "n4-hc-block", "shape": same}, {"variant": "n1-inductor", "shape": same}
        c1024 = label.startswith("C1024")
        if c1024:
            t.append(Target("mhc", f"step n4 hc / n1 inductor, {label}", "3", ratio(n4, n1, "step_ms"),
                            "<=", 1.10, **mhc))
        t.append(Target("mhc", f"memory n4 hc / n1 inductor, {label}", "3, 18" if c1024 else "18",
                        ratio(n4, n1, "peak_gib"), "<=", 1.3, rows_hint=f"peak_gib, shape {shape}", **mhc))
        t.append(Target("mhc", f"compile n4 hc / n1 inductor, {label}", "3, 18" if c1024 else "18",
                        ratio(n4, n1, "compile_s"), "<=", 2.0, rows_hint=f"compile_s, shape {shape}", **mhc))
        t.append(Target("mhc", f"excess / floor, {label}", "18", mhc_excess_over_floor(shape), "<=", 1.5,
                        rows_hint=f"n4-hc-block and n1-inductor step_ms and floor_ms, shape {shape}", **mhc))
    t.append(Target("mhc", "saved bytes hc block / inductor, worst form", "18",
                    largest({"bench": "mhc_saved"}, field_ratio("hc_block_bytes", "inductor_bytes"),
                            lambda r: str(r.get("form"))), "<=", 0.6,
                    rows_hint='{"bench": "mhc_saved", "form", "hc_block_bytes", "inductor_bytes"}'))

    # Lightning (issue 4: every shape, decay and not; issue 20: 0.6x at two shapes, first call)
    lightning = dict(files="lightning_2*.jsonl", device=H100, run_key="copy_gbs")
    ours_l = "hccompile.lightning_attn"
    fla_l = lambda impl: str(impl or "").startswith("FLA")  # noqa: E731
    shapes = ("B4-T4096-H16-D128", "B1-T32768-H16-D128", "B8-T2048-H32-D64")
    for shape in shapes:
        for decay in (True, False):
            tag = f"{shape.replace('-', ' ')}, {'decay' if decay else 'no decay'}"
            base = {"shape": shape_is(shape), "decay": decay}
            ours, fla = {**base, "impl": ours_l}, {**base, "impl": fla_l}
            if shape != "B8-T2048-H32-D64":
                t.append(Target("lightning", f"fwd+bwd ours / FLA, {tag}", "20", ratio(ours, fla, "fwd_bwd_ms"),
                                "<=", 0.6, **lightning))
            t.append(Target("lightning", f"fwd+bwd ours / FLA, {tag}", "4", ratio(ours, fla, "fwd_bwd_ms"),
                            "<=", 0.5, **lightning))
            t.append(Target("lightning", f"fwd ours / memory floor, {tag}", "4",
                            ratio(ours, ours, "fwd_ms", "floor_fwd_ms"), "<=", 2.0, **lightning))
            if shape != "B1-T32768-H16-D128":  # the plain form's [B,H,T,T] scores do not fit at T=32768
                t.append(Target("lightning", f"fwd+bwd plain under hc / op, {tag}", "4",
                                ratio({**base, "impl": "plain form, hc"}, ours, "fwd_bwd_ms"), "<=", 1.1,
                                **lightning))
    t.append(Target("lightning", "first call beyond compile, ours", "20",
                    largest({"impl": ours_l}, field_minus("first_call_s", "first_call_compile_s"),
                            lambda r: f"{str(r.get('shape'))}"), "<=", 10.0, unit="s",
                    rows_hint="first_call_s (and first_call_compile_s) on ours' rows", **lightning))

    # Delta rule (issue 5: 0.8x FLA at three shapes, KDA 4.4 ms, plain 20x; issue 20: GDN 0.6x,
    # KDA both gate forms 0.8x, first call)
    delta = dict(files="delta_rule_2*.jsonl", device=H100)
    not_in_kernel = lambda v: not v  # noqa: E731
    for shape in ("B4 T4096 H16 D128", "B1 T32768 H16 D128", "B2 T2048 H8 D128"):
        long = shape != "B2 T2048 H8 D128"
        for op in ("GDN", "KDA"):
            base = {"bench": "kernel", "op": op, "shape": shape_is(shape), "gate_in_kernel": not_in_kernel}
            r = ratio({**base, "impl": "ours"}, {**base, "impl": "FLA"}, "fwd_bwd_ms")
            if op == "GDN":
                if long:
                    t.append(Target("delta_rule", f"GDN fwd+bwd ours / FLA, {shape}", "20", r, "<=", 0.6, **delta))
                t.append(Target("delta_rule", f"GDN fwd+bwd ours / FLA, {shape}", "5", r, "<=", 0.8, **delta))
            else:
                t.append(Target("delta_rule", f"KDA fwd+bwd ours / FLA, {shape}", "5, 20" if long else "5", r,
                                "<=", 0.8, **delta))
                if long:
                    gate = {**base, "gate_in_kernel": True}
                    t.append(Target("delta_rule", f"KDA gate in kernel, ours / FLA, {shape}", "20",
                                    ratio({**gate, "impl": "ours"}, {**gate, "impl": "FLA"}, "fwd_bwd_ms"),
                                    "<=", 0.8, rows_hint='KDA rows with "gate_in_kernel": true, ours and FLA',
                                    **delta))
    t.append(Target("delta_rule", "KDA fwd+bwd ours, B4 T4096 H16 D128", "5",
                    value_of({"bench": "kernel", "op": "KDA", "impl": "ours", "shape": shape_is("B4 T4096 H16 D128"),
                              "gate_in_kernel": not_in_kernel}, "fwd_bwd_ms"), "<=", 4.4, unit="ms", **delta))
    plain = {"bench": "kernel", "op": "GDN", "shape": shape_is("B1 T8192 H8 D128")}
    t.append(Target("delta_rule", "plain GDN inductor / hc fwd+bwd, B1 T8192 H8 D128", "5",
                    ratio({**plain, "impl": "plain inductor"}, {**plain, "impl": "plain hc"}, "fwd_bwd_ms"),
                    ">=", 20.0, rows_hint="plain inductor and plain hc rows at B1 T8192 H8 D128 "
                    "(--plain-shapes B1T8192H8D128)", **delta))
    t.append(Target("delta_rule", "first call beyond compile, ours", "20",
                    largest({"bench": "kernel", "impl": "ours"}, field_minus("first_call_s", "first_call_compile_s"),
                            lambda r: f"{r.get('op')} {r.get('shape')}"), "<=", 10.0, unit="s", **delta))

    # htree (issue 7: 128K speed and memory; issue 19: 32K, 128K, public regime, memory + tree)
    htree = dict(files="htree*.jsonl", device=H100, run_key="time")
    geometry = {"B": 1, "HQ": 32, "H_kv": 4, "D": 128, "causal": lambda v: not v}
    for T, goal, issue, op in ((32768, 1.0, "19", ">="), (131072, 3.0, "7, 19", ">=")):
        cond = {**geometry, "T": T, "mode": "fwd+bwd", "config": "default"}
        t.append(Target("htree", f"fwd+bwd SDPA / htree, T={T}", issue,
                        ratio({**cond, "impl": "sdpa"}, {**cond, "impl": "htree"}, "ms"), op, goal, **htree))
    seed = {**geometry, "T": 131072, "mode": "fwd+bwd", "config": "seed"}
    t.append(Target("htree", "fwd+bwd SDPA / htree, public regime, T=131072", "19",
                    ratio({**seed, "impl": "sdpa"}, {**seed, "impl": "htree"}, "ms"), ">", 1.0,
                    rows_hint="htree.py --config seed --seq 131072 (htree and sdpa rows)", **htree))
    cond = {**geometry, "T": 131072, "mode": "fwd+bwd", "config": "default"}
    t.append(Target("htree", "peak memory htree / SDPA, T=131072", "7",
                    ratio({**cond, "impl": "htree"}, {**cond, "impl": "sdpa"}, "peak_mib"), "<=", 2.0, **htree))
    for config, label in (("default", ""), ("seed", "public regime, ")):
        c = {**geometry, "T": 131072, "mode": "fwd+bwd", "config": config}
        t.append(Target("htree", f"peak memory htree / (SDPA + tree), {label}T=131072", "19",
                        htree_memory_over_sdpa_plus_tree(c), "<=", 1.0, **htree))

    # Context parallelism (issue 6: 64K, 0.55x one GPU and <= FLA CP; issue 22: 0.9x FLA CP at CP2
    # and CP4, 64K and 256K, 0.55x one GPU at 256K)
    cp = dict(files="cp_*.jsonl", device=H100_OR_H200)
    ours_cp = lambda world: (lambda v: v in (f"cp{world}-hc-all_gather", f"cp{world}-hc"))  # noqa: E731
    for tokens, label in ((65536, "64K"), (262144, "256K")):
        for op in ("gdn", "kda"):
            for layout in ("one", "several"):
                base = {"op": op, "layout": layout, "tokens": tokens}
                t.append(Target("cp", f"{op.upper()} CP2 / 1 GPU fwd+bwd, {label}, {layout}",
                                "6" if tokens == 65536 else "22",
                                ratio({**base, "variant": ours_cp(2)}, {**base, "variant": "1gpu-hc"}, "fwd_bwd_ms"),
                                "<=", 0.55, **cp))
            base = {"op": op, "layout": "one", "tokens": tokens}
            for world in (2, 4):
                r = ratio({**base, "variant": ours_cp(world)}, {**base, "variant": f"cp{world}-fla"}, "fwd_bwd_ms")
                if world == 2 and tokens == 65536:
                    t.append(Target("cp", f"{op.upper()} CP2 ours / FLA CP2, {label}, one", "6", r, "<=", 1.0, **cp))
                t.append(Target("cp", f"{op.upper()} CP{world} ours / FLA CP{world}, {label}, one", "22", r,
                                "<=", 0.9, optional=world == 4,
                                rows_hint=f"cp{world}-hc-all_gather and cp{world}-fla rows, tokens {tokens}", **cp))

    # Compile time (issue 5: the plain GDN layer; issue 21: HF Kimi-Linear KDA, one graph for all T)
    def compile_cond(pattern):
        return {"bench": "compile", "backend": "hc", "model": lambda m: bool(re.search(pattern, str(m or ""), re.I))}
    t.append(Target("compile", "plain GDN layer under hc, compile at any T", "5",
                    largest(compile_cond(r"GatedDeltaNet"), lambda r: r.get("compile_s") if number(r.get("compile_s"))
                            else None, lambda r: f"T={r.get('T')}"),
                    "<=", 30.0, unit="s", device=H100))
    t.append(Target("compile", "HF Kimi-Linear KDA under hc, compile at any T", "21",
                    largest(compile_cond(r"^HF Kimi"), lambda r: r.get("compile_s") if number(r.get("compile_s"))
                            else None, lambda r: f"T={r.get('T')}"),
                    "<=", 30.0, unit="s", device=H100,
                    rows_hint='{"bench": "compile", "model": "HF Kimi-Linear KDA ...", "backend": "hc", "T", '
                              '"compile_s"} at two or more T'))
    t.append(Target("compile", "graphs for T=96,160,288 (dynamic), worst module", "21",
                    largest({"bench": "graphs"}, graphs_value, lambda r: str(r.get("model"))), "<=", 1,
                    unit="graphs",
                    rows_hint='{"bench": "graphs", "model", "lengths": [96, 160, 288], "graphs", "lowered"} '
                              'per hccompile.nn attention module and HF layer'))

    # Host overhead (issue 24)
    same = shape_is("L4 C1024 H16 B4 S2048")
    t.append(Target("host", "mHC step without / with CUDA graphs, C1024 L4 B4", "24",
                    ratio({"variant": "n4-hc-block", "shape": same}, {"variant": "n4-hc-block-cg", "shape": same},
                          "step_ms"), "<=", 1.15, files="mhc*.jsonl", device=H100))
    for op in ("gdn", "kda"):
        t.append(Target("host", f"host time, {op.upper()} fwd+bwd", "24",
                        value_of({"bench": "host", "op": op, "compiled": lambda v: v is not False,
                                  "static_launch": lambda v: not v}, "host_ms"),
                        "<=", 0.5, unit="ms", files="host*", device=H100))
    t.append(Target("host", "compiled step after / before, worst family", "24",
                    largest({"bench": "regression"}, field_ratio("after_ms", "before_ms"),
                            lambda r: str(r.get("family"))), "<=", 1.0, files="host*.jsonl", device=H100,
                    rows_hint='{"bench": "regression", "family", "before_ms", "after_ms"} per family'))
    return t


TARGETS = build_targets()


# ------------------------------------------------------------------------------------------ runner

def runs_of(target: Target, files: dict[str, list[Row]]) -> Iterable[list[Row]]:
    for name in sorted(files, key=natural):
        if not Path(name).match(target.files):
            continue
        groups: dict[object, list[Row]] = {}
        for row in files[name]:
            device = row.get("device")
            if target.device and device is not None and not re.search(target.device, str(device), re.I):
                continue
            key = row.get("run")
            if key is None and target.run_key is not None:
                key = ("marker", row.get(target.run_key))
            groups.setdefault(key, []).append(row)
        yield from groups.values()


def measure(target: Target, files: dict[str, list[Row]]) -> Measured | None:
    best, best_key = None, None
    for rows in runs_of(target, files):
        found = target.compute(rows)
        if found is None:
            continue
        newest = max(found.rows, key=lambda r: r.line)
        date = max((r.date for r in found.rows if r.date != "?"), default="")  # undated rows sort oldest
        # run_stamp's run id starts with the UTC time: within a date it orders runs whatever their files
        # are named (files named by commit sort arbitrarily); rows without one sort first
        started = max((str(r.get("run")) for r in found.rows if r.get("run") is not None), default="")
        key = (date, started, natural(newest.file), newest.line)
        if best_key is None or key > best_key:
            best, best_key = found, key
    return best


def describe_rows(rows: list[Row]) -> tuple[str, str, str]:
    dates = sorted({r.date for r in rows})
    devices = []
    for r in rows:
        device = r.get("device")
        if device is None:
            text = "?"
        else:
            text = re.sub(r"^NVIDIA\s+", "", str(device))
            if number(r.get("world")) and r.get("world") > 1:
                text += f" x{r.get('world')}"
        if text not in devices:
            devices.append(text)
    commits = {r.get("commit") for r in rows}
    if None in commits or "" in commits:
        commit = "?"
    else:
        commit = "+".join(sorted(str(c)[:12] for c in commits))
    return (dates[-1] if dates else "?"), ", ".join(devices), commit


def evaluate(targets: list[Target], files: dict[str, list[Row]]) -> list[dict]:
    out = []
    for target in targets:
        found = measure(target, files)
        line = {"family": target.family, "target": target.name, "issue": target.issue,
                "goal": target.goal_text(), "op": target.op, "goal_value": target.goal, "unit": target.unit,
                "optional": target.optional, "needs": target.rows_hint or None}
        if found is None:
            line.update(measured=None, measured_text="—", status="no result", date="", device="", commit="",
                        sources=[])
        else:
            if found.rounds:
                worst = (max if target.op in ("<=", "<") else min)(found.rounds, key=lambda m: m.value)
                found = Measured(worst.value, worst.rows, found.text,
                                 f"least favourable of {len(found.rounds)} rounds: "
                                 + ", ".join(fmt(m.value, target.unit) for m in found.rounds))
            date, device, commit = describe_rows(found.rows)
            value = found.value
            line.update(measured=value if math.isfinite(value) else None,
                        measured_text=found.text or (fmt(value, target.unit)
                                                     + (f" ({found.detail})" if found.detail else "")),
                        status="met" if math.isfinite(value) and target.met(value) else "not met",
                        date=date, device=device, commit=commit, sources=[r.where() for r in found.rows])
        out.append(line)
    return out


COLUMNS = (("family", "family"), ("target", "target"), ("measured_text", "measured"), ("goal", "goal"),
           ("status", "status"), ("date", "date"), ("device", "device"), ("commit", "commit"), ("issue", "issue"))


def table(lines: list[dict], verbose: bool = False) -> str:
    cells = [[head for _, head in COLUMNS]] + [[str(line[key]) for key, _ in COLUMNS] for line in lines]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    text = []
    for index, row in enumerate(cells):
        text.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if index == 0:
            text.append("  ".join("-" * width for width in widths))
        elif verbose:
            line = lines[index - 1]
            if line["sources"]:
                text.append("    rows: " + ", ".join(line["sources"]))
            elif line.get("needs"):
                text.append("    needs: " + line["needs"])
    return "\n".join(text)


def summary(lines: list[dict]) -> str:
    counts = {status: sum(line["status"] == status for line in lines) for status in ("met", "not met", "no result")}
    return f"{len(lines)} targets: {counts['met']} met, {counts['not met']} not met, {counts['no result']} no result"


def run_stamp(repo: str | os.PathLike | None = None) -> dict:
    """Fields a benchmark script adds to every row it writes: today's date, the commit of the
    measured tree (HCCOMPILE_COMMIT, else `git rev-parse HEAD`, with "+dirty" when hccompile/ differs
    from it; absent when neither is known) and a
    run id unique to this process. Standard library only."""
    root = Path(repo) if repo is not None else Path(__file__).resolve().parent.parent
    commit = os.environ.get("HCCOMPILE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
            # HEAD names the measured code only for a clean hccompile/: the device copies the working
            # tree over a .git that can be older than it
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "hccompile"], cwd=root,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            if commit and dirty:
                commit += "+dirty"
        except (OSError, subprocess.SubprocessError):
            commit = None
    now = datetime.datetime.now(datetime.timezone.utc)
    stamp = {"date": datetime.date.today().isoformat(), "run": f"{now:%Y%m%dT%H%M%S}-{os.getpid()}"}
    if commit:
        stamp["commit"] = commit
    return stamp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="", help=f"comma-separated, from: {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every selected target is met")
    parser.add_argument("--json", action="store_true", help="print the lines as a JSON list")
    parser.add_argument("--results", default=str(RESULTS), help="the raw results directory (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="name the rows each line was computed from")
    parser.add_argument("--device", metavar="REGEX",
                        help="a diagnostic: read the rows of devices matching REGEX (e.g. H200) where a target "
                             "names its device (H100); refused with --check, which reads the targets' own devices")
    args = parser.parse_args(argv)
    if args.device and args.check:
        print("targets.py: --device is a diagnostic; --check reads each target's own device", file=sys.stderr)
        return 2
    if (getattr(sys.stdout, "encoding", None) or "").lower().replace("-", "") != "utf8":
        sys.stdout.reconfigure(errors="replace")  # "≤" and "×" on a non-UTF-8 terminal: no crash

    wanted = [f.strip() for f in args.family.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in FAMILIES]
    if unknown:
        print(f"targets.py: unknown family {', '.join(map(repr, unknown))} (known: {', '.join(FAMILIES)})",
              file=sys.stderr)
        return 2
    results = Path(args.results)
    if not results.is_dir():
        print(f"targets.py: no results directory {results}", file=sys.stderr)
        return 2
    files, warnings = load(results)
    for warning in warnings:
        print(f"targets.py: {warning}", file=sys.stderr)
    selected = [t for t in TARGETS if not wanted or t.family in wanted]
    if args.device:
        selected = [dataclasses.replace(t, device=args.device) if t.device else t for t in selected]
    lines = evaluate(selected, files)
    if args.json:
        print(json.dumps(lines, indent=1, ensure_ascii=False))
    else:
        print(table(lines, args.verbose))
        print()
        print(summary(lines))
    if args.check:
        failing = [line for line in lines
                   if line["status"] != "met" and not (line["optional"] and line["status"] == "no result")]
        if not args.json:
            print(f"--check: {'passed' if not failing else f'{len(failing)} selected targets not met'}")
        return 1 if failing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
