"""Launch options (num_warps, num_stages) of the delta-rule kernels, one kernel at a time: each
variant overrides one kernel's options and times a whole forward+backward, next to the baseline
in the same process. It finds which of the kernels' fixed options (measured on sm_90 for spills,
not for speed) leave time on the table.

    python benchmarks/tune_delta_rule.py --ops gdn,kda --shape B4T4096H16D128 --out tune.jsonl

Rows: op, intermediates (default / fp32 for bf16 inputs), kernel, options, ms, ms / baseline.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hccompile.kernels.delta_rule import chunk, dqkw, gate_cumsum, local_du, output, qk_l2norm, scores, state, wy_bwd  # noqa: E402
from hccompile.kernels.delta_rule import plan as kernel_plan  # noqa: E402
from profile_ops import parse_shape  # noqa: E402

# kernel attribute -> (the module whose launcher reads it, option sets tried); the launcher's own
# options are the baseline. An upper-case name is a module constant the launchers read, set to each
# value in turn.
VARIANTS = {
    # 4 warps: KDA's default 2 spill 240 bytes per thread on Triton 3.6 (sm_90, K 128 bf16), 4 none (240 registers)
    "_wy_solve_kernel": (chunk, [dict(num_warps=1), dict(num_warps=2), dict(num_warps=4), dict(num_warps=8),
                                 dict(num_stages=1), dict(num_stages=3)]),
    "_wy_backward_kernel": (chunk, [dict(num_warps=4), dict(num_warps=16)]),
    # GDN's split wy_backward (plan.SPLIT_WY_BACKWARD)
    "_dqkw_kernel": (dqkw, [dict(num_warps=8), dict(num_stages=1), dict(num_stages=3)]),
    "_wy_bwd_kernel": (wy_bwd, [dict(num_warps=8), dict(num_stages=1), dict(num_stages=3)]),
    "_decayed_scores_kernel": (scores, [dict(num_warps=4), dict(num_warps=8)]),
    "_decayed_scores_backward_kernel": (scores, [dict(num_warps=2), dict(num_warps=4), dict(num_warps=8),
                                                dict(num_stages=1), dict(num_stages=3)]),
    "_state_forward_kernel": (chunk, [dict(num_warps=4), dict(num_warps=8), dict(num_stages=1), dict(num_stages=3),
                                      dict(num_stages=4)]),
    "_state_backward_kernel": (chunk, [dict(num_warps=4), dict(num_warps=8), dict(num_stages=1), dict(num_stages=3)]),
    "_output_kernel": (chunk, [dict(num_warps=8), dict(num_stages=1), dict(num_stages=2), dict(num_stages=4)]),
    # Module constants the launchers read at call time: the values tried.
    "L2NORM_BLOCK_ROWS": (qk_l2norm, [32, 64]),
    # the output kernel's value tile: 64 forms P twice per chunk and head at V 128 (default 128: once)
    "OUTPUT_BLOCK_V": (output, [64]),
    "L2NORM_WARPS": (qk_l2norm, [1, 2, 8]),
    # GDN: decayed_scores_backward apart from wy_backward (KDA takes it either way)
    "FUSED_SCORES_BACKWARD": (kernel_plan, [False]),
    # GDN: wy.py's single wy_backward instead of the split
    "SPLIT_WY_BACKWARD": (kernel_plan, [False]),
    # KDA: decayed_scores and its backward with one program per sub-chunk instead of one per chunk (the
    # default since sessions 45 and 46)
    "CHUNK_SCORE_PROGRAMS": (kernel_plan, [False]),
    # KDA: the backward sweep on decayed queries and keys formed before it (decayed_keys.py)
    "PREPARED_CHANNEL_SWEEP": (kernel_plan, [True]),
    # KDA: wy_solve's substitution with a row load per step instead of L's diagonal blocks loaded once
    "REGISTER_DIAGONAL_BLOCKS": (kernel_plan, [False]),
    # wy_solve in two launches (the solve, then W and U~ at WY_FORM_WARPS): a dict sets each of its constants
    "SPLIT_WY_SOLVE": (kernel_plan, [{"SPLIT_WY_SOLVE": True, "WY_FORM_WARPS": w} for w in (2, 4, 8)]),
    # GDN: dU's local part (scale P^T dO) by a chunk-parallel kernel before the backward sweep forced on and
    # off (default: on where the sweep's grid fits one wave, plan.local_du_wanted); that kernel's warps
    # (default 4) in a process with HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL=1
    "LOCAL_DU_KERNEL": (kernel_plan, [True, False]),
    "LOCAL_DU_WARPS": (local_du, [2, 8]),
    # GDN: dk's partial sum between dqkw and wy_bwd in fp32 (in bf16 the default since session 50: 0.986x at B1)
    "HALF_DK_PARTIAL": (kernel_plan, [False]),
    # GDN: the forward's decayed_scores launch instead of Kdot formed in wy_solve and P in the output kernel
    "FUSED_SCORES_FORWARD": (kernel_plan, [False]),
    # the sweeps' value tiles: narrowed while the grid fills at most half of this many programs (None: the
    # SM count; 0: never narrowed)
    "SWEEP_MIN_PROGRAMS": (kernel_plan, [0, 264, 528]),
    # dqkw's key tile: 128 puts K 128 in one program per chunk and head (at DQKW_OTHER_WARPS); narrower tiles
    # are widened until K takes at most two (dqkw.dqkw_key_block)
    "DQKW_BLOCK_K": (dqkw, [128]),
    # GDN: a chunk's two dqkw key-tile programs next to each other in the launch (the default since session 48,
    # 0.980x at B1; False: the key tile as the grid's slowest axis)
    "DQKW_KEY_TILES_FASTEST": (dqkw, [False]),
    # wy_bwd's tiles (4 warps, 2 stages): BK 32 compiles without the 104 bytes of spills BK 64 has on Triton 3.6
    # (it gave wrong dbeta and dk on the H100: wy_bwd.py's note; this times it, the kernel tests judge it)
    "WY_BWD_BLOCK_K": (wy_bwd, [16, 32]),
    "WY_BWD_BLOCK_V": (wy_bwd, [32, 128]),
    # wy_bwd's dL = -A^T dA A^T as tf32 products of the fp32 A instead of from bf16 A and dA (FLA's order,
    # the default since session 46)
    "WY_BWD_HALF_DL": (wy_bwd, [False]),
    # KDA with the gate in the kernel (--ops kda-gate): gate_backward's key tile and warps (default 32 and 8)
    "GATE_BACKWARD_BLOCK_K": (gate_cumsum, [64]),
    "GATE_BACKWARD_WARPS": (gate_cumsum, [4]),
    # KDA: the score kernels' gate span past which a diagonal block is split (default 40): what the split
    # blocks cost (with FLA's gate initialisation 3.5 % of the sub-chunks pass 40, 0.02 % pass 60; factoring
    # them loses accuracy in bf16: Kdot 5.8e-3 and P 5.9e-3 against float64 always factored, 4.0e-3 and 2.6e-3
    # at 40, 3.8e-3 and 1.7e-3 always split, in the strong-gate test case)
    "FACTOR_SPAN_LIMIT": (scores, [60.0, float("inf")]),
    # The backward sweep's widest value tile (K * BV elements; default 64 * 64: BV 32 at K 128). At B4 T4096 H16
    # the default BV 32 makes 256 programs, two waves at one CTA an SM (177-206 KiB of shared memory); BV 64
    # makes 128, one wave, and the one-wave rule then turns dU's local part on (plan.local_du_wanted). Compiled
    # for sm_90 on the CPU (Triton 3.9, session 52): BV 64 at 4 warps spills 184 B with local dU (456-464
    # without), so 8 warps too. A key "module.NAME" sets another module's constant; "launch" overrides the
    # options of the named kernels.
    "STATE_TILE_ELEMENTS": (state, [8192,
                                    {"STATE_TILE_ELEMENTS": 8192, "launch": {"_state_backward_kernel": dict(num_warps=8)}},
                                    {"STATE_TILE_ELEMENTS": 8192, "plan.LOCAL_DU_KERNEL": False}]),
}
MODULES = {"plan": kernel_plan, "state": state, "chunk": chunk}


@contextlib.contextmanager
def launch_override(kernel, options):
    """While active, every launch plan chunk.py makes launches `kernel` with `options` in place of its
    own. The ops launch through plan.launch (torch.library.wrap_triton, eager and traced alike), which
    takes only JIT kernels: the options are swapped at the launch, not by replacing the kernel object."""
    make_plan = chunk.make_plan

    def make_overriding(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        launch = plan.launch
        plan.launch = lambda k: _Override(launch(k), options) if k is kernel else launch(k)
        return plan

    chunk.make_plan = make_overriding
    try:
        yield
    finally:
        chunk.make_plan = make_plan


class _Override:
    """Stands in for a JIT kernel: kernel[grid](*args, **options) with some options replaced."""

    def __init__(self, kernel, options):
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **{**kwargs, **self.options})


def step_fn(op: str, shape: dict, compiled: bool = False):
    import hccompile

    B, T, H, D = shape["B"], shape["T"], shape["H"], shape["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*s):
        return torch.randn(*s, generator=gen, device="cuda").bfloat16().requires_grad_()

    q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    beta = torch.rand(B, T, H, generator=gen, device="cuda").bfloat16().requires_grad_()
    g_shape = (B, T, H) if op == "gdn" else (B, T, H, D)
    f = hccompile.chunk_gated_delta_rule if op == "gdn" else hccompile.chunk_kda
    if op == "kda-gate":  # the gate activation in the kernel, raw g and FLA's KDA initialisation (delta_rule.py)
        from delta_rule import kda_gate_parameters

        g = randn(*g_shape)
        A_log, dt_bias = (t.requires_grad_() for t in kda_gate_parameters(H, D, gen))
        gate = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    else:
        g = torch.nn.functional.logsigmoid(torch.randn(*g_shape, generator=gen, device="cuda")).requires_grad_()
        gate = {}
    do = torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16()

    call = (lambda *a: f(*a, use_qk_l2norm_in_kernel=True, **gate)[0])
    if compiled:  # Inductor's code launches the kernels (issue 24); one graph for every length
        call = torch.compile(call, fullgraph=True, dynamic=True)

    def step():
        o = call(q, k, v, g, beta)
        torch.autograd.backward(o, do)

    return step


def measure(step) -> float:
    from triton.testing import do_bench

    step()
    torch.cuda.synchronize()
    return float(do_bench(step, warmup=25, rep=200, return_mode="median"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="gdn,kda")
    p.add_argument("--shape", default="B4T4096H16D128")
    p.add_argument("--modes", default="default,fp32",
                   help="intermediates: default and/or fp32 (BF16_INTERMEDIATES off, for bf16 inputs)")
    p.add_argument("--kernels", default=",".join(VARIANTS), help="comma-separated kernel (or constant) names")
    p.add_argument("--out", default=None, help="append JSON lines here")
    args = p.parse_args()
    shape = parse_shape(args.shape)
    bf16_default = kernel_plan.BF16_INTERMEDIATES
    for op in args.ops.split(","):
        step = step_fn(op, shape)
        for mode in args.modes.split(","):
            kernel_plan.BF16_INTERMEDIATES = mode != "fp32"
            base = measure(step)
            print(f"{op} {mode:7s} baseline {base:.3f} ms", flush=True)
            rows = [dict(op=op, mode=mode, kernel="baseline", options={}, ms=base, ratio=1.0)]
            for name in args.kernels.split(","):
                module, variants = VARIANTS[name]
                original = getattr(module, name)
                for options in variants:
                    override = contextlib.ExitStack()
                    if name.isupper():
                        constants = dict(options) if isinstance(options, dict) else {name: options}
                        for kernel_name, kernel_options in constants.pop("launch", {}).items():
                            override.enter_context(launch_override(getattr(chunk, kernel_name), kernel_options))
                        targets = {key: (MODULES[key.split(".")[0]], key.split(".")[1]) if "." in key else (module, key)
                                   for key in constants}
                        originals = {key: getattr(*targets[key]) for key in constants}
                        for key, value in constants.items():
                            setattr(*targets[key], value)
                    else:
                        override.enter_context(launch_override(original, options))
                    started = time.perf_counter()
                    try:
                        with override:
                            ms = measure(step)
                    except Exception as error:  # noqa: BLE001 - a config can exceed the GPU's resources
                        print(f"{op} {mode:7s} {name} {options}: failed: {str(error).splitlines()[0][:120]}")
                        continue
                    finally:
                        setattr(module, name, original)
                        if name.isupper():
                            for key, value in originals.items():
                                setattr(*targets[key], value)
                    rows.append(dict(op=op, mode=mode, kernel=name, options=options, ms=ms, ratio=ms / base))
                    print(f"{op} {mode:7s} {name:32s} {str(options):22s} {ms:.3f} ms ({ms / base:.3f}x)"
                          f"  [{time.perf_counter() - started:.0f} s]", flush=True)
            if args.out:
                meta = dict(shape=args.shape, device=torch.cuda.get_device_name(), torch=torch.__version__,
                            date=time.strftime("%Y-%m-%d"))
                with open(args.out, "a") as f:
                    for row in rows:
                        f.write(json.dumps({**meta, **row}) + "\n")
    kernel_plan.BF16_INTERMEDIATES = bf16_default


if __name__ == "__main__":
    main()
