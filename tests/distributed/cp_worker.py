"""One rank of the multi-process CP tests (gloo on CPU). Started by harness.run_ranks with RANK,
WORLD_SIZE, CP_INIT_FILE (a file store), TRITON_INTERPRET=1 and CP_SUITE / CP_RESULTS in the environment.

Every rank runs the suite's cases through the public functions inside context_parallel (so through
the custom ops' CP dispatch), gathers outputs, final states and gradients onto rank 0, and rank 0
compares them with the single-process run of the same functions on the global inputs, writing
{case: {quantity: relative RMS error}} as JSON."""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: interpreter_compat

import interpreter_compat  # noqa: E402

if os.environ.get("HCCOMPILE_EXPECT_TRITON"):  # make test-triton-oldest: this rank runs that Triton too
    import triton
    assert triton.__version__ == os.environ["HCCOMPILE_EXPECT_TRITON"], (triton.__version__, triton.__file__)
interpreter_compat.apply()  # before any kernel runs (TRITON_INTERPRET=1 in every rank)

import hccompile  # noqa: E402
from hccompile.distributed import build_cp_context, context_parallel  # noqa: E402

from cp_cases import make_inputs, output_grads, relative_rms_error  # noqa: E402

FUNCTIONS = {
    "none": hccompile.chunk_delta_rule,
    "scalar": hccompile.chunk_gated_delta_rule,
    "channel": hccompile.chunk_kda,
}

# name: (world size, gate, make_inputs kwargs, context kwargs, options)
#   options: backward="inside" | "outside" (of the with-block), compile=True, op=True (call the op
#   with chunk_size 16 instead of the public function, whose chunk is 64)
CASES = {
    # 2 ranks
    "gdn-one-sequence-crosses-1": (2, "scalar", dict(seqlens=[41]), dict(), dict(op=True)),
    "gdn-varlen-0-and-1-uneven-no-init": (2, "scalar", dict(seqlens=[7, 30, 0, 12], initial_state=False),
                                          dict(), dict(op=True, backward="outside")),
    "gdn-zigzag-crosses-3-ring": (2, "scalar", dict(seqlens=[45]), dict(layout="zigzag", strategy="ring"),
                                  dict(op=True)),
    "kda-gate-in-kernel-fixed-b2-uneven-scan": (2, "channel", dict(batch=2, time=37, gate_in_kernel=True),
                                                dict(strategy="scan"), dict(lower_bound=-4.0)),
    "delta-rule-zigzag-varlen": (2, "none", dict(seqlens=[20, 29], initial_state=False), dict(layout="zigzag"),
                                 dict(op=True)),
    "gdn-compiled-hc-fullgraph": (2, "scalar", dict(seqlens=[9, 40]), dict(), dict(compile=True)),
    # The GDN written in plain PyTorch (chunked form), compiled with hc: the delta-rule pass lowers it
    # (substitutes disabled) or hc traces the function as the op (hccompile.substitutes, the default),
    # and the op runs as CP; without that, each rank would compute its own tokens' recurrence only.
    "gdn-plain-chunked-form-lowered-by-hc": (2, "scalar", dict(batch=1, time=37), dict(), dict(plain="pass")),
    "gdn-plain-chunked-form-substituted-by-hc": (2, "scalar", dict(batch=1, time=37), dict(),
                                                 dict(plain="substitute")),
    # 4 ranks
    "gdn-varlen-crosses-3-middle-ranks": (4, "scalar", dict(seqlens=[5, 60, 8]), dict(), dict(op=True)),
    "kda-zigzag-crosses-7": (4, "channel", dict(seqlens=[43]), dict(layout="zigzag", strategy="scan"),
                             dict(op=True)),
    "gdn-fixed-b2-ring": (4, "scalar", dict(batch=2, time=42), dict(strategy="ring"), dict(op=True)),
}
SUITES = {
    "two": [name for name, case in CASES.items() if case[0] == 2],
    "four": [name for name, case in CASES.items() if case[0] == 4],
    "plain": ["gdn-plain-chunked-form-lowered-by-hc", "gdn-plain-chunked-form-substituted-by-hc"],
}


