"""What the kernel-variant experiments share (narrow_backward_tile.py; dqkw_split.py until its one-pass kernel
became dqkw.py, session 44; chunk_scores_backward.py, kda_wy_split.py and paired_sweep.py until their timing in
session 46, in git at 505844f): the kernel tests' helpers
importable, with the interpreter's rounding as tests/conftest.py sets it; a kernel module rebuilt from its own
source with text edits, so that a variant follows the kernel as it is in the tree; each variant checked, then
the right ones timed on a GDN or KDA fwd+bwd with their kernels' GPU time.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def use_kernel_tests() -> None:
    """hccompile, tests/ and tests/kernels/ importable; under TRITON_INTERPRET bf16 casts round as on the GPU."""
    for path in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "kernels")):
        if path not in sys.path:
            sys.path.insert(0, path)
    if os.environ.get("TRITON_INTERPRET") == "1":
        import interpreter_compat

        interpreter_compat.apply()


def edited_module(module: ModuleType, edits: list[tuple[str, str]], name: str) -> ModuleType:
    """`module` defined again from its source with each (old, new) edit applied in turn (each `old` must occur
    exactly once when its turn comes), as `<package>.<name>`, so its relative imports resolve."""
    source = open(module.__file__).read()
    for old, new in edits:
        assert source.count(old) == 1, f"{os.path.basename(module.__file__)} changed: update the edit of {old!r}"
        source = source.replace(old, new)
    path = os.path.join(os.path.dirname(module.__file__), name + ".py")
    with open(path, "w") as f:
        f.write(source)
    try:  # Triton read the kernels' source when the module defined them: the file can go
        return importlib.import_module(f"{module.__package__}.{name}")
    finally:
        os.remove(path)


def check_cases(cases, repeats: int) -> list[str]:
    """The kernel tests' forward+backward check against float64 (tests/kernels/test_delta_rule_chunk.py) on each
    (name, sizes, gate, options, dtype, chunk) case, `repeats` seeds each: one line per wrong or failed case."""
    import test_delta_rule_chunk as t

    failures = []
    for name, sizes, gate, options, dtype, chunk in cases:
        for r in range(repeats):
            inputs, kwargs = t.build_case(sizes, gate, options, seed=sizes[1] + r)
            try:
                t.check_forward_and_backward(t.kernel_inputs(inputs, dtype), kwargs, dtype, chunk)
            except AssertionError as error:
                failures.append(f"{name} (seed {sizes[1] + r}): {str(error).splitlines()[0][:100]}")
            except Exception as error:  # noqa: BLE001 -- a compile failure is a result here
                failures.append(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
                break
    return failures


def right_variants(variants: list[str], check) -> list[str]:
    """The variants for which `check(variant)` (which applies the variant and returns its failure lines) finds
    nothing wrong, printing each verdict and up to 12 of its failures."""
    import traceback

    passed = []
    for variant in variants:
        try:
            failures = check(variant)
        except Exception:  # noqa: BLE001 -- a variant that cannot run is a result here
            print(f"{variant}: could not run\n{traceback.format_exc()}", flush=True)
            continue
        print(f"{variant}: {'all cases right' if not failures else f'{len(failures)} wrong'}", flush=True)
        for line in failures[:12]:
            print(f"    {line}", flush=True)
        if not failures:
            passed.append(variant)
    return passed


def delta_rule_case(op: str, shape: str, output_final_state: bool = False):
    """(f, leaves, do): hccompile's GDN (op "gdn") or KDA ("kda") with the in-kernel l2norm as `f(*leaves)`, its
    CUDA bf16 inputs of shape B<b>T<t>H<h>D<d> (fp32 log-gates) requiring grad, and an output gradient, seeded
    alike every call."""
    import torch

    import hccompile
    from shapes import bthd

    B, T, H, D = bthd(shape)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    beta = torch.rand(B, T, H, generator=gen, device="cuda").bfloat16().requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, *(() if op == "gdn" else (D,)), generator=gen,
                                                   device="cuda")).requires_grad_()
    do = torch.randn(B, T, H, D, generator=gen, device="cuda").bfloat16()
    op_function = hccompile.chunk_gated_delta_rule if op == "gdn" else hccompile.chunk_kda

    def f(*leaves):
        return op_function(*leaves, use_qk_l2norm_in_kernel=True, output_final_state=output_final_state)

    return f, [q, k, v, g, beta], do


def delta_rule_step(op: str, shape: str):
    """(step, leaves): one eager fwd+bwd of delta_rule_case(op, shape), as the variant scripts time it."""
    f, leaves, do = delta_rule_case(op, shape)

    def step():
        f(*leaves)[0].backward(do)

    return step, leaves


def time_step(step, leaves, kernel_names: tuple[str, ...]) -> tuple[float, dict[str, float]]:
    """(fwd+bwd ms by do_bench, {name: GPU ms per step of the kernels whose name contains it}, by the profiler
    over three steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench

    step()
    ms = do_bench(step, grad_to_none=leaves)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return ms, {name: sum(e.device_time_total for e in events if name in e.key) / 3e3 for name in kernel_names}


def check_then_time(variants: list[str], apply, check, time_variant, shapes: list[str], reference: str) -> None:
    """Each variant applied, timed at each shape on a GPU (`time_variant(shape)` returns the line to print), then all
    checked (`check()` returns failure lines) unless VARIANT_CHECK=off. Timing comes first because the checks
    compile every kernel once per case and may take minutes: a run cut by the device's per-run limit still
    keeps every time it measured (session 46 lost all of them to the checks). A time is a result only for a
    variant whose check passed, here or in an earlier run."""
    import torch

    on_gpu = torch.cuda.is_available()
    checking = os.environ.get("VARIANT_CHECK", "on") != "off"
    if not on_gpu:
        right_variants(variants, lambda variant: (apply(variant), check())[1])
        return
    import traceback

    ordered = [reference] + [v for v in variants if v != reference]
    for variant in ordered:
        apply(variant)
        for shape in shapes:
            try:
                print(f"{variant} {shape}: {time_variant(shape)}", flush=True)
            except Exception:  # noqa: BLE001
                print(f"{variant} {shape}: timing failed\n{traceback.format_exc()}", flush=True)
    if checking:
        right_variants([v for v in ordered if v != reference],
                       lambda variant: (apply(variant), check())[1])
