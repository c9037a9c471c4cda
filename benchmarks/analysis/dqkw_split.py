"""Whether GDN's dqkw kernel runs faster with its key tiles spread over programs, and with one pass over the
value tiles (issue 20, GDN B1 rows).

dqkw (kernels/delta_rule/dqkw.py) is the largest kernel of GDN's fwd+bwd at B1 T32768 H16 D128: 1.29 of 4.67 ms
busy on one H200 (session 41's delta-profile), about 3x what its bytes cost at the copy bandwidth (~1.9 GB,
0.45 ms). One program per (chunk, value head) walks both 64-wide key tiles in turn at 8 warps, one stage,
231 registers (Triton 3.6): one program per SM, and no load overlapped with the products. FLA's chunk_bwd_kernel_dqkwg
runs one program per (key tile, chunk, head) and forms dS in each. GDN B1 at 0.884x FLA (2bb0177) needs
about 0.42 ms off to meet <= 0.8x.

Each variant below is checked on the kernel tests' cases that take dqkw (no gate and scalar gates, fixed and
variable length, float64 reference; twice, to see a race) and on the test file's repeat check (eight backwards,
every gradient bitwise equal), and, if right, timed: GDN fwd+bwd at the shapes
given (do_bench, bf16, l2norm in kernel) with dqkw's own GPU time (profiler), beside `base` in one process.

    base         today's kernel and options (DQKW_OPTIONS, BK = BV = 64)
    split        one program per (chunk, value head, key tile): dS formed in each (one more [BT, V] x [V, BT]
                 product and the dO, U tiles read again, from L2 mostly); dG's rows of the key tiles summed by
                 tl.atomic_add into a zeroed buffer (two tiles at K <= 128: x + y either way, so bitwise
                 deterministic; four at K = 256 are not)
    onepass      one program per (chunk, value head, key tile) and one pass over the value tiles, dS accumulated
                 beside the three products (FLA's dqkwg order): the dO, U tiles read once; dG's rows added as in
                 split (at BK 128 and K <= 128 one tile: one add onto zero)
    -kN -vN      BK, BV; -wN -sN warps and software-pipelining stages; -mem dS through memory
                 (DQKW_SCORES_VIA_MEMORY; base and split only)

FLA's own autotuner timed its dqkwg on one H200 at B1 T32768 H16 K128 (its cache, committed in
benchmarks/autotune/): 0.914 ms at BK = BV = 128 and 4 warps, against our dqkw's 1.285 in session 41's profile.

Compiled for sm_90 on the CPU (--sm90, Triton 3.6, K = V = 128 bf16): base 231 registers at 8 warps, 56 KiB of
shared memory, one program per SM; the split at 8 warps 166 registers, still one per SM (two need <= 128); at
4 warps two per SM without spills: split-k32-w4-s2 (248 registers, 56 KiB), split-k32-w4-s3 (246, 88),
split-w4-v32-s2 / -s3 (254; 32 / 52 KiB), split-k32-v32-w4-s3 (209, 44); split-w4-s2 spills 40 bytes. BK 32 at
4 warps gave wrong dq and dk in the unsplit kernel on the H100 (dqkw.py's launch options): the check decides.
The one-pass kernel: onepass-w4-v32-s3 255 registers, no spills, two per SM; onepass-k128-v64-w8-s2 16 bytes of
spills, one per SM; onepass-k128-v128-w4-s2 (FLA's tiles) 1944 bytes of spills; onepass-w8-s2 157 registers.

The split kernel is dqkw.py's text with the key loop's two lines and dG's store changed, in a module written
next to dqkw.py for this process only, so it follows dqkw.py as it is.

    python benchmarks/analysis/dqkw_split.py [--variants base,split,split-s2] [--repeats 2]
        [--time-shapes B1T32768H16D128,B4T4096H16D128]
    python benchmarks/analysis/dqkw_split.py --sm90    # no GPU: each variant compiled for sm_90
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_variants import check_cases, edited_module, right_variants, use_kernel_tests  # noqa: E402
from shapes import bthd  # noqa: E402

use_kernel_tests()

from hccompile.kernels.delta_rule import chunk as chunk_kernels  # noqa: E402
from hccompile.kernels.delta_rule import dqkw  # noqa: E402
from hccompile.kernels.delta_rule.plan import block_size  # noqa: E402
from hccompile.kernels._triton import scratch_rows, triton  # noqa: E402

KEY_LOOP = ("        for k0 in range(0, K, BK):\n"
            "            kc = k0 + tl.arange(0, BK)\n")
SPLIT_KEY = ("        for _ in tl.static_range(1):\n"
             "            kc = tl.program_id(2) * BK + tl.arange(0, BK)\n")
GATE_STORE = "            tl.store(dg_ptr + tokens * HV, dg, mask=valid)\n"
GATE_ADD = "            tl.atomic_add(dg_ptr + tokens * HV, dg, mask=valid)\n"


# The one-pass body: from the dS pass's comment to dG's store, replaced by one pass over the value tiles that
# accumulates dS beside the key tile's three products (FLA's dqkwg order; their autotuner's H200 timing of it at
# B1 T32768 H16 K128, BK = BV = 128, 4 warps: 0.914 ms, against our dqkw's 1.285).
ONEPASS_START = "        # dS first, in a pass of its own"
ONEPASS_BODY = """        # one pass over the value tiles: dS beside the key tile's three accumulators
        kc = tl.program_id(2) * BK + tl.arange(0, BK)
        d_scores, dq_state, dk_to_end, dw, dg_whole = _dqkw_value_pass(
            do_ptr, u_ptr, du_ptr, h_ptr, dh_ptr, tokens, valid, kc, stride_dot, stride_dov, HV, K, V,
            dot_dtype, BT, BK, BV, GATE, DOT_PRECISION)
        d_scores = tl.where((local[:, None] >= local[None, :]) & valid[:, None], scale * d_scores, 0.0)
        if GATE == 1:
            d_scores *= _pair_decays(cum_ptr, tokens, valid, HV, BT)
        d_scores = d_scores.to(dot_dtype)
        dg = _dqkw_finish_tile(q_ptr, k_ptr, cum_ptr, dq_ptr, dk_ptr, dw_ptr, d_scores, d_scores, dq_state,
                               dk_to_end, dw, dg_whole, tokens, valid, last, length, kc, stride_qt, stride_qk,
                               stride_kt, stride_kk, HV, K, scale, dot_dtype, BT, GATE, DOT_PRECISION, False)
        if GATE == 1:
            tl.atomic_add(dg_ptr + tokens * HV, dg, mask=valid)
