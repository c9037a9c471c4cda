"""Context parallelism (CP) for the gated delta rule (plain, GDN, KDA) over torch.distributed.

    ctx = build_cp_context(cu_seqlens, group=dist.group.WORLD, layout="contiguous")
    with context_parallel(ctx):
        o, final_state = model(ctx.shard(q), ...)    # any call of hccompile::chunk_delta_rule

See docs/cp.md. The per-rank kernels are in hccompile/kernels/delta_rule/cp.py.
"""
from .context import STRATEGIES, CPContext, build_cp_context
from .dispatch import context_parallel, current_context
from .layout import LAYOUTS

__all__ = ["CPContext", "LAYOUTS", "STRATEGIES", "build_cp_context", "context_parallel", "current_context"]
