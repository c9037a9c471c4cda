"""Lower plain-PyTorch htree attention (seed 003) to `hccompile::htree_attention`.

What is matched: an htree computation as `hccompile.nn.htree.htree_attention_plain` writes it (and
as other ports of the seed's naive code look): a mean-pooled tree of k and v, descending stable
sorts that select each layer's top-k, and an online softmax over the rest. Found structurally,
then proven numerically:

1. Anchor: each descending sort (or topk) not yet claimed starts an instance. Walking forward
   from it in graph order, the instance's output is the first floating tensor that is, at that
   point, the only live value depending on the sort (the layers' running softmax states and
   parents all funnel into the final division), extended through trailing layout ops (transpose,
   reshape, cast) to the tensor the rest of the model consumes.
2. q, k, v: the most upstream 4-D floating tensors [B, T, h, d] among the output's ancestors that
   do not depend on the sort; k and q reach the sort, v does not; q has the most heads.
3. Options: r from the pooling (a sum or mean over a dim split off by a reshape), top_k from the
   width kept after the sort, the tree depth from the number of selecting sorts, max_top_nodes
   from the depth and T, packed sort mode from a float-to-int32 bit view; scale, rope_base and
   causal are tried from the constants of the region (defaults first) until one candidate
   matches.
4. Proof: the region is evaluated on random probe inputs (with the graph's real buffers) and
   compared, row by row, with the reference of the op on the same inputs; a mismatch in any row
   (a selection decided differently moves a whole row) refuses the candidate with the reason.

Refused: dynamic sequence lengths (the tree depth, and so max_top_nodes, would need proving for
every length), one-layer trees (no selection: dense attention, left to Inductor), anything the
probe cannot confirm (a different pooling, no forced rightmost node, other scores).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..compat import concrete_shape
from ..lowering.htree import saves_selections
from . import fx_match as M
from .emit import EagerEmitter, Emitter, GraphEmitter
from .fx_match import Refusal
from .base import GraphPass, PassContext, register_pass

PATTERN = "htree_attention"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LAYOUT_OPS = M.LAYOUT_METHODS | {f.__name__ for f in M.LAYOUT_FUNCTIONS}
_SORTS = ((torch.sort, torch.argsort, torch.topk), ("sort", "argsort", "topk"))
_REDUCTIONS = ((torch.sum, torch.mean), ("sum", "mean"))
_RESHAPES = ((torch.reshape,), ("view", "reshape", "unflatten"))
# Row-wise relative error under which the region and the reference agree; a selection decided
# differently moves its row by far more (the reference itself differs by rounding only).
ROW_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}
MAX_REGION_NODES = 20000
PROBE_SEED = 20261122


@dataclass
class Instance:
    sort: fx.Node
    output: fx.Node
    selections: list[fx.Node]
    q: fx.Node | None = None
    k: fx.Node | None = None
    v: fx.Node | None = None
    options: dict[str, Any] = field(default_factory=dict)
    layout: str = ""


def _is_call(node: Any, spellings) -> bool:
    functions, methods = spellings
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function":
        return node.target in functions
    return node.op == "call_method" and node.target in methods


def _descending_sort(node: fx.Node) -> bool:
    """A sort that ranks largest first: sort/argsort(descending=True) or topk (largest=True)."""
    if not _is_call(node, _SORTS):
        return False
    name = node.target if node.op == "call_method" else node.target.__name__
    if name == "topk":
        return M.arg(node, 4, "largest", True) is not False
    return M.arg(node, 2, "descending", False) is True


def _tensor(node: Any) -> torch.Tensor | None:
    value = M.example(node)
    return value if isinstance(value, torch.Tensor) else None


def _is_float(node: Any) -> bool:
    value = _tensor(node)
    return value is not None and value.is_floating_point()


def _find_output(sort: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """First floating node after `sort` that is then the only live value depending on it."""
    tainted = M.downstream(sort)
    last_use = {n: max((order[u] for u in n.users), default=order[n]) for n in tainted}
    live: set[fx.Node] = set()
    for node in sorted(tainted, key=order.__getitem__):
        if node.op == "output":
            break
        live = {n for n in live if last_use[n] > order[node]}
        live.add(node)
        if len(live) == 1 and node is not sort and _is_float(node) and _tensor(node).dim() >= 3:
            return node
    raise Refusal("no single output found: values depending on the selection stay live to the end")


def _extend_through_layout(node: fx.Node) -> fx.Node:
    """Follow a chain of single-user layout ops and casts (the function's trailing reshapes)."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op not in ("call_method", "call_function") or user.args[0] is not node:
            break
        name = user.target if user.op == "call_method" else getattr(user.target, "__name__", "")
        if name not in _LAYOUT_OPS or not _is_float(user):
            break
        node = user
    return node


def _entries(output: fx.Node, first_sort: fx.Node, order: dict[fx.Node, int], batch: int,
             time: int) -> list[fx.Node]:
    """q, k, v candidates: the tensors live at the earliest program point where the only live
    data values the region still needs are three floating [batch, time, h, d] tensors.

    Data values are tensors that depend on a graph input; constants (aranges, RoPE tables) do not
    count. Walking forward through the output's ancestors, in a transformer block that point is
    just after the q, k, v projections (the residual stream is used only after the output), and in
    a bare function it is the inputs themselves.
    """
    region = M.upstream(output)
    depends = {}
    for node in sorted(region, key=order.__getitem__):
        depends[node] = node.op == "placeholder" or any(depends.get(p, False) for p in node.all_input_nodes)
    last_use = {n: max((order[u] for u in n.users if u in region), default=-1) for n in region}
    live: set[fx.Node] = set()
    for node in sorted(region, key=order.__getitem__):
        if order[node] >= order[first_sort]:
            break
        live = {n for n in live if last_use[n] > order[node]}
        if depends[node] and isinstance(M.example(node), torch.Tensor) and last_use[node] > order[node]:
            live.add(node)
        if len(live) == 3 and all(_is_float(n) and _tensor(n).dim() == 4 and
                                  tuple(concrete_shape(_tensor(n))[:2]) == (batch, time) for n in live):
            return sorted(live, key=order.__getitem__)
    raise Refusal("no point where q, k, v (three 4-D [B, T, heads, dim] tensors) are the only values the "
                  "region reads")


def _assign_roles(inst: Instance, entries: list[fx.Node]) -> list[tuple[fx.Node, fx.Node, fx.Node]]:
    """(q, k, v) orders to try: k and q reach the sort, v does not; q has the most heads."""
    reaching = [e for e in entries if e in M.upstream(inst.sort)]
    values = [e for e in entries if e not in reaching]
    if len(reaching) != 2 or len(values) != 1:
        raise Refusal("could not tell v (the input that does not reach the selection) from q and k")
    first, second = reaching
    heads = {n: _tensor(n).shape[2] for n in reaching}
    if heads[first] == heads[second]:
        return [(first, second, values[0]), (second, first, values[0])]
    q, k = (first, second) if heads[first] > heads[second] else (second, first)
    return [(q, k, values[0])]


def _pooling_rates(region: set[fx.Node]) -> set[int]:
    rates = set()
    for node in region:
        if not _is_call(node, _REDUCTIONS) or not _is_call(node.args[0], _RESHAPES):
            continue
        dim = M.arg(node, 1, "dim")
        source = _tensor(node.args[0])
        if isinstance(dim, int) and source is not None and -source.dim() <= dim < source.dim():
            rates.add(int(source.shape[dim]))
    return {r for r in rates if r >= 2}


def _kept_widths(selections: list[fx.Node]) -> list[int]:
    """Widths kept after each selection: topk's k, or the length of a prefix slice of the order."""
    widths = []
    for sort in selections:
        name = sort.target if sort.op == "call_method" else sort.target.__name__
        if name == "topk":
            k = M.arg(sort, 1, "k")
            if isinstance(k, int):
                widths.append(k)
            continue
        # sort(...)[1][..., :k] or argsort(...)[..., :k]
        index_nodes = [sort] if name == "argsort" else [
            u for u in sort.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1]
        for indices in index_nodes:
            for user in indices.users:
                if user.op == "call_function" and user.target is operator.getitem:
                    index = user.args[1]
                    last = index[-1] if isinstance(index, tuple) and index else index
                    if isinstance(last, slice) and last.start in (None, 0) and last.step in (None, 1) \
                            and isinstance(last.stop, int) and _tensor(user) is not None:
                        widths.append(int(_tensor(user).shape[-1]))
    return widths


def _constants(region: set[fx.Node], kinds: tuple[str, ...]) -> list[float]:
    """Python float constants multiplying (or dividing, inverted) tensors, or raised to a tensor power."""
    found: list[float] = []
    for node in region:
        kind = M.kind(node)
        if "pow" in kinds and node.op == "call_function" and node.target in (operator.pow, torch.pow):
            base = node.args[0]
            if M.scalar(base) is not None and isinstance(node.args[1], fx.Node):
                found.append(float(base))
        if "mul" in kinds and kind in ("mul", "div") and len(node.args) == 2:
            a, b = node.args
            if _is_float(a) and M.scalar(b) not in (None, 0.0):
                found.append(M.scalar(b) if kind == "mul" else 1.0 / M.scalar(b))
            elif kind == "mul" and _is_float(b) and M.scalar(a) not in (None, 0.0):
                found.append(M.scalar(a))
    unique = []
    for value in found:
        if math.isfinite(value) and all(not math.isclose(value, u, rel_tol=1e-12) for u in unique):
            unique.append(value)
    return unique


def _uses_packed_keys(region: set[fx.Node]) -> bool:
    for node in region:
        if node.op == "call_method" and node.target == "view" and any(a is torch.int32 for a in node.args[1:]):
            source = _tensor(node.args[0])
            if source is not None and source.dtype == torch.float32:
                return True
    return False


def _packed_index_bits(region: set[fx.Node]) -> int | None:
    """b of the packed key's index mask: an integer tensor `& (2**b - 1)` with a constant."""
    for node in region:
        if node.op == "call_function" and node.target in (operator.and_, torch.bitwise_and) and len(node.args) == 2:
            mask = node.args[1]
            value = _tensor(node.args[0])
            if isinstance(mask, int) and not isinstance(mask, bool) and mask > 0 and (mask & (mask + 1)) == 0 \
                    and value is not None and not value.is_floating_point() and value.dtype != torch.bool:
                return mask.bit_length()
    return None


def _layer_sizes(time: int, r: int, depth: int) -> list[int]:
    sizes = [time]
    for _ in range(depth - 1):
        sizes.append(-(-sizes[-1] // r))
    return sizes


def _candidate_options(inst: Instance, region: set[fx.Node], time: int, key_dim: int) -> list[dict[str, Any]]:
    rates = _pooling_rates(region)
    if len(rates) != 1:
        raise Refusal(f"no single mean-pooling rate found (reductions over split dims: {sorted(rates)})")
    (r,) = rates
    widths = _kept_widths(inst.selections)
    if len(widths) != len(inst.selections) or not widths:
        raise Refusal("the number of nodes kept after a selection is not a compile-time constant")
    top_k = max(widths)
    depth = len(inst.selections) + 1
    sizes = _layer_sizes(time, r, depth)
    if sizes[-2] <= 1:
        raise Refusal(f"tree depth {depth} is not possible for T={time} and r={r}")
    # Any max_top_nodes in [top size, size below) builds this tree for this T; packed keys also
    # fix the index bits, log2 of max(max_top_nodes, top_k * r) rounded up.
    sort_mode = "packed" if _uses_packed_keys(region) else "exact"
    allowed = range(sizes[-1], sizes[-2])
    if sort_mode == "packed":
        bits = _packed_index_bits(region)
        if bits is None:
            raise Refusal("packed sort keys without a constant index mask")
        allowed = [m for m in allowed if max(1, (max(m, top_k * r) - 1).bit_length()) == bits]
        if not allowed:
            raise Refusal(f"packed sort keys with {bits} index bits fit no max_top_nodes for T={time}")
    max_top_nodes = top_k * r if top_k * r in allowed else allowed[0]
    scales = [key_dim ** -0.5] + _constants(region, ("mul",))
    bases = [10000.0] + [b for b in _constants(region, ("pow",)) if b > 0]
    candidates = []
    for causal in (False, True):
        for scale in scales[:6]:
            for base in bases[:4]:
                candidates.append(dict(compression_rate=r, top_k=top_k, max_top_nodes=max_top_nodes, scale=scale,
                                       rope_base=base, causal=causal, sort_mode=sort_mode))
    return candidates


def _row_error(out: torch.Tensor, ref: torch.Tensor, batch: int, time: int) -> float:
    """Largest relative error over the rows [b, t] (every head and channel of one position)."""
    out64 = out.detach().double().reshape(batch, time, -1)
    ref64 = ref.detach().double().reshape(batch, time, -1)
    if out64.shape != ref64.shape or not torch.isfinite(out64).all():
        return float("inf")
    norms = ref64.norm(dim=-1).clamp_min(ref64.norm() / math.sqrt(batch * time) * 1e-3 + 1e-30)
    return ((out64 - ref64).norm(dim=-1) / norms).max().item()


def _adapt(op_out: Any, want_shape: tuple[int, ...], layout: str, em: Emitter) -> Any:
    """[B, T, H, V] -> the region output's layout: 'bthv' (reshape only) or 'bhtv'."""
    if layout == "bhtv":
        op_out = em.method("transpose", op_out, 1, 2)
    return em.method("reshape", op_out, list(want_shape))


def _layouts(output_shape: tuple[int, ...], batch: int, time: int, heads: int, value_dim: int) -> list[str]:
    layouts = []
    numel = batch * time * heads * value_dim
    if math.prod(output_shape) != numel:
        return layouts
    if output_shape[:2] == (batch, time):
        layouts.append("bthv")
    if len(output_shape) >= 3 and output_shape[0] == batch and output_shape[1] == heads:
        layouts.append("bhtv")
    return layouts


def _probe_inputs(q: fx.Node, k: fx.Node, v: fx.Node, sharpness: float) -> dict[fx.Node, torch.Tensor]:
    inputs = {}
    for i, node in enumerate((q, k, v)):
        value = _tensor(node)
        generator = torch.Generator(device=value.device).manual_seed(PROBE_SEED + i)
        x = torch.randn(concrete_shape(value), generator=generator, device=value.device, dtype=torch.float32)
        inputs[node] = (x * (sharpness if node is q else 1.0)).to(value.dtype)
    return inputs


def probe(inst: Instance, gm: fx.GraphModule, ctx: PassContext, orders, candidates) -> tuple[dict, str, float]:
    """Evaluate the region on probe inputs; return the first (options, layout) that matches."""
    from ..kernels.htree.reference import htree_attention_ref

    out_shape = concrete_shape(_tensor(inst.output))
    errors = []
    for q, k, v in orders:
        qv, kv_, vv = _tensor(q), _tensor(k), _tensor(v)
        batch, time, heads, key_dim = concrete_shape(qv)
        if heads % kv_.shape[2] or tuple(concrete_shape(kv_)) != (batch, time, kv_.shape[2], key_dim) or \
                concrete_shape(vv)[:3] != (batch, time, kv_.shape[2]):
            errors.append("q, k, v shapes are not [B, T, H, K], [B, T, H_kv, K], [B, T, H_kv, V]")
            continue
        layouts = _layouts(tuple(out_shape), batch, time, heads, vv.shape[3])
        if not layouts:
            errors.append(f"output shape {tuple(out_shape)} is not a layout of [B, T, H, V]")
            continue
        probes = []
        for sharpness in (1.0, 3.0):
            inputs = _probe_inputs(q, k, v, sharpness)
            with torch.no_grad():
                region_out = _evaluate(gm, inst.output, inputs, ctx.example_inputs)
            probes.append((inputs, region_out))
        tolerance = ROW_TOLERANCE[qv.dtype]
        best = float("inf")
        for options in candidates:
            for layout in layouts:
                worst = 0.0
                for inputs, region_out in probes:
                    with torch.no_grad():
                        ref = htree_attention_ref(inputs[q], inputs[k], inputs[v], **options)
                    adapted = _adapt(ref, tuple(out_shape), layout, EagerEmitter()).to(region_out.dtype)
                    worst = max(worst, _row_error(region_out, adapted, batch, time))
                    if worst > tolerance:
                        break
                best = min(best, worst)
                if worst <= tolerance:
                    inst.q, inst.k, inst.v = q, k, v
                    return options, layout, worst
        errors.append(f"no candidate options reproduce the region (best row error {best:.3g}, "
                      f"tolerance {tolerance:g}, {len(candidates)} candidates tried)")
    raise Refusal("probe mismatch: " + "; ".join(errors))


def _evaluate(gm: fx.GraphModule, output: fx.Node, overrides: dict[fx.Node, Any], example_inputs: list[Any]) -> Any:
    """The region's value with `overrides` for q, k, v (fx_match.evaluate: `&`, `|`, `~` are pure there)."""
    (value,) = M.evaluate(gm, [output], overrides, example_inputs, max_nodes=MAX_REGION_NODES)
    return value


def match(sort: fx.Node, gm: fx.GraphModule, order: dict[fx.Node, int]) -> tuple[Instance, set[fx.Node]]:
    output = _extend_through_layout(_find_output(sort, order))
    tainted = M.downstream(sort)
    selections = [n for n in tainted if _descending_sort(n) and order[n] < order[output]]
    inst = Instance(sort=sort, output=output, selections=sorted(selections, key=order.__getitem__))
    return inst, tainted


def rewrite(inst: Instance, gm: fx.GraphModule, ctx: PassContext) -> fx.Node:
    g = gm.graph
    o = inst.options
    want = _tensor(inst.output)
    em = GraphEmitter(g, ctx.fake_mode, meta={"stack_trace": inst.output.meta.get("stack_trace")})
    with g.inserting_before(inst.output):
        # Keep the forward's selections for the backward when the graph will be differentiated.
        keep = saves_selections(*(_tensor(x) for x in (inst.q, inst.k, inst.v)))
        result = em.op("htree_attention", inst.q, inst.k, inst.v, o["compression_rate"], o["top_k"],
                       o["max_top_nodes"], float(o["scale"]), float(o["rope_base"]), bool(o["causal"]),
                       o["sort_mode"], keep)
        out = em.getitem(result, 0)
        out = _adapt(out, tuple(want.shape), inst.layout, em)
        if out.meta.get("example_value") is not None and out.meta["example_value"].dtype != want.dtype:
            out = em.method("to", out, want.dtype)
    region = M.upstream(inst.output)
    inst.output.replace_all_uses_with(out)
    order = {n: i for i, n in enumerate(g.nodes)}
    # Users before producers, so that one sweep frees whole chains.
    for node in sorted(region, key=lambda n: -order[n]):
        if not node.users and node.op not in ("placeholder", "output", "get_attr") and not M.is_impure(node):
            g.erase_node(node)
    return out


def _static(value: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in value.shape)


@register_pass
class HTreeAttentionPass(GraphPass):
    name = "htree"
    stage = "dynamo"

    def run(self, gm: fx.GraphModule, ctx: PassContext, record: Any) -> bool:
        changed = False
        claimed: set[fx.Node] = set()
        sorts = [n for n in gm.graph.nodes if _descending_sort(n)]
        for sort in sorts:
            if sort in claimed or sort.graph is not gm.graph:
                continue
            where = sort.name
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            try:
                inst, tainted = match(sort, gm, order)
                claimed.update(inst.selections)
                out_value = _tensor(inst.output)
                if not _static(out_value):
                    raise Refusal("symbolic shapes (dynamic sequence length): the tree depth and max_top_nodes "
                                  "cannot be proven for every length; compile with dynamic=False")
                shape = concrete_shape(out_value)
                try:
                    entries = _entries(inst.output, sort, order, shape[0], shape[1])
                except Refusal:
                    if len(shape) < 3:
                        raise
                    entries = _entries(inst.output, sort, order, shape[0], shape[2])  # [B, H, T, ...]
                orders = _assign_roles(inst, entries)
                q, k, v = orders[0]
                dtypes = {_tensor(n).dtype for n in (q, k, v)}
                if len(dtypes) != 1 or next(iter(dtypes)) not in SUPPORTED_DTYPES:
                    raise Refusal(f"q, k, v dtypes {sorted(map(str, dtypes))}: the op takes one of float16, "
                                  f"bfloat16, float32")
                region = M.upstream(inst.output) - M.upstream(q) - M.upstream(k) - M.upstream(v)
                if not ctx.config.probe:
                    raise Refusal("probing is disabled (probe=False): htree options are only inferred by probing")
                candidates = _candidate_options(inst, region, _tensor(q).shape[1], _tensor(q).shape[3])
                inst.options, inst.layout, err = probe(inst, gm, ctx, orders, candidates)
            except Refusal as r:
                record.refuse(PATTERN, str(r), node=where)
                continue
            except (ValueError, RuntimeError) as e:  # the probe evaluator: impure or unevaluable region
                record.refuse(PATTERN, f"probe impossible: {type(e).__name__}: {e}", node=where)
                continue
            out = rewrite(inst, gm, ctx)
            record.match(PATTERN, node=where, replacement=out.name, layout=inst.layout,
                         inputs={"q": inst.q.name, "k": inst.k.name, "v": inst.v.name},
                         options=dict(inst.options), probe_row_err=err)
            changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
        return changed
