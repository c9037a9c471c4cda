"""Markdown table and target ratios from benchmarks/mhc.py's JSON lines."""
import json
import sys


def main(path: str) -> None:
    rows = {r["variant"]: r for r in map(json.loads, open(path))}
    any_row = next(iter(rows.values()))
    print(f"{any_row['date']}, {any_row['device']}, torch {any_row['torch']}, {any_row['shape']}\n")
    print("| variant | step (ms) | peak memory above params (GiB) | compile (s) |")
    print("|---|---|---|---|")
    for v, r in rows.items():
        print(f"| {v} | {r['step_ms']:.2f} | {r['peak_gib']:.2f} | {r['compile_s']:.1f} |")
    base = rows.get("n1-inductor")
    best = rows.get("n4-hc-block")
    if base and best:
        print("\n| target | measured | goal |\n|---|---|---|")
        print(f"| memory n4 hc / n1 inductor | {best['peak_gib'] / base['peak_gib']:.2f}x | <= 1.3x |")
        print(f"| step time n4 hc / n1 inductor | {best['step_ms'] / base['step_ms']:.2f}x | <= 1.10x |")
        n1c = rows.get("n1-hc", base)["compile_s"]
        print(f"| compile n4 hc / n1 hc | {best['compile_s'] / n1c:.1f}x | <= 2x |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mhc_results.jsonl")
