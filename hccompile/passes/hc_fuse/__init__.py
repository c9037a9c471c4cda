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
"""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..compat import concrete_shape, size_hint
from . import fx_match as M
from .fx_match import Refusal
from .base import GraphPass, PassContext, register_pass
from .hc_detect import (HCLayer, current_layers, is_view, norm_step_parts, normalize_l1_parts,
                        view_root)

PATTERNS = ("mhc_mapping", "mhc_post", "mhc_aggregate")
MAX_PROBE_NODES = 4096
_SEED = 20261122


# ----------------------------------------------------------------------------------------
# index maps through view chains


_RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as",
                    "reshape_as"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze,
                      torch.Tensor.view}
_SAME_INDEX_METHODS = {"contiguous", "float", "to", "type_as", "half", "bfloat16", "double", "clone"}


def _sym_shape(node: Any) -> tuple[Any, ...]:
    """The example value's sizes: ints, or SymInts under dynamic shapes."""
    ev = M.example(node)
    if not isinstance(ev, torch.Tensor):
        raise Refusal(f"{getattr(node, 'name', node)} has no tensor example value")
    return tuple(ev.shape)


def _shape(node: Any) -> tuple[int, ...]:
    """Concrete sizes (a symbolic size by its hint, adding no guard). Decisions that must hold for
    every size compare _sym_shape instead."""
    return concrete_shape(M.example(node)) if isinstance(M.example(node), torch.Tensor) else \
        _sym_shape(node)


