"""Whether what multiplies the scores is a causal 0/1 mask and at most one decay exp(γ_h (t−s)), and
which γ. Kept apart because it is the one analysis of a match that reads values, not structure: it
evaluates the masks on the real inputs, and it must refuse the decays the kernel cannot express
(data-dependent, trainable, per-position or windowed) before anything is probed."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import fx_match as M
from ..fx_match import Refusal
from .vocabulary import _kind, _other, _shape
from .facts import _Facts
from .quadratic import TABLE, Candidate, Decay


# ---------------------------------------------------------------------------------------------
# Masks and decays of the quadratic form


# The decay checks read the leading WINDOW x WINDOW corner of the evaluated matrices: enough to
# identify γ·(t−s), without float64 copies of a [H, T, T] matrix at long T.
WINDOW = 256


def _aligned(value: Any, rank: int, ti: int, si: int) -> torch.Tensor:
    """value as float64 on the CPU, rank `rank` (leading size-1 dims), cut to the leading WINDOW
    positions along t and s."""
    value = torch.as_tensor(value).detach()
    if value.dim() > rank:
        raise Refusal(f"a mask of rank {value.dim()} multiplies scores of rank {rank}")
    value = value.reshape((1,) * (rank - value.dim()) + tuple(value.shape))
    value = value.narrow(ti, 0, min(WINDOW, value.shape[ti])).narrow(si, 0, min(WINDOW, value.shape[si]))
    return value.to("cpu", torch.float64)


def _aligned_shape(node: Any, rank: int) -> tuple[int, ...]:
    shape = _shape(node) if isinstance(node, fx.Node) else ()
    if shape is None:
        raise Refusal(f"{M.describe(node)} has no tensor example value")
    if len(shape) > rank:
        raise Refusal(f"a mask of rank {len(shape)} multiplies scores of rank {rank}")
    return (1,) * (rank - len(shape)) + tuple(shape)


@dataclass
class _Term:
    """An exponent coeff · Π heads · Π positions, each factor a graph node."""

    coeff: float = 1.0
    heads: list[tuple[fx.Node, bool]] = field(default_factory=list)
    positions: list[fx.Node] = field(default_factory=list)


class _DecayAnalysis:
    """Reads γ off a tensor D that multiplies the scores: D = c · exp(γ_h (t−s)) on and below the
    diagonal, with 0/1 masks, nan_to_num and views around it."""

    def __init__(self, cand: Candidate, facts: _Facts, qkv_deps: int):
        self.cand, self.facts, self.qkv_deps = cand, facts, qkv_deps
        self.rank = len(cand.p_labels)
        self.ti, self.si = cand.p_labels.index("t"), cand.p_labels.index("s")
        self.weight = 1.0
        self.terms: list[_Term] = []

    # classification of a tensor by how it broadcasts against the scores
    def _per_head(self, node: fx.Node) -> bool:
        shape = _aligned_shape(node, self.rank)
        return shape[self.ti] == 1 and shape[self.si] == 1

    def _per_position(self, node: fx.Node) -> bool:
        shape = _aligned_shape(node, self.rank)
        return all(s == 1 for i, s in enumerate(shape) if i not in (self.ti, self.si))

    def _is_binary(self, node: fx.Node) -> bool:
        if not self._per_position(node) or self.facts.deps(node) & self.qkv_deps:
            return False
        value = self.facts.value(node)
        if not isinstance(value, torch.Tensor):
            return False
        return bool(((value == 0) | (value == 1)).all())

    def weight_factor(self, node: Any) -> None:
        """Walk a factor of D (outside the exponent)."""
        if not isinstance(node, fx.Node):
            c = M.scalar(node)
            if c is None:
                raise Refusal(f"decay mask: factor {node!r} is not a number")
            self.weight *= c
            return
        k = _kind(node)
        if k == "exp":
            self.terms.append(self.exponent(node.args[0], _Term()))
        elif k == "pow":
            base, expo = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["exponent"]
            term = self.exponent(expo, _Term())
            if isinstance(base, fx.Node):
                if not self._per_head(base):
                    raise Refusal("decay mask: the base of the power varies with position")
                self._check_head(base)
                term.heads.append((base, True))
            else:
                b = M.scalar(base)
                if b is None or b <= 0:
                    raise Refusal(f"decay mask: power of a non-positive base {base!r}")
                term.coeff *= math.log(b)
            self.terms.append(term)
        elif k in ("mul",):
            self.weight_factor(node.args[0])
            self.weight_factor(_other(node))
        elif k == "div" and M.scalar(_other(node)) is not None:
            self.weight /= M.scalar(_other(node))
            self.weight_factor(node.args[0])
        elif k in ("tril", "triu", "nan_to_num", "cast", "contiguous", "reshape", "expand", "unsqueeze",
                   "getitem"):
            if k == "getitem" and not isinstance(node.args[1], (tuple, slice, type(None))):
                raise Refusal("decay mask: indexing is not a slice")
            self.weight_factor(node.args[0])
        elif k == "masked_fill":
            if M.scalar(M.arg(node, 2, "value")) != 0.0:
                raise Refusal("decay mask: masked_fill with a non-zero value outside the exponent")
            self.weight_factor(node.args[0])
        elif k == "where":
            x, y = M.arg(node, 1, "input"), M.arg(node, 2, "other")
            if M.scalar(y) == 0.0:
                self.weight_factor(x)
            elif M.scalar(x) == 0.0:
                self.weight_factor(y)
            else:
                raise Refusal("decay mask: where() without a zero branch")
        elif self._is_binary(node):
            return  # a 0/1 (causal) mask; the probe checks which entries it keeps
        elif self._is_table(node):
            # γ is read off the table, and the whole table is compared with exp(γ (t−s)) below
            self.terms.append(_Term(heads=[(node, TABLE)]))
        else:
            self._refuse_leaf(node, "is not part of a decay mask exp(γ·(t−s))")

    def _is_table(self, node: fx.Node) -> bool:
        """A constant tensor (a buffer: no graph input behind it) with extent along t and s."""
        return not self.facts.deps(node) and self._table_shape_ok(node)

    def _table_shape_ok(self, node: fx.Node) -> bool:
        shape = _aligned_shape(node, self.rank)
        value = self.facts.value(node)
        return shape[self.ti] >= 2 and shape[self.si] >= 2 and isinstance(value, torch.Tensor) \
            and not value.requires_grad and bool(torch.isfinite(value).all())

    def exponent(self, node: Any, term: _Term) -> _Term:
        """Decompose the exponent into coeff · per-head factors · position factors."""
        if not isinstance(node, fx.Node):
            c = M.scalar(node)
            if c is None:
                raise Refusal(f"decay exponent: {node!r} is not a number")
            term.coeff *= c
            return term
        k = _kind(node)
        if k == "neg":
            term.coeff = -term.coeff
            return self.exponent(node.args[0], term)
        if k == "mul":
            self.exponent(node.args[0], term)
            return self.exponent(_other(node), term)
        if k == "div" and M.scalar(_other(node)) is not None:
            term.coeff /= M.scalar(_other(node))
            return self.exponent(node.args[0], term)
        if k == "where":
            x, y = M.arg(node, 1, "input"), M.arg(node, 2, "other")
            cond = node.args[0]
            if self.facts.deps(cond) & self.qkv_deps:
                raise Refusal("decay exponent: masked by a condition on q/k/v (data-dependent)")
            if isinstance(x, fx.Node) and M.scalar(y) is not None:
                return self.exponent(x, term)
            if isinstance(y, fx.Node) and M.scalar(x) is not None:
                return self.exponent(y, term)
        if k in ("cast", "contiguous"):
            return self.exponent(node.args[0], term)
        if self._per_head(node):  # no extent along t or s (a scalar tensor is a head factor too)
            self._check_head(node)
            term.heads.append((node, False))
            return term
        if self._per_position(node):
            bits = self.facts.deps(node)
            if bits:
                raise Refusal(f"decay exponent: the positions depend on the input(s) "
                              f"{self.facts.input_names(bits)}")
            term.positions.append(node)
            return term
        if k == "masked_fill":
            return self.exponent(node.args[0], term)
        self._refuse_leaf(node, "varies along heads and positions at once: not a per-head "
                                "constant γ·(t−s)")
        raise AssertionError  # unreachable

    def _check_head(self, node: fx.Node) -> None:
        if self.facts.deps(node) & self.qkv_deps:
            raise Refusal(f"decay {M.describe(node)} ({node.name}) is computed from q/k/v "
                          f"(data-dependent decay): not a per-head constant")
        ev = M.example(node)
        if isinstance(ev, torch.Tensor) and ev.requires_grad:
            raise Refusal(f"decay {node.name} requires grad (a trainable decay); the lowered op "
                          f"treats the decay as a constant")

    def _refuse_leaf(self, node: fx.Node, why: str) -> None:
        bits = self.facts.deps(node)
        if bits & self.qkv_deps:
            raise Refusal(f"decay mask: {node.name} is computed from q/k/v (data-dependent decay)")
        raise Refusal(f"decay mask: {M.describe(node)} ({node.name}) {why}")

    # the numeric side
    def gamma(self) -> Decay:
        if not self.terms:
            raise Refusal("the scores are multiplied by a tensor that is neither a 0/1 mask nor "
                          "a decay exp(γ·(t−s)) (a per-head or tensor scale?)")
        if len(self.terms) > 1:
            raise Refusal("decay mask with more than one exponential factor")
        (term,) = self.terms
        table = any(mode == TABLE for _, mode in term.heads)
        if not term.positions and not table:
            raise Refusal("decay exponent does not depend on the positions t, s")
        distance = self._position_factor(term.positions) if term.positions else 1.0
        heads = [(n, log) for n, log in term.heads]
        gamma = torch.tensor([term.coeff * distance], dtype=torch.float64)
        for node, log in heads:
            if log == TABLE:
                d = _aligned(self.facts.value(node), self.rank, self.ti, self.si)
                value = d.narrow(self.ti, 1, 1).narrow(self.si, 0, 1).log().reshape(-1)
                gamma = gamma * value
                continue
            value = self.facts.value(node)
            value = torch.as_tensor(value).detach().to("cpu", torch.float64).reshape(-1)
            if log:
                value = value.log()
            if gamma.numel() > 1 and value.numel() > 1 and value.numel() != gamma.numel():
                raise Refusal("decay factors disagree on the number of heads")
            gamma = gamma * value
        return Decay(heads=heads, coeff=term.coeff * distance, values=gamma)

    def _position_factor(self, nodes: list[fx.Node]) -> float:
        """The position part must be c'·(t−s) on and below the diagonal; returns c'."""
        value = None
        for n in nodes:
            v = _aligned(self.facts.value(n), self.rank, self.ti, self.si)
            value = v if value is None else value * v
        rest = [i for i in range(self.rank) if i not in (self.ti, self.si)]
        grid = value.permute(rest + [self.ti, self.si]).reshape(-1, value.shape[self.ti],
                                                                 value.shape[self.si])[0]
        t_len, s_len = grid.shape
        if t_len < 2 or s_len < 2:
            if t_len == s_len == 1 and float(grid[0, 0]) == 0.0:
                return 1.0  # one position: only exp(γ·0) = 1 is used, whatever γ is
            raise Refusal(f"decay: a {t_len}x{s_len} decay matrix cannot be exp(γ·(t−s))")
        t = torch.arange(t_len, dtype=torch.float64)[:, None]
        s = torch.arange(s_len, dtype=torch.float64)[None, :]
        causal = (s <= t).expand(t_len, s_len)
        dist = (t - s).expand(t_len, s_len)[causal]
        got = grid[causal]
        if not torch.isfinite(got).all():
            raise Refusal("decay exponent is not finite on or below the diagonal")
        c = float((got * dist).sum() / (dist * dist).sum())
        err = float((got - c * dist).norm() / max(float((c * dist).norm()), 1e-30))
        dtype = M.example(nodes[0]).dtype if isinstance(M.example(nodes[0]), torch.Tensor) \
            else torch.float32
        if c == 0.0 or not err <= M.probe_tolerance(dtype, self.facts.ctx.config) * 1e-1:
            raise Refusal(f"decay exponent is not proportional to (t−s) below the diagonal "
                          f"(relative misfit {err:.3g}): a per-position or windowed decay")
        return c


def _analyse_masks(cand: Candidate, facts: _Facts, qkv_deps: int) -> None:
    """Sort the tensors multiplying the scores into 0/1 masks and at most one decay; for a decay,
    find γ and check the evaluated decay matrix against exp(γ·(t−s))."""
    for c in cand.mask_conditions:
        bits = facts.deps(c)
        if bits & qkv_deps:
            raise Refusal("the mask is computed from q/k/v (a data-dependent mask): not causal "
                          "linear attention")
        if bits:
            raise Refusal(f"the mask is read from the forward input(s) {facts.input_names(bits)}: "
                          f"its values may change from call to call")
    decays = []
    rank = len(cand.p_labels)
    # a block of one position (a loop's ragged last block): every factor looks per-head there
    shape = cand.score_shape or ()
    one_position = len(shape) == rank and \
        shape[cand.p_labels.index("t")] == shape[cand.p_labels.index("s")] == 1
    for f in cand.mask_factors:
        if not isinstance(f, fx.Node):
            raise Refusal(f"mask factor {f!r} is not a tensor")
        bits = facts.deps(f)
        if bits & qkv_deps:
            raise Refusal(f"the scores are multiplied by {f.name}, computed from q/k/v "
                          f"(a data-dependent mask or decay)")
        analysis = _DecayAnalysis(cand, facts, qkv_deps)
        if analysis._per_head(f) and not one_position:
            raise Refusal(f"the scores are multiplied by {f.name}, which has no extent along "
                          f"time (a per-head or tensor scale): not matched")
        if analysis._is_binary(f):
            if bits:
                raise Refusal(f"the mask is read from the forward input(s) "
                              f"{facts.input_names(bits)}: its values may change from call to call")
            continue
        if not analysis._per_position(f) and not one_position:
            value = facts.value(f)
            if isinstance(value, torch.Tensor) and bool(((value == 0) | (value == 1)).all()):
                raise Refusal(f"the scores are multiplied by a 0/1 mask {f.name} that varies along "
                              f"batch or heads (a padding mask?): not matched")
        decays.append(f)
    if not decays:
        return
    if len(decays) > 1:
        raise Refusal("the scores are multiplied by more than one non-0/1 tensor")
    (f,) = decays
    analysis = _DecayAnalysis(cand, facts, qkv_deps)
    analysis.weight_factor(f)
    decay = analysis.gamma()
    if not math.isfinite(analysis.weight) or analysis.weight == 0.0:
        raise Refusal(f"decay mask weight {analysis.weight}")
    cand.scale *= analysis.weight

    # Evaluate D and compare with weight·exp(γ (t−s)) on and below the diagonal, per head.
    d = _aligned(facts.value(f), rank, analysis.ti, analysis.si)
    rest = [i for i in range(rank) if i not in (analysis.ti, analysis.si)]
    # the head dim: where the γ factors vary, else where D varies
    varying = {i for node, _ in decay.heads for i in rest if _aligned_shape(node, rank)[i] > 1}
    if len(varying) > 1:
        raise Refusal("the decay varies along two batch dims: not one decay per head")
    head_pos = varying.pop() if varying else None
    for i in rest:
        if i != head_pos and d.shape[i] > 1:
            first = d.narrow(i, 0, 1)
            if torch.equal(torch.nan_to_num(d), torch.nan_to_num(first.expand_as(d))):
                d = first
            elif head_pos is None:
                head_pos = i
            else:
                raise Refusal("the decay varies along a batch dim other than the heads")
    gamma = decay.values
    heads = d.shape[head_pos] if head_pos is not None else 1
    if gamma.numel() > 1 and heads not in (1, gamma.numel()):
        raise Refusal(f"decay has {gamma.numel()} values for {heads} heads")
    grid = d.permute(rest + [analysis.ti, analysis.si]).reshape(-1, d.shape[analysis.ti],
                                                                d.shape[analysis.si])
    t_len, s_len = grid.shape[-2:]
    t = torch.arange(t_len, dtype=torch.float64)[:, None]
    s = torch.arange(s_len, dtype=torch.float64)[None, :]
    causal = (s <= t).expand(t_len, s_len)
    expected = torch.exp(gamma.reshape(-1, 1, 1) * (t - s))
    grid, expected = torch.broadcast_tensors(grid, expected)
    got = grid[:, causal] / analysis.weight
    want = expected[:, causal]
    err = M.rel_rms_error(got, want)
    dtype = M.example(f).dtype if isinstance(M.example(f), torch.Tensor) else torch.float32
    if not err <= M.probe_tolerance(dtype, facts.ctx.config):
        raise Refusal(f"decay mask is not exp(γ_h·(t−s)) below the diagonal for the γ read off its "
                      f"construction (relative error {err:.3g}): wrong orientation, or not a "
                      f"per-head constant decay")
    if (gamma > 0).any():
        raise Refusal(f"decay grows with distance (log-decay {float(gamma.max()):.4g} > 0): wrong "
                      f"sign or orientation of the decay mask")
    if head_pos is not None:
        cand.head_label = cand.p_labels[head_pos]
    cand.decay = decay
    cand.mask_factors = [f]


def _qkv_deps(cand: Candidate, facts: _Facts) -> int:
    return facts.deps(cand.q.node) | facts.deps(cand.k.node) | facts.deps(cand.v.node)
