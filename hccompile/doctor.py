"""`hccompile doctor`: what this machine has, which implementation each op family will use, and
the known incompatibilities. Exit status 1 when something is broken (a FAIL line), else 0.

Each check is one line: OK; INFO (a fact, e.g. no GPU); WARN (works, with a limit worth knowing:
a version newer than tested, Triton 3.6's interpreter with NumPy >= 2.4, no depyf); FAIL (hccompile
or part of it cannot work here: a torch or Triton older than supported, no Triton beside a GPU, an
op family that does not load, backend "hc" not registered because the package is not installed).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import sys
from dataclasses import dataclass
from typing import Any

# Triton 3.6's interpreter converts a run-time loop bound with int() of a 1-element array, an
# error since NumPy 2.4 (triton-lang/triton#9171; Triton 3.8 squeezes first): kernels/_triton.py
# interpreter_problem() falls back to the references when it bites.
INTERPRETER_NUMPY_LIMIT = ((3, 8), (2, 4))  # Triton below 3.8 with NumPy >= 2.4
# Triton's own statement of supported NVIDIA hardware (its README): compute capability 8.0+.
MIN_CAPABILITY = (8, 0)
# The torch and Triton versions this release is tested with: pyproject.toml's dependencies say the
# same (tests/test_cli.py checks that they agree, and that a built wheel's metadata states them).
TESTED_RANGES = {"torch": ">=2.11,<2.16", "triton": ">=3.6,<3.10"}

FAMILIES = (
    ("causal linear attention", "hccompile.lowering.linear_attn"),
    ("lightning attention", "hccompile.lowering.lightning"),
    ("delta rule / GDN / KDA", "hccompile.lowering.delta_rule"),
    ("htree attention", "hccompile.lowering.htree"),
    ("mHC hyper-connections", "hccompile.lowering.mhc"),
)


@dataclass
class Check:
    status: str  # "OK", "WARN", "FAIL" or "INFO"
    name: str
    detail: str


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """(major, minor, patch) of a version string such as '2.13.0+cpu' or '3.8.0.dev1'."""
    if not text:
        return None
    parts = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    return tuple(int(p or 0) for p in parts.groups()) if parts else None


def _parse_range(spec: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for clause in spec.split(","):
        m = re.match(r"\s*(>=|<=|==|<|>|~=|!=)\s*([\d.]+)", clause)
        if m:
            out.append((m.group(1), version_tuple(m.group(2))))
    return out


def in_range(version: tuple[int, ...], spec: str) -> bool:
    """Whether `version` meets every >=, <, <=, >, == clause of `spec` (release numbers only)."""
    def cmp(a, b):
        n = max(len(a), len(b))
        a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
        return (a > b) - (a < b)

    ops = {">=": lambda c: c >= 0, "<": lambda c: c < 0, "<=": lambda c: c <= 0, ">": lambda c: c > 0,
           "==": lambda c: c == 0, "!=": lambda c: c != 0, "~=": lambda c: c >= 0}
    return all(ops[op](cmp(version, bound)) for op, bound in _parse_range(spec))


def _range_check(name: str, version_text: str, spec: str, what: str) -> Check:
    version = version_tuple(version_text)
    if version is None or not spec:
        return Check("WARN", name, f"{version_text}: cannot compare with the supported range {spec or '?'}")
    if in_range(version, spec):
        return Check("OK", name, f"{version_text} (supported: {spec})")
    lower = [b for op, b in _parse_range(spec) if op in (">=", ">")]
    if lower and version < lower[0]:
        return Check("FAIL", name, f"{version_text} is older than supported ({spec}); {what}")
    return Check("WARN", name, f"{version_text} is newer than tested ({spec}): it may work; problems are "
                               f"likely in hccompile/compat.py")


def gather() -> tuple[list[Check], dict[str, Any]]:
    """Every check, and the facts they came from (for --json)."""
    checks: list[Check] = []
    facts: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    ranges = TESTED_RANGES
    facts["supported"] = dict(ranges)

    py = sys.version_info[:2]
    checks.append(Check("OK" if py >= (3, 10) else "FAIL", "Python",
                        f"{platform.python_version()} ({sys.executable})" + ("" if py >= (3, 10) else
                                                                              "; hccompile needs >= 3.10")))

    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        checks.append(Check("FAIL", "torch", f"cannot be imported: {type(e).__name__}: {e}"))
        return checks, facts
    facts["torch"] = torch.__version__
    checks.append(_range_check("torch", torch.__version__, ranges.get("torch", ""),
                               "hccompile refuses to load (hccompile/compat.py)"))

    try:
        import numpy
        facts["numpy"] = numpy.__version__
        checks.append(Check("OK", "NumPy", numpy.__version__))
    except ImportError:
        numpy = None
        facts["numpy"] = None
        checks.append(Check("WARN" if os.environ.get("TRITON_INTERPRET") == "1" else "INFO", "NumPy",
                            "not installed (Triton's interpreter, TRITON_INTERPRET=1, needs it)"))

    from .kernels import _triton

    triton_version = getattr(_triton.triton, "__version__", None)
    facts["triton"] = triton_version
    cuda = torch.cuda.is_available()
    if _triton.TRITON_IMPORT_ERROR is not None:
        checks.append(Check("FAIL" if cuda else "WARN", "Triton",
                            f"cannot be imported ({_triton.TRITON_IMPORT_ERROR}): " +
                            ("no kernels on the GPU, and Inductor needs Triton for CUDA code" if cuda else
                             "the ops use their plain-PyTorch references")))
    else:
        checks.append(_range_check("Triton", triton_version, ranges.get("triton", ""),
                                   "the kernels use newer Triton language features"))
        tv, nv = version_tuple(triton_version), version_tuple(getattr(numpy, "__version__", None))
        (triton_fixed, numpy_breaks) = INTERPRETER_NUMPY_LIMIT
        if tv and nv and tv[:2] < triton_fixed and nv[:2] >= numpy_breaks:
            checks.append(Check("WARN", "Triton interpreter + NumPy",
                                f"Triton {triton_version}'s interpreter fails with NumPy {numpy.__version__} "
                                f"(triton-lang/triton#9171): under TRITON_INTERPRET=1 the CPU ops fall back to "
                                f"the plain-PyTorch references; pip install 'numpy<2.4' or Triton >= 3.8. "
                                f"GPU kernels are not affected"))

    interp = os.environ.get("TRITON_INTERPRET") == "1"
    facts["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    if interp and _triton.TRITON_IMPORT_ERROR is None:
        problem = _triton.interpreter_problem()
        if problem:
            checks.append(Check("WARN", "Triton interpreter", f"cannot run the kernels: {problem}"))

    facts["torch_cuda"] = torch.version.cuda
    facts["gpus"] = []
    if cuda:
        for index in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(index)
            cap = torch.cuda.get_device_capability(index)
            facts["gpus"].append({"name": name, "capability": f"{cap[0]}.{cap[1]}"})
            ok = tuple(cap) >= MIN_CAPABILITY
            checks.append(Check("OK" if ok else "WARN", f"GPU {index}",
                                f"{name}, compute capability {cap[0]}.{cap[1]}, CUDA {torch.version.cuda}" +
                                ("" if ok else f"; Triton supports {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ "
                                               f"(bfloat16 kernels need it)")))
    else:
        why = (f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else
               f"torch is built for CUDA {torch.version.cuda} but sees no GPU")
        checks.append(Check("INFO", "GPU", f"no GPU ({why}): the ops run on the CPU"))

    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    facts["implementations"] = {}
    for family, module in FAMILIES:
        try:
            impl = importlib.import_module(module).implementation(device, dtype)
        except Exception as e:  # noqa: BLE001 - a broken family is the finding
            checks.append(Check("FAIL", family, f"cannot be loaded: {type(e).__name__}: {e}"))
            continue
        facts["implementations"][family] = impl
        checks.append(Check("OK", family, f"{impl} on {device} {str(dtype).replace('torch.', '')}"))
    if not cuda:
        if interp:
            note = "TRITON_INTERPRET=1: the Triton kernels run in Triton's interpreter (slow; for testing)"
        else:
            note = ("the ops run their plain-PyTorch references (same math); set TRITON_INTERPRET=1 "
                    "before Python starts to run the Triton kernels in the interpreter")
        checks.append(Check("INFO", "on this CPU", note + "; float64 always uses the references"))

    checks.append(_backend_check())
    try:
        import depyf  # noqa: F401
        checks.append(Check("OK", "depyf", importlib.metadata.version("depyf")))
    except Exception:  # noqa: BLE001
        checks.append(Check("WARN", "depyf", "not importable: dump_dir dumps lack decompiled sources"))
    return checks, facts


def _backend_check() -> Check:
    """backend="hc" comes from the torch_dynamo_backends entry point of the installed package."""
    try:
        eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    except Exception as e:  # noqa: BLE001
        return Check("FAIL", 'backend "hc"', f"cannot read entry points: {e}")
    hc = [ep for ep in eps if ep.name == "hc"]
    if not hc:
        return Check("FAIL", 'backend "hc"', "no torch_dynamo_backends entry point named hc: hccompile is "
                                             "not installed (pip install .), so backend=\"hc\" needs an "
                                             "explicit backend=hccompile.hc_backend")
    return Check("OK", 'backend "hc"', f"registered ({hc[0].value})")


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.status:<4}  {c.name:<{width}}  {c.detail}" for c in checks)


def main(checks: list[Check] | None = None) -> int:
    checks, _ = gather() if checks is None else (checks, None)
    print(report(checks))
    failed = [c for c in checks if c.status == "FAIL"]
    warned = [c for c in checks if c.status == "WARN"]
    print()
    if failed:
        print(f"broken: {', '.join(c.name for c in failed)}")
        return 1
    print("hccompile can run here" + (f" ({len(warned)} warning{'s' if len(warned) > 1 else ''})" if warned else ""))
    return 0
