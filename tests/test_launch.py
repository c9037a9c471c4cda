"""lowering/_launch.py: the triton_op + host-op pair every kernel op is made of (issue 24)."""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

import hccompile  # registers the ops
from hccompile.lowering import _launch


@pytest.mark.parametrize("name", ["mhc_post", "mhc_post_backward", "mhc_aggregate",
                                  "mhc_aggregate_backward", "mhc_mapping", "mhc_mapping_backward",
                                  "htree_attention", "htree_attention_backward"])
def test_op_and_its_host_twin_share_one_schema(name):
    op = getattr(torch.ops.hccompile, name).default
    host = getattr(torch.ops.hccompile, f"{name}_host").default
    assert str(op._schema).replace(f"::{name}(", "(") == str(host._schema).replace(f"::{name}_host(", "(")


def test_each_op_is_named_by_its_own_first_kernel():
    """A graph traced on CUDA holds kernel launches; op_inventory names the op by its first
    kernel, so a kernel may be the first of one op only."""
    firsts = [n for _, n, _ in _launch._KERNEL_OPS.values() if n]
    assert len(firsts) == len(set(firsts))
    if not firsts:
        pytest.skip("Triton is not installed: no kernels")
    kernel = next(k for k, n, _ in _launch._KERNEL_OPS.values() if n == "hccompile.mhc_post.default")
    with pytest.raises(ValueError, match="already the first kernel of hccompile.mhc_post.default"):
        _launch.launched_by("hccompile.other.default", kernel)
    _launch.launched_by("hccompile.other.default", None, kernel)  # a later kernel: allowed
    assert _launch.launched_op(kernel) == ("hccompile.mhc_post.default", 1)
    assert _launch.launched_op(None) == ("", 1)


def test_cpu_tensors_run_the_host_op():
    assert not _launch.traced_launch(torch.ones(1), (torch.float32,))
    assert not _launch.traced_launch(torch.ones(1, dtype=torch.float64), (torch.float32,))


def _lightning(device):
    from hccompile.lowering.lightning import alibi_decay, lightning_attn

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 37, 3, 16, generator=gen, device=device) for _ in range(3))
    decay = alibi_decay(3, device=device)
    return (q, k, v), lambda q, k, v: lightning_attn(q, k, v, decay=decay)[0]


def _linear(device):
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(2, 29, 2, 8, generator=gen, device=device) for _ in range(3))
    return (q, k, v), hccompile.causal_linear_attn


def _aggregate(device):
    from hccompile.lowering.mhc import mhc_aggregate

    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(2, 5, 4, 24, generator=gen, device=device)
    weights = torch.rand(2, 5, 4, generator=gen, device=device)
    return (x, weights), mhc_aggregate


@pytest.mark.parametrize("family", [_lightning, _linear, _aggregate], ids=["lightning", "linear", "mhc_aggregate"])
def test_eager_calls_skip_the_dispatcher_and_match_the_op(family):
    """call_op: in plain eager mode the host function runs under the op's autograd (no dispatcher);
    under a function mode (`with torch.device`) the same call meets the op. Same kernels, so the same
    bits, forward and backward; without a gradient no autograd node at all."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs, fn = family(device)

    def run(op_path: bool):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with torch.device(device) if op_path else contextlib.nullcontext():
            out = fn(*leaves)
            node = type(out.grad_fn).__name__
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        return out.detach(), grads, node

    direct, direct_grads, direct_node = run(False)
    through_op, op_grads, op_node = run(True)
    assert direct_node == "_DirectFunctionBackward", direct_node
    assert op_node.startswith("GeneratedBackwardFor_hccompile_"), op_node
    assert torch.equal(direct, through_op)
    for a, b in zip(direct_grads, op_grads):
        assert torch.equal(a, b)
    assert fn(*inputs).grad_fn is None


def test_call_op_meets_the_op_wherever_the_direct_call_could_differ(monkeypatch):
    """The host function directly only for plain tensors in plain eager mode; a subclass, a list of
    tensors, a function mode, or a differentiable call of an op without autograd (the backward ops:
    double backward must fail as the op fails, not return a constant) meet the op, as does a meta tensor. Missing trailing
    arguments take the host function's defaults. DIRECT_CALLS off sends every call to the op."""
    def host(x, y=2):
        return ("host", x, y)

    def op(*args):
        return ("op", *args)

    monkeypatch.setitem(_launch._DIRECT, op, _launch._DirectCall(host, inspect.signature(host)))
    plain, wanting = torch.ones(2), torch.ones(2, requires_grad=True)
    assert _launch.call_op(op, plain) == ("host", plain, 2)
    assert _launch.call_op(op, wanting)[0] == "op"
    with torch.no_grad():
        assert _launch.call_op(op, wanting)[0] == "host"

    class Sub(torch.Tensor):
        pass

    assert _launch.call_op(op, plain.as_subclass(Sub))[0] == "op"
    assert _launch.call_op(op, [plain])[0] == "op"
    assert _launch.call_op(op, torch.ones(2, device="meta"))[0] == "op"
    with torch.device("cpu"):
        assert _launch.call_op(op, plain)[0] == "op"
    monkeypatch.setattr(_launch, "DIRECT_CALLS", False)
    assert _launch.call_op(op, plain)[0] == "op"


