"""kernels/launcher.py: eager launches through Triton's specialization and compiled launcher, without
JITFunction.run on a repeat (issues 20, 24). A hit must launch exactly what run would have: the
same compiled kernel for the same specialization, a new one for any other, on the current stream."""
from __future__ import annotations

import contextlib

import pytest
import torch

from hccompile.kernels import launcher as launcher_module
from hccompile.kernels._triton import interpreted, tl, triton
from hccompile.kernels.launcher import Launcher, launcher

pytestmark = pytest.mark.skipif(triton is None, reason="Triton is not installed")

if triton is not None:
    @triton.jit
    def _shifted_copy_kernel(x_ptr, out_ptr, n, shift, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=ok, other=0.0) + shift, mask=ok)


def test_interpreted_kernels_and_a_disabled_launcher_launch_through_the_kernel(monkeypatch):
    if interpreted(_shifted_copy_kernel):
        assert launcher(_shifted_copy_kernel) is _shifted_copy_kernel
    else:
        assert isinstance(launcher(_shifted_copy_kernel), Launcher)
        assert launcher(_shifted_copy_kernel) is launcher(_shifted_copy_kernel)
    monkeypatch.setattr(launcher_module, "enabled", False)
    assert launcher(_shifted_copy_kernel) is _shifted_copy_kernel
    assert launcher(print) is print


@contextlib.contextmanager
def counting_runs():
    """Counts JITFunction.run calls (the plain launch path) while the block runs."""
    calls = []
    original = triton.runtime.JITFunction.run

    def run(self, *args, **kwargs):
        calls.append(getattr(self, "__name__", self))
        return original(self, *args, **kwargs)

    triton.runtime.JITFunction.run = run
    try:
        yield calls
    finally:
        triton.runtime.JITFunction.run = original


def _launch(launch, x, n, shift, block=32, warps=4):
    out = torch.full_like(x, float("nan"))  # poisoned: an unwritten element fails
    launch[(triton.cdiv(n, block),)](x, out, n, shift, BLOCK=block, num_warps=warps)
    return out


@pytest.mark.gpu
def test_a_hit_launches_what_run_would_and_every_new_specialization_misses():
    launch = Launcher(_shifted_copy_kernel)
    base = torch.randn(200, device="cuda")
    cases = [  # (x, n, shift, BLOCK, warps): alignment, divisibility, 1, dtype, constexpr and options vary
        (base[:64], 64, 1.5, 32, 4),
        (base[1:65], 64, 1.5, 32, 4),  # a pointer 4 bytes past 16-byte alignment
        (base[:17], 17, -2.0, 32, 4),  # n not a multiple of 16
        (base[:1], 1, 0.25, 32, 4),
        (base[:64].bfloat16(), 64, 1.5, 32, 4),
        (base[:100], 100, 3.0, 64, 4),
        (base[:100], 100, 3.0, 64, 1),
    ]
    for x, n, shift, block, warps in cases + cases:  # the second round is all hits
        out = _launch(launch, x, n, shift, block, warps)
        torch.testing.assert_close(out, x + shift, rtol=0, atol=0)
    # alignment, divisibility, dtype and BLOCK key different specializations, num_warps different options
    assert len({key[1] for key in launch.compiled}) >= 5
    assert launch.misses == len(launch.compiled) >= 6
    with counting_runs() as runs:
        for x, n, shift, block, warps in cases:
            _launch(launch, x, n, shift, block, warps)
    assert runs == []


@pytest.mark.gpu
def test_a_launch_hook_takes_the_plain_path():
    launch = Launcher(_shifted_copy_kernel)
    x = torch.randn(64, device="cuda")
    _launch(launch, x, 64, 1.0)
    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook

    def hook(metadata):
        seen.append(metadata)

    if hasattr(hooks, "add"):
        hooks.add(hook)
        restore = lambda: hooks.remove(hook)  # noqa: E731
    else:  # pragma: no cover - a Triton whose hook is one function
        triton.knobs.runtime.launch_enter_hook = hook
        restore = lambda: setattr(triton.knobs.runtime, "launch_enter_hook", hooks)  # noqa: E731
    try:
        out = _launch(launch, x, 64, 1.0)
    finally:
        restore()
    torch.testing.assert_close(out, x + 1.0, rtol=0, atol=0)
    assert len(seen) == 1 and launch.misses == 2


@pytest.mark.gpu
def test_a_hit_launches_on_the_current_stream_under_graph_capture():
    launch = Launcher(_shifted_copy_kernel)
    x = torch.randn(64, device="cuda")
    out = torch.full_like(x, float("nan"))
    launch[(2,)](x, out, 64, 2.0, BLOCK=32)  # the miss, outside the capture
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a launch on any other stream would fail the capture
        launch[(2,)](x, out, 64, 2.0, BLOCK=32)
    assert launch.misses == 1
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x + 2.0, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["lightning", "gdn", "mhc"])
def test_an_eager_repeat_of_an_op_calls_no_jit_function_run(family):
    """Every launch of an eager fwd+bwd goes through the Launcher: the second step calls
    JITFunction.run not once."""
    import hccompile
    from hccompile.lowering.lightning import alibi_decay

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, D = 1, 100, 2, 64

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).bfloat16().requires_grad_()

    if family == "lightning":
        q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
        decay = alibi_decay(H, device="cuda")
        step = lambda: hccompile.lightning_attn(q, k, v, decay=decay)[0].float().square().sum().backward()  # noqa: E731
    elif family == "gdn":
        q, k, v, beta = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H).sigmoid()
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen)).requires_grad_()

        def step():
            o = hccompile.chunk_gated_delta_rule(q, k, v, g, beta.detach(), use_qk_l2norm_in_kernel=True)[0]
            o.float().square().sum().backward()
    else:
        from hccompile.lowering.mhc import mhc_aggregate, mhc_post

        n, C = 4, 96
        x, h_res, h_post, f = randn(B, T, n, C), randn(B, T, n, n), randn(B, T, n), randn(B, T, C)

        def step():
            out = mhc_post(x, h_res, h_post, f) + mhc_aggregate(x, h_post)[:, :, None]
            out.float().square().sum().backward()
    step()
    with counting_runs() as runs:
        step()
    assert runs == [], f"JITFunction.run called on a repeat: {runs}"
