"""Under dynamic shapes, Inductor must launch our kernels as well as Triton's own launcher does.

Triton's launcher marks every integer argument that is a multiple of 16 (strides, head dims) so the
compiler can vectorise loads; Inductor, compiling a traced kernel, marks only those it can prove
so. With dynamic=True a symbolic head dim made every row stride unprovable, and the compiled GDN
step ran 3.3x slower than eager on the H100 (12.0 against 3.6 ms, 2026-11-26). The ops fix their
head counts and head dims at trace time (lowering._launch.fix_sizes); batch and time stay symbolic.
"""
from __future__ import annotations

import ast
import re

import pytest
import torch

from hccompile.lowering._launch import HEADS, fix_sizes


def _symbolic(*shapes):
    """Fake tensors whose every dim is a backed symbol of one shape environment (equal sizes share
    one symbol, as under dynamic=True)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    tensors = [mode.from_tensor(torch.empty(shape), source=ConstantSource(f"t{i}"),
                                symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DUCK] * len(shape)))
               for i, shape in enumerate(shapes)]
    return env, tensors


def _values(env, tensor):
    return [env.replace(size.node.expr) if isinstance(size, torch.SymInt) else size for size in tensor.shape]


def test_fix_sizes_fixes_heads_and_keeps_batch_and_time_symbolic():
    env, (q, v) = _symbolic((2, 101, 4, 64), (2, 101, 4, 32))
    fix_sizes({"q": q, "v": v, "beta": None}, {"q": HEADS, "v": HEADS, "beta": (2,)})
    qs, vs = _values(env, q), _values(env, v)
    assert qs[2:] == [4, 64] and vs[2:] == [4, 32], (qs, vs)
    assert all(not s.is_number for s in qs[:2] + vs[:2]), (qs, vs)   # batch and time: still symbols


def test_fix_sizes_leaves_a_head_dim_that_shares_the_time_symbol():
    """dynamic=True gives equal sizes one symbol: fixing D = T = 64 would fix the length too, and
    one graph for every length comes first."""
    env, (q,) = _symbolic((2, 64, 4, 64))
    fix_sizes({"q": q}, {"q": HEADS})
    qs = _values(env, q)
    assert qs[2] == 4, qs
    assert not qs[3].is_number and qs[3] == qs[1], qs


def test_fix_sizes_leaves_static_sizes_alone():
    q = torch.empty(2, 5, 4, 8)
    fix_sizes({"q": q}, {"q": HEADS})   # eager calls: plain ints, nothing to guard


# ------------------------------------------------------------------------------------------
# On the GPU: the divisibility hints Inductor gives each of our kernels under dynamic=True equal
# those of the same function compiled for static shapes. T is odd, so a product T*x is a
# multiple of 16 exactly when x is, for a number and for a symbol alike.

_KERNEL = re.compile(r"async_compile\.triton\('(?P<name>\w+)', '''(?P<source>.*?)'''", re.S)


def divisible_arguments(code: str) -> dict[str, list[tuple[str, ...]]]:
    """kernel name -> for each compiled variant, the arguments Inductor marks as multiples of 16
    (its triton_meta), for our kernels (Inductor's own are named triton_*)."""
    found: dict[str, list[tuple[str, ...]]] = {}
    for match in _KERNEL.finditer(code):
        name, source = match["name"], match["source"]
        if name.startswith("triton_"):
            continue
        signature = re.search(r"'signature': (\{.*?\})", source)
        configs = re.search(r"'configs': \[(\{.*?\})?\]", source)
        assert signature and configs, f"{name}: no triton_meta signature/configs in Inductor's code"
        names = list(ast.literal_eval(signature[1]))
        marked = ast.literal_eval(configs[1]) if configs[1] else {}
        divisible = sorted(names[index[0]] for index, attrs in marked.items()
                           if ["tt.divisibility", 16] in attrs)
        found.setdefault(name, []).append(tuple(divisible))
    return {name: sorted(variants) for name, variants in found.items()}


def _case(family: str):
    import hccompile

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    B, T, H, D = 2, 101, 4, 64
    if family in ("gdn", "kda"):
        f = hccompile.chunk_gated_delta_rule if family == "gdn" else hccompile.chunk_kda
        g = torch.nn.functional.logsigmoid(randn(B, T, H, *(() if family == "gdn" else (D,)), dtype=torch.float32))
        beta = torch.rand(B, T, H, generator=gen, device="cuda").bfloat16()
        return (lambda q, k, v, g, beta: f(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]), \
            [randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D), g, beta]
    if family == "lightning":
        decay = hccompile.lowering.lightning.alibi_decay(H, device="cuda")
        return (lambda q, k, v: hccompile.lightning_attn(q, k, v, decay=decay)[0]), \
            [randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)]
    if family == "linear_attn":
        return hccompile.causal_linear_attn, [randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)]
    if family == "mhc":
        from hccompile.nn import MHCGPT

        torch.manual_seed(0)
        model = MHCGPT(64, 2, 1, n=4, sinkhorn_iters=4).cuda().bfloat16()
        return model, [randn(B, T, 64)]
    raise AssertionError(family)


def _compiled_code(family: str, dynamic: bool) -> str:
    from torch._inductor.utils import run_and_get_code

    function, inputs = _case(family)
    leaves = [t.clone().requires_grad_() for t in inputs]
    torch._dynamo.reset()
    # the mHC ops come from hc's passes; the attention ops are called directly
    compiled = torch.compile(function, backend="hc" if family == "mhc" else "inductor", fullgraph=True,
                             dynamic=dynamic)
    _, codes = run_and_get_code(lambda: compiled(*leaves).float().square().sum().backward())
    return "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gdn", "kda", "lightning", "linear_attn", "mhc"])
def test_gpu_dynamic_shapes_keep_the_kernels_alignment_hints(family):
    static = divisible_arguments(_compiled_code(family, dynamic=False))
    dynamic = divisible_arguments(_compiled_code(family, dynamic=True))
    assert static, "none of our kernels found in Inductor's code"
    assert dynamic.keys() == static.keys()
    lost = {name: [sorted(set(s) - set(d)) for s, d in zip(static[name], dynamic[name])]
            for name in static if static[name] != dynamic[name]}
    assert not lost, f"arguments Inductor no longer knows to be multiples of 16 under dynamic=True: {lost}"
