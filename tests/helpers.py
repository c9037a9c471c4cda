"""Shared test helpers: compile with hc and collect the per-graph reports."""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

import hccompile.backend as hc
from hccompile.config import resolve
from hccompile.debug.memory import SavedStorages


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    assert torch.isfinite(out).all(), "non-finite values"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Collect:
    """torch.compile(fn, backend=Collect(...)) records every GraphReport.

    Inductor's graph caches are off unless the options say otherwise: a cache hit (any earlier
    compile of the same graph, in any process on the machine, say a GPU run of the same tests
    minutes before) skips the inner compile that writes the reports' lowered ops. fx_graph_cache=False
    turns off both graph caches (FX graph and AOTAutograd, whose lookups need the former), so every
    compile runs our passes and Inductor's lowering; unlike force_disable_caches it leaves Inductor's
    kernel cache on, which is keyed by the generated C++ source: a kernel that an earlier compile
    already built is loaded instead of built again (test_hc_passes' seven compiles of one model,
    mhc_runs: 213 s with force_disable_caches, 133 s so, on the 2-core CI machine)."""

    __hccompile_backend__ = True  # hc's substitutes apply (hccompile.substitutes reads self.cfg)

    def __init__(self, **options: Any):
        self.cfg = resolve({"fx_graph_cache": False, **options})
        self.reports: list[Any] = []

    def __call__(self, gm, example_inputs):
        stack = hc._collect.__dict__.setdefault("stack", [])
        stack.append(self.reports)
        try:
            return hc.compile_graph(gm, example_inputs, self.cfg)
        finally:
            stack.remove(self.reports)

    @property
    def matches(self):
        return [m for r in self.reports for m in r.matches]

    @property
    def refusals(self):
        return [x for r in self.reports for x in r.refusals]

    def ops(self, graph: str) -> list[str]:
        return [op for r in self.reports for op in r.lowered_ops.get(graph, [])]


def fwd_bwd(fn, *inputs: torch.Tensor, seed: int = 0):
    """Output and gradients of a random projection of fn's output w.r.t. every input."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    grads = torch.autograd.grad((out * w).sum(), leaves)
    return out.detach(), grads


def train_step(model, x, backend=None, **options):
    """One compiled training step, dropout masks from a fixed seed: (saved-for-backward bytes seen
    by saved_tensors_hooks, activations only; the backend; the output; the gradients of a fixed
    random projection of it with respect to x and every parameter). `backend` defaults to hc
    (Collect) with the given options and Inductor's graph caches off."""
    torch._dynamo.reset()
    be = backend or Collect(**options)
    cm = torch.compile(model, backend=be)
    torch.manual_seed(123)
    cm(x)  # compile
    torch.manual_seed(123)  # the same dropout masks in every run
    with SavedStorages(exclude=[*model.parameters(), x]) as saved:
        out = cm(x)
    nbytes = saved.nbytes
    del saved
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad((out * w).sum(), [x] + list(model.parameters()))
    return nbytes, be, out.detach(), grads


def calls_through_hccompile_ops(code: str) -> list[str]:
    """Lines of Inductor output code that call one of our ops (torch.ops.hccompile...), but for the
    run-time checks traced graphs keep (lowering._launch.RUNTIME_CHECKS). Comments are left out:
    they name the kernels' source files, a path that may itself hold "hccompile"."""
    from hccompile.lowering._launch import RUNTIME_CHECKS

    checks = [name.split(".")[1] for name in RUNTIME_CHECKS]
    return [line for line in code.splitlines() if "ops.hccompile" in line and not line.lstrip().startswith("#")
            and not any(f"ops.hccompile.{check}" in line for check in checks)]


def inductor_step(compiled, inputs, cotangents):
    """(outputs, Inductor's output code) of compiled(*inputs) and the backward of its outputs with
    `cotangents`, both compiled in this call."""
    from torch._inductor.utils import run_and_get_code

    def step():
        outputs = compiled(*inputs)
        torch.autograd.backward(outputs, cotangents)
        return outputs

    outputs, codes = run_and_get_code(step)
    return outputs, "\n".join(codes)


def count_pass_work(monkeypatch, pass_cls) -> list[int]:
    """Make each run of `pass_cls` append to the returned list the number of calls of the passes' own
    functions (hccompile/passes/...) it made: a deterministic measure of a pass's work, where its time
    on a loaded machine is not (no timed assertions in tests)."""
    import os
    import sys

    passes = os.path.join("hccompile", "passes")
    run = pass_cls.run
    counts: list[int] = []

    def counted(self, gm, ctx, record):
        count = [0]

        def profile(frame, event, arg):
            if event == "call" and passes in frame.f_code.co_filename:
                count[0] += 1

        previous = sys.getprofile()
        sys.setprofile(profile)
        try:
            return run(self, gm, ctx, record)
        finally:
            sys.setprofile(previous)
            counts.append(count[0])

    monkeypatch.setattr(pass_cls, "run", counted)
    return counts


def rerun_without_interpreter(test_file: str) -> None:
    """Run `test_file`'s tests in a fresh pytest process without TRITON_INTERPRET: under the
    interpreter (make test) kernels are interpreted functions, which neither torch's tracing nor
    its mutation analysis can read."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
                            env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout, result.stdout[-2000:]


@contextlib.contextmanager
def kernel_target():
    """Triton IR needs a target, not a GPU: without one, an H100's (torch's mutation analysis of a
    traced launch compiles the kernel to Triton IR; were that to fail, torch would take every
    tensor argument as written, inputs included)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if torch.cuda.is_available():
        yield
        return

    class H100Target:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver = triton.runtime.driver
    previous = driver._active
    driver.set_active(H100Target())
    try:
        yield
    finally:
        driver._active = previous
