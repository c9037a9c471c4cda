"""The proof: each planned fusion is evaluated on random inputs both ways, the matched region with
the graph's own code and the replacement through the builders the rewrite uses, and refused unless
they agree. Nothing is rewritten on matching alone. The replacement's ops compute with their
plain-PyTorch references (lowering's references()): the proof is of the op's contract, which the
kernels' own tests hold them to, and a probe compiles no Triton kernel."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...compat import concrete_shape
from ...lowering._launch import references
from .. import fx_match as M
from ..fx_match import Refusal
from ..base import PassContext
from ..emit import EagerEmitter
from .views import _SEED
from .mapping import MappingPlan, build_mapping
from .post import PostPlan, build_post
from .aggregate import AggregatePlan, build_aggregate

MAX_PROBE_NODES = 4096


# ----------------------------------------------------------------------------------------
# probes


class _Random:
    """Probe inputs, drawn on the graph's device (full-size streams: no host-side generation)."""

    def __init__(self, seed: int):
        self.seed, self.gens = seed, {}

    def __call__(self, node: fx.Node, kind: str) -> torch.Tensor:
        ev = M.example(node)
        dev = ev.device
        gen = self.gens.get(dev)
        if gen is None:
            gen = self.gens[dev] = torch.Generator(device=dev).manual_seed(self.seed)
        shape = concrete_shape(ev)
        if kind == "positive":
            t = torch.rand(shape, generator=gen, device=dev) + 0.5
        elif kind == "scale":
            sign = torch.where(torch.rand(shape, generator=gen, device=dev) < 0.5, -1.0, 1.0)
            t = (torch.rand(shape, generator=gen, device=dev) + 0.5) * sign
        else:
            t = torch.randn(shape, generator=gen, device=dev)
        return t.to(ev.dtype)


def _compare(got, want, what: str, tol: float) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        if tuple(g.shape) != tuple(w.shape):
            raise Refusal(f"probe: {what} replacement shape {tuple(g.shape)} differs from the "
                          f"region's {tuple(w.shape)}")
        worst = max(worst, M.rel_rms_error(g, w))
    if not worst <= tol:
        raise Refusal(f"probe mismatch: the {what} region differs from the fused op by relative RMS "
                      f"{worst:.3g} (tolerance {tol:g})")
    return worst


def probe_mapping(plan: MappingPlan, gm: fx.GraphModule, ctx: PassContext) -> float:
    rand = _Random(_SEED)
    inputs = {plan.proj: rand(plan.proj, "normal"), plan.r: rand(plan.r, "positive")}
    for a in plan.alphas:
        if a is not None:
            inputs[a] = rand(a, "scale")
    for b in plan.biases:
        if b is not None:
            inputs[b] = rand(b, "normal")
    with torch.no_grad(), references():
        want = M.evaluate(gm, plan.values, inputs, ctx.example_inputs, max_nodes=MAX_PROBE_NODES)
        got = build_mapping(plan, EagerEmitter(), inputs[plan.proj], inputs[plan.r],
                            [inputs.get(a) for a in plan.alphas], [inputs.get(b) for b in plan.biases])
    return _compare(got, want, "mapping", M.probe_tolerance(M.example(plan.proj).dtype, ctx.config))


def probe_post(plan: PostPlan, gm: fx.GraphModule, ctx: PassContext) -> float:
    rand = _Random(_SEED + 1)
    X = plan.layout.x
    inputs = {X: rand(X, "normal"), plan.f: rand(plan.f, "normal"),
              plan.h_res: rand(plan.h_res, "positive"), plan.h_post: rand(plan.h_post, "positive")}
    if len(inputs) != 4:
        raise Refusal("x, f, H_res and H_post are not four distinct tensors")
    with torch.no_grad(), references():
        want = M.evaluate(gm, [plan.x_out], inputs, ctx.example_inputs, max_nodes=MAX_PROBE_NODES)
        got = [build_post(plan, EagerEmitter(), inputs[X], inputs[plan.h_res], inputs[plan.h_post],
                          inputs[plan.f])]
    return _compare(got, want, "post", M.probe_tolerance(M.example(X).dtype, ctx.config))


def probe_aggregate(plan: AggregatePlan, gm: fx.GraphModule, ctx: PassContext) -> float:
    rand = _Random(_SEED + 2)
    X = plan.layout.x
    inputs = {X: rand(X, "normal"), plan.h_pre: rand(plan.h_pre, "positive")}
    with torch.no_grad(), references():
        want = M.evaluate(gm, [plan.node], inputs, ctx.example_inputs, max_nodes=MAX_PROBE_NODES)
        got = [build_aggregate(plan, EagerEmitter(), inputs[X], inputs[plan.h_pre])]
    return _compare(got, want, "aggregate", M.probe_tolerance(M.example(X).dtype, ctx.config))
