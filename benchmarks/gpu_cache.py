"""Packs the compiled binaries of our own Triton kernels from the GPU suite's Triton cache, for the next
device session's suite to start from (Makefile: test-gpu packs, GPU_CACHE seeds).

Triton's cache keeps an entry per compiled kernel: a directory holding the metadata (json), the binary
(cubin) and every intermediate (source, ttir, ttgir, llir, ptx), listed by a group file. A lookup needs
the group file, the metadata and the binary only, once the group file names only those: Triton takes a
group's children by path (triton/runtime/cache.py get_group; 3.6 skips a missing child, 3.9 misses on one),
and a compiled kernel runs from its cubin. So the group files are rewritten to list the kept children;
their paths stay absolute, the device's GPU_CACHE_DIR, the same in every session.
The intermediates are 3-4 times the binary (session 51: wy_solve's 211 KB cubin beside 1.0 MB of text),
so the whole cache (1.9 GB at f2f9d4a) and even our entries whole (2660 of them) were over the budget a
call can carry back and in (64 MiB with the tree and the wheels). Binaries gzip ~4x.

Entries of Inductor's generated kernels (files named triton_*) are left out: Inductor's own cache keys
them by graph, and they change with every graph. Ours are packed smallest first (a small kernel costs
about as much compile time as a large one, for a fraction of the bytes) until the archive fills the
budget; entries past it compile as before.

    python3 benchmarks/gpu_cache.py CACHE_DIR OUT_DIR BUDGET_MIB [PART_MIB]

writes OUT_DIR/cache-triton-ours.tgz.00, .01, ... (PART_MIB each, 15 by default) and prints the packed size
in bytes on its last line (0 when nothing fitted).
"""
from __future__ import annotations

import io
import json
import os
import sys
import tarfile

KEPT_SUFFIXES = (".json", ".cubin")
# bytes of a cubin per byte of its gzip (four of our kernels compiled for sm_90: 3.7-4.0)
GZIP_RATIO = 3.5


def our_entries(cache_dir: str) -> list[tuple[int, list[str]]]:
    """(estimated packed bytes, kept files relative to cache_dir) of each entry of our kernels."""
    root = os.path.join(cache_dir, "triton")
    entries = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        entry = os.path.join(root, name)
        files = sorted(os.listdir(entry)) if os.path.isdir(entry) else []
        if not files or any(f.startswith(("triton_", "__grp__triton_")) for f in files):
            continue
        kept = [f for f in files if f.endswith(KEPT_SUFFIXES)]
        if not any(f.endswith(".cubin") for f in kept):
            continue
        size = sum(os.path.getsize(os.path.join(entry, f)) for f in kept)
        entries.append((int(size / GZIP_RATIO) + 512, [os.path.join("triton", name, f) for f in kept]))
    return sorted(entries)


def pack(cache_dir: str, files: list[str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
        for path in files:
            full = os.path.join(cache_dir, path)
            if not os.path.basename(path).startswith("__grp__"):
                archive.add(full, arcname=path)
                continue
            with open(full) as f:
                group = json.load(f)
            group["child_paths"] = {name: where for name, where in group.get("child_paths", {}).items()
                                    if name.endswith(KEPT_SUFFIXES)}
            data = json.dumps(group).encode()
            info = archive.gettarinfo(full, arcname=path)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def main() -> None:
    cache_dir, out_dir, budget_mib = sys.argv[1], sys.argv[2], float(sys.argv[3])
    part = int(float(sys.argv[4]) * 1048576) if len(sys.argv) > 4 else 15 * 1048576
    budget = int(budget_mib * 1048576)
    entries = our_entries(cache_dir)
    count, total = 0, 0
    for estimate, _ in entries:  # the smallest first, while the estimate fits
        if total + estimate > budget:
            break
        count, total = count + 1, total + estimate
    data = b""
    while count:
        data = pack(cache_dir, [f for _, files in entries[:count] for f in files])
        if len(data) <= budget:
            break
        count = int(count * 0.85)  # the estimate was short: fewer entries
        data = b""
    os.makedirs(out_dir, exist_ok=True)
    for index in range(0, len(data), part):
        with open(os.path.join(out_dir, f"cache-triton-ours.tgz.{index // part:02d}"), "wb") as f:
            f.write(data[index:index + part])
    print(f"triton-ours: {count} of {len(entries)} entries of our kernels packed (cubin and metadata only), "
          f"{len(data) / 1048576:.1f} MiB")
    print(len(data))


if __name__ == "__main__":
    main()
