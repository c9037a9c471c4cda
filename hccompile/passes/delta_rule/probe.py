"""The proof that the loop is the op: the region evaluated on random inputs and compared with the
op's float64 reference, choosing among the candidate roles, l2 normalisation, state orientation
and scale (step 3 of the package docstring). Nothing is rewritten unless this agrees."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from ...compat import concrete_shape
from ..fx_match import Refusal
from ..emit import EagerEmitter
from .vocabulary import _Index, _example, _plain, _shape, _tensor_example
from .loops import _Loop
from .region import _Region
from .roles import _Input, _Roles
from .emit import _out_from_op, _out_labels, _state_from_op, _state_to_op, _to_op
from .evaluate import _Evaluator

OP_CHUNK_SIZE = 64
# Iterations evaluated in full by the probe from the initial state (the last one is evaluated from a
# random state, which checks what the state feeds into the step).
PROBE_HEAD_STEPS = 1
# Scan steps run by the probe (every scan step runs the same body).
PROBE_SCAN_STEPS = 2
# Probe references shorter than this run the token loop (faster for short inputs).
NAIVE_REFERENCE_TOKENS = 256


# ----------------------------------------------------------------------------------------------
# Probe


@dataclass
class _Hypothesis:
    roles: _Roles
    l2norm: bool
    transposed: bool
    step_labels: list[str]
    scale: float = 1.0
    error: float = math.inf
    head_out: torch.Tensor | None = None  # the op's output on the probe's first steps, canonical layout


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if out.shape != ref.shape:
        return math.inf
    if not torch.isfinite(out).all():
        return math.inf
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _probe_values(roles: _Roles, h0_shape, seed: int = 20261122) -> dict[fx.Node, torch.Tensor]:
    """Random inputs shaped and distributed for their roles (k of unit norm on average, a negative
    log-gate, beta in (0, 1)) in each input's own dtype and device."""
    values = {}
    gen = None

    def make(node, kind):
        nonlocal gen
        ev = _tensor_example(node)
        shape = concrete_shape(ev)
        if gen is None:
            gen = torch.Generator(device=ev.device).manual_seed(seed)
        if kind == "beta":
            x = torch.rand(shape, generator=gen, device=ev.device)
        elif kind == "g":
            x = -(0.02 + 0.13 * torch.rand(shape, generator=gen, device=ev.device))
        elif kind == "qk":
            # norms spread over [0.4, 1.3]: l2 normalisation changes them visibly, and beta |k|^2 < 2
            # keeps the recurrence stable over a chunk
            x = torch.randn(shape, generator=gen, device=ev.device) / math.sqrt(shape[-1])
            x = x / x.norm(dim=-1, keepdim=True) * (0.4 + 0.9 * torch.rand(shape[:-1] + (1,), generator=gen,
                                                                             device=ev.device))
        else:
            x = torch.randn(shape, generator=gen, device=ev.device)
            if kind == "h0":
                x = x / math.sqrt(h0_shape[-2])
        return x.to(ev.dtype)

    for i in (roles.q, roles.k):
        values[i.node] = make(i.node, "qk")
    widths = {_shape(roles.q.node)[-1], _shape(roles.v.node)[-1]}
    values[roles.v.node] = make(roles.v.node, "qk" if len(widths) == 1 else "v")
    if roles.beta is not None:
        values[roles.beta.node] = make(roles.beta.node, "beta")
    if roles.g is not None:
        values[roles.g.node] = make(roles.g.node, "g")
    if roles.h0 is not None:
        values[roles.h0] = make(roles.h0, "h0")
    return values


