"""Replace each mHC layer that hc_detect found with the fused kernels' custom ops (lowering/mhc.py).

Per layer, three independent rewrites, each matched from the roles hc_detect recorded, proven on
random probe inputs (the matched region, evaluated at compile time with the graph's own code,
must equal the replacement) and refused with a reason otherwise:

  mhc_mapping    the σ maps and the whole Sinkhorn chain, from the projection `proj` (which stays a
                 matmul) and the norm r:  z = coef·α·p·ρ + bias (ρ = 1/r or r), H = a·σ(z) + b,
                 H_res = Sinkhorn(exp(z) or softmax(z)+ε, alternating normalisations with +ε)
                 -> hccompile::mhc_mapping
  mhc_post       H_res·x (or H_resᵀ·x) + H_post·f, the residual add -> hccompile::mhc_post
  mhc_aggregate  y = H_pre·x, the sublayer's input -> hccompile::mhc_aggregate

Layouts: every layout hc_detect recognises. The stream tensor x is related to the flattened stream
v (the projection's input) through view ops only; replaying those views on indices gives how x's
memory holds [token dims, stream, channel] (e.g. [B, S, n, C], [S, B, n·C], or streams folded into
the batch, [(B·n), S, C]). The ops read x through that strided view and write the new stream in the
same memory order, so the graph around them is unchanged; the residual output keeps x's layout,
the aggregate and f are token-major (the probe checks all of this).

The new nodes keep `node.meta["hc"]` roles and the layer's HCLayer fields point at them, so the
recompute pass (order 200, after this one) tags them MUST_RECOMPUTE per block like the nodes they
replace. `options={"disable_passes": ["hc_fuse"]}` turns the fusion off.

Dynamic shapes: the layouts are worked out on the size hints, the new views take symbolic token
sizes from the graph (-1, or size nodes of the projection), so one graph serves every length.

Limits (refused, never wrong): a symbolic stream width n·C; more than two token dims; a mixing
product that is not a matmul/bmm/einsum; α that is not a one-element tensor, a bias that is not a
tensor; the three parts dividing by different norms; n > 16 streams; more than 256 Sinkhorn
normalisations; an aggregate or sublayer output that is not token-major (the probe refuses it).
A mapping that computes something else than the kernel (`_mapping_differences`: each stream
normalised on its own before the projection, H_post from a projection of its own, Sinkhorn steps
that floor Σ|m| at ε (F.normalize(p=1)), an exp(z − max z) start; the `hyper-connections`
package's mHC has all four) is refused with those reasons; its post and aggregate still fuse,
also where H_pre and H_res are applied in one product sliced into y and the mixed streams, and
where the mapping values are [1, B, S, 1, n, ...] rather than [tokens, n].

Modules, in the order data flows: views (index maps through view chains, shape helpers), layout
(the stream layout), mapping, post and aggregate (each fusion planned, and built against the shared
emitter, passes/emit.py), probe, rewrite; the pass itself is here.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from .. import fx_match as M
from ..fx_match import Refusal
from ..base import GraphPass, PassContext, register_pass
from ..hc_detect import HCLayer, current_layers, view_root
from .views import _shape
from .layout import stream_layout
from .mapping import _res_value, _sigma_side, plan_mapping
from .post import plan_post
from .aggregate import plan_aggregate
from .probe import probe_aggregate, probe_mapping, probe_post
from .rewrite import rewrite_aggregate, rewrite_mapping, rewrite_post

PATTERNS = ("mhc_mapping", "mhc_post", "mhc_aggregate")


# ----------------------------------------------------------------------------------------


@register_pass
class HCFusePass(GraphPass):
    name = "hc_fuse"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        layers = [l for l in current_layers(gm) if not l.fused]
        changed = False
        for layer in layers:
            changed |= self._fuse_layer(layer, layers, gm, ctx, record)
        if changed:
            gm.graph.lint()
            gm.recompile()
            fused = {p: sum(p[4:] in l.fused for l in layers) for p in PATTERNS}
            record.notes.append(f"fused {fused} of {len(layers)} hyper-connection layer(s)")
        return changed

    def _fuse_layer(self, layer: HCLayer, layers: list[HCLayer], gm: fx.GraphModule,
                    ctx: PassContext, record: Any) -> bool:
        changed = False
        probe = ctx.config.probe
        try:
            n = _shape(layer.sinkhorn[-1])[-1]
            h_res = _res_value(layer)
            h_pre, _, _ = _sigma_side(layer.h_pre)
            h_post, _, _ = _sigma_side(layer.h_post)
            layout = stream_layout(layer, n)
        except Refusal as r:
            for p in PATTERNS:
                record.refuse(p, str(r), node=layer.x_out.name, layer=layer.index)
            return False

        def attempt(pattern: str, plan_fn, probe_fn, rewrite_fn, where: fx.Node) -> None:
            nonlocal changed
            name = where.name
            try:
                plan = plan_fn()
                err = probe_fn(plan, gm, ctx) if probe else None
            except Refusal as r:
                record.refuse(pattern, str(r), node=name, layer=layer.index)
                return
            except ValueError as e:  # the probe evaluator: an impure or unevaluable region
                record.refuse(pattern, f"probe impossible: {e}", node=name, layer=layer.index)
                return
            except Exception as e:  # noqa: BLE001 - nothing has changed yet: refuse, do not fail
                if ctx.config.strict:
                    raise
                record.refuse(pattern, f"matching or probing failed: {type(e).__name__}: {e}",
                              node=name, layer=layer.index)
                return
            out = rewrite_fn(plan)
            layer.fused.append(pattern[4:])
            record.match(pattern, node=name, layer=layer.index, replacement=getattr(out, "name", None),
                         probe_rel_err=err, **self._details(pattern, plan))
            changed = True

        attempt("mhc_post", lambda: plan_post(layer, layout, h_res, h_post), probe_post,
                lambda plan: rewrite_post(plan, layer, layers, gm, ctx), layer.x_out)
        attempt("mhc_aggregate", lambda: plan_aggregate(layer, layout, h_pre), probe_aggregate,
                lambda plan: rewrite_aggregate(plan, layer, gm, ctx), layer.aggregate)
        token_dependent = M.downstream(view_root(layer.x))
        attempt("mhc_mapping", lambda: plan_mapping(layer, token_dependent), probe_mapping,
                lambda plan: rewrite_mapping(plan, layer, gm, ctx)[2], layer.sinkhorn[-1])
        return changed

    @staticmethod
    def _details(pattern: str, plan: Any) -> dict[str, Any]:
        if pattern == "mhc_mapping":
            s = plan.spec
            return {"n": s.n, "init": s.init, "sinkhorn_steps": s.steps, "row_first": s.row_first,
                    "offsets": list(s.part_offsets()), "r_divides": s.r_divides}
        lay = plan.layout
        out = {"stream": lay.x.name, "tokens_streams_channels": list(lay.sizes),
               "memory_order": list(lay.order)}
        if pattern == "mhc_post":
            out["transpose_res"] = plan.transpose_res
        return out
