"""hc_project: the two reductions of the stream that feed a fused mHC mapping become one op.

A fused mapping (hc_fuse's hccompile::mhc_mapping) reads the projection p = v·φᵀ of the flattened
stream v and the per-token norm r made from Σ v² (r = sqrt(mean(v²) + ε) and its spellings). The
graphs compute them as

    proj = F.linear(v, φ)                   a cuBLAS call reading v
    ms   = (v.float() ** 2).mean(-1)        an Inductor reduction reading v again

and their backward writes dv = dproj·φ (cuBLAS), reads it back to add the norm's 2·dsq·v, and reads
v once more for dφ. hccompile::mhc_project (kernels/mhc/project.py) computes (proj, Σ v²) from one
read of v and (dv, dφ) from one more; the mean is its sum over K.

Matched, per fused mapping: its projection argument is `linear(v, φ)` without a bias (v [T1, T2, K],
φ [W, K], one dtype) and its norm argument is computed, through per-token pointwise steps, from a
mean or a sum over the last dim of v·v, v**2 or v.square(), v cast to float32 or not. Refused, with
the reason: a bias, another reduction dim, squares of another tensor than the projection's, a
projection wider than the kernels take (it would run the reference). The replacement is proven on
random inputs against the graph's own code before it is made; hc_detect's layer record is pointed
at the new projection value, so block recompute keeps it (recompute.mapping_inputs).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import fx_match as M
from ..compat import concrete_shape
from ..lowering._launch import references
from .base import GraphPass, PassContext, register_pass
from .emit import EagerEmitter, Emitter, GraphEmitter
from .fx_match import Refusal
from .hc_detect import HCLayer, current_layers

PATTERN = "mhc_project"
_LINEAR = {torch.nn.functional.linear, torch._C._nn.linear}
_MAX_CHAIN = 8  # per-token steps between the reduction and the norm the mapping reads
_FLOAT16_32 = (torch.float16, torch.bfloat16, torch.float32)
_INHERITED_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


@dataclass
class ProjectPlan:
    layer: HCLayer
    linear: fx.Node       # proj = linear(v, φ)
    reduction: fx.Node    # mean or sum over the last dim of v² (cast or not)
    v: fx.Node
    phi: fx.Node
    width: int            # K, the stream's flattened width
    mean: bool
    keepdim: bool
    dtype: torch.dtype    # the reduction's dtype


def _is(node: Any, method: str, functions: tuple) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target == method)
        or (node.op == "call_function" and node.target in functions))


def _squared(node: fx.Node) -> fx.Node:
    """x for x·x, x**2, x.pow(2), x.square()."""
    if _is(node, "pow", (torch.pow, operator.pow)):
        base, exponent = M.arg(node, 0, "input"), M.arg(node, 1, "exponent")
        if M.scalar(exponent) == 2.0 and isinstance(base, fx.Node):
            return base
    elif _is(node, "mul", (operator.mul, torch.mul)):
        a, b = node.args[:2] if len(node.args) >= 2 else (None, None)
        if isinstance(a, fx.Node) and a is b:
            return a
    elif _is(node, "square", (torch.square,)) and isinstance(node.args[0], fx.Node):
        return node.args[0]
    raise Refusal(f"{node.name}: the norm's reduction does not read a square (x·x, x**2, x.square())")


def _uncast(node: fx.Node) -> fx.Node:
    """x for x.float() or x.to(torch.float32) (the squares taken in float32); else the node."""
    if node.op == "call_method" and node.target == "float" and len(node.args) == 1:
        return node.args[0]
    if node.op == "call_method" and node.target == "to":
        target = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
        if target == torch.float32 and len(node.args) <= 2 and set(node.kwargs) <= {"dtype"}:
            return node.args[0]
    return node


def _last_dim(node: fx.Node, dim: Any, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _reduction(r: fx.Node) -> fx.Node:
    """The mean or sum the norm `r` is computed from, through per-token single-input steps."""
    cur = r
    for _ in range(_MAX_CHAIN):
        if _is(cur, "mean", (torch.mean,)) or _is(cur, "sum", (torch.sum,)):
            return cur
        inputs = cur.all_input_nodes if isinstance(cur, fx.Node) else []
        if len(inputs) != 1 or cur.op not in ("call_function", "call_method") or M.is_impure(cur):
            break
        cur = inputs[0]
    raise Refusal(f"{r.name}: the norm is not computed from a mean or sum of squares of the stream")


def plan_project(layer: HCLayer, mapping: fx.Node) -> ProjectPlan:
    proj, r = mapping.args[0], mapping.args[1]
    if not (isinstance(proj, fx.Node) and proj.op == "call_function" and proj.target in _LINEAR):
        raise Refusal(f"{getattr(proj, 'name', proj)}: the projection is not F.linear(v, φ)")
    v, phi = M.arg(proj, 0, "input"), M.arg(proj, 1, "weight")
    if M.arg(proj, 2, "bias") is not None:
        raise Refusal(f"{proj.name}: the projection has a bias")
    ev, ephi = M.example(v), M.example(phi)
    if not isinstance(ev, torch.Tensor) or not isinstance(ephi, torch.Tensor) or ev.dim() != 3 or ephi.dim() != 2:
        raise Refusal(f"{proj.name}: v is not [T1, T2, K] or φ not [W, K]")
    if ev.dtype != ephi.dtype or ev.dtype not in _FLOAT16_32:
        raise Refusal(f"{proj.name}: v and φ are {ev.dtype} and {ephi.dtype}, not one of {list(_FLOAT16_32)}")
    # K from φ, a parameter: the stream's own width may be a symbol (the first layer's stream is
    # the input's, and dynamic=True makes every input size one); linear makes the two equal
    outs, width = ephi.shape
    if not isinstance(width, int) or not isinstance(outs, int):
        raise Refusal(f"{proj.name}: the stream width or the projection width is not static")
    from ..kernels.mhc.project import kernel_width

    if not kernel_width(outs, ev.dtype):
        raise Refusal(f"{proj.name}: a projection of width {outs} in {ev.dtype} is wider than the kernels take")
    if not isinstance(r, fx.Node):
        raise Refusal("the mapping's norm is not a graph value")
    red = _reduction(r)
    x = M.arg(red, 0, "input")
    if not isinstance(x, fx.Node):
        raise Refusal(f"{red.name}: reduces no graph value")
    ex = M.example(x)
    if not _last_dim(red, M.arg(red, 1, "dim"), ex.dim() if isinstance(ex, torch.Tensor) else -1):
        raise Refusal(f"{red.name}: the reduction is not over the last dim")
    if M.arg(red, 3, "dtype") is not None or (len(red.args) > 3) or set(red.kwargs) - {"dim", "keepdim"}:
        raise Refusal(f"{red.name}: the reduction takes arguments besides dim and keepdim")
    keepdim = M.arg(red, 2, "keepdim", False)
    if not isinstance(keepdim, bool):
        raise Refusal(f"{red.name}: keepdim is not a constant")
    base = _uncast(_squared(x))
    if base is not v:
        raise Refusal(f"{red.name}: squares {base.name}, not the projection's input {v.name}")
    return ProjectPlan(layer, proj, red, v, phi, width, _is(red, "mean", (torch.mean,)), keepdim,
                       M.example(red).dtype)


def build_project(plan: ProjectPlan, em: Emitter, v: Any, phi: Any) -> tuple[Any, Any]:
    """(proj, the reduction's value) from hccompile::mhc_project(v, φ)."""
    out = em.op("mhc_project", v, phi)
    proj, sq = em.getitem(out, 0), em.getitem(out, 1)
    value = em.call(operator.truediv, sq, plan.width) if plan.mean else sq
    if plan.keepdim:
        value = em.method("unsqueeze", value, -1)
    return proj, em.cast(value, plan.dtype)


def probe_project(plan: ProjectPlan, gm: fx.GraphModule, ctx: PassContext) -> float:
    """The region (linear and the reduction, with the graph's own code) against the replacement
    (the op's reference, lowering's references()) on random v and φ."""
    ev, ephi = M.example(plan.v), M.example(plan.phi)
    gen = torch.Generator(device=ev.device).manual_seed(20261130)
    v = torch.randn(concrete_shape(ev), generator=gen, device=ev.device).to(ev.dtype)
    phi = (torch.randn(concrete_shape(ephi), generator=gen, device=ev.device) * plan.width ** -0.5).to(ephi.dtype)
    with torch.no_grad(), references():
        want = M.evaluate(gm, [plan.linear, plan.reduction], {plan.v: v, plan.phi: phi}, ctx.example_inputs,
                          max_nodes=64)
        got = build_project(plan, EagerEmitter(), v, phi)
    worst = 0.0
    for g, w, what in zip(got, want, ("projection", "norm's reduction")):
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
            raise Refusal(f"probe: the {what} would change from {tuple(w.shape)} {w.dtype} to "
                          f"{tuple(g.shape)} {g.dtype}")
        worst = max(worst, M.rel_rms_error(g, w))
    tol = M.probe_tolerance(ev.dtype, ctx.config)
    if not worst <= tol:
        raise Refusal(f"probe mismatch: the projection region differs from mhc_project by relative RMS "
                      f"{worst:.3g} (tolerance {tol:g})")
    return worst


def rewrite_project(plan: ProjectPlan, gm: fx.GraphModule, ctx: PassContext) -> fx.Node:
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    # right after v and φ: before the linear, the reduction and every user of either; past the
    # placeholders when both are inputs (a node inserted among them breaks the graph's signature)
    anchor = max(plan.v, plan.phi, key=order.__getitem__).next
    while anchor.op == "placeholder":
        anchor = anchor.next
    meta_from = plan.linear
    em = GraphEmitter(g, ctx.fake_mode, {k: meta_from.meta[k] for k in _INHERITED_META if k in meta_from.meta})
    with g.inserting_before(anchor):
        proj, value = build_project(plan, em, plan.v, plan.phi)
    for node in em.created:
        node.meta["hc"] = {"layer": plan.layer.index, "role": "project"}
    plan.linear.replace_all_uses_with(proj)
    plan.reduction.replace_all_uses_with(value)
    dead = [plan.reduction, plan.linear]
    while dead:
        node = dead.pop(0)
        if node.users or M.is_impure(node) or node.op != "call_method" and node.op != "call_function":
            continue
        inputs = [a for a in node.all_input_nodes if a is not plan.v and a is not plan.phi]
        g.erase_node(node)
        dead.extend(inputs)
    layer = plan.layer
    layer.projs = [proj if p is plan.linear else p for p in layer.projs]
    layer.proj = proj
    return proj


def _mapping_op(layer: HCLayer) -> fx.Node | None:
    """The fused mapping's op node (h_pre is its first output), or None if hc_fuse did not fuse it."""
    if "mapping" not in layer.fused:
        return None
    node = layer.h_pre.args[0] if layer.h_pre.target is operator.getitem else None
    return node if isinstance(node, fx.Node) and "mhc_mapping" in str(node.target) else None


@register_pass
class HCProjectPass(GraphPass):
    name = "hc_project"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        changed = False
        for layer in current_layers(gm):
            mapping = _mapping_op(layer)
            if mapping is None:
                if layer.fused or layer.proj is not None:
                    record.refuse(PATTERN, "the layer's mapping is not fused (hc_fuse)", layer=layer.index,
                                  node=layer.x_out.name)
                continue
            try:
                plan = plan_project(layer, mapping)
                err = probe_project(plan, gm, ctx) if ctx.config.probe else None
            except Refusal as r:
                record.refuse(PATTERN, str(r), node=mapping.name, layer=layer.index)
                continue
            except ValueError as e:  # the probe evaluator: an impure or unevaluable region
                record.refuse(PATTERN, f"probe impossible: {e}", node=mapping.name, layer=layer.index)
                continue
            except Exception as e:  # noqa: BLE001 - nothing has changed yet: refuse, do not fail
                if ctx.config.strict:
                    raise
                record.refuse(PATTERN, f"matching or probing failed: {type(e).__name__}: {e}",
                              node=mapping.name, layer=layer.index)
                continue
            proj = rewrite_project(plan, gm, ctx)
            record.match(PATTERN, node=mapping.name, layer=layer.index, replacement=proj.args[0].name,
                         reduction="mean" if plan.mean else "sum", keepdim=plan.keepdim, probe_rel_err=err)
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