"""
# ... with dqkw.py's value pass accumulating dS too (in the variant module only: its body above is the one caller)
VALUE_PASS_EDITS = [
    ("        dg_whole = tl.zeros([BK], dtype=tl.float32)\n        key_valid = kc < K\n",
     "        dg_whole = tl.zeros([BK], dtype=tl.float32)\n        key_valid = kc < K\n"
     "        d_scores = tl.zeros([BT, BT], dtype=tl.float32)\n"),
    ("            dq_state += _dot(do_tile, tl.trans(state), dot_dtype, DOT_PRECISION)\n",
     "            d_scores += _dot(do_tile, tl.trans(u), dot_dtype, DOT_PRECISION)\n"
     "            dq_state += _dot(do_tile, tl.trans(state), dot_dtype, DOT_PRECISION)\n"),
    ("        return dq_state, dk_to_end, dw, dg_whole\n", "        return d_scores, dq_state, dk_to_end, dw, dg_whole\n"),
]


def split_kernel():
    """_dqkw_kernel with one key tile per program (program_id(2)) and dG's rows added, from dqkw.py's text."""
    return edited_module(dqkw, [(KEY_LOOP, SPLIT_KEY), (GATE_STORE, GATE_ADD)], "_dqkw_variant_split")._dqkw_kernel


def onepass_kernel():
    """_dqkw_kernel with one key tile per program and one pass over the value tiles (ONEPASS_BODY), from
    dqkw.py's text: its coordinates and pointers as they are, its body from the dS pass to dG's store replaced."""
    source = open(dqkw.__file__).read()
    start, end = source.index(ONEPASS_START), source.index(GATE_STORE) + len(GATE_STORE)
    return edited_module(dqkw, VALUE_PASS_EDITS + [(source[start:end], ONEPASS_BODY)],
                         "_dqkw_variant_onepass")._dqkw_kernel


def parse(variant: str) -> dict:
    parts = variant.split("-")
    assert parts[0] in ("base", "split", "onepass"), variant
    chosen = {"kernel": parts[0], "split": parts[0] != "base", "BK": dqkw.DQKW_BLOCK_K, "BV": dqkw.DQKW_BLOCK_V,
              "options": dict(dqkw.DQKW_OPTIONS), "via_memory": dqkw.DQKW_SCORES_VIA_MEMORY}
    for part in parts[1:]:
        if part == "mem":
            chosen["via_memory"] = True
        elif part[0] in "kv" and part[1:].isdigit():
            chosen["BK" if part[0] == "k" else "BV"] = int(part[1:])
        elif part[0] in "ws" and part[1:].isdigit():
            chosen["options"]["num_warps" if part[0] == "w" else "num_stages"] = int(part[1:])
        else:
            raise ValueError(f"{variant}: unknown part {part!r}")
    return chosen


def launcher(variant: str):
    """A launch_dqkw for `variant` (launch_dqkw's arguments and contract)."""
    chosen = parse(variant)
    kernel = {"base": lambda: dqkw._dqkw_kernel, "split": split_kernel, "onepass": onepass_kernel}[chosen["kernel"]]()

    def launch(plan, q, k, do, cum, u, du, h, dh, dq_heads, dk_heads, dw, dcum, num_chunks, table, seqlens,
               scale):
        problem = plan.problem
        block_k = block_size(problem.key_dim, chosen["BK"])
        key_tiles = triton.cdiv(problem.key_dim, block_k) if chosen["split"] else 1
        if chosen["split"] and plan.gate_code == 1:
            dcum.zero_()  # the key tiles' programs add their rows of dG
        scratch = (torch.empty(scratch_rows(num_chunks), problem.value_heads, plan.chunk_size, plan.chunk_size,
                               dtype=plan.intermediate_dtype, device=q.device) if chosen["via_memory"] else plan.dummy)
        plan.launch(kernel)[(num_chunks, problem.value_heads, key_tiles)](
            q, k, do, cum, u, du, h, dh, dq_heads, dk_heads, dw, dcum, scratch,
            *q.stride(), *k.stride(), *do.stride(), table, seqlens,
            problem.time, plan.chunks_per_row, problem.value_heads, problem.group_size, problem.key_dim,
            problem.value_dim, scale,
            GATE=plan.gate_code, BT=plan.chunk_size, BK=block_k,
            BV=block_size(problem.value_dim, chosen["BV"]), IS_VARLEN=plan.varlen,
            DOT_PRECISION=plan.dot_precision, SCORES_VIA_MEMORY=chosen["via_memory"], **chosen["options"],
        )

    return launch


ORIGINAL_LAUNCH = chunk_kernels.launch_dqkw


def apply(variant: str) -> None:
    chunk_kernels.launch_dqkw = ORIGINAL_LAUNCH if variant == "base" else launcher(variant)


def cases():
    """The kernel tests' cases that reach dqkw (no gate or a scalar one), and varlen ones of each."""
    import test_delta_rule_chunk as t

    picked = [c for c in t.KERNEL_CASES if c[2] != "channel"]
    for gate in ("none", "scalar"):
        picked.append((f"{gate}-varlen", t.THREE_SEQUENCES, gate, t.THREE_SEQUENCE_OPTIONS, torch.bfloat16, 32))
    return picked


def check(repeats: int) -> list[str]:
    import test_delta_rule_chunk as t

    failures = check_cases(cases(), repeats)
    # the test file's repeat check (8 backwards on the GPU, every gradient bitwise equal): dG's rows are
    # added by atomics, deterministic for two key tiles only (K 128 at BK 64), and the port must keep it so
    for name, (_, sizes, gate, options, dtype, chunk), narrow in t.REPEAT_CASES:
        if gate == "channel":
            continue
        try:
            t.check_repeated_backward(sizes, gate, options, dtype, chunk, checked=("k", "g"))
        except AssertionError as error:
            failures.append(f"{name} repeated: {str(error).splitlines()[0][:100]}")
    return failures


def time_gdn(shape: str) -> str:
    import hccompile
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench

    B, T, H, D = bthd(shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    beta = torch.rand(B, T, H, generator=gen, device="cuda").bfloat16().requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen, device="cuda")).requires_grad_()
    do = torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16()
    leaves = [q, k, v, g, beta]

    def step():
        hccompile.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0].backward(do)

    step()
    ms = do_bench(step, grad_to_none=leaves)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
            for leaf in leaves:
                leaf.grad = None
        torch.cuda.synchronize()
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 3 / 1e3
    kernel = sum(e.device_time_total for e in prof.key_averages() if "dqkw" in e.key) / 3 / 1e3
    return f"GDN fwd+bwd {ms:.3f} ms, GPU busy {busy:.3f} ms, dqkw {kernel:.3f} ms"


