"""Prototype (issue 20): KDA's backward score kernel with one program per chunk (the default) pays 2.15x its
time when every diagonal block is split (3.825 against 1.782 ms at B1 T32768 H16 K128 on one H200), one program
per sub-chunk 1.35x (split_cost.py, session 47), and with FLA's gate initialisation (3.5 % of the sub-chunks
split) the difference costs 0.34 ms of the kda-gate fwd+bwd. With bf16 inputs the split joins the main key
loop (scores._sub_chunk_scores_backward); this times it apart, after the key loop (the fp32 inputs' pass,
_split_diagonal_backward), and the chunk program's sub-chunk loop flipped (looped in hccompile since session 47: the
prototype unrolls it), each variant
built from hccompile's own source with those lines changed (nothing in hccompile is modified), each
variant's gradients against the default's.

    python benchmarks/analysis/split_apart_proto.py [--shapes B1T32768H16D128,B4T4096H16D128] [--ops kda-gate,kda,kda-strong]

kda-strong: the in-kernel gate with A four times FLA's initialisation (A in [4, 64]): most sub-chunks split.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import tempfile
import textwrap

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from _profile import profile_step  # noqa: E402
from profile_ops import parse_shape  # noqa: E402

import hccompile  # noqa: E402
from hccompile.kernels.delta_rule import scores  # noqa: E402

# (as dedented from the kernel module's source)
JOINED = """        if HALF_DOTS:
            # Apart from the products' results"""
APART_LATER = """    if not HALF_DOTS:
        if span > factor_limit:"""
UNROLLED = "for sub_chunk in tl.static_range(BT // BC):"
LOOPED = "for sub_chunk in range(BT // BC):"


def variant_module(apart: bool, loop: bool):
    """A module holding copies of _sub_chunk_scores_backward and _decayed_scores_backward_kernel with the
    split apart and / or the sub-chunk loop not unrolled."""
    helper = textwrap.dedent(inspect.getsource(scores._sub_chunk_scores_backward.fn))
    kernel = textwrap.dedent(inspect.getsource(scores._decayed_scores_backward_kernel.fn))
    if apart:
        assert JOINED in helper and APART_LATER in helper
        helper = helper.replace(JOINED, JOINED.replace("if HALF_DOTS:", "if False:"))
        helper = helper.replace(APART_LATER, APART_LATER.replace("if not HALF_DOTS:", "if True:"))
    # `loop` flips the chunk program's sub-chunk loop from hccompile's form (looped since session 47) to the other
    if loop:
        assert (UNROLLED in kernel) != (LOOPED in kernel)
        kernel = kernel.replace(UNROLLED, LOOPED) if UNROLLED in kernel else kernel.replace(LOOPED, UNROLLED)
    source = ("import hccompile.kernels.delta_rule.scores as _scores\n"
              "globals().update({k: v for k, v in vars(_scores).items() if not k.startswith('__')})\n"
              "import triton\nimport triton.language as tl\n\n\n" + helper + "\n\n" + kernel)  # (their @triton.jit lines)
    path = os.path.join(tempfile.mkdtemp(), f"scores_variant_{int(apart)}{int(loop)}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="B1T32768H16D128")
    p.add_argument("--ops", default="kda-gate,kda")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        run_shape(shape, args.ops.split(","))


def run_shape(shape_text: str, ops: list[str]) -> None:
    s = parse_shape(shape_text)
    B, T, H, D = s["B"], s["T"], s["H"], s["D"]
    from delta_rule import kda_gate_parameters

    default_kernel = scores._decayed_scores_backward_kernel
    variants = {"joined (default)": None}
    flipped = "unrolled" if LOOPED in inspect.getsource(scores._decayed_scores_backward_kernel.fn) else "loop"
    for name, apart, loop in (("apart", True, False), (flipped, False, True), (f"apart+{flipped}", True, True)):
        variants[name] = variant_module(apart, loop)._decayed_scores_backward_kernel
    for op in ops:
        gen = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device="cuda").bfloat16().requires_grad_()

        q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
        beta = torch.rand(B, T, H, generator=gen, device="cuda").bfloat16().requires_grad_()
        if op in ("kda-gate", "kda-strong"):
            g = randn(B, T, H, D)
            A_log, dt_bias = kda_gate_parameters(H, D, gen)
            if op == "kda-strong":
                A_log = A_log + torch.log(torch.tensor(4.0, device="cuda"))
            A_log, dt_bias = A_log.requires_grad_(), dt_bias.requires_grad_()
            gate = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
            leaves = (q, k, v, g, beta, A_log, dt_bias)
        else:
            g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, generator=gen, device="cuda")).requires_grad_()
            gate = {}
            leaves = (q, k, v, g, beta)
        do = torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16()

        def step():
            for leaf in leaves:
                leaf.grad = None
            o = hccompile.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **gate)[0]
            o.backward(do)

        for limit in (scores.FACTOR_SPAN_LIMIT, 0.0):
            reference = None
            for name, kernel in variants.items():
                saved_limit = scores.FACTOR_SPAN_LIMIT
                scores._decayed_scores_backward_kernel = kernel or default_kernel
                scores.FACTOR_SPAN_LIMIT = limit
                try:
                    step()
                    torch.cuda.synchronize()
                    grads = [leaf.grad.float().clone() for leaf in leaves]
                    _, summary = profile_step(step, steps=5, top=40)
                except Exception as error:  # noqa: BLE001 - a variant that does not compile is a result
                    print(f"{op} limit {limit:3.0f} {name}: failed: {str(error).splitlines()[0][:150]}", flush=True)
                    continue
                finally:
                    scores._decayed_scores_backward_kernel = default_kernel
                    scores.FACTOR_SPAN_LIMIT = saved_limit
                ms = sum(r["ms"] for r in summary["top"] if r["kernel"].startswith("_decayed_scores_backward_kernel"))
                note = ""
                if reference is None:
                    reference = grads
                else:
                    worst = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(grads, reference))
                    note = f", gradients {worst:.1e} from the default's (worst input)"
                print(f"{op} {shape_text} limit {limit:3.0f} {name:17s}: decayed_scores_backward {ms:.3f} ms, "
                      f"GPU {summary['gpu_busy_ms']:.3f} ms{note}", flush=True)


if __name__ == "__main__":
    main()
