"""Lower the (gated) delta rule written in plain PyTorch to `hccompile::chunk_delta_rule`.

Per value head, with state S in R^{K x V}: S_t = D_t S_{t-1} + beta_t k_t (v_t - (D_t S_{t-1})^T k_t)^T,
o_t = scale S_t^T q_t, where D_t = 1 (delta rule), exp(g_t) (GDN, one log-gate per head) or
diag(exp(g_t)) (KDA, one per key channel).

Recognised forms (each in [B, T, H, D], [B, H, T, D] or any layout whose non-time, non-feature axes
are the state's batch axes in order):

* a token-by-token loop (`for t in range(T)`), which Dynamo unrolls into T copies of one step;
* the chunked form that model libraries ship: intra-chunk machinery over the whole sequence
  (padding, cumulative gates, the masked k·kᵀ matrix and its forward-substitution loop), then a loop
  over chunks carrying the state;
* one `torch._higher_order_ops.scan` over time whose step function is the recurrence.

How, without knowing the spelling:

1. Loops. Tensors indexed at every position 0..L-1 of one axis, in increasing order through the
   graph, are sliced sequences; sequences with the same count whose slices interleave form one loop.
   Iteration j is the run of nodes from the first slice of step j to the first slice of step j+1.
   Every iteration must be the same graph as the next (a structural signature with the step index
   masked, linear in the graph size); the one value an iteration hands to the next is the state, the
   one value it writes out (a buffer slot or an element of a later stack/cat) is the output.
2. Region and inputs. From what the loop reads, walk back through the recurrence's own machinery
   (layout, casts, padding, cumsum, products, exp, masks, l2 norms, mutation of loop-local buffers)
   and stop at tensors shaped like the op's inputs: per-token tensors whose other axes are the
   state's batch axes (q, k, v, beta, g) and one state-shaped tensor (h0). Anything else that the
   loop reads (a parameter, a per-head decay) refuses the region. Roles come from use: the per-token
   input that reaches an exp is the gate; the per-token input of value width is v.
3. Proof. The region is evaluated at compile time on random inputs shaped for their roles and
   compared with the op's math (its plain-PyTorch reference, float64): the first iteration from the
   initial state, the last one from a random state (which also checks padding and the last chunk),
   the final state, and the output after the loop's assembly, where random values stand in for
   the outputs of the iterations in between (step 2 proved those compute what the checked ones do;
   the assembly must put each value where the op's output has it). The scale is fitted, l2
   normalisation and the role assignments that shapes leave open are tried; the probe runs a fixed
   number of iterations, whatever the sequence length. A mismatch is a refusal.
4. Rewrite. One op call after the last input, the layout permutes, the region erased.

Near-misses (another update rule, a sign flip, a gate without exp, a non-causal chunk, a loop over
time backwards, a state decay that is not exp of a per-token input) are refused with the reason.

Modules, in the order data flows: vocabulary (what each node does), loops (step 1), region and roles
(step 2), emit (layout conversions shared by the probe and the rewrite), evaluate and probe (step 3),
rewrite (step 4); the pass itself is here.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..fx_match import Refusal, probe_tolerance
from ..base import GraphPass, PassContext, register_pass, unrolled_loop_note
from .vocabulary import _Index, _describe, _is_erased, _is_scan, _plain, _shape, _tensor_example
from .loops import NotARecurrence, _Loop, _analyse_scan, _analyse_unrolled, _find_families, _group_loops
from .region import _Region, _build_region
from .roles import _Roles, _assign_roles
from .probe import _Hypothesis, _Probe
from .rewrite import _rewrite

PATTERN = "delta_rule"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# ----------------------------------------------------------------------------------------------
# The pass


def _state_shape(loop: _Loop) -> tuple[int, ...]:
    if loop.kind == "scan":
        init = loop.scan_inputs[0][0]
        shape = _shape(init) if isinstance(init, fx.Node) else None
    else:
        shape = _shape(loop.states[0])
    if shape is None or len(shape) < 2:
        raise Refusal("the carried state is not a tensor of at least two dims")
    return shape


def _check_dtypes(roles: _Roles) -> None:
    for name, item in (("q", roles.q), ("k", roles.k), ("v", roles.v)):
        dtype = _tensor_example(item.node).dtype
        if dtype not in SUPPORTED_DTYPES:
            raise Refusal(f"{name} has dtype {dtype}; the kernels take float16, bfloat16 or float32")
        width = _shape(item.node)[-1]
        if width > MAX_HEAD_DIM:
            raise Refusal(f"{name}: head dim {width} exceeds the kernels' maximum {MAX_HEAD_DIM}")
    if _shape(roles.q.node) != _shape(roles.k.node) or roles.q.labels != roles.k.labels:
        raise Refusal(f"q {list(_shape(roles.q.node))} and k {list(_shape(roles.k.node))} differ in shape or layout")
    if roles.nb == 2:
        bq, bv = _shape(roles.q.node), _shape(roles.v.node)
        b0q, b0v = bq[roles.q.labels.index("b0")], bv[roles.v.labels.index("b0")]
        if b0q != b0v:
            raise Refusal("q and v differ in the first batch axis (only heads may be grouped)")


def _has_l2norm_ops(region: _Region, idx: _Index) -> bool:
    return any(_plain(idx.name(n)) in ("rsqrt", "normalize", "norm", "vector_norm", "sqrt") for n in region.nodes
               if n.op in ("call_function", "call_method"))


def lower_loop(loop: _Loop, gm: fx.GraphModule, idx: _Index, ctx: PassContext) -> dict[str, Any]:
    """Analyse, prove and replace one loop; returns the match details. Raises Refusal."""
    if loop.kind == "unrolled":
        _analyse_unrolled(loop, idx)
    state_shape = _state_shape(loop)
    region = _build_region(loop, idx, state_shape)
    out_shape = _shape(loop.out)
    if out_shape is None:
        raise Refusal(f"the loop's output {_describe(loop.out)} is not a tensor")
    options = _assign_roles(loop, region, idx, out_shape[-1])
    _check_dtypes(options[0])
    if not ctx.config.probe:
        raise Refusal("probe=False: this pass identifies the scale, l2 normalisation and the roles of "
                      "q, k and v numerically, so it does not lower without the probe")
    dtype = _tensor_example(options[0].v.node).dtype
    tol = probe_tolerance(dtype, ctx.config)
    probe = _Probe(loop, region, gm, idx, tol)
    l2_options = (False, True) if _has_l2norm_ops(region, idx) else (False,)
    with torch.no_grad():
        try:
            h, values, ev, m, span = probe.choose(options, l2_options)
            if not h.error <= tol:
                raise Refusal(_mismatch_reason(h, tol, "first steps"))
            err = probe.verify(h, values, ev, m, span)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            raise Refusal(f"probe impossible: {type(e).__name__}: {e}") from e
    if not err <= tol:
        raise Refusal(_mismatch_reason(h, tol, "whole loop", err))
    r = h.roles
    anchor_name = loop.anchor.name
    result = _rewrite(gm, idx, loop, region, h, probe.out_labels, ctx.fake_mode)
    return {
        "node": anchor_name,
        "replacement": result.name,
        "form": _form(loop, span),
        "gate": r.gate,
        "steps": loop.steps,
        "tokens": r.T,
        "scale": h.scale,
        "use_qk_l2norm_in_kernel": h.l2norm,
        "initial_state": r.h0 is not None,
        "final_state": bool(loop.final_users),
        "grouped_heads": _shape(r.q.node)[r.q.labels.index("b1")] != _shape(r.v.node)[r.v.labels.index("b1")]
        if r.nb == 2 else False,
        "layout": {"q": r.q.labels, "v": r.v.labels, "out": probe.out_labels},
        "region_nodes": len(region.nodes),
        "probe_rel_err": max(h.error, err),
        **({"lengths": unrolled_loop_note(loop.steps, f"hccompile.{_PUBLIC_OP[r.gate]}")}
           if loop.kind == "unrolled" else {}),
    }


_PUBLIC_OP = {"none": "chunk_delta_rule", "scalar": "chunk_gated_delta_rule", "channel": "chunk_kda"}


def _form(loop: _Loop, span: int) -> str:
    if loop.kind == "scan":
        return "scan"
    return "recurrent" if span == 1 else f"chunked (chunk {span})"


def _mismatch_reason(h: _Hypothesis, tol: float, where: str, err: float | None = None) -> str:
    err = h.error if err is None else err
    what = {"none": "delta rule", "scalar": "gated delta rule (scalar gate)",
            "channel": "gated delta rule (per-channel gate)"}[h.roles.gate]
    return (f"probe mismatch ({where}): the loop differs from the {what} by relative RMS {err:.3g} "
            f"(tolerance {tol:g}) under every role assignment tried; a different update rule (e.g. linear "
            f"attention S += k v^T, a sign flip, a gate without exp) or a non-causal form")


def find_loops(gm: fx.GraphModule, idx: _Index) -> list[_Loop]:
    loops = _group_loops(_find_families(idx), idx)
    for n in gm.graph.nodes:
        if _is_scan(n):
            loops.append(_Loop("scan", n, 0))
    loops.sort(key=lambda lp: idx.pos[lp.anchor])
    return loops


@register_pass
class DeltaRulePass(GraphPass):
    name = "delta_rule"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        idx = _Index(gm.graph)
        changed = False
        for loop in find_loops(gm, idx):
            if _is_erased(loop.anchor):
                continue  # inside a loop replaced already
            where = loop.anchor.name
            try:
                if loop.kind == "scan":
                    loop = _analyse_scan(loop.anchor, gm, idx)
                details = lower_loop(loop, gm, idx, ctx)
            except NotARecurrence as e:
                record.notes.append(f"{PATTERN}: {e}")
                continue
            except Refusal as e:
                record.refuse(PATTERN, str(e), node=where)
                continue
            record.match(PATTERN, **details)
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