def sm90(variants: list[str]) -> None:
    """--sm90 (no GPU, no TRITON_INTERPRET): each variant's dqkw launch in a GDN backward at K = V = 128, bf16,
    l2norm (compile_check's case: HV 16, the benchmark's strides) compiled for sm_90, with its registers,
    spills and shared memory (ptxas through hccompile's compile_check)."""
    from hccompile.kernels.delta_rule.compile_check import _case
    from hccompile.kernels.launch_recorder import recording_launches
    from hccompile.kernels.mhc.compile_check import ARCH, compile_launch, resources

    inputs, do, dht = _case("scalar", 128, torch.bfloat16, False)
    for variant in variants:
        apply(variant)
        with recording_launches() as calls:
            chunk_kernels.chunk_delta_rule_bwd(**inputs, do=do, dht=dht)
        for kernel, grid, args, kwargs in calls:
            if "dqkw" not in kernel.__name__:
                continue
            try:
                compiled = compile_launch(kernel, args, kwargs, ARCH)
                usage = resources(compiled)
            except Exception as error:  # noqa: BLE001 -- a failed compile is a result here
                print(f"{variant:20s} compile failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            tiles = {k: v for k, v in kwargs.items() if k in ("BK", "BV", "num_warps", "num_stages")}
            warps, shared = kwargs.get("num_warps", 4), compiled.metadata.shared
            # programs an SM holds at once: 64K registers (allocated per warp, 8 a thread at a time) and
            # 228 KiB of shared memory (cuobjdump's SHARED is only the static part; Triton's is dynamic)
            resident = min(65536 // (-(-usage["REG"] // 8) * 8 * 32 * warps), 228 * 1024 // max(shared + 1024, 1))
            print(f"{variant:20s} grid {tuple(grid)} {tiles} REG {usage['REG']} STACK {usage.get('STACK', 0)} "
                  f"shared {shared // 1024} KiB, {resident} program(s) per SM", flush=True)
    apply("base")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="onepass-w4-v32-s3,onepass-k128-v64-w8-s2,onepass-k128-v128-w4-s2,"
                   "onepass-w4-s2,onepass-w8-s2,split-k32-w4-s2,split-w4-v32-s2,split-k32-v32-w4-s3,split-w4-v32-s3",
                   help="in the order run; base is timed first and last whatever the list")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--time-shapes", default="B1T32768H16D128,B4T4096H16D128")
    p.add_argument("--no-time", action="store_true", help="check only (the CPU's interpreter)")
    p.add_argument("--sm90", action="store_true", help="compile each variant for sm_90 only (no GPU)")
    a = p.parse_args()
    variants = a.variants.split(",")
    if a.sm90:
        sm90(variants)
        return

    def check_variant(variant: str) -> list[str]:
        apply(variant)
        return check(a.repeats)

    def time_all(variant: str) -> None:
        apply(variant)
        for shape in a.time_shapes.split(","):
            try:
                print(f"{variant} {shape}: {time_gdn(shape)}", flush=True)
            except Exception:  # noqa: BLE001
                print(f"{variant} {shape}: timing failed\n{traceback.format_exc()}", flush=True)

    # Each variant timed as soon as it is found right, so a run cut by its time limit keeps what it timed;
    # base timed first and last, so a drift of the machine shows.
    if not a.no_time:
        time_all("base")
    for variant in variants:
        if right_variants([variant], check_variant) and not a.no_time and variant != "base":
            time_all(variant)
    if not a.no_time:
        time_all("base")
    apply("base")


if __name__ == "__main__":
    main()