def _static(size: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return isinstance(size, int) or is_concrete_int(size)


def _same_size(a: Any, b: Any) -> bool:
    if _static(a) and _static(b):
        return int(a) == int(b)
    if _static(a) or _static(b):
        return False
    return a.node.expr == b.node.expr


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


def _transform(node: fx.Node) -> tuple | None:
    """How an index of `node` maps to an index of node.args[0], or None if unsupported."""
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    perm = M.permutation_of(node)
    if perm is not None:
        return ("permute", perm[1])
    name = node.target if node.op == "call_method" else None
    if name in _RESHAPE_METHODS or (node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS):
        return ("reshape", _shape(src), _shape(node))
    if name == "expand":
        return ("expand", _shape(src), _shape(node))
    if name in _SAME_INDEX_METHODS:
        return ("same",) if _shape(src) == _shape(node) else None
    return None


def _ravel(idx: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.zeros(idx.shape[0], dtype=torch.int64)
    for d, size in enumerate(shape):
        flat = flat * size + idx[:, d]
    return flat


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(flat.shape[0], len(shape), dtype=torch.int64)
    for d in range(len(shape) - 1, -1, -1):
        out[:, d] = flat % shape[d]
        flat = flat // shape[d]
    return out


def view_chain(src: fx.Node, dst: fx.Node) -> list[fx.Node] | None:
    """The view nodes from src (exclusive) to dst (inclusive), or None if dst is not a view of src."""
    chain, node = [], dst
    while node is not src:
        if not is_view(node):
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def map_index(chain: list[fx.Node], idx: torch.Tensor) -> torch.Tensor:
    """Indices [K, ndim] of chain[-1] -> indices of the chain's source (chain[0].args[0])."""
    for node in reversed(chain):
        t = _transform(node)
        if t is None:
            raise Refusal(f"view op {M.describe(node)} ({node.name}) cannot be followed")
        if t[0] == "permute":
            perm = t[1]
            src_idx = torch.empty_like(idx)
            for i, d in enumerate(perm):
                src_idx[:, d] = idx[:, i]
            idx = src_idx
        elif t[0] == "reshape":
            idx = _unravel(_ravel(idx, t[2]), t[1])
        elif t[0] == "expand":
            in_shape, out_shape = t[1], t[2]
            lead = len(out_shape) - len(in_shape)
            idx = idx[:, lead:].clone()
            for d, size in enumerate(in_shape):
                if size == 1:
                    idx[:, d] = 0
    return idx


def _sample_indices(shape: tuple[int, ...], count: int = 96) -> torch.Tensor:
    """Corners, unit steps and random indices of `shape`."""
    rows = [[0] * len(shape), [s - 1 for s in shape]]
    for d, s in enumerate(shape):
        for v in (1, s - 1):
            if 0 < v < s:
                rows.append([v if i == d else 0 for i in range(len(shape))])
    gen = torch.Generator().manual_seed(_SEED)
    rand = torch.stack([torch.randint(0, max(1, s), (count,), generator=gen) for s in shape], 1)
    return torch.cat([torch.tensor(rows, dtype=torch.int64).reshape(-1, len(shape)), rand])


# ----------------------------------------------------------------------------------------
# the stream layout: x as [T1, T2, n, C] in some memory order


ORDERS = [(0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3)] + [
    p for p in itertools.permutations(range(4)) if p not in ((0, 1, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3))]


@dataclass
class StreamLayout:
    """x (node) holds the canonical [T1, T2, n, C] stream with its dims in memory order `order`:
    x.reshape([sizes[d] for d in order]).permute(inverse) is the canonical view."""

    x: fx.Node
    sizes: tuple[int, int, int, int]
    order: tuple[int, ...]
    lead: tuple[int, ...]          # the projection's token dims (1 or 2 of them)
    sym_sizes: tuple[Any, ...] = ()  # sizes with SymInt token dims under dynamic shapes
    proj: fx.Node | None = None      # has the token dims as its leading dims

    @property
    def mem_shape(self) -> list[int]:
        return [self.sizes[d] for d in self.order]

    @property
    def sym_mem_shape(self) -> tuple[Any, ...]:
        return tuple(self.sym_sizes[d] for d in self.order)


def _per_stream_view(v: fx.Node, n: int) -> tuple[int, int, int]:
    """v holds [tokens.., 1.., n, C] (the input of a per-stream norm): (token dims, ones, C)."""
    shape = _shape(v)
    if len(shape) < 3 or shape[-2] != n:
        raise Refusal(f"{v.name}: the per-stream norm's input {shape} is not [tokens.., n, C]")
    if not _static(_sym_shape(v)[-1]):
        raise Refusal("the stream width C is symbolic")
    k = len(shape) - 2
    while k > 0 and shape[k - 1] == 1 and k > 1:
        k -= 1
    return k, len(shape) - 2 - k, shape[-1]


def stream_layout(layer: HCLayer, n: int) -> StreamLayout:
    """How the stream tensor holds [T1, T2, n, C], found from the view of it the mapping reads:
    the flattened v = vec(x) of the projection, or the input of a per-stream norm
    ([tokens.., n, C], the `hyper-connections` package)."""
    per_stream = layer.stream_norm is not None
    v = layer.v if layer.v is not None else layer.proj.args[0]
    if per_stream:
        n_lead, ones, C = _per_stream_view(v, n)
        token_node = v
        lead = _shape(v)[:n_lead]
    else:
        token_node = layer.proj
        lead = _shape(layer.proj)[:-1]
    if len(lead) not in (1, 2):
        raise Refusal(f"the projection has {len(lead)} token dims (1 or 2 are fused)")
    if not per_stream:
        nc = _shape(v)[-1]
        if not _static(_sym_shape(v)[-1]):
            raise Refusal("the flattened stream width n·C is symbolic")
        if nc % n:
            raise Refusal(f"flattened stream width {nc} is not a multiple of n={n}")
        C = nc // n
    T1, T2 = (1, lead[0]) if len(lead) == 1 else lead
    sizes = (T1, T2, n, C)
    sym_lead = _sym_shape(token_node)[:len(lead)]
    sym_sizes = ((1,) + sym_lead if len(lead) == 1 else sym_lead) + (n, C)
    canon = _sample_indices(sizes)
    v_idx = torch.stack([canon[:, 1]] if len(lead) == 1 else [canon[:, 0], canon[:, 1]], 1)
    if per_stream:  # v[t.., 0.., j, c]
        zeros = torch.zeros(canon.shape[0], ones, dtype=torch.int64)
        v_idx = torch.cat([v_idx, zeros, canon[:, 2:4]], 1)
    else:  # v[t, j·C + c]: the flattened stream is stream-major, as vec(x) of x ∈ R^{n×C}
        v_idx = torch.cat([v_idx, (canon[:, 2] * C + canon[:, 3])[:, None]], 1)
    candidates, node = [v], v
    # not past an identity dropout (the probe cannot evaluate it) nor past a view that reads a
    # second tensor (`y.type_as(f)`: the probe would have to evaluate f's region too)
    while is_view(node) and not _reads_other_tensor(node) and \
            (node.op != "call_function" or node.target not in _DROPOUTS):
        node = node.args[0]
        candidates.append(node)
    found = []
    for cand in reversed(candidates):  # most upstream first
        shape = _shape(cand)
        if torch.Size(shape).numel() != T1 * T2 * n * C:
            continue
        chain = view_chain(cand, v)
        try:
            flat = _ravel(map_index(chain, v_idx), shape)
        except Refusal:
            continue
        for order in ORDERS:
            want = _ravel(canon[:, list(order)], tuple(sizes[d] for d in order))
            if torch.equal(flat, want):
                found.append(StreamLayout(cand, sizes, order, lead, sym_sizes, token_node))
                break
    if not found:
        raise Refusal("the flattened stream v is not a view of a [tokens, n, C] stream tensor")
    # The new stream is written in the memory order of x and viewed back as x_out: take the
    # stream tensor shaped like x_out (the model's own residual layout, not some intermediate
    # view of it, e.g. the previous layer's fused output before its reshape).
    like_out = [lay for lay in found if _same_shape(_sym_shape(lay.x), _sym_shape(layer.x_out))]
    return (like_out or found)[0]


_DROPOUTS = {torch.nn.functional.dropout, torch.dropout}


def _reads_other_tensor(node: fx.Node) -> bool:
    """A view op with a tensor argument besides its input (type_as, view_as, expand_as...)."""
    return any(isinstance(a, fx.Node) and isinstance(M.example(a), torch.Tensor)
               for a in list(node.args[1:]) + list(node.kwargs.values()))


def _inverse(order) -> list[int]:
    return [list(order).index(d) for d in range(len(order))]


# ----------------------------------------------------------------------------------------
# mapping: parse the σ maps, the affine parts, the Sinkhorn init and steps


def _strip(node: Any, kinds=("cast", "contiguous")) -> Any:
    while isinstance(node, fx.Node) and M.kind(node) in kinds and node.op == "call_method":
        node = node.args[0]
    return node


def _norm_source(node: fx.Node) -> fx.Node:
    """The per-token norm behind casts and reshapes (r, r.unsqueeze(-1), r.float() are one r)."""
    while is_view(node):
        t = _transform(node)
        if t is None or t[0] not in ("reshape", "same"):
            break
        node = node.args[0]
    return node


def _reaches(node: Any, target: fx.Node, depth: int = 24) -> bool:
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n is target:
                return True
            if not isinstance(n, fx.Node) or n in seen or n.op == "placeholder":
                continue
            seen.add(n)
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return False


def _forward_closure(start: fx.Node) -> set[fx.Node]:
    seen, todo = {start}, [start]
    while todo:
        for u in todo.pop().users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _is_add(node: Any) -> bool:
    return isinstance(node, fx.Node) and not node.kwargs and len(node.args) == 2 and (
        (node.op == "call_function" and node.target in (operator.add, torch.add)) or
        (node.op == "call_method" and node.target == "add"))


def _is_neg(node: Any) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_function" and node.target in
                                           (operator.neg, torch.neg)) or
                                          (node.op == "call_method" and node.target == "neg"))


@dataclass
class Affine:
    """z = coef · α · p · r^power + bias, p = proj[..., offset:offset + width]."""

    offset: int
    width: int
    coef: float = 1.0
    alpha: fx.Node | None = None
    r: fx.Node | None = None
    r_power: int = -1
    bias: fx.Node | None = None


_SPLITS = {torch.split, torch.functional.split, torch.Tensor.split}


