"""The mapping (the σ maps and the Sinkhorn chain) read back into the few numbers the fused kernel
takes (kernels.mhc.MappingSpec): the affine parts of the projection, the norm r, α and the biases,
the Sinkhorn start and steps. Kept apart because it is the one part that parses arithmetic: what
the spec cannot express is refused here, with the difference named, before anything is probed."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import fx_match as M
from ..emit import Emitter
from ..fx_match import Refusal
from ..hc_detect import HCLayer, is_view, norm_step_parts, normalize_l1_parts
from .views import _same_shape, _shape, _sym_shape, _transform


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


def _reaches(node: Any, target: fx.Node, max_depth: int = 23) -> bool:
    return isinstance(node, fx.Node) and any(
        n is target for n in M.walk(node, M.inputs, stop=lambda n: n.op == "placeholder", max_depth=max_depth))


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
        if isinstance(arg, fx.Node) and \
                arg.op == "call_function" and arg.target in (operator.sub, torch.sub):
            out.append("the Sinkhorn start is exp(z − max z) (a detached shift), which the kernel "
                       "does not subtract")
    return out


def plan_mapping(layer: HCLayer, token_dependent: set[fx.Node]) -> MappingPlan:
    from ...kernels.mhc import MappingSpec

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


def build_mapping(plan: MappingPlan, em: Emitter, proj, r, alphas, biases):
    from ...lowering.mhc import spec_args

    spec = plan.spec
    n = spec.n
    alphas = [a if a is not None else em.method("new_ones", proj, ()) for a in alphas]
    biases = [b if b is not None else em.method("new_zeros", proj, (w,))
              for b, w in zip(biases, (n, n, n * n))]
    dtypes = [M.example(v).dtype for v in plan.values]
    outs = em.op("mhc_mapping", proj, r, *alphas, *biases, *spec_args(spec), *dtypes)
    return [em.getitem(outs, i) for i in range(3)]


# ----------------------------------------------------------------------------------------
# graph order: α and biases read after the mapping starts (the plan refuses those not computed from
# parameters alone, the rewrite moves the rest up)


def _earliest(g: fx.Graph, nodes: list[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(g.nodes)}
    return min(nodes, key=order.__getitem__)


def _late_inputs(g: fx.Graph, nodes: list[Any], anchor: fx.Node) -> list[fx.Node]:
    """The nodes (and their inputs) that come after `anchor` in the graph, in graph order: e.g.
    `hc_scale[2]`, an α read where the code first needs it, after H_pre is already computed.
    Refused unless each is a pure function of parameters (placeholders, get_attr)."""
    order = {n: i for i, n in enumerate(g.nodes)}

    def early(n: fx.Node) -> bool:
        return order[n] < order[anchor] or n.op in ("placeholder", "get_attr")

    late = []
    # depth-first: the first node refused is the one the message names
    for n in M.walk([n for n in nodes if isinstance(n, fx.Node)], M.inputs, skip=early, depth_first=True):
        if n.op not in ("call_function", "call_method") or M.is_impure(n):
            raise Refusal(f"{n.name}: an α or bias computed after the mapping starts, not from "
                          f"parameters alone")
        late.append(n)
    return sorted(late, key=order.__getitem__)
