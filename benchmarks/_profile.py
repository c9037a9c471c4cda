"""Per-kernel GPU time of a step, from torch.profiler: which kernels a step spends its time in, how
many launches it makes, and how much of the wall time the GPU is busy (a step whose GPU-busy time is
far below its wall time is bound by the host: Python, dispatch and launch overhead)."""
from __future__ import annotations

import time

import torch


def profile_step(step, steps: int = 5, top: int = 30) -> tuple[str, dict]:
    """Runs `step` (already warm) `steps` times under the profiler. Returns a text table of the
    kernels by total GPU time (per step) and a summary dict."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    events = sorted(prof.events(), key=lambda e: getattr(getattr(e, "time_range", None), "start", 0))
    for event in events:
        device_type = getattr(event, "device_type", None)
        if device_type is None or "CUDA" not in str(device_type):
            continue
        duration = getattr(event, "device_time", None)
        if duration is None:
            duration = getattr(event, "cuda_time", 0.0)
        kernels.setdefault(event.name, []).append(float(duration) / 1e3)  # us -> ms
    rows = sorted(((sum(v) / steps, len(v) / steps, name) for name, v in kernels.items()), reverse=True)
    busy = sum(r[0] for r in rows)
    launches = sum(r[1] for r in rows)
    lines = [f"wall {wall_ms:.3f} ms/step (unprofiled), GPU busy {busy:.3f} ms/step "
             f"({100 * busy / max(wall_ms, 1e-9):.0f}%), {launches:.0f} kernels/step",
             f"{'ms/step':>9} {'share':>6} {'calls':>6}  kernel"]
    for ms, calls, name in rows[:top]:
        lines.append(f"{ms:9.3f} {100 * ms / max(busy, 1e-9):5.1f}% {calls:6.0f}  {name[:110]}")
        per_step = len(kernels[name]) // steps
        if 1 < per_step <= 8 and ms >= 0.05 * busy and len(kernels[name]) == per_step * steps:
            # A kernel launched a few times per step (a loop over layers, say): each launch's time,
            # in launch order, averaged over the steps.
            each = [sum(kernels[name][s * per_step + i] for s in range(steps)) / steps for i in range(per_step)]
            lines.append(f"{'':9} {'':6} {'':6}    each launch, in order: {', '.join(f'{x:.3f}' for x in each)} ms")
    summary = {"wall_ms": wall_ms, "gpu_busy_ms": busy, "kernels_per_step": launches,
               "top": [{"kernel": n[:160], "ms": ms, "calls": c} for ms, c, n in rows[:top]]}
    return "\n".join(lines), summary


def memory_at_peak(step, top: int = 25) -> str:
    """The blocks alive when one step's allocated memory peaks, largest first, each with the Python
    frame that allocated it (in Inductor's generated code, the line names the buffer: "buf84 =
    empty_strided_cuda(...)"), from the allocator's recorded history replayed event by event. Counts
    what the step allocates, not what was alive before it (parameters, optimizer state)."""
    import linecache

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=500_000)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, dict] = {}
    current = peak = 0
    at_peak: dict[int, dict] = {}
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
            if action == "alloc":
                live[addr] = event
                current += size
                if current > peak:
                    peak, at_peak = current, dict(live)
            elif action == "free_completed" and addr in live:
                current -= live.pop(addr).get("size", 0)

    def where(event) -> str:
        frames = event.get("frames") or []
        mine = [f for f in frames if "torchinductor" in f.get("filename", "") or "hccompile" in f.get("filename", "")
                or "benchmarks" in f.get("filename", "")]
        frame = (mine or frames or [{}])[0]
        text = linecache.getline(frame.get("filename", ""), frame.get("line", 0)).strip()
        return f"{frame.get('filename', '?').rsplit('/', 1)[-1]}:{frame.get('line', '?')} {frame.get('name', '')}: {text[:110]}"

    groups: dict[str, list[int]] = {}
    for event in at_peak.values():
        groups.setdefault(where(event), []).append(event.get("size", 0))
    rows = sorted(((sum(sizes), len(sizes), place) for place, sizes in groups.items()), reverse=True)
    lines = [f"peak {peak / 2**30:.3f} GiB allocated within the step, {len(at_peak)} blocks alive at the peak"]
    lines += [f"  {total / 2**20:9.1f} MiB  {count:3d} x  {place}" for total, count, place in rows[:top]]
    return "\n".join(lines)