def _reference(h: _Hypothesis, values: dict, start: int, stop: int | None, state_shape,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's math (plain-PyTorch reference, float64) on tokens [start, stop) of the probe values,
    from `state` (op layout) or else the probe's initial state: output in the op layout with scale
    1, final state in the op layout."""
    from ...kernels.delta_rule.reference import chunk_delta_rule_ref

    r, E = h.roles, EagerEmitter()

    def op_layout(i: _Input):
        x = _to_op(values[i.node], i.labels, r.nb, E).double()
        return x[:, start:stop]

    q, k, v = op_layout(r.q), op_layout(r.k), op_layout(r.v)
    beta = op_layout(r.beta) if r.beta is not None else torch.ones(v.shape[:-1], dtype=v.dtype, device=v.device)
    g = op_layout(r.g) if r.g is not None else None
    h0 = state
    if h0 is None and r.h0 is not None and start == 0:
        h0 = _state_to_op(values[r.h0], r.nb, h.transposed, E).double()
    # The token loop is the faster reference for short prefixes, the chunked one for long inputs.
    if q.shape[1] <= NAIVE_REFERENCE_TOKENS:
        return _token_recurrence(q, k, v, beta, g, h0, h.l2norm)
    return chunk_delta_rule_ref(q, k, v, beta, g, gate=r.gate, scale=1.0, initial_state=h0,
                                output_final_state=True, use_qk_l2norm_in_kernel=h.l2norm,
                                chunk_size=OP_CHUNK_SIZE)


def _token_recurrence(q, k, v, beta, g, h0, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule token by token, scale 1, op layout ([B, T, H, D]; v, beta, g with HV heads),
    with batched matrix products: the probe's reference for short spans (einsum's per-call planning
    costs more than the arithmetic at these sizes)."""
    from ...kernels.delta_rule.reference import l2norm as l2

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if l2norm:
        q, k = l2(q), l2(k)
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    state = torch.zeros(B, HV, K, V, dtype=q.dtype, device=q.device) if h0 is None else h0.clone()
    outs = []
    for t in range(T):
        if g is not None:
            decay = g[:, t].exp()
            state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        k_t = k[:, t, :, None, :]                                      # [B, HV, 1, K]
        error = v[:, t, :, None, :] - k_t @ state                      # [B, HV, 1, V]
        state = state + k_t.transpose(-1, -2) @ (beta[:, t, :, None, None] * error)
        outs.append((q[:, t, :, None, :] @ state)[:, :, 0])
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, HV, V)
    return o, state


def _canonical_out(o_op: torch.Tensor, nb: int) -> tuple[torch.Tensor, list[str]]:
    labels = [f"b{i}" for i in range(nb)] + ["t", "e"]
    return _out_from_op(o_op, labels, nb, EagerEmitter()), labels


def _relabel(x: torch.Tensor, src: list[str], dst: list[str]) -> torch.Tensor:
    if "t" in src and "t" not in dst:
        x = x.select(src.index("t"), 0)
        src = [lab for lab in src if lab != "t"]
    return x.permute(*[src.index(lab) for lab in dst])


def _step_tokens(j: int, span: int, T: int) -> tuple[int, int]:
    return j * span, min((j + 1) * span, T)


def _expected_step(o_can: torch.Tensor, can_labels, j: int, span: int, T: int, step_labels, length: int):
    """The op's output for step j in the step output's layout (zero-padded past T, as a padded
    chunk's outputs are discarded anyway)."""
    a, b = _step_tokens(j, span, T)
    t_axis = can_labels.index("t")
    piece = o_can.narrow(t_axis, a, b - a)
    if b - a < length:
        pad_shape = list(piece.shape)
        pad_shape[t_axis] = length - (b - a)
        piece = torch.cat([piece, piece.new_zeros(pad_shape)], dim=t_axis)
    return _relabel(piece, can_labels, step_labels)


def _snap_scale(s: float, key_dim: int, tol: float, constants: set[float]) -> float:
    """The fitted scale, snapped to the constant the code most likely wrote (K^-0.5, a literal of
    the region, or a product of two) when within the probe's tolerance."""
    base = {1.0, key_dim ** -0.5, 1.0 / key_dim} | {c for c in constants if c != 0}
    base |= {1.0 / c for c in base}
    candidates = base | {a * b for a in base for b in base}
    best = min(candidates, key=lambda c: abs(s - c))
    return best if abs(s - best) <= tol * abs(best) else s


