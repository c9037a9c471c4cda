"""What the kernel-variant experiments share (narrow_backward_tile.py; dqkw_split.py until its one-pass kernel became dqkw.py, session 44): the kernel tests' helpers
importable, with the interpreter's rounding as tests/conftest.py sets it, and a kernel module rebuilt from its own
source with text edits, so that a variant follows the kernel as it is in the tree.
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
