"""Lower plain-PyTorch causal linear attention, with or without a constant per-head decay, to our ops.

Forms recognised (each in [B,H,T,D], [B,T,H,D] or flattened [BH,T,D] layouts, `@`/matmul/bmm or
einsum, the scale anywhere on the way):

* quadratic, ``O = c·tril(QKᵀ)V`` — a product `P @ V` whose left operand comes from `Q @ Kᵀ` through
  a causal mask (tril, masked_fill, where, or a multiplied 0/1 mask) and constant scalings;
* quadratic with a decay, ``O = c·(QKᵀ ⊙ D)V`` with ``D[h,t,s] = exp(γ_h (t−s))`` for s ≤ t, 0 above
  the diagonal — the decay matrix built the ways real code builds it (arange and an outer
  difference, exp or pow, masked with tril/where/masked_fill/-inf/nan_to_num; lightning attention's,
  RetNet's, MiniMax's constructions) from a per-head γ that is a buffer, a constant or any tensor that
  is not computed from q/k/v and needs no gradient;
* the block loop of lightning attention 2's reference (Dynamo unrolls it): per block an
  intra-block masked product plus an inter-block `Q·KV` with a carried KV state, with or without
  decay, assembled by torch.cat or by writing slices of an output buffer; the whole region becomes
  one op;
* the cumulative form ``o_t = q_t · Σ_{s≤t} k_s v_sᵀ`` — a cumsum over time of k⊗v (einsum or
  broadcasting) contracted with q (einsum, broadcast-and-sum, or matmul).

Every structural match is then proven on random probe inputs: the matched region, evaluated at
compile time with the graph's real masks and buffers, must equal the replacement. The decay is
also checked on its own: the evaluated decay matrix must be exp(γ_h (t−s)) below the diagonal for
the γ that the rewritten graph will compute. Anything else is refused with the reason, and the
graph is left to Inductor.

Which op each form lowers to is decided in one place, `OP_FOR_FORM` / `lowering_op`.

Modules, in the order data flows: forms (the report names, the op each form lowers to), vocabulary
(what each node does), facts (per-run dependences and the compile-time evaluator), quadratic (the
structural match and the Candidate every form fills in), decay (masks and γ), emit (the
replacement, written once for the probe and the rewrite), probe (the proof), rewrite (the
replacement inserted, dead code erased), block_loop and cumulative (the other forms); the pass
itself is here.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from .. import fx_match as M
from ..fx_match import Refusal
from ..base import GraphPass, PassContext, register_pass, unrolled_loop_note
from .forms import (OP_FOR_FORM, PATTERN, PATTERN_CUMSUM, PATTERN_DECAY, PATTERN_LOOP, _NotThisPattern,
                    lowering_op)
from .vocabulary import _alive, _kind
from .facts import _Facts
from .quadratic import Candidate, Decay, Operand, _is_candidate_anchor, match
from .decay import _analyse_masks, _qkv_deps
from .emit import _check_shapes, build
from .probe import _diagnose, probe
from .rewrite import _sweep_dead, rewrite
from .block_loop import _group_block_loops
from .cumulative import _noncausal_state, match_cumulative

# What code outside the package uses, or may: the report names, the op table (a dict, changed in place,
# so a change made through this module reaches the candidates), the matchers and the pass. Tunables
# read inside a submodule (WINDOW, SUPPORTED_DTYPES, MAX_HEAD_DIM) are not re-exported: rebinding
# them here would not reach the code that reads them; patch the submodule instead.
__all__ = ["PATTERN", "PATTERN_DECAY", "PATTERN_LOOP", "PATTERN_CUMSUM", "OP_FOR_FORM", "lowering_op",
           "Operand", "Decay", "Candidate", "match", "match_cumulative", "build", "probe", "rewrite",
           "LinearAttentionPass"]


# ---------------------------------------------------------------------------------------------
# The pass


@register_pass
class LinearAttentionPass(GraphPass):
    name = "linear_attn"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        g = gm.graph
        facts = _Facts(gm, ctx)
        lead_memo: dict = {}
        changed = False
        anchors = [n for n in g.nodes if _is_candidate_anchor(n, lead_memo)]

        # 1. structural matches of the quadratic form (no probe yet), grouped into block loops
        structural = []
        for anchor in anchors:
            try:
                cand = match(anchor, lead_memo)
                _analyse_masks(cand, facts, _qkv_deps(cand, facts))
                structural.append(cand)
            except (Refusal, ValueError):
                pass  # reported when the anchor is matched on its own below
        loops, refused_loops = _group_block_loops(structural, facts)
        facts.clear_memo()  # masks can be large: keep them only while one candidate needs them
        for cand, reason in refused_loops:
            record.refuse(PATTERN_LOOP, reason, node=cand.anchor.name)
        for loop in loops:
            if not all(_alive(n, g) for n in (loop.anchor, loop.q.node, loop.k.node, loop.v.node)):
                continue
            changed |= self._lower(loop, gm, ctx, facts, record)

        # 2. every other quadratic anchor on its own (matched again: earlier rewrites may have
        #    replaced its inputs)
        for anchor in anchors:
            if not _alive(anchor, g):
                continue  # erased by an earlier rewrite
            facts.clear_memo()
            cand = None
            try:
                cand = match(anchor, lead_memo)
                _analyse_masks(cand, facts, _qkv_deps(cand, facts))
            except (Refusal, ValueError) as r:
                pattern = PATTERN_DECAY if cand is not None and cand.mask_factors else PATTERN
                why = str(r) if isinstance(r, Refusal) else f"probe impossible: {r}"
                record.refuse(pattern, why, node=anchor.name)
                continue
            changed |= self._lower(cand, gm, ctx, facts, record)

        # 3. the cumulative form, and non-causal q·(KᵀV) for the report
        for node in list(g.nodes):
            if not _alive(node, g):
                continue
            if _kind(node) == "cumsum" and _kind(node.args[0]) in ("einsum", "mul"):
                try:
                    cand = match_cumulative(node)
                except _NotThisPattern:
                    continue  # a cumsum of something else than k⊗v: nothing to report
                except Refusal as r:
                    record.refuse(PATTERN_CUMSUM, str(r), node=node.name)
                    continue
                changed |= self._lower(cand, gm, ctx, facts, record)
            elif M.kind(node) in ("matmul", "einsum"):
                why = _noncausal_state(node, facts)
                if why:
                    record.refuse(PATTERN_CUMSUM, why, node=node.name)
        if changed:
            _sweep_dead(g)
            g.lint()
            gm.recompile()
        return changed

    @staticmethod
    def _lower(cand: Candidate, gm: fx.GraphModule, ctx: PassContext, facts: _Facts,
               record: Any) -> bool:
        where = cand.anchor.name
        try:
            _check_shapes(cand)
            op_name = cand.op
            err = None
            wanted = list(cand.mutations) + [cand.anchor]
            region = facts.region(wanted, stop={cand.q.node, cand.k.node, cand.v.node})
            if cand.form == "block_loop":
                others = facts.inputs_read(wanted, stop={cand.q.node, cand.k.node, cand.v.node})
                if others:
                    raise Refusal(f"the block loop reads {others}, forward input(s) other than q, "
                                  f"k, v (an initial state?)")
            if ctx.config.probe:
                err, region = probe(cand, facts)
                dtype = M.example(cand.q.node).dtype
                tol = M.probe_tolerance(dtype, ctx.config)
                if not err <= tol:
                    raise Refusal(f"probe mismatch: the region differs from the {cand.form} "
                                  f"form's replacement by relative RMS {err:.3g} (tolerance "
                                  f"{tol:g}); the mask is not causal lower-triangular or the math "
                                  f"differs{_diagnose(cand, facts)}")
        except Refusal as r:
            record.refuse(cand.pattern, str(r), node=where)
            return False
        except ValueError as e:  # from the evaluator: impure or unevaluable region
            record.refuse(cand.pattern, f"probe impossible: {e}", node=where)
            return False
        out = rewrite(cand, gm, ctx, facts, region)
        details = {"form": cand.form, "op": op_name, "replacement": out.name,
                   "layout": {"q": cand.q.labels, "k": cand.k.labels, "v": cand.v.labels,
                              "out": cand.out_labels},
                   "scale": cand.scale, "probe_rel_err": err}
        if cand.decay is not None:
            details["decay"] = [round(float(x), 6) for x in cand.decay.values[:16]]
        if cand.form == "block_loop":
            details["blocks"] = cand.blocks
            details["lengths"] = unrolled_loop_note(cand.blocks, f"hccompile.{op_name}")
        record.match(cand.pattern, node=where, **details)
        return True