def _scaled_projection(node: Any, proj: fx.Node) -> list[tuple[Any, int]] | None:
    """`node` = proj times/divided by factors that broadcast over its last dim (a per-token norm
    [tokens.., 1] or a number, e.g. DeepSeek-style `F.linear(v, φ) * rsqrt(mean(v²))` split
    afterwards): the factors with their powers (+1 multiplied, -1 divided), else None."""
    factors: list[tuple[Any, int]] = []
    cur = node
    for _ in range(8):
        if cur is proj:
            return factors
        if not isinstance(cur, fx.Node):
            return None
        k = M.kind(cur)
        if k in ("cast", "contiguous") and cur.op == "call_method" and \
                _shape(cur.args[0]) == _shape(cur):
            cur = cur.args[0]
            continue
        if k not in ("mul", "div") or len(cur.args) != 2 or cur.kwargs:
            return None
        a, b = cur.args
        if _reaches(a, proj) and not _reaches(b, proj):
            main, other, power = a, b, (1 if k == "mul" else -1)
        elif k == "mul" and _reaches(b, proj) and not _reaches(a, proj):
            main, other, power = b, a, 1
        else:
            return None
        if isinstance(other, fx.Node):
            shape = _shape(other)
            if shape and shape[-1] != 1:
                return None
        elif M.scalar(other) is None:
            return None
        factors.append((other, power))
        cur = main
    return None


def _slice_of_proj(node: fx.Node, proj: fx.Node) -> tuple[int, int, list[tuple[Any, int]]]:
    """(offset, width, factors) of a last-dim slice of proj (or of proj scaled per token, see
    _scaled_projection) that `node` views without reordering."""
    width_total = _shape(proj)[-1]
    cur = node
    while is_view(cur) and cur is not proj:
        t = _transform(cur)
        if t is None or t[0] not in ("reshape", "same"):
            raise Refusal(f"{cur.name}: the projection part is reordered before use")
        cur = cur.args[0]
    if cur.op == "call_function" and cur.target is operator.getitem:
        base, index = cur.args
        factors = _scaled_projection(base, proj)
        if factors is not None:
            index = index if isinstance(index, tuple) else (index,)
            nd = len(_shape(proj))
            if len(index) == 2 and index[0] is Ellipsis:
                sl = index[1]
            elif len(index) == nd and all(i == slice(None) for i in index[:-1]):
                sl = index[-1]
            else:
                raise Refusal(f"{cur.name}: only last-dim slices of the projection are matched")
            if not isinstance(sl, slice) or sl.step not in (None, 1):
                raise Refusal(f"{cur.name}: not a contiguous last-dim slice")
            start, stop, _ = sl.indices(width_total)
            return start, stop - start, factors
        is_split = (base.op == "call_method" and base.target == "split") or \
            (base.op == "call_function" and base.target in _SPLITS)
        factors = _scaled_projection(base.args[0], proj) if is_split else None
        if is_split and factors is not None and isinstance(index, int):
            sizes = M.arg(base, 1, "split_size_or_sections" if base.op == "call_function" else
                          "split_size")
            if sizes is None:
                sizes = base.kwargs.get("split_size", base.kwargs.get("split_size_or_sections"))
            dim = M.arg(base, 2, "dim", 0)
            if dim not in (-1, len(_shape(proj)) - 1):
                raise Refusal(f"{base.name}: split is not along the last dim")
            if isinstance(sizes, int):
                return index * sizes, min(sizes, width_total - index * sizes), factors
            if isinstance(sizes, (list, tuple)) and all(isinstance(s, int) for s in sizes):
                return sum(sizes[:index]), sizes[index], factors
        raise Refusal(f"{cur.name}: the projection part is not a slice or split of proj")
    raise Refusal(f"{cur.name}: the projection part is not a slice of proj")


def parse_affine(z: fx.Node, proj: fx.Node, token_dependent: set[fx.Node]) -> Affine:
    term, bias = z, None
    if _is_add(z):
        a, b = z.args
        ra, rb = _reaches(a, proj), _reaches(b, proj)
        if ra == rb:
            raise Refusal(f"{z.name}: expected one side of the add to use the projection")
        term, bias = (a, b) if ra else (b, a)
        if not isinstance(bias, fx.Node) or bias in token_dependent:
            raise Refusal(f"{z.name}: the bias is not a parameter tensor")
    coef, leaves = 1.0, []

    def walk(node: Any, power: int) -> None:
        nonlocal coef
        c = M.scalar(node)
        if c is not None:
            coef *= c ** power
            return
        k = M.kind(node)
        if k == "mul" and len(node.args) == 2 and not node.kwargs:
            walk(node.args[0], power), walk(node.args[1], power)
        elif k == "div" and len(node.args) == 2 and not node.kwargs:
            walk(node.args[0], power), walk(node.args[1], -power)
        elif k in ("cast", "contiguous") and node.op == "call_method":
            walk(node.args[0], power)
        elif _is_neg(node):
            coef = -coef
            walk(node.args[0], power)
        elif isinstance(node, fx.Node):
            leaves.append((node, power))
        else:
            raise Refusal(f"{z.name}: factor {node!r} is not a tensor or number")

    walk(term, 1)
    p = [(n, pw) for n, pw in leaves if _reaches(n, proj)]
    if len(p) != 1 or p[0][1] != 1:
        raise Refusal(f"{z.name}: expected the projection part once, as a factor")
    offset, width, factors = _slice_of_proj(p[0][0], proj)
    for factor, pw in factors:
        if M.scalar(factor) is not None:
            coef *= M.scalar(factor) ** pw
        else:
            leaves.append((factor, pw))
    aff = Affine(offset, width, coef=coef, bias=bias)
    for node, pw in leaves:
        if node is p[0][0]:
            continue
        if node in token_dependent:
            if aff.r is not None or pw not in (1, -1):
                raise Refusal(f"{z.name}: expected one per-token norm r (divided or multiplied)")
            aff.r, aff.r_power = _norm_source(node), pw
        else:
            if aff.alpha is not None or pw != 1:
                raise Refusal(f"{z.name}: expected at most one α factor")
            if torch.Size(_shape(node)).numel() != 1:
                raise Refusal(f"{z.name}: the α factor {node.name} has shape {_shape(node)}")
            aff.alpha = node
    if aff.r is None:
        raise Refusal(f"{z.name}: no per-token norm r in the mapping")
    return aff


def _sigma_side(sig: fx.Node) -> tuple[fx.Node, float, float]:
    """From σ forward through scalar affine ops and casts: (value node, scale a, shift b)."""
    cur, a, b = sig, 1.0, 0.0
    while len(cur.users) == 1:
        u = next(iter(cur.users))
        k = M.kind(u)
        others = [x for x in u.args if x is not cur]
        c = M.scalar(others[0]) if len(others) == 1 and not u.kwargs else None
        if k == "cast" and u.op == "call_method":
            cur = u
            continue
        if c is None:
            break
        if k == "mul":
            a, b = a * c, b * c
        elif k == "div" and u.args[0] is cur:
            a, b = a / c, b / c
        elif _is_add(u):
            b += c
        elif u.op == "call_function" and u.target in (operator.sub, torch.sub) and u.args[0] is cur:
            b -= c
        else:
            break
        cur = u
    return cur, a, b


