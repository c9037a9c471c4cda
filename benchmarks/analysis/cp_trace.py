"""One CP step's GPU timeline per rank, from the chrome traces `benchmarks/cp.py --profile` writes.

    python benchmarks/analysis/cp_trace.py DIR/cp2_gdn_262144_one_rank0.trace.json DIR/...rank1.trace.json

The profile covers `steps` forward+backward steps (3); this prints the last one: every GPU kernel with its
start (ms from the step's first kernel, on that rank's clock), its duration, and the idle gap before it,
then per rank the step's span, its kernels' summed time (streams overlap: NCCL runs on its own, so the
sum can exceed the span), the NCCL part (a rank waiting for the other shows as a long NCCL kernel) and
the span not covered by the sum. Ranks' clocks are not aligned: compare spans and phases, not starts.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(path: Path) -> list[dict]:
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X"),
                  key=lambda e: e["ts"])


def last_step(events: list[dict], steps: int) -> list[dict]:
    """The events of the last of `steps` equal steps: the last len // steps events."""
    if not events:
        return []
    return events[len(events) - len(events) // steps:]


def summarize(path: Path, steps: int, min_gap_us: float) -> str:
    events = last_step(gpu_events(path), steps)
    if not events:
        return f"{path.name}: no GPU events (a CPU run?)"
    start = events[0]["ts"]
    lines = [f"== {path.name}: {len(events)} GPU events in the last of {steps} steps",
             f"{'start ms':>9} {'dur ms':>8} {'gap ms':>8}  kernel"]
    busy = nccl = 0.0
    end = start
    for event in events:
        gap = max(0.0, event["ts"] - end)
        duration = event["dur"]
        busy += duration
        if "nccl" in event["name"].lower():
            nccl += duration
        marker = f"{gap / 1e3:8.3f}" if gap >= min_gap_us else " " * 8
        lines.append(f"{(event['ts'] - start) / 1e3:9.3f} {duration / 1e3:8.3f} {marker}  {event['name'][:70]}")
        end = max(end, event["ts"] + duration)
    span = end - start
    lines.append(f"span {span / 1e3:.3f} ms, kernels {busy / 1e3:.3f} (NCCL {nccl / 1e3:.3f}), "
                 f"span minus kernels {(span - busy) / 1e3:.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=3, help="steps the profile covers (cp.py: 3)")
    parser.add_argument("--min-gap-us", type=float, default=20.0, help="idle gaps shorter than this are not printed")
    options = parser.parse_args(argv)
    for path in options.traces:
        print(summarize(path, options.steps, options.min_gap_us))


if __name__ == "__main__":
    main()
