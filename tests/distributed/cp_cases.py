"""Shared by the CP tests (single-process simulation and multi-process gloo workers): random global
inputs, the single-process run they must match, and a simulated exchange of all ranks in one process."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hccompile.kernels.delta_rule import chunk_delta_rule_bwd, chunk_delta_rule_fwd

GRADIENT_NAMES = ("q", "k", "v", "beta", "g", "initial_state", "A_log", "dt_bias")


def make_inputs(gate: str, *, seqlens=None, batch=1, time=None, H=1, HV=2, K=16, V=16, initial_state=True,
                gate_in_kernel=False, seed=0, dtype=torch.float32, device="cpu"):
    """Global inputs: varlen (seqlens, B = 1) or fixed-length rows (batch x time)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    if seqlens is not None:
        batch, time, count = 1, sum(seqlens), len(seqlens)
    else:
        count = batch
    case = dict(q=randn(batch, time, H, K), k=randn(batch, time, H, K), v=randn(batch, time, HV, V),
                beta=torch.rand(batch, time, HV, generator=gen), g=None, initial_state=None, A_log=None,
                dt_bias=None)
    # Weak decays (about e^-0.05 per token), so that states carry across rank boundaries: with
    # strong ones the cross-rank terms fall below fp32 resolution and a broken exchange would pass.
    if gate == "scalar":
        case["g"] = F.logsigmoid(randn(batch, time, HV) + 3)
    elif gate == "channel":
        case["g"] = randn(batch, time, HV, K) - 5 if gate_in_kernel else F.logsigmoid(randn(batch, time, HV, K) + 3)
    if gate_in_kernel:
        case["A_log"], case["dt_bias"] = 0.3 * randn(HV), 0.5 * randn(HV * K)
    if initial_state:
        case["initial_state"] = 0.5 * randn(count, HV, K, V)
    for name in ("q", "k", "v", "beta", "g"):
        if case[name] is not None:
            case[name] = case[name].to(dtype)
    case = {n: None if t is None else t.to(device) for n, t in case.items()}
    cu = None
    if seqlens is not None:
        cu = [0]
        for length in seqlens:
            cu.append(cu[-1] + length)
    return case, cu


def output_grads(case, cu, seed=1):
    gen = torch.Generator().manual_seed(seed)
    batch, time, heads, value_dim = case["v"].shape
    count = batch if cu is None else len(cu) - 1
    do = torch.randn(batch, time, heads, value_dim, generator=gen).to(case["v"])
    dht = torch.randn(count, heads, case["q"].shape[3], value_dim, generator=gen).to(case["v"].device)
    return do, dht


def single_process(case, cu, options, do, dht):
    """(o, final state, gradients) of the non-CP kernels on the global inputs."""
    cu_tensor = None if cu is None else torch.tensor(cu, device=case["q"].device)
    o, final = chunk_delta_rule_fwd(**case, cu_seqlens=cu_tensor, output_final_state=True, **options)
    grads = chunk_delta_rule_bwd(**case, cu_seqlens=cu_tensor, do=do, dht=dht, **options)
    return o, final, grads


def local_inputs(ctx, case):
    """This rank's share of the global inputs: token dims sharded, per-sequence states selected."""
    local = {}
    for name, t in case.items():
        if t is None or name in ("A_log", "dt_bias"):
            local[name] = t
        elif name == "initial_state":
            local[name] = ctx.local_initial_state(t)
        else:
            local[name] = ctx.shard(t)
    return local


def local_final_grads(ctx, dht, batch=1):
    """The gradient of each local row's final state: the global one where the row's last segment
    ends its sequence, zero where the row ends at a rank boundary (an intermediate state)."""
    plan = ctx.plan(batch)
    rows = []
    for segment in plan.final_segment:
        if segment >= 0 and plan.ends_sequence[segment]:
            rows.append(dht[plan.sequence[segment]])
        else:
            rows.append(torch.zeros_like(dht[0]))
    return torch.stack(rows)


def relative_rms_error(out, ref) -> float:
    assert torch.isfinite(out).all(), "non-finite values"
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def simulate(contexts, case, options, do=None, dht=None, merge=None, engine="triton", output_final_state=True,
             keep=False):
    """Every rank's CP run in this process, the all-gather simulated by concatenation.

    Returns per rank (o, final state) or, with do, the gradient dict. `merge` replaces the runs'
    merge (e.g. exchange.merge_chains_scan). `keep`: forwards keep their intermediates
    (keep_state_rows, as the op asks) and return (o, final state, kept); with do, the backward runs
    from a kept forward's intermediates."""
    if keep and do is not None:
        kept = [k for _, _, k in simulate(contexts, case, options, merge=merge, engine=engine, keep=True)]
        return _simulate(contexts, case, options, do, dht, merge, engine, output_final_state, kept=kept)
    return _simulate(contexts, case, options, do, dht, merge, engine, output_final_state, keep=keep)


def _simulate(contexts, case, options, do, dht, merge, engine, output_final_state, keep=False, kept=None):
    from hccompile.kernels.delta_rule.plan import kept_state_rows

    if engine == "triton":
        from hccompile.kernels.delta_rule.cp import CPBackward as Backward, CPForward as Forward
    else:
        from hccompile.kernels.delta_rule.cp_reference import CPBackwardRef as Backward, CPForwardRef as Forward
    runs = []
    gate = "none" if case["g"] is None else ("scalar" if case["g"].dim() == 3 else "channel")
    for ctx in contexts:
        local = local_inputs(ctx, case)
        batch = local["q"].shape[0]
        args = (ctx.plan(batch), local["q"], local["k"], local["v"], local["beta"], local["g"], gate,
                local["initial_state"], local["A_log"], local["dt_bias"], options.get("lower_bound"),
                options.get("scale"), options.get("use_qk_l2norm_in_kernel", False), options.get("chunk_size", 16))
        if do is None:
            sequences = len(ctx.cu_seqlens_cpu) - 1 if ctx.varlen else None
            rows = kept_state_rows(batch, local["q"].shape[1], options.get("chunk_size", 16), sequences)
            runs.append(Forward(*args, **(dict(keep_state_rows=rows) if keep else {})))
        else:
            extra = dict(intermediates=kept[len(runs)]) if kept is not None else {}
            runs.append(Backward(*args, do=ctx.shard(do), dht=local_final_grads(ctx, dht, batch), **extra))
    for run in runs:
        run.prepare()
    for run in runs:
        run.overlap()
    plan = runs[0].plan
    if plan.out_slots:
        summaries_out = torch.cat([run.summaries_out for run in runs])
        summaries_in = torch.cat([run.summaries_in for run in runs]) if do is not None else None
        for run in runs:
            fold = merge or run.merge
            fold(run.plan, "forward", summaries_out, None, run.initial_states, run.value_dim)
            if do is not None:
                fold(run.plan, "backward", summaries_out, summaries_in, run.final_grads, run.value_dim)
    if do is None:
        finished = [run.finish(output_final_state) for run in runs]
        return [(*f, run.kept()) for f, run in zip(finished, runs)] if keep else finished
    return [run.finish() for run in runs]
