"""Eager block-level recomputation for mHC hyper-connections (for models that are not compiled).

Inside a block, the mHC intermediates (h_pre, h_post, h_res, the aggregated input, the mixed
residual, norm outputs, bias-dropout-add outputs, the Sinkhorn iterations) are computed without
saving anything, their storages are freed when the block ends, and one hook on the block's final
tensor recomputes them all, in forward order, when backward reaches the block. Only the block
input and each attention/MLP output (with the attention/MLP's own saved tensors) stay in memory.
Gradients are bit-for-bit those of the plain eager run, dropout included, when each checkpoint
uses each input in one op (true of the mHC functions; see `hccompile.recompute.manager`).

API
---
`CheckpointWithoutOutput(manager=<current>, *, name=None, preserve_rng_state=True)`
    `.checkpoint(fn, *args, **kwargs)` runs `fn` under no_grad, keeps its inputs by reference and
    the RNG states it drew from, returns its output. `.discard_output()` frees the output storage
    (`untyped_storage().resize_(0)`); `.recompute()` re-runs `fn` (same RNG, enable_grad) and
    refills the original storage in place. Standalone: `.discard_output_and_register_recompute(t)`.
`checkpoint_without_output(fn, *args, **kwargs)`: the same in one call.
`BlockRecomputeManager(config="block" | "layer" | RecomputeConfig, *, name="block")`
    a context manager around one block's forward; checkpoints created inside register with it.
    `.checkpoint(name, fn, *args, **kwargs)`, `.end_layer(t)`, `.finalize(t)` (alias
    `discard_all_outputs_and_register_unified_recompute`), `.hooks`, `.groups`,
    `.recompute_log`, `.stats()`.
`RecomputeConfig(granularity="block", include_layernorm=True, include_bda=True)`: design v1.1's knobs.
`MHCSublayer`, `mhc_sublayer_forward`, `mhc_block_forward`: the mHC layer structure with the
    user's plain functions (see `hccompile.recompute.mhc`).
`RecomputeError`: a plan that cannot be recomputed correctly (see `hccompile.recompute.manager`
    for the rules checked).

Example
-------
```python
import torch
import torch.nn.functional as F
from hccompile.recompute import BlockRecomputeManager

torch.manual_seed(0)
w = [torch.randn(16, 16, requires_grad=True) for _ in range(2)]
x = torch.randn(4, 16, requires_grad=True)

def norm(t):
    return F.layer_norm(t, t.shape[-1:])

def bda(f, residual):                            # bias-dropout-add (no bias here)
    return residual + F.dropout(f, p=0.1)

with BlockRecomputeManager("block") as mgr:      # checkpoints created inside register with mgr
    h = x
    for i in range(2):
        z = mgr.checkpoint(f"layer{i}.norm", norm, h)   # freed at finalize, refilled in backward
        f = z @ w[i]                                     # not checkpointed; matmul saves z by reference
        if i == 1:
            h = bda(f, h)                                # the block's tail: carries the unified hook
        else:
            h = mgr.checkpoint(f"layer{i}.bda", bda, f, h)  # its dropout mask is replayed exactly
        mgr.end_layer(h)
    mgr.finalize(h)                              # free the outputs, register one hook on h
h.sum().backward()                               # the hook recomputes layer0.norm, layer0.bda, layer1.norm
print(mgr.recompute_log)
```
"""
from .manager import (
    BlockRecomputeManager,
    CheckpointWithoutOutput,
    HookRecord,
    RecomputeConfig,
    RecomputeError,
    checkpoint_without_output,
    current_manager,
)
from .mhc import MHCSublayer, mhc_block_forward, mhc_sublayer_forward

__all__ = [
    "BlockRecomputeManager",
    "CheckpointWithoutOutput",
    "HookRecord",
    "MHCSublayer",
    "RecomputeConfig",
    "RecomputeError",
    "checkpoint_without_output",
    "current_manager",
    "mhc_block_forward",
    "mhc_sublayer_forward",
]