def _call(gate, tensors, cu_seqlens, options, output_final_state=True):
    q, k, v, beta, g = (tensors[n] for n in ("q", "k", "v", "beta", "g"))
    if options.get("op"):
        o, final, *_ = torch.ops.hccompile.chunk_delta_rule(
            q, k, v, beta, g, tensors["initial_state"], cu_seqlens, tensors["A_log"], tensors["dt_bias"], gate, 0.3,
            output_final_state, True, options.get("lower_bound"), 16)
        return o, final
    kwargs = dict(initial_state=tensors["initial_state"], output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    if gate == "channel" and tensors["A_log"] is not None:
        kwargs.update(A_log=tensors["A_log"], dt_bias=tensors["dt_bias"], lower_bound=options.get("lower_bound"),
                      use_gate_in_kernel=True)
    positional = (q, k, v) + ((g,) if gate != "none" else ()) + (beta,)
    return FUNCTIONS[gate](*positional, **kwargs)


def _leaves(tensors):
    return {n: t.detach().clone().requires_grad_() for n, t in tensors.items() if t is not None}


def _with_leaves(tensors, leaves):
    return {n: leaves.get(n) if t is not None else None for n, t in tensors.items()}


def run_case(name: str) -> dict[str, float] | None:
    world, gate, input_kwargs, ctx_kwargs, options = CASES[name]
    # One head keeps the interpreter fast; several heads and GVA are covered by test_cp_kernels.py.
    case, cu = make_inputs(gate, H=1, HV=1, **input_kwargs)
    do, dht = output_grads(case, cu)
    if cu is not None:
        ctx = build_cp_context(cu, **ctx_kwargs)
    else:
        ctx = build_cp_context(seq_len=case["q"].shape[1], **ctx_kwargs)
    batch = case["q"].shape[0]
    plan = ctx.plan(batch)

    local = {n: (None if t is None else (t if n in ("A_log", "dt_bias") else
                                         ctx.local_initial_state(t) if n == "initial_state" else ctx.shard(t)))
             for n, t in case.items()}
    leaves = _leaves(local)
    tensors = _with_leaves(local, leaves)
    # The gradient of a local row's final state: zero where the row ends at a rank boundary.
    dht_local = torch.stack([dht[plan.sequence[s]] if s >= 0 and plan.ends_sequence[s] else torch.zeros_like(dht[0])
                             for s in plan.final_segment])
    do_local = ctx.shard(do)

    function = _call
    if options.get("compile"):
        def layer(q, k, v, beta, g, initial_state, cu_seqlens):
            o, final = hccompile.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                        output_final_state=True, cu_seqlens=cu_seqlens,
                                                        use_qk_l2norm_in_kernel=True)
            return o * 2, final

        compiled = torch.compile(layer, backend="hc", fullgraph=True)

        def function(gate, tensors, cu_seqlens, options):  # noqa: F811
            o, final = compiled(*(tensors[n] for n in ("q", "k", "v", "beta", "g", "initial_state")), cu_seqlens)
            return o / 2, final

    if options.get("plain"):
        from hccompile.nn.delta_net import plain_chunk_gated_delta_rule

        def plain_layer(q, k, v, beta, g, initial_state):
            return plain_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                                use_qk_l2norm=True, chunk_size=16)

        disabled = ["substitutes"] if options["plain"] == "pass" else []
        compiled_plain = torch.compile(plain_layer, backend="hc", fullgraph=True,
                                       options={"disable_passes": disabled})

        def function(gate, tensors, cu_seqlens, options):  # noqa: F811
            return compiled_plain(*(tensors[n] for n in ("q", "k", "v", "beta", "g", "initial_state")))

    with context_parallel(ctx):
        o, final = function(gate, tensors, ctx.cu_seqlens, options)
        if options.get("backward", "inside") == "inside":
            grads = torch.autograd.grad((o, final), list(leaves.values()), (do_local, dht_local))
    if options.get("backward") == "outside":
        grads = torch.autograd.grad((o, final), list(leaves.values()), (do_local, dht_local))
    grads = dict(zip(leaves, grads))

    gathered = {"o": ctx.unshard(o.detach()), "final_state": ctx.global_final_state(final.detach())}
    for name, grad in grads.items():
        if name in ("A_log", "dt_bias"):
            dist.all_reduce(grad)
            gathered[f"d{name}"] = grad
        elif name == "initial_state":
            if ctx.varlen:
                total = torch.zeros_like(case["initial_state"])
                total.index_add_(0, torch.tensor(plan.sequence), grad)
            else:
                total = grad.clone()
            dist.all_reduce(total)
            gathered["dinitial_state"] = total
        else:
            gathered[f"d{name}"] = ctx.unshard(grad)
    if ctx.rank != 0:
        return None

    full_leaves = _leaves(case)
    cu_tensor = None if cu is None else torch.tensor(cu)
    o_ref, final_ref = _call(gate, _with_leaves(case, full_leaves), cu_tensor, options)
    grads_ref = torch.autograd.grad((o_ref, final_ref), list(full_leaves.values()), (do, dht))
    reference = {"o": o_ref, "final_state": final_ref}
    reference.update({f"d{n}": g for n, g in zip(full_leaves, grads_ref)})
    return {quantity: relative_rms_error(gathered[quantity], ref) for quantity, ref in reference.items()}


def main() -> None:
    suite = os.environ["CP_SUITE"]
    dist.init_process_group("gloo", init_method=f"file://{os.environ['CP_INIT_FILE']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    results = {}
    for name in SUITES[suite]:
        start = time.perf_counter()
        try:
            errors = run_case(name)
        except Exception:  # reported per case; the other ranks then fail in a collective or finish
            results[name] = {"error": traceback.format_exc()}
            print(f"rank {dist.get_rank()} case {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        if errors is not None:
            results[name] = errors
            print(f"case {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        with open(os.environ["CP_RESULTS"], "w") as f:
            json.dump(results, f)
    dist.barrier()  # no rank tears down while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
