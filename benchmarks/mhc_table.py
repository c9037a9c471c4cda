"""Markdown tables and the issue-3 target ratios from benchmarks/mhc.py's JSON lines.

    python benchmarks/mhc_table.py mhc_results.jsonl

One table per metric (step time, peak memory above parameters, compile time): rows n=1 and n=4,
columns eager, eager + manager, Inductor, hc off / layer / block (and hc block unfused when
measured). When a file holds several shapes, each gets its own tables; the last row of a variant
wins. Rows written by the first version of the script ("n1-hc") count as hc block.
"""
from __future__ import annotations

import json
import sys

COLUMNS = [("eager", "eager"), ("manager", "eager + manager"), ("inductor", "Inductor"),
           ("hc-off", "hc off"), ("hc-layer", "hc layer"), ("hc-block", "hc block"),
           ("hc-block-nofuse", "hc block, unfused")]
METRICS = [("step_ms", "step (ms)", "{:.2f}"), ("peak_gib", "peak memory above params (GiB)", "{:.2f}"),
           ("compile_s", "compile (s)", "{:.1f}")]
LEGACY = {"n1-hc": "n1-hc-block"}


def load(path: str) -> dict[str, dict[str, dict]]:
    """shape -> variant -> row."""
    by_shape: dict[str, dict[str, dict]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                variant = LEGACY.get(row["variant"], row["variant"])
                by_shape.setdefault(row["shape"], {})[variant] = row
    return by_shape


def tables(rows: dict[str, dict]) -> list[str]:
    any_row = next(iter(rows.values()))
    out = [f"{any_row['date']}, {any_row['device']}, torch {any_row['torch']}, {any_row['shape']}", ""]
    cols = [(key, name) for key, name in COLUMNS if any(f"n{n}-{key}" in rows for n in (1, 4))]
    for metric, title, fmt in METRICS:
        out.append(f"**{title}**")
        out.append("")
        out.append("| n | " + " | ".join(name for _, name in cols) + " |")
        out.append("|---" * (len(cols) + 1) + "|")
        for n in (1, 4):
            cells = []
            for key, _ in cols:
                r = rows.get(f"n{n}-{key}")
                cells.append(fmt.format(r[metric]) if r else "–")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        out.append("")
    base, best = rows.get("n1-inductor"), rows.get("n4-hc-block")
    if base and best:
        n1_compile = rows.get("n1-hc-block", base)
        out += ["| target (issue 3) | measured | goal |", "|---|---|---|",
                f"| step time n4 hc block / n1 Inductor | {best['step_ms'] / base['step_ms']:.2f}× | ≤ 1.10× |",
                f"| memory n4 hc block / n1 Inductor | {best['peak_gib'] / base['peak_gib']:.2f}× | ≤ 1.3× |",
                f"| compile n4 hc block / n1 hc block | {best['compile_s'] / n1_compile['compile_s']:.1f}× | ≤ 2× |",
                ""]
    return out


def main(path: str) -> None:
    for rows in load(path).values():
        print("\n".join(tables(rows)))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mhc_results.jsonl")