def test_values_read_once_per_tensor_and_version():
    """cached_by_tensor keeps a value while the same tensor object lives unmodified: an in-place
    change (its version), another tensor with equal values, or what=... of another computation reads
    again; an inference tensor (no version counter) is read every time."""
    from hccompile.kernels.value_checks import cached_by_tensor, host_ints

    reads = []

    def read(t):
        return lambda: reads.append(1) or tuple(t.tolist())

    t = torch.tensor([0, 3, 7])
    assert cached_by_tensor(t, ("a",), read(t)) == (0, 3, 7)
    assert cached_by_tensor(t, ("a",), read(t)) == (0, 3, 7) and len(reads) == 1
    cached_by_tensor(t, ("b",), read(t))
    assert len(reads) == 2
    t[1] = 4
    assert cached_by_tensor(t, ("a",), read(t)) == (0, 4, 7) and len(reads) == 3
    other = torch.tensor([0, 4, 7])
    cached_by_tensor(other, ("a",), read(other))
    assert len(reads) == 4
    with torch.inference_mode():
        frozen = torch.tensor([0, 1])
    cached_by_tensor(frozen, ("a",), read(frozen))
    cached_by_tensor(frozen, ("a",), read(frozen))
    assert len(reads) == 6
    assert host_ints(torch.tensor([0, 2, 5], dtype=torch.int32)) == (0, 2, 5)


def test_launch_analysis_cache_key():
    """compat caches torch's analysis of a traced launch per key: the values torch substitutes before
    generating the kernel's IR (a fake tensor's dtype, 'a symbolic size', any other value itself).
    Not cached: kernels not ours, real tensors (Triton specializes on their address), TMA
    descriptors. (The cached answers are checked against torch's in test_traced_launch.py.)"""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from hccompile import compat
    from hccompile.kernels.mhc import post

    kernel = post._mhc_post_fwd_kernel
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        a, b = torch.empty(4, 8), torch.empty(16, 3)
        h = torch.empty(4, 8, dtype=torch.bfloat16)
    sym = mode.shape_env.create_unbacked_symint()
    key = compat._access_key(kernel, {"x": a, "C": 64, "T": sym}, {})
    assert key is not None and key == compat._access_key(kernel, {"x": b, "C": 64, "T": 7 + sym}, {})
    assert key != compat._access_key(kernel, {"x": h, "C": 64, "T": sym}, {})
    assert key != compat._access_key(kernel, {"x": a, "C": 32, "T": sym}, {})
    assert compat._access_key(kernel, {"x": torch.empty(4, 8), "C": 64}, {}) is None
    assert compat._access_key(kernel, {"x": a, "C": 64}, {"x": ("stable", ([8, 8],))}) is None
    foreign = type("Foreign", (), {"fn": (lambda x: x)})()  # a kernel defined outside hccompile
    assert compat._access_key(foreign, {"x": a}, {}) is None


def test_backward_mark_is_read_once():
    """call_backward_op marks the host function it reaches as its forward's backward; the first read
    clears the mark, so nothing the host function calls in turn, and no later call, sees it."""
    seen = []

    def host():
        seen.extend([_launch.checked_by_forward(), _launch.checked_by_forward()])

    _launch.call_backward_op(host)  # not a registered op: call_op calls it as it is
    host()
    assert seen == [True, False, False, False]


def _gdn_inputs(device):
    gen = torch.Generator(device=device).manual_seed(4)
    q, k, v = (torch.randn(1, 40, 2, 32, generator=gen, device=device) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 40, 2, generator=gen, device=device))
    beta = torch.rand(1, 40, 2, generator=gen, device=device)
    return q, k, v, g, beta


def test_backward_of_a_checked_forward_skips_the_checks(monkeypatch):
    """The delta rule's and lightning's eager backwards, called by their forwards' autograd, do not check
    their arguments again (the host time before a backward's first launch is GPU idle time); the same
    backward ops called directly still check everything, and name a wrong argument."""
    from hccompile.kernels.delta_rule import chunk as delta_chunk
    from hccompile.lowering import delta_rule as delta_lowering
    from hccompile.lowering import lightning as lightning_lowering

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, g, beta = _gdn_inputs(device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, _ = hccompile.chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)
    do = torch.randn_like(o)
    want = torch.autograd.grad(o, leaves, do)

    def refuse(*args, **kwargs):
        raise AssertionError("checked again")

    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, _ = hccompile.chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    lightning_o, _ = hccompile.lightning_attn(*qkv)
    for module, name in ((delta_chunk, "_validate"), (delta_chunk, "_checked_intermediates"),
                         (delta_lowering, "_check_options"), (lightning_lowering, "_check_eager")):
        monkeypatch.setattr(module, name, refuse)
    for a, b in zip(torch.autograd.grad(o, leaves, do), want):
        assert torch.equal(a, b)
    torch.autograd.grad(lightning_o, qkv, torch.randn_like(lightning_o))
    with pytest.raises(AssertionError, match="checked again"):  # the forwards check
        hccompile.lightning_attn(*qkv)
    monkeypatch.undo()

    wrong = torch.ones(1, 39, 2, 32, device=device)
    with pytest.raises(ValueError, match="do"):
        delta_lowering.chunk_delta_rule_backward_op(q, k, v, beta, g, None, None, None, None, wrong, None,
                                                    "scalar", 0.3, True, None, 64)
    with pytest.raises(ValueError, match="do"):
        lightning_lowering.lightning_attn_backward_op(q, k, v, torch.zeros(2, device=device), None, wrong, None,
                                                      0.3)