class _Probe:
    """Compile-time evaluation of one candidate against the op's math (see the package docstring)."""

    def __init__(self, loop: _Loop, region: _Region, gm: fx.GraphModule, idx: _Index, tol: float):
        self.loop, self.region, self.gm, self.idx, self.tol = loop, region, gm, idx, tol
        self.batch = region.state_shape[:-2]
        self.constants = {float(a) for n in region.nodes if n.op in ("call_function", "call_method") and
                          _plain(idx.name(n)) in ("mul", "div") for a in n.args
                          if isinstance(a, (int, float)) and not isinstance(a, bool)}

    # -- the first steps, from the region

    def head(self, values: dict) -> tuple[_Evaluator, list[torch.Tensor], torch.Tensor, int]:
        loop = self.loop
        ev = _Evaluator(self.gm, self.idx, self.region, values)
        if loop.kind == "scan":
            init, xs, extra = loop.scan_inputs
            ev.run([a for a in init + xs + extra if isinstance(a, fx.Node)])
            env = ev.env
            state = env[init[0]] if isinstance(init[0], fx.Node) else init[0]
            x_vals = [env[x] for x in xs]
            extra_vals = [env[a] if isinstance(a, fx.Node) else a for a in extra]
            m = min(PROBE_SCAN_STEPS, loop.steps)
            outs = []
            for t in range(m):
                res = loop.body(state, *[x[t] for x in x_vals], *extra_vals)
                state, y = res[0], res[1]
                outs.append(y)
            return ev, outs, state, m
        m = min(PROBE_HEAD_STEPS, loop.steps - 1)
        wanted = loop.outputs[:m] + [loop.states[m - 1]]
        got = ev.run(wanted)
        return ev, got[:m], got[m], m

    def choose(self, options: list[_Roles], l2_options) -> tuple[_Hypothesis, dict, _Evaluator, int, int]:
        """Evaluate the first steps once per value assignment and pick the hypothesis (roles, l2norm,
        state orientation, step output layout, fitted scale) that reproduces them."""
        loop = self.loop
        state_shape = self.region.state_shape
        best: _Hypothesis | None = None
        best_ctx = None
        groups: dict[tuple, list[_Roles]] = defaultdict(list)
        for r in options:
            groups[(id(r.beta), id(r.g), r.h0)].append(r)
        for roles_group in groups.values():
            values = _probe_values(roles_group[0], state_shape)
            ev, outs, state, m = self.head(values)
            step_shape = tuple(outs[0].shape)
            step_readings = _out_labels(step_shape, self.batch, None, "per-step output")
            span = 1
            for r in roles_group:
                for labels in step_readings:
                    if loop.kind == "scan" and "t" in labels:
                        continue  # a scan over chunks: its stacked outputs have two time axes
                    span = step_shape[labels.index("t")] if "t" in labels else 1
                    if (loop.steps - 1) * span >= r.T or loop.steps * span < r.T:
                        continue
                    tokens = min(m * span, r.T)
                    for transposed in self._orientations(r, state_shape):
                        for l2 in l2_options:
                            h = _Hypothesis(r, l2, transposed, labels)
                            self._score(h, values, outs, state, m, span, tokens)
                            if best is None or h.error < best.error:
                                best, best_ctx = h, (values, ev, m, span)
        if best is None:
            raise Refusal(f"the loop's {loop.steps} steps do not cover the inputs' {options[0].T} tokens "
                          f"in equal spans")
        values, ev, m, span = best_ctx
        return best, values, ev, m, span

    def _orientations(self, r: _Roles, state_shape) -> list[bool]:
        key_dim, value_dim = _shape(r.k.node)[-1], _shape(r.v.node)[-1]
        out = []
        if state_shape[-2:] == (key_dim, value_dim):
            out.append(False)
        if state_shape[-2:] == (value_dim, key_dim):
            out.append(True)
        return out

    def _score(self, h: _Hypothesis, values, outs, state, m, span, tokens) -> None:
        r = h.roles
        try:
            o_op, s_op = _reference(h, values, 0, tokens, self.region.state_shape)
        except (RuntimeError, ValueError, TypeError):
            return
        o_can, can_labels = _canonical_out(o_op, r.nb)
        h.head_out = o_can
        expected = [_expected_step(o_can, can_labels, j, span, r.T, h.step_labels, outs[j].shape[
            h.step_labels.index("t")] if "t" in h.step_labels else 1) for j in range(m)]
        got = torch.cat([o.double().flatten() for o in outs])
        exp = torch.cat([e.flatten() for e in expected])
        den = float((exp * exp).sum())
        if den == 0 or not torch.isfinite(got).all():
            return
        scale = float((got * exp).sum()) / den
        key_dim = _shape(r.k.node)[-1]
        h.scale = _snap_scale(scale, key_dim, max(self.tol, 1e-4), self.constants)
        s_exp = _state_from_op(s_op, r.nb, h.transposed, EagerEmitter())
        h.error = max(_rel(got, exp * h.scale), _rel(state, s_exp))

    # -- the rest: the last step from a random state, random values for the steps in between, the
    #    assembly after the loop

    def verify(self, h: _Hypothesis, values: dict, ev: _Evaluator, m: int, span: int) -> float:
        """Run the rest of the region with random values standing in for the outputs of the steps
        after the first m (and for the state entering the last step), and compare what reaches the
        graph with the op's math: the first steps' outputs, the random values where they belong, the
        last step computed by the op from that state, and the final state."""
        loop, r, E = self.loop, h.roles, EagerEmitter()
        T = r.T
        can_labels = [f"b{i}" for i in range(r.nb)] + ["t", "e"]
        value_dim = _shape(r.v.node)[-1]
        device = _tensor_example(r.v.node).device
        gen = torch.Generator(device=device).manual_seed(7)
        expected = torch.zeros(*self.batch, T, value_dim, dtype=torch.float64, device=device)
        head_tokens = min(m * span, T)
        expected[..., :head_tokens, :] = h.head_out[..., :head_tokens, :] * h.scale
        checked = [(0, head_tokens)]
        final_expected = None

        def random_piece(tokens: int, dtype: torch.dtype) -> torch.Tensor:
            x = torch.randn(*self.batch, tokens, value_dim, generator=gen, device=device)
            return x.to(dtype).double()

        if loop.kind == "scan":
            ys_dtype = self._dtype_of_scan_output()
            tail = random_piece(T - head_tokens, ys_dtype)
            expected[..., head_tokens:, :] = tail
            ys = _relabel(expected, can_labels, ["t"] + h.step_labels).to(ys_dtype)
            state_dtype = self._dtype_of(loop.scan_inputs[0][0]) or torch.float32
            state = torch.randn(self.region.state_shape, generator=gen, device=device).to(state_dtype)
            ev.env[loop.scan] = (state, ys)
            final_expected = state
            wanted = [loop.out] + ([loop.final] if loop.final is not None else [])
        else:
            n = loop.steps
            for j in range(m, n - 1):
                o_j = loop.outputs[j]
                a, b = _step_tokens(j, span, T)
                piece = random_piece(b - a, _tensor_example(o_j).dtype)
                expected[..., a:b, :] = piece
                length = _shape(o_j)[h.step_labels.index("t")] if "t" in h.step_labels else 1
                ev.env[o_j] = _expected_step(piece, can_labels, 0, span, b - a, h.step_labels, length).to(
                    _tensor_example(o_j).dtype)
            prev = loop.states[n - 2]
            if n - 2 >= m:
                ev.env[prev] = (torch.randn(self.region.state_shape, generator=gen, device=device) /
                                math.sqrt(self.region.state_shape[-2])).to(_tensor_example(prev).dtype)
            (s_prev,) = ev.run([prev])
            a = (n - 1) * span
            o_last, s_last = _reference(h, values, a, T, self.region.state_shape,
                                        state=_state_to_op(s_prev, r.nb, h.transposed, E).double())
            expected[..., a:, :] = _canonical_out(o_last, r.nb)[0] * h.scale
            checked.append((a, T))
            final_expected = _state_from_op(s_last, r.nb, h.transposed, E)
            wanted = [loop.out, loop.final]
        got = ev.run(wanted, read_pos=loop.end)
        out_val = got[0]
        errors, best_out = [], math.inf
        for labels in _out_labels(tuple(out_val.shape), self.batch, T, "loop's output"):
            exp = _relabel(expected, can_labels, labels)
            err = _rel(out_val, exp)
            t_axis = labels.index("t")
            for lo, hi in checked:
                if hi > lo:
                    err = max(err, _rel(out_val.narrow(t_axis, lo, hi - lo), exp.narrow(t_axis, lo, hi - lo)))
            if err < best_out:
                best_out, self.out_labels = err, labels
        errors.append(best_out)
        if loop.final is not None and len(got) > 1:
            errors.append(_rel(got[1], final_expected))
        return max(errors)

    def _dtype_of(self, n):
        ev = _tensor_example(n)
        return None if ev is None else ev.dtype

    def _dtype_of_scan_output(self):
        ev = _example(self.loop.scan)
        if isinstance(ev, (list, tuple)) and len(ev) > 1 and isinstance(ev[1], torch.Tensor):
            return ev[1].dtype
        return torch.float32
