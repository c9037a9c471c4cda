"""Whether the delta rule's backward state sweep can run 16-wide value tiles on the GPU (issue 20, B1 rows).

At B1 T32768 H16 D128 the sequential state_backward runs one program per (head, 32-wide value tile): 64
programs on 132 SMs, 1.00 ms of GDN's 4.67 ms busy and 2.60 of KDA's 10.02 (H200, session 41). 16-wide
tiles double the programs; state.MIN_BACKWARD_SWEEP_TILE kept them at 32 until session 42, since 16-wide tiles
had returned a wrong initial-state gradient on the H100 (Triton 3.6, K = 100/128, bf16; every other output
right). This run checks each variant below on the kernel tests' cases, narrowed to the floor (twice, to
see a race), and times the B1 fwd+bwd of those that pass, with the state_backward kernel's own time:

    floor32            the floor until session 42 (32) with today's launch options
    floor16            16-wide tiles, today's options (GDN 4 warps 3 stages, KDA 8 warps 2 stages)
    floor16-w4-s3 ...  16-wide tiles with those warps (wN) and software-pipelining stages (sN), both gates
    floor16-inloop     16-wide tiles, dh0 stored inside the loop at its last step (the kernel's text
                       changed here, in a module written next to state.py for this process only)
    floor16-barrier    16-wide tiles, a tl.debug_barrier() before dh0's store after the loop
    floor16-reload     16-wide tiles, KDA's G tile loaded a second time for e^G (the kernel until session 42;
                       now loaded once a step, tiles._channel_decays)

On one H200 at 146d178 floor32, floor16, floor16-s2, floor16-s1, floor16-inloop and floor16-barrier were
all right, and 16-wide tiles with the options of then timed best (GDN s2 and s1 slower; inloop and barrier
equal): the floor became 16. The default list now times the second G load (reload) and the options at 16 wide.

    python benchmarks/analysis/narrow_backward_tile.py [--variants a,b] [--repeats 2] [--time-shapes B1T32768H16D128,B4T4096H16D128]
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import (check_cases, delta_rule_step, edited_module, right_variants, time_step,  # noqa: E402
                             use_kernel_tests)

use_kernel_tests()

from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule import plan as kernel_plan  # noqa: E402
from hccompile.kernels.delta_rule import state as state_kernels  # noqa: E402

STORE_AFTER_LOOP = """        if STORE_INITIAL_STATE_GRAD:
            _store_rows(dh0_ptr + seq * stride_dh0n + head * stride_dh0h, dstate, kc, vc, stride_dh0k, stride_dh0v,
                        kc < K, V)
"""
LAST_UPDATE = "            dstate -= _dot(tl.trans(w), du, dot_dtype, DOT_PRECISION)\n"
DECAYED_QUERIES = "                q_tile *= tl.exp(g)\n"


def variant_kernel(kind: str):
    """state_backward with its dh0 store changed (`kind`: inloop or barrier) or its gate tile loaded twice
    (reload), from state.py's text."""
    if kind == "inloop":
        in_loop = LAST_UPDATE + (
            "            if STORE_INITIAL_STATE_GRAD:\n"
            "                if step == num_chunks - 1:\n"
            "                    _store_rows(dh0_ptr + seq * stride_dh0n + head * stride_dh0h, dstate, kc, vc,\n"
            "                                stride_dh0k, stride_dh0v, kc < K, V)\n")
        # a sequence without chunks keeps the after-loop store (dh0 = dht)
        edits = [(LAST_UPDATE, in_loop),
                 (STORE_AFTER_LOOP, STORE_AFTER_LOOP.replace("if STORE_INITIAL_STATE_GRAD:",
                                                             "if STORE_INITIAL_STATE_GRAD and num_chunks == 0:"))]
    elif kind == "barrier":
        edits = [(STORE_AFTER_LOOP, "        tl.debug_barrier()\n" + STORE_AFTER_LOOP)]
    elif kind == "reload":  # the channel gate's G tile read a second time for e^G, as until session 42
        edits = [(DECAYED_QUERIES,
                  "                q_tile *= tl.exp(_load_rows(cum_ptr, tokens, kc, HV * K, 1, valid, K))\n")]
    else:
        raise ValueError(kind)
    return edited_module(state_kernels, edits, f"_state_variant_{kind}")._state_backward_kernel


ORIGINAL_KERNEL = chunk_kernels._state_backward_kernel
ORIGINAL_OPTIONS = chunk_kernels.state_launch_options


def apply(variant: str) -> None:
    """Sets the floor, the backward sweep's options and its kernel for `variant`."""
    parts = variant.split("-")
    state_kernels.MIN_BACKWARD_SWEEP_TILE = int(parts[0][len("floor"):])
    override = {}
    for part in parts[1:]:
        if part[0] in "ws" and part[1:].isdigit():
            override["num_warps" if part[0] == "w" else "num_stages"] = int(part[1:])

    def options(block_k_full, dtype, *, timed_sweep=None, intermediates=None):
        chosen = ORIGINAL_OPTIONS(block_k_full, dtype, timed_sweep=timed_sweep, intermediates=intermediates)
        if timed_sweep is not None and timed_sweep[1] == "backward":
            chosen = {**chosen, **override}
        return chosen

    chunk_kernels.state_launch_options = options
    kind = next((p for p in parts[1:] if p in ("inloop", "barrier", "reload")), None)
    chunk_kernels._state_backward_kernel = variant_kernel(kind) if kind else ORIGINAL_KERNEL


def check(variant: str, repeats: int) -> list[str]:
    import test_delta_rule_chunk as t

    kernel_plan.SWEEP_MIN_PROGRAMS = 10**6  # the narrowest tiles: the floor in the backward sweep
    try:
        return check_cases(t.KERNEL_CASES + t.NARROW_SWEEP_CASES, repeats)
    finally:
        kernel_plan.SWEEP_MIN_PROGRAMS = None


def time_variant(shape: str) -> str:
    out = []
    for op in ("gdn", "kda"):
        ms, kernels = time_step(*delta_rule_step(op, shape), ("state_backward",))
        out.append(f"{op} fwd+bwd {ms:.3f} ms, state_backward {kernels['state_backward']:.3f} ms")
    return "; ".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="floor16,floor16-reload,floor16-w4,floor16-s3")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--time-shapes", default="B1T32768H16D128,B4T4096H16D128",
                   help="comma-separated; at B4 H16 the tiles are not narrowed (the options still apply)")
    a = p.parse_args()
    def check_variant(variant: str) -> list[str]:
        apply(variant)
        return check(variant, a.repeats)

    passed = right_variants(a.variants.split(","), check_variant)
    for variant in a.variants.split(","):
        if variant not in passed and variant not in ("floor32", "floor16"):  # the two references, right or not
            continue
        apply(variant)
        for shape in a.time_shapes.split(","):
            try:
                print(f"{variant} {shape}{'' if variant in passed else ' (wrong, timed anyway)'}: "
                      f"{time_variant(shape)}", flush=True)
            except Exception:  # noqa: BLE001
                print(f"{variant} {shape}: timing failed\n{traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    main()
