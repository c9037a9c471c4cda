"""Context parallelism for Gated DeltaNet: every rank holds a slice of the tokens of a packed batch.

    torchrun --standalone --nproc-per-node 2 examples/cp_torchrun.py   # one GPU per rank: NCCL
    python examples/cp_torchrun.py                                     # launches itself with 2 ranks

With a GPU for every rank the ranks use NCCL, one GPU each. With fewer GPUs than ranks (one GPU, or
none) the ranks run on the CPU with gloo, and the script says so: NCCL cannot put two ranks on one
GPU. On the CPU the Triton kernels need TRITON_INTERPRET=1 before Python starts (the self-launch
sets it; without it the ops run the plain-PyTorch reference, which also works). Rank 0 checks the
CP result against one process on all tokens.
"""
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import hccompile
from hccompile.distributed import build_cp_context, context_parallel


RANKS = 2


def ranks_get_gpus(world_size: int) -> bool:
    """NCCL needs a GPU of its own for every rank."""
    return torch.cuda.device_count() >= world_size


def main() -> None:
    cuda = ranks_get_gpus(int(os.environ["WORLD_SIZE"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if rank == 0:
        print(f"{dist.get_world_size()} ranks on " + ("GPUs (NCCL)" if cuda else
              f"the CPU (gloo; {torch.cuda.device_count()} GPU(s) for {dist.get_world_size()} ranks)"), flush=True)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    # The global batch, the same on every rank: three sequences packed into one row (B = 1).
    seqlens = [3000, 9000, 4000] if cuda else [20, 50, 26]
    cu_seqlens = [0]
    for n in seqlens:
        cu_seqlens.append(cu_seqlens[-1] + n)
    total, heads, dim = cu_seqlens[-1], 4, 64 if cuda else 16
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, total, heads, dim, generator=gen, device=device) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, total, heads, generator=gen, device=device) + 4)
    beta = torch.rand(1, total, heads, generator=gen, device=device)
    h0 = torch.randn(len(seqlens), heads, dim, dim, generator=gen, device=device)

    # zigzag: 2W slices, rank r holds slices r and 2W-1-r; sequences cross slice boundaries freely.
    ctx = build_cp_context(cu_seqlens, layout="zigzag", device=device)
    local = [ctx.shard(x).requires_grad_() for x in (q, k, v, g, beta)]
    with context_parallel(ctx):
        o, final_state = hccompile.chunk_gated_delta_rule(
            *local, initial_state=ctx.local_initial_state(h0), output_final_state=True,
            cu_seqlens=ctx.cu_seqlens, use_qk_l2norm_in_kernel=True)
        o.square().sum().backward()  # this rank's share of the loss
    print(f"rank {rank}: {ctx.num_local_tokens} tokens, local cu_seqlens {ctx.cu_seqlens.tolist()}", flush=True)

    o_all, final_all = ctx.unshard(o.detach()), ctx.global_final_state(final_state.detach())
    dq_all = ctx.unshard(local[0].grad)
    if rank == 0:  # the same call on one process, all tokens
        q1 = q.clone().requires_grad_()
        o1, final1 = hccompile.chunk_gated_delta_rule(
            q1, k, v, g, beta, initial_state=h0, output_final_state=True,
            cu_seqlens=torch.tensor(cu_seqlens, device=device), use_qk_l2norm_in_kernel=True)
        o1.square().sum().backward()

        def error(a, b):
            return ((a - b).norm() / b.norm()).item()

        errors = dict(o=error(o_all, o1), final_state=error(final_all, final1), dq=error(dq_all, q1.grad))
        print("relative error vs one process:", {n: f"{e:.1e}" for n, e in errors.items()}, flush=True)
        assert max(errors.values()) < 1e-4, errors
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        env = dict(os.environ)
        if not ranks_get_gpus(RANKS):
            env.setdefault("TRITON_INTERPRET", "1")
        # --standalone: a free port of this host, so that two launches at once (a test suite) never share one
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
                        __file__],
                       env=env, check=True)
