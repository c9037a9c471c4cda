"""What the mHC kernel launchers share: output allocation (one place, so tests can poison it),
canonical-layout checks, block sizes."""
from __future__ import annotations

import torch

from .._triton import direct, interpreted, next_power_of_2, require_triton, triton_available  # noqa: F401 (direct: the launchers default)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Elements of a [tokens, channels] or [rows, channels] tile per program (4 warps): the aggregate
# kernels' (channel_blocks, row_blocks). These kernels are memory-bound: the tile only has to keep
# enough bytes in flight, and every element costs registers (value and 64-bit address). Measured
# when the post forward still took [tokens, streams, channels] tiles (sm_90, ptxas): 2048 elements
# ([1, 4, 512]) took 56 registers, 4096 ([8, 4, 128]) 252.
TILE_ELEMENTS = 2048
MAX_BLOCK_C = 512
# The post forward's [tokens, C] tile, one stream at a time (16 elements a thread on 4 warps).
STREAM_TILE = 2048
# The backward sweeps (post and aggregate) reduce over C: C spans SWEEP_LANES lanes of a warp,
# 16 bytes per lane, so every sum over C is one shuffle tree inside a warp; the other lanes and
# the warps take tokens.
SWEEP_LANES = 8
SWEEP_WARPS = 4


def new_output(shape, dtype: torch.dtype, device: torch.device, order=None) -> torch.Tensor:
    """An uninitialised output of `shape` whose memory holds the dims in `order` (outer to inner;
    None: contiguous). Every kernel output is allocated here; tests replace this function with one
    that fills NaN, so an element a kernel forgets to write fails the comparison."""
    if order is None:
        return torch.empty(shape, dtype=dtype, device=device)
    order = list(order)
    return torch.empty([shape[d] for d in order], dtype=dtype, device=device).permute(
        *[order.index(d) for d in range(len(shape))])


def check_order(order, ndim: int, name: str = "out_order") -> list[int]:
    order = [int(d) for d in order]
    if sorted(order) != list(range(ndim)):
        raise ValueError(f"{name}: must be a permutation of 0..{ndim - 1}, got {order}")
    return order


def check_tensor(name: str, t, ndim: int, layout: str, float64_ok: bool = True, shape: tuple | None = None) -> None:
    """t a tensor of ndim dims in a supported dtype, of `shape` if given (sizes possibly symbolic:
    only compared for equality). `layout` names the dims in messages, e.g. "[T1, T2, n]"."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {layout}, got shape {tuple(t.shape)}")
    allowed = SUPPORTED_DTYPES + ((torch.float64,) if float64_ok else ())
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported (one of {[str(d) for d in allowed]})")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)} must be {layout} = {tuple(shape)}")


def check_same_device(**named: torch.Tensor) -> None:
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.device != first.device:
            raise ValueError(f"{name}: device {t.device} differs from {first_name}'s {first.device}")


MAX_STREAMS = 16


def check_streams(n) -> None:
    """n within the kernels' limit (a symbolic n is checked when it is concrete)."""
    if isinstance(n, int) and n > MAX_STREAMS:
        raise ValueError(f"x: {n} streams exceed the kernels' maximum {MAX_STREAMS}")


def block_n(n: int) -> int:
    return next_power_of_2(n)


def block_c(c: int, limit: int = MAX_BLOCK_C) -> int:
    return max(16, min(limit, next_power_of_2(c)))


def block_t(per_token_elements: int, limit: int = 64, tile: int = TILE_ELEMENTS) -> int:
    """Tokens per program so that the tile stays near `tile` elements."""
    bt = max(1, tile // max(1, per_token_elements))
    return min(limit, 1 << (bt.bit_length() - 1))


def stream_blocks(n: int, C: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_C) for the post forward ([tokens, C] tiles, one stream at a time): at
    n <= 4 in 16-bit, STREAM_TILE elements ([4, 512] at C = 1024: a warp per token row, two
    16-byte vectors per lane). The compiler keeps the n input tiles in registers across the output
    streams (it hoists their loads out of the loop), so the tile shrinks as n grows, and by half
    in float32 past n = 2: sm_90, Triton 3.6, no spills for n 2-16."""
    bc = block_c(C)
    tile = STREAM_TILE * 4 // max(4, block_n(n))
    if element_size > 2 and n > 2:
        tile //= 2
    return block_t(bc, limit=64, tile=max(tile, 256)), bc


def channel_blocks(C: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_C) for kernels on [tokens, C] tiles with no sum over C (aggregate
    forward): 16-byte vectors along C, TILE_ELEMENTS per tile."""
    bc = block_c(C)
    return block_t(bc, limit=64), bc


def row_blocks(C: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for a sum over C per row (the aggregate backward, a row per (token,
    stream)): a warp's 32 lanes of 16-byte vectors along C (fewer for a small C), TILE_ELEMENTS
    per tile. At C = 1024 in bf16: [8, 256], 4096 programs at B4 S2048 n 4."""
    vec = max(1, 16 // element_size)
    bc = max(16, min(32 * vec, next_power_of_2(max(1, C))))
    return max(1, TILE_ELEMENTS // bc), bc


def sweep_blocks(C: int, element_size: int, slots: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_C, BLOCK_P, num_warps) for the backward sweeps over C: BLOCK_C is
    SWEEP_LANES lanes of 16-byte vectors (fewer for a small C), BLOCK_T fills the rest of the
    warps' lanes, BLOCK_P holds `slots` sums over C per token."""
    vec = max(1, 16 // element_size)
    bc = max(16, min(SWEEP_LANES * vec, next_power_of_2(max(1, C))))
    rows_per_warp = max(1, 32 * vec // bc)
    return rows_per_warp * SWEEP_WARPS, bc, next_power_of_2(slots), SWEEP_WARPS


def column_sweep_blocks(element_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_C, HALVES, num_warps) for the post backward's column sweep (n = 3, 5, ...). Its
    partial sums go through an fp32 scratch tile of the data tiles' shape, so that both take one
    layout: BLOCK_C is SWEEP_LANES lanes of 16 bytes of fp32 for every dtype (a 16-bit tile of
    16-byte vectors would take another layout than the fp32 one: a conversion through shared memory
    inside the sweep). A step of C is HALVES such tiles, SWEEP_LANES lanes of 16 bytes per row and
    stream as in the slot sweep: the n streams' tiles of one step are reread per column from L1,
    and more would not stay there. BLOCK_T fills the warps' other lanes."""
    return 32 // SWEEP_LANES * SWEEP_WARPS, SWEEP_LANES * 4, max(1, 4 // element_size), SWEEP_WARPS


def require(device: torch.device, kernel, module: str) -> None:
    require_triton(device, kernel, module, f"the reference in {module.rsplit('.', 1)[0]}.reference")


__all__ = ["MAX_STREAMS", "SUPPORTED_DTYPES", "block_c", "block_n", "block_t", "channel_blocks",
           "check_order", "check_same_device", "check_streams", "check_tensor", "column_sweep_blocks",
           "interpreted", "new_output", "require", "row_blocks", "stream_blocks", "sweep_blocks", "triton_available"]
