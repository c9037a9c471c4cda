"""The proof: the matched region, evaluated at compile time on random q, k, v with the graph's real
masks and buffers, against the replacement. Kept apart because a structural match is only a
hypothesis; nothing is rewritten that this did not confirm, and a mismatch is turned into a reason
the user can act on."""
from __future__ import annotations

import torch
import torch.fx as fx

from ...compat import concrete_shape
from .. import fx_match as M
from ..fx_match import Refusal
from ..emit import EagerEmitter
from .facts import _Facts
from .quadratic import Candidate, _einsum_roles
from .emit import build


def probe(cand: Candidate, facts: _Facts) -> tuple[float, list[fx.Node]]:
    """Relative RMS error between the matched region and the replacement on random inputs;
    also returns the region's nodes. The region must read no forward input but q, k, v (and
    masks, which the probe uses with their real values, as the original pass did)."""
    gen = None
    inputs: dict[fx.Node, torch.Tensor] = {}
    for op in (cand.q, cand.k, cand.v):
        ev = M.example(op.node)
        if gen is None:
            gen = torch.Generator(device=ev.device).manual_seed(20261122)
        inputs[op.node] = torch.randn(concrete_shape(ev), generator=gen, device=ev.device,
                                      dtype=torch.float32).to(ev.dtype)
    if len(inputs) != 3:
        raise Refusal("q, k and v are not three distinct tensors")
    if cand.mutations:
        wanted = list(cand.mutations) + [cand.anchor]
    else:
        wanted = [cand.anchor]
    with torch.no_grad():
        values, region = facts.evaluate(wanted, inputs)
        region_out = values[-1]
        ref = build(cand, EagerEmitter(facts.value), inputs[cand.q.node], inputs[cand.k.node],
                    inputs[cand.v.node])
    if tuple(region_out.shape) != tuple(ref.shape):
        raise Refusal(f"probe: region output shape {tuple(region_out.shape)} differs from the "
                      f"replacement's {tuple(ref.shape)}")
    return M.rel_rms_error(region_out, ref), region


def _diagnose(cand: Candidate, facts: _Facts) -> str:
    """Why a quadratic candidate failed its probe: read the effective weights (scores = 1)."""
    if cand.form != "quadratic":
        return ""
    try:
        qk = next(n for n in cand.region if M.kind(n) in ("matmul", "einsum"))
        ones = torch.ones(concrete_shape(M.example(qk)), dtype=M.example(qk).dtype,
                          device=M.example(qk).device)
        p = cand.anchor.args[0] if M.kind(cand.anchor) == "matmul" else _einsum_roles(cand.anchor)[1][0]
        (w,), _ = facts.evaluate([p], {qk: ones})
        ti, si = cand.p_labels.index("t"), cand.p_labels.index("s")
        w = w.detach().double().movedim((ti, si), (-2, -1))
        t_len, s_len = w.shape[-2:]
        future = torch.ones(t_len, s_len, dtype=torch.bool, device=w.device).triu(1)
        if (w[..., future] != 0).any():
            return " (the mask keeps entries above the diagonal: not causal, or the wrong orientation)"
        if (w.diagonal(dim1=-2, dim2=-1) == 0).any():
            return " (the mask drops the diagonal)"
    except Exception:  # noqa: BLE001 - a diagnosis is advisory
        return ""
    return ""