def _sigmoid_arg(sig: fx.Node) -> fx.Node:
    z = _strip(sig.args[0])
    if not isinstance(z, fx.Node):
        raise Refusal(f"{sig.name}: σ of a non-tensor")
    return z


def _res_value(layer: HCLayer) -> fx.Node:
    end = layer.sinkhorn[-1]
    users = list(end.users)
    if len(users) == 1 and M.kind(users[0]) == "cast" and users[0].op == "call_method":
        return users[0]
    return end


@dataclass
class MappingPlan:
    spec: Any                      # kernels.mhc.MappingSpec
    proj: fx.Node
    r: fx.Node
    alphas: list[Any]              # node or None (then 1)
    biases: list[Any]              # node or None (then 0)
    values: list[fx.Node]          # the nodes the op's outputs replace: H_pre, H_post, H_res
    lead: tuple[int, ...]


def _parse_init(m0: fx.Node) -> tuple[str, float, fx.Node]:
    if (m0.op == "call_function" and m0.target is torch.exp) or \
            (m0.op == "call_method" and m0.target == "exp"):
        return "exp", 0.0, m0.args[0]
    eps, node = 0.0, m0
    if _is_add(m0):
        a, b = m0.args
        if M.scalar(b) is not None and isinstance(a, fx.Node):
            node, eps = a, M.scalar(b)
        elif M.scalar(a) is not None and isinstance(b, fx.Node):
            node, eps = b, M.scalar(a)
    if M.kind(node) == "softmax" and getattr(node.target, "__name__", node.target) == "softmax":
        dim = M.arg(node, 1, "dim")
        nd = len(_shape(node))
        if not isinstance(dim, int) or dim % nd != nd - 1:
            raise Refusal(f"{node.name}: Sinkhorn init softmax over dim {dim}, not the rows (-1)")
        return "softmax", eps, node.args[0]
    raise Refusal(f"{m0.name}: Sinkhorn init is neither exp nor softmax(-1)(+ε)")


def _mapping_differences(layer: HCLayer) -> list[str]:
    """Where a detected mapping computes something else than the fused kernel's
    z = α·(v·φ)/r + b, H = a·σ(z) + b', H_res = Sinkhorn(exp(z) or softmax(z)+ε) with
    m / (Σ m + ε) steps: each entry names the difference (the report's refusal reason)."""
    out = []
    if layer.stream_norm is not None:
        out.append(f"the mapping reads each stream normalised on its own ({layer.stream_norm}) and "
                   f"projects every stream with the same weights, not the projection of the "
                   f"flattened stream v = vec(x) divided by its norm r = ‖v‖/√(nC)")
    if len(layer.projs) > 1:
        out.append(f"H_post comes from a projection of its own ({', '.join(p.name for p in layer.projs[1:])}), "
                   f"not from the same v·φ as H_pre and H_res")
    if any(normalize_l1_parts(node) is not None for node in layer.sinkhorn[1:]):
        out.append("the Sinkhorn steps are F.normalize(m, p=1), which divides by max(Σ|m|, ε), not "
                   "by Σ m + ε")
    start = layer.sinkhorn[0]
    if (start.op == "call_function" and start.target is torch.exp) or \
            (start.op == "call_method" and start.target == "exp"):
        arg = start.args[0]
        if M.kind(arg) is None and isinstance(arg, fx.Node) and \
                arg.op == "call_function" and arg.target in (operator.sub, torch.sub):
            out.append("the Sinkhorn start is exp(z − max z) (a detached shift), which the kernel "
                       "does not subtract")
    return out


def plan_mapping(layer: HCLayer, token_dependent: set[fx.Node]) -> MappingPlan:
    from ..kernels.mhc import MappingSpec

    differences = _mapping_differences(layer)
    if differences:
        raise Refusal("the mapping differs from the fused kernel's: " + "; ".join(differences))
    proj = layer.proj
    chain = layer.sinkhorn
    n = _shape(chain[-1])[-1]
    lead = _shape(proj)[:-1]
    sym_lead = _sym_shape(proj)[:-1]
    if _shape(chain[-1])[-2:] != (n, n) or not _same_shape(_sym_shape(chain[-1])[:-2], sym_lead):
        raise Refusal(f"H_res shape {_shape(chain[-1])} is not [tokens..., n, n] over the "
                      f"projection's tokens {lead}")
    if _shape(proj)[-1] != n * n + 2 * n:
        raise Refusal(f"projection width {_shape(proj)[-1]} is not n²+2n = {n * n + 2 * n}")
    # Sinkhorn steps
    steps = [norm_step_parts(node) for node in chain[1:]]
    if any(s is None for s in steps):
        raise Refusal("a Sinkhorn step is not m / (m.sum(dim, keepdim=True) + ε)")
    eps_set = {s[2] for s in steps}
    if len(eps_set) != 1:
        raise Refusal(f"Sinkhorn steps use different ε: {sorted(eps_set)}")
    nd = len(_shape(chain[-1]))
    row_first = steps[0][1] == nd - 1
    init, init_eps, logits = _parse_init(chain[0])
    # logits -> the affine node through casts and order-preserving reshapes
    z_res = logits
    while isinstance(z_res, fx.Node) and is_view(z_res):
        t = _transform(z_res)
        if t is None or t[0] not in ("reshape", "same"):
            raise Refusal(f"{z_res.name}: the Sinkhorn logits are reordered ({M.describe(z_res)})")
        z_res = z_res.args[0]
    if not _same_shape(_sym_shape(z_res)[:len(lead)], sym_lead) or \
            torch.Size(_shape(z_res)[len(lead):]).numel() != n * n:
        raise Refusal(f"{z_res.name}: Sinkhorn logits shape {_shape(z_res)} is not [tokens, n²]")
    parts = []
    values = []
    affines_sig = []
    for sig in (layer.h_pre, layer.h_post):
        value, a, b = _sigma_side(sig)
        values.append(value)
        affines_sig.append((a, b))
        parts.append(parse_affine(_sigmoid_arg(sig), proj, token_dependent))
    parts.append(parse_affine(z_res, proj, token_dependent))
    values.append(_res_value(layer))
    widths = [p.width for p in parts]
    if widths != [n, n, n * n]:
        raise Refusal(f"projection parts have widths {widths}, expected {[n, n, n * n]}")
    if len({p.r for p in parts}) != 1 or len({p.r_power for p in parts}) != 1:
        raise Refusal("the three mapping parts do not use the same norm r")
    r = parts[0].r
    r_shape = _sym_shape(r)
    if not (_same_shape(r_shape, sym_lead) or _same_shape(r_shape, sym_lead + (1,))):
        raise Refusal(f"norm r has shape {_shape(r)}, expected {lead + (1,)}")
    for p, width in zip(parts, (n, n, n * n)):
        if p.bias is not None and torch.Size(_shape(p.bias)).numel() != width:
            raise Refusal(f"bias {p.bias.name} has shape {_shape(p.bias)}, expected {width} values")
    spec = MappingSpec(n=n, offsets=tuple(p.offset for p in parts), coefs=tuple(p.coef for p in parts),
                       r_divides=parts[0].r_power == -1, pre_affine=affines_sig[0],
                       post_affine=affines_sig[1], init=init, init_eps=init_eps, steps=len(steps),
                       row_first=row_first, norm_eps=eps_set.pop())
    try:
        spec.validate()
    except ValueError as e:
        raise Refusal(f"mapping not supported by the kernel: {e}") from None
    for v in values:
        if M.example(v).dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise Refusal(f"{v.name}: dtype {M.example(v).dtype} is not a float type")
    anchor = _earliest(proj.graph, values)
    _late_inputs(proj.graph, [p.alpha for p in parts] + [p.bias for p in parts], anchor)
    return MappingPlan(spec, proj, r, [p.alpha for p in parts], [p.bias for p in parts], values, lead)


