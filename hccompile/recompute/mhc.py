"""The mHC layer structure on top of `BlockRecomputeManager`, with plain functions passed in.

One mHC sublayer (attention or MLP) with n residual streams x ∈ [..., n, C] runs, in this order:

    h_pre, h_post, h_res = compute_mappings(x)    checkpointed
    y     = aggregate(x, h_pre)                   checkpointed   Σ_i h_pre[i]·x_i
    mixed = apply_h_res(h_res, x)                 checkpointed   H_res · x
    z     = norm(y)                               checkpointed if include_layernorm, else saved
    f     = fn(z)                                 never recomputed (attention / MLP): persistent
    post  = apply_h_post(f, h_post)               checkpointed   h_post[i]·f
    out   = bda(post, mixed)                      checkpointed if include_bda, except the group's
                                                  tail, which carries the unified hook

A layer is a sequence of sublayers (typically attention then MLP). With granularity "block" the
tail is the last BDA of the block's last layer; with "layer" it is the last BDA of every layer.
So the memory kept per block is: the block input, each F output (and F's own saved tensors), the
group tails, plus the norm outputs when include_layernorm=False and the BDA outputs when
include_bda=False. Everything else (h_pre, h_post, h_res, y, mixed, z, post, the intermediate
BDA outputs, the Sinkhorn iterations) is rebuilt in backward.

Usage::

    from hccompile.recompute import BlockRecomputeManager, MHCSublayer, RecomputeConfig, mhc_block_forward

    layers = [[MHCSublayer(...attention functions...), MHCSublayer(...mlp functions...)] for _ in range(4)]
    cfg = RecomputeConfig(granularity="block", include_layernorm=True, include_bda=True)
    h = mhc_block_forward(h, layers, cfg)        # or manager=BlockRecomputeManager(cfg) to inspect it
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

from .manager import BlockRecomputeManager, RecomputeConfig

__all__ = ["MHCSublayer", "mhc_sublayer_forward", "mhc_block_forward"]

Tensor = torch.Tensor


@dataclasses.dataclass
class MHCSublayer:
    """The plain functions of one mHC sublayer. Each function must return new tensors (not views
    of its inputs); `fn` is the attention or MLP and is never recomputed."""

    compute_mappings: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]  # x -> (h_pre, h_post, h_res)
    aggregate: Callable[[Tensor, Tensor], Tensor]      # (x, h_pre) -> y
    apply_h_res: Callable[[Tensor, Tensor], Tensor]    # (h_res, x) -> mixed
    norm: Callable[[Tensor], Tensor]                   # y -> z
    fn: Callable[[Tensor], Tensor]                     # z -> f
    apply_h_post: Callable[[Tensor, Tensor], Tensor]   # (f, h_post) -> post
    bda: Callable[[Tensor, Tensor], Tensor]            # (post, mixed) -> out (bias-dropout-add)
    name: str = "sublayer"


def mhc_sublayer_forward(x: Tensor, sub: MHCSublayer, manager: BlockRecomputeManager | None = None, *,
                         tail: bool = False, prefix: str | None = None) -> Tensor:
    """One sublayer. Without a manager: the plain functions, in the same order. With one: the
    checkpoints listed in the module docstring; `tail=True` leaves the BDA un-checkpointed (its
    output is the hook tensor of the group)."""
    if manager is None:
        h_pre, h_post, h_res = sub.compute_mappings(x)
        y = sub.aggregate(x, h_pre)
        mixed = sub.apply_h_res(h_res, x)
        f = sub.fn(sub.norm(y))
        return sub.bda(sub.apply_h_post(f, h_post), mixed)
    cfg = manager.config
    p = prefix if prefix is not None else sub.name
    ck = manager.checkpoint
    h_pre, h_post, h_res = ck(f"{p}.compute_mappings", sub.compute_mappings, x)
    y = ck(f"{p}.aggregate", sub.aggregate, x, h_pre)
    mixed = ck(f"{p}.apply_h_res", sub.apply_h_res, h_res, x)
    z = ck(f"{p}.norm", sub.norm, y) if cfg.include_layernorm else sub.norm(y)
    f = sub.fn(z)
    post = ck(f"{p}.apply_h_post", sub.apply_h_post, f, h_post)
    if cfg.include_bda and not tail:
        return ck(f"{p}.bda", sub.bda, post, mixed)
    return sub.bda(post, mixed)


def mhc_block_forward(x: Tensor, layers: Sequence[Sequence[MHCSublayer]], config: RecomputeConfig | None = None,
                      *, manager: BlockRecomputeManager | None = None, name: str = "block") -> Tensor:
    """Run one block (a sequence of layers, each a sequence of sublayers) on the streams `x`.

    `config.granularity=None`, or grad mode off: the plain functions, no checkpoint. Otherwise a
    `BlockRecomputeManager` (the one passed, fresh and un-entered, or a new one named `name`)
    checkpoints the block and hooks its tail(s). Checkpoint names: "{name}.layer{i}.{sublayer}.{op}"."""
    if manager is not None:
        if config is not None and config != manager.config:
            raise ValueError(f"config {config} differs from the manager's {manager.config}")
        config = manager.config
    config = config if config is not None else RecomputeConfig()
    if config.granularity is None or not torch.is_grad_enabled():
        for layer in layers:
            for sub in layer:
                x = mhc_sublayer_forward(x, sub, None)
        return x
    mgr = manager if manager is not None else BlockRecomputeManager(config, name=name)
    last_layer = len(layers) - 1
    with mgr:
        for li, layer in enumerate(layers):
            for si, sub in enumerate(layer):
                is_tail = si == len(layer) - 1 and (config.granularity == "layer" or li == last_layer)
                x = mhc_sublayer_forward(x, sub, mgr, tail=is_tail, prefix=f"{mgr.name}.layer{li}.{sub.name}")
            mgr.end_layer(x)
        mgr.finalize(x)
    return x