def build_mapping(plan: MappingPlan, emit, proj, r, alphas, biases):
    from ..lowering.mhc import spec_args

    spec = plan.spec
    n = spec.n
    alphas = [a if a is not None else emit("new_ones", proj, ()) for a in alphas]
    biases = [b if b is not None else emit("new_zeros", proj, (w,))
              for b, w in zip(biases, (n, n, n * n))]
    dtypes = [M.example(v).dtype for v in plan.values]
    outs = emit("op:mhc_mapping", proj, r, *alphas, *biases, *spec_args(spec), *dtypes)
    return [emit("getitem", outs, i) for i in range(3)]


# ----------------------------------------------------------------------------------------
# post and aggregate


@dataclass
class PostPlan:
    layout: StreamLayout
    transpose_res: bool
    h_res: fx.Node
    h_post: fx.Node
    f: fx.Node
    x_out: fx.Node


def _product_operands(product: fx.Node) -> list[Any]:
    if M.kind(product) == "einsum":
        ops = list(product.args[1:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = list(ops[0])
        return ops
    return [a for a in product.args[:2]]


def _einsum_terms(product: fx.Node) -> tuple[list[str], str] | None:
    """The einsum's operand terms and output term with each `...` written out as one character per
    dim (right-aligned across the terms, as einsum broadcasts them), or None."""
    eq = product.args[0]
    ops = _product_operands(product)
    if not isinstance(eq, str) or "->" not in eq:
        return None
    ins, out = eq.replace(" ", "").split("->")
    terms = ins.split(",")
    if len(terms) != len(ops):
        return None
    fill = "0123456789"
    widths = []
    expanded = []
    for term, op in zip(terms, ops):
        if "..." not in term:
            expanded.append(term)
            continue
        k = len(_shape(op)) - (len(term) - 3)
        if k < 0 or k > len(fill):
            return None
        widths.append(k)
        expanded.append(term.replace("...", fill[len(fill) - k:]))
    if "..." in out:
        k = max(widths, default=0)
        out = out.replace("...", fill[len(fill) - k:])
    return expanded, out


def _operand_labels(product: fx.Node, operand: fx.Node) -> tuple[int, int, int] | None:
    """For a product using `operand` as the mixing matrix: (dim of operand that indexes the
    output stream, dim that is contracted, dim of the product's output that the output stream
    is)."""
    k = M.kind(product)
    if k == "matmul":
        nd = len(_shape(operand))
        out_nd = len(_shape(product))
        if product.args[0] is operand:
            return nd - 2, nd - 1, out_nd - 2
        if product.args[1] is operand:
            return nd - 1, nd - 2, out_nd - 1
        return None
    if k == "einsum":
        ops = _product_operands(product)
        terms = _einsum_terms(product)
        if terms is None or len(ops) != 2:
            return None
        (la, lb), out = terms
        if ops[0] is not operand and ops[1] is not operand:
            return None
        mine, other = (la, lb) if ops[0] is operand else (lb, la)
        sizes = dict(zip(mine, _shape(operand)))
        # size-1 dims (the package's fraction dims) are neither contracted nor a stream
        contracted = [c for c in mine if c in other and c not in out and sizes[c] != 1]
        out_stream = [c for c in mine if c in out and c not in other and sizes[c] != 1]
        if len(contracted) != 1 or len(out_stream) != 1:
            return None
        return mine.index(out_stream[0]), mine.index(contracted[0]), out.index(out_stream[0])
    return None


def _is_cat(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (torch.cat,
                                                                                       torch.concat)


def _leads_to(target: fx.Node, node: Any, depth: int = 16) -> bool:
    """`node` is `target` seen through views and concatenations."""
    for _ in range(depth):
        if node is target:
            return True
        if _is_cat(node):
            return any(_leads_to(target, p, depth) for p in node.args[0])
        if not is_view(node):
            return False
        node = node.args[0]
    return False


def _index_in(target: fx.Node, node: Any, idx: torch.Tensor, depth: int = 16
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Indices [K, ndim] of `node` -> (the same elements as indices of `target`, which rows come
    from target at all), back through views and concatenations; None if target is not reached."""
    if not _leads_to(target, node, depth):
        return None
    valid = torch.ones(idx.shape[0], dtype=torch.bool)
    for _ in range(depth):
        if node is target:
            return idx, valid
        if _is_cat(node):
            dim = M.arg(node, 1, "dim", 0) % len(_shape(node))
            offset = 0
            for part in node.args[0]:
                width = _shape(part)[dim]
                if _leads_to(target, part, depth):
                    valid = valid & (idx[:, dim] >= offset) & (idx[:, dim] < offset + width)
                    idx = idx.clone()
                    idx[:, dim] = (idx[:, dim] - offset).clamp(0, width - 1)
                    node = part
                    break
                offset += width
            continue
        idx = map_index([node], idx)
        node = node.args[0]
    return None


def _getitem_slice(node: fx.Node, dim: int) -> tuple[int, int] | None:
    """(start, stop) of `base[index]` along `dim`, every other dim taken whole; else None."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return None
    base, index = node.args
    nd = len(_shape(base))
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (nd - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (nd - len(index))
    if len(index) != nd:
        return None
    for d, i in enumerate(index):
        if d == dim:
            continue
        if i != slice(None):
            return None
    i = index[dim]
    size = _shape(base)[dim]
    if isinstance(i, int):
        return None
    if not isinstance(i, slice) or i.step not in (None, 1):
        return None
    start, stop, _ = i.indices(size)
    return start, stop


def _mixing_orientation(mixed: fx.Node, product: fx.Node, h_res: fx.Node, n: int,
                        combined: bool) -> bool:
    """Whether the mixing computes H_resᵀ·x (True) or H_res·x (False), read off the product's
    labels and the views (and, for H_pre and H_res applied in one product, the concatenation and
    the slice) between H_res and the product's operand."""
    if M.kind(product) not in ("matmul", "einsum"):
        raise Refusal(f"{mixed.name}: the mixing is not a matmul/bmm/einsum ({M.describe(product)})")
    for operand in _product_operands(product):
        if not isinstance(operand, fx.Node):
            continue
        dims = _operand_labels(product, operand)
        if dims is None:
            continue
        out_dim, in_dim, product_dim = dims
        start = 0
        if combined:
            sl = _getitem_slice(mixed, product_dim)
            if sl is None or sl[1] - sl[0] != n:
                raise Refusal(f"{mixed.name}: the mixed streams are not one slice of {n} outputs of "
                              f"the product {product.name}")
            start = sl[0]
        idx = torch.zeros(2, len(_shape(operand)), dtype=torch.int64)
        idx[0, out_dim], idx[0, in_dim] = start + 0, 1      # A[out=0, in=1]
        idx[1, out_dim], idx[1, in_dim] = start + 1, 0      # A[out=1, in=0]
        found = _index_in(h_res, operand, idx)
        if found is None:
            continue
        src, valid = found
        if not bool(valid.all()):
            raise Refusal(f"{mixed.name}: the mixed streams do not come from H_res's part of the "
                          f"product {product.name}")
        pq = [tuple(r) for r in src[:, -2:].tolist()]
        if pq == [(0, 1), (1, 0)]:
            return False
        if pq == [(1, 0), (0, 1)]:
            return True
        raise Refusal(f"{mixed.name}: cannot tell how the mixing indexes H_res")
    raise Refusal(f"{mixed.name}: the mixing product's H_res operand is not a view of H_res, or the "
                  f"mixing has not one contracted stream dim ({M.describe(product)})")


def plan_post(layer: HCLayer, layout: StreamLayout, h_res: fx.Node, h_post: fx.Node) -> PostPlan:
    mixed = layer.mixed
    product = mixed.args[0] if layer.combined else mixed
    if not isinstance(product, fx.Node):
        raise Refusal(f"{mixed.name}: no mixing product")
    n = layout.sizes[2]
    transpose = _mixing_orientation(mixed, product, h_res, n, layer.combined)
    x_out = layer.x_out
    X = layout.x
    if M.example(x_out).dtype != M.example(X).dtype:
        raise Refusal(f"{x_out.name}: the new stream's dtype {M.example(x_out).dtype} differs from "
                      f"the stream's {M.example(X).dtype}")
    T1, T2, n, C = layout.sizes
    if torch.Size(_shape(x_out)).numel() != T1 * T2 * n * C:
        raise Refusal(f"{x_out.name}: the new stream has {_shape(x_out)}, not {layout.sizes} values")
    f = _f_in_token_order(layer)
    if M.example(f).dtype != M.example(X).dtype:
        raise Refusal(f"{f.name}: the sublayer output's dtype {M.example(f).dtype} differs from the "
                      f"stream's {M.example(X).dtype}")
    if torch.Size(_shape(f)).numel() != T1 * T2 * C:
        raise Refusal(f"{f.name}: sublayer output shape {_shape(f)} is not [tokens, C]")
    return PostPlan(layout, transpose, h_res, h_post, f, x_out)


def _f_in_token_order(layer: HCLayer) -> fx.Node:
    """The sublayer output as the post product pairs it with the streams: its operand, back through
    order-preserving reshapes only (a transpose on the way, e.g. [S, B, C] -> [B, S, C], stays)."""
    post = layer.post
    operands = [a for a in post.args if isinstance(a, fx.Node)]
    fo = [a for a in operands if view_chain(layer.f, a) is not None]
    if len(fo) != 1:
        return layer.f
    node = fo[0]
    while node is not layer.f:
        t = _transform(node)
        same_dtype = M.example(node.args[0]).dtype == M.example(node).dtype
        if t is None or t[0] not in ("reshape", "same") or not same_dtype:
            break
        node = node.args[0]
    return node


def _canonical_stream(layout: StreamLayout, emit, x):
    x = emit("reshape_to", x, _sym_shape(layout.x), layout.sym_mem_shape)
    if tuple(layout.order) != (0, 1, 2, 3):
        x = emit("permute", x, tuple(_inverse(layout.order)))
    return x


def _tokens2(layout: StreamLayout, emit, t, node: fx.Node, tail: tuple[int, ...]):
    """A mapping value [lead..., *tail] -> [T1, T2, *tail]. Any other shape holding the same
    values in token-major order (the `hyper-connections` package's H_pre is [1, B, S, 1, n, 1])
    is reshaped; the probe checks the order."""
    src = _sym_shape(node)
    if len(layout.lead) == 1 and _same_shape(src, tuple(layout.sym_sizes[1:2]) + tail):
        return emit("unsqueeze", t, 0)
    want = tuple(layout.sym_sizes[:2]) + tail
    if _same_shape(src, want):
        return t
    return emit("reshape_to", t, src, want)


def build_post(plan: PostPlan, emit, x, h_res, h_post, f):
    lay = plan.layout
    n, C = lay.sizes[2], lay.sizes[3]
    x4 = _canonical_stream(lay, emit, x)
    h4, hp = _tokens2(lay, emit, h_res, plan.h_res, (n, n)), _tokens2(lay, emit, h_post, plan.h_post, (n,))
    f3 = emit("reshape_to", f, _sym_shape(plan.f), lay.sym_sizes[:2] + (C,))
    out = emit("op:mhc_post", x4, h4, hp, f3, plan.transpose_res, list(lay.order))
    if tuple(lay.order) != (0, 1, 2, 3):
        out = emit("permute", out, tuple(lay.order))
    return emit("reshape_to", out, lay.sym_mem_shape, _sym_shape(plan.x_out))


@dataclass
class AggregatePlan:
    layout: StreamLayout
    h_pre: fx.Node
    node: fx.Node


def plan_aggregate(layer: HCLayer, layout: StreamLayout, h_pre: fx.Node) -> AggregatePlan:
    T1, T2, n, C = layout.sizes
    y = layer.aggregate
    if torch.Size(_shape(y)).numel() != T1 * T2 * C:
        raise Refusal(f"{y.name}: aggregate shape {_shape(y)} is not [tokens, C]")
    if M.example(y).dtype != M.example(layout.x).dtype:
        raise Refusal(f"{y.name}: the aggregate's dtype differs from the stream's")
    return AggregatePlan(layout, h_pre, y)


def build_aggregate(plan: AggregatePlan, emit, x, h_pre):
    lay = plan.layout
    x4 = _canonical_stream(lay, emit, x)
    y = emit("op:mhc_aggregate", x4, _tokens2(lay, emit, h_pre, plan.h_pre, (lay.sizes[2],)),
             list(lay.order))
    return emit("reshape_to", y, lay.sym_sizes[:2] + (lay.sizes[3],), _sym_shape(plan.node))


# ----------------------------------------------------------------------------------------
# emit: the same builders run eagerly (probe) or insert FX nodes (rewrite)


def _op(name: str):
    from .. import lowering  # noqa: F401
    from ..lowering import mhc  # noqa: F401  (registers the ops)

    return getattr(torch.ops.hccompile, name).default


def eager_emit(what: str, *args):
    if what.startswith("op:"):
        return _op(what[3:])(*args)
    if what == "getitem":
        return args[0][args[1]]
    x, *rest = args
    if what == "permute":
        return x.permute(*rest[0])
    if what == "reshape_to":
        src, dst = rest
        return x if _same_shape(src, dst) else x.reshape([size_hint(s) for s in dst])
    return getattr(x, what)(*rest)


def _regroup(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Consecutive groups of src and dst dims with equal products (by hints): the flatten /
    unflatten steps that turn one shape into the other in the same element order."""
    hs, hd = [size_hint(s) for s in src], [size_hint(s) for s in dst]
    groups, i, j = [], 0, 0
    while i < len(hs) or j < len(hd):
        a, b, ps, pd = i, j, 1, 1
        if i < len(hs):
            ps, i = ps * hs[i], i + 1
        if j < len(hd):
            pd, j = pd * hd[j], j + 1
        while ps != pd:
            if ps < pd and i < len(hs):
                ps, i = ps * hs[i], i + 1
            elif pd < ps and j < len(hd):
                pd, j = pd * hd[j], j + 1
            else:
                raise Refusal(f"cannot regroup shape {tuple(hs)} as {tuple(hd)}")
        groups.append((list(range(a, i)), list(range(b, j))))
    return groups


class GraphEmitter:
    def __init__(self, gm: fx.GraphModule, ctx: PassContext, layer: int, meta_from: fx.Node,
                 layout: StreamLayout | None = None):
        self.g, self.ctx, self.layer, self.meta_from = gm.graph, ctx, layer, meta_from
        self.layout = layout
        self.nodes: list[fx.Node] = []

    def _size_arg(self, size: Any, only_symbolic: bool) -> Any:
        """An unflatten size: the int, -1 for the one symbolic size of a group, or a size node of
        the projection (whose leading dims are the token dims)."""
        if _static(size):
            return int(size)
        if only_symbolic:
            return -1
        lay = self.layout
        if lay is not None and lay.proj is not None:
            for k, s in enumerate(_sym_shape(lay.proj)[:-1]):
                if _same_size(s, size):
                    return self("size", lay.proj, k)
        raise Refusal(f"no source for the symbolic size {size}")

    def reshape_to(self, x: fx.Node, src: tuple, dst: tuple) -> fx.Node:
        if _same_shape(src, dst):
            return x
        d = 0
        for sg, dg in _regroup(src, dst):
            if len(sg) > 1:
                x = self("flatten", x, d, d + len(sg) - 1)
            if not sg:
                for _ in dg:
                    x = self("unsqueeze", x, d)
            elif not dg:
                x = self("squeeze", x, d)
                continue
            elif len(dg) > 1:
                sizes = [dst[k] for k in dg]
                symbolic = [s for s in sizes if not _static(s)]
                x = self("unflatten", x, d, tuple(self._size_arg(s, len(symbolic) == 1)
                                                  for s in sizes))
            d += len(dg)
        return x

    def __call__(self, what: str, *args) -> fx.Node:
        if what == "reshape_to":
            return self.reshape_to(*args)
        if what.startswith("op:"):
            node = self.g.call_function(_op(what[3:]), tuple(args))
            role = what[3:]
        elif what == "getitem":
            node = self.g.call_function(operator.getitem, tuple(args))
            role = ("h_pre", "h_post", "h_res")[args[1]]
        else:
            node = self.g.call_method(what, tuple(args))
            role = "size" if what == "size" else "view"
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        node.meta["example_value"] = M.fake_value(node, self.ctx.fake_mode)
        node.meta["hc"] = {"layer": self.layer, "role": role}
        self.nodes.append(node)
        return node


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
    with torch.no_grad():
        want = M.evaluate(gm, plan.values, inputs, ctx.example_inputs, max_nodes=MAX_PROBE_NODES)
        got = build_mapping(plan, eager_emit, inputs[plan.proj], inputs[plan.r],
                            [inputs.get(a) for a in plan.alphas], [inputs.get(b) for b in plan.biases])
    return _compare(got, want, "mapping", M.probe_tolerance(M.example(plan.proj).dtype, ctx.config))


def probe_post(plan: PostPlan, gm: fx.GraphModule, ctx: PassContext) -> float:
    rand = _Random(_SEED + 1)
    X = plan.layout.x
    inputs = {X: rand(X, "normal"), plan.f: rand(plan.f, "normal"),
              plan.h_res: rand(plan.h_res, "positive"), plan.h_post: rand(plan.h_post, "positive")}
    if len(inputs) != 4:
        raise Refusal("x, f, H_res and H_post are not four distinct tensors")
    with torch.no_grad():
        want = M.evaluate(gm, [plan.x_out], inputs, ctx.example_inputs, max_nodes=MAX_PROBE_NODES)
        got = [build_post(plan, eager_emit, inputs[X], inputs[plan.h_res], inputs[plan.h_post],
                          inputs[plan.f])]
    return _compare(got, want, "post", M.probe_tolerance(M.example(X).dtype, ctx.config))


def probe_aggregate(plan: AggregatePlan, gm: fx.GraphModule, ctx: PassContext) -> float:
    rand = _Random(_SEED + 2)
    X = plan.layout.x
    inputs = {X: rand(X, "normal"), plan.h_pre: rand(plan.h_pre, "positive")}
    with torch.no_grad():
        want = M.evaluate(gm, [plan.node], inputs, ctx.example_inputs, max_nodes=MAX_PROBE_NODES)
        got = [build_aggregate(plan, eager_emit, inputs[X], inputs[plan.h_pre])]
    return _compare(got, want, "aggregate", M.probe_tolerance(M.example(X).dtype, ctx.config))


# ----------------------------------------------------------------------------------------
# rewrite


def _dead_code(g: fx.Graph, old: list[fx.Node], keep: set[fx.Node]) -> int:
    """Erase the replaced nodes and whatever only they used, up to `keep`."""
    region: list[fx.Node] = []
    seen: set[fx.Node] = set()
    todo = list(old)
    while todo:
        node = todo.pop()
        if node in seen or node in keep or node.op in ("placeholder", "output", "get_attr"):
            continue
        seen.add(node)
        region.append(node)
        todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(g.nodes)}
    erased = 0
    for node in sorted((n for n in region if n in order), key=order.__getitem__, reverse=True):
        if not node.users and not M.is_impure(node):
            g.erase_node(node)
            erased += 1
    return erased


def _earliest(g: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(g.nodes)}
    return min(nodes, key=order.__getitem__)


def _tag(node: fx.Node, layer: int, role: str) -> None:
    node.meta["hc"] = {"layer": layer, "role": role}


def _late_inputs(g: fx.Graph, nodes: list[Any], anchor: fx.Node) -> list[fx.Node]:
    """The nodes (and their inputs) that come after `anchor` in the graph, in graph order: e.g.
    `hc_scale[2]`, an α read where the code first needs it, after H_pre is already computed.
    Refused unless each is a pure function of parameters (placeholders, get_attr)."""
    order = {n: i for i, n in enumerate(g.nodes)}
    late: set[fx.Node] = set()
    todo = [n for n in nodes if isinstance(n, fx.Node)]
    while todo:
        n = todo.pop()
        if n in late or order[n] < order[anchor] or n.op in ("placeholder", "get_attr"):
            continue
        if n.op not in ("call_function", "call_method") or M.is_impure(n):
            raise Refusal(f"{n.name}: an α or bias computed after the mapping starts, not from "
                          f"parameters alone")
        late.add(n)
        todo.extend(n.all_input_nodes)
    return sorted(late, key=order.__getitem__)


def rewrite_mapping(plan: MappingPlan, layer: HCLayer, gm: fx.GraphModule, ctx: PassContext
                    ) -> list[fx.Node]:
    g = gm.graph
    anchor = _earliest(g, plan.values)
    for node in _late_inputs(g, plan.alphas + plan.biases, anchor):
        anchor.prepend(node)  # graph order kept among them; they read parameters only
    emit = GraphEmitter(gm, ctx, layer.index, anchor)
    with g.inserting_before(anchor):
        outs = build_mapping(plan, emit, plan.proj, plan.r, plan.alphas, plan.biases)
    op = next(n for n in emit.nodes if n.meta["hc"]["role"] == "mhc_mapping")
    _tag(op, layer.index, "mapping")
    for old, new in zip(plan.values, outs):
        old.replace_all_uses_with(new)
    keep = {plan.proj, plan.r, *[a for a in plan.alphas if a is not None],
            *[b for b in plan.biases if b is not None]}
    _dead_code(g, plan.values + [layer.h_pre, layer.h_post, layer.sinkhorn[-1]], keep)
    layer.h_pre, layer.h_post, layer.h_res = outs
    return outs


def rewrite_post(plan: PostPlan, layer: HCLayer, layers: list[HCLayer], gm: fx.GraphModule,
                 ctx: PassContext) -> fx.Node:
    g = gm.graph
    old = plan.x_out
    emit = GraphEmitter(gm, ctx, layer.index, old, plan.layout)
    with g.inserting_before(old):
        new = build_post(plan, emit, plan.layout.x, plan.h_res, plan.h_post, plan.f)
    op = next(n for n in emit.nodes if n.meta["hc"]["role"] == "mhc_post")
    _tag(op, layer.index, "post")
    _tag(new, layer.index, "x_out")
    old.replace_all_uses_with(new)
    _dead_code(g, [old, layer.mixed, layer.post],
               {plan.layout.x, plan.h_res, plan.h_post, plan.f, layer.aggregate})
    for other in layers:  # the next layer's stream input is this layer's output
        if other.x is old:
            other.x = view_root(new)
    layer.x_out, layer.mixed, layer.post = new, op, op
    return new


def rewrite_aggregate(plan: AggregatePlan, layer: HCLayer, gm: fx.GraphModule, ctx: PassContext
                      ) -> fx.Node:
    g = gm.graph
    old = plan.node
    emit = GraphEmitter(gm, ctx, layer.index, old, plan.layout)
    with g.inserting_before(old):
        new = build_aggregate(plan, emit, plan.layout.x, plan.h_pre)
    _tag(new, layer.index, "aggregate")
    old.replace_all_uses_with(new)
    _dead_code(g, [old], {plan.layout.x, plan.h_pre, layer.mixed})
    layer.aggregate = new
    return new


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
        token_dependent = _forward_closure(view_root(layer.x))
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
