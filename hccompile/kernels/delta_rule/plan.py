"""Launch planning shared by chunk.py's two passes and cp.py: what the kernels support (dtypes, head
dims, chunk sizes), the Plan of one call (chunk tables, gate code, the intermediates' dtype and the
products' precision), tile widths, and how far the sequential sweeps' tiles narrow for occupancy.

Precision. Running states, accumulators, gates and the [BT, BT] scores and inverse are fp32 (P stored
by the output kernel, Plan.scores_dtype, and the inverse A with the split backward, Plan.inverse_dtype,
in the intermediates' dtype).
With half intermediates (Plan.intermediate_dtype: fp16 inputs, and bf16 ones unless
BF16_INTERMEDIATES is off) the intermediates that feed tensor-core products are stored in the input dtype
(l2normed q and k, W, U~, U, the chunk states h, and the backward's dh and dU), and every product
over K, V or the chunk takes half operands with fp32 accumulation (tiles._dot rounds fp32 register
tiles, e.g. the running state, right before the product), as FLA does. Otherwise intermediates
are fp32 and products exact (fp32 inputs) or tf32 (bf16 inputs with BF16_INTERMEDIATES off; their
l2-normed q and k are stored in fp16, see Plan.normed_qk_dtype). Each kernel takes its operand
dtype from the stored intermediate it reads (`dot_dtype`), so launchers only pick buffer dtypes.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from .reference import DeltaRuleProblem

from .._triton import cdiv, direct, kept_rows, next_power_of_2

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Half-precision intermediates (Plan.intermediate_dtype), as FLA keeps them. fp16 ones keep 10
# mantissa bits, as many as the tf32 products they replace: every test case, the ill-conditioned
# aligned-keys ones included, stays within FLA's limits (worst 1.6e-3 relative RMS). bf16 ones keep
# 7: on random inputs o/state/grads stay near 4e-3 against float64, FLA 0.6.0's own errors (3.9e-3
# o, 4.5e-3 dk measured side by side), within its test limits. On aligned keys (in-chunk condition
# numbers ~100) the roundings of U~, U, h, dU and of the products' operands add up to ~1.6e-2 (o)
# and ~5e-2 (dg), over FLA's test limits but again FLA's own errors there (1.5e-2, 4.5e-2); fp32
# intermediates with tf32 products keep 4.5e-3 (o) there, at 1.5-1.75x the time.
# HCCOMPILE_DELTA_RULE_BF16_INTERMEDIATES=0 (read at import; tests and benchmarks set this
# attribute) selects those for bf16 inputs.
BF16_INTERMEDIATES = os.environ.get("HCCOMPILE_DELTA_RULE_BF16_INTERMEDIATES", "1") != "0"
CHUNK_SIZES = (16, 32, 64)
DEFAULT_CHUNK_SIZE = 64
# Per-channel decays cannot be factored over a whole chunk without overflow, so the
# chunk is cut into sub-chunks of this size; blocks off the diagonal are factored
# through the first row of their row sub-chunk, diagonal blocks too while the gate span allows it,
# else split at middle rows (scores.py).
# The triangular solve inverts blocks of the same size first.
SUB_CHUNK = 16
MIN_DOT_DIM = 16
# Key/value tiles of the chunk-parallel kernels (the sequential state kernels' are state.py's).
MAX_TILE = 64
# The state sweeps walk each sequence's chunks one after another, one program per (sequence,
# value head, value tile), and each walk is latency-bound. With few sequences x heads (one long
# sequence, a CP shard) the widest tile leaves most SMs idle: the tile is halved (down to
# MIN_DOT_DIM in the forward sweep, state.MIN_BACKWARD_SWEEP_TILE in the backward ones) while the
# grid would still fill at most half of SWEEP_MIN_PROGRAMS (narrow_for_occupancy). None means the
# GPU's SM count (no narrowing off CUDA); 0 turns it off. Narrower tiles re-read k and w (from L2)
# once more per tile. Read at call time: tests and benchmarks set it.
SWEEP_MIN_PROGRAMS: int | None = None
# Without per-channel gates, wy_backward also takes the gradients through Kdot and P (wy.py), as
# FLA's chunk_bwd_kernel_dqkwg consumes its ds: the fp32 [B, T, HV, BT] dKdot and dP are neither
# stored nor read back, and decayed_scores_backward (0.83 of 6.74 ms at GDN B1 T32768 H16 D128 on
# the H100) is not launched. Off: the two kernels, as KDA always runs them.
# HCCOMPILE_DELTA_RULE_FUSED_SCORES_BACKWARD=0 (read at import) turns it off; the attribute is read
# when the backward's launches are made (traced ones: when traced), so benchmarks time both in one
# process and tests set it.
FUSED_SCORES_BACKWARD = os.environ.get("HCCOMPILE_DELTA_RULE_FUSED_SCORES_BACKWARD", "1") != "0"
# Where wy_backward takes the score gradients itself (Plan.fused_scores_backward: no gate or a scalar
# one), the backward splits it in two kernels along FLA's dqkwg / prepare_wy_repr_bwd line (R1 of
# benchmarks/analysis/gdn_traffic_2026-11-26.md): dqkw.py (one pass over the value tiles: dq final,
# dk's score and end-state terms, dW) and wy_bwd.py (dA, dv, dbeta, dL = -A^T dA A^T and its terms),
# small tiles and few warps each instead of one program holding everything (wy.py). Off: wy.py's
# single kernel. HCCOMPILE_DELTA_RULE_SPLIT_WY_BACKWARD=0 (read at import) turns it off; the
# attribute is read when a Plan is made, so benchmarks time both in one process and tests set it.
SPLIT_WY_BACKWARD = os.environ.get("HCCOMPILE_DELTA_RULE_SPLIT_WY_BACKWARD", "1") != "0"
# Without per-channel gates the forward launches no decayed_scores kernel (R2 of
# benchmarks/analysis/gdn_traffic_2026-11-26.md): wy_solve forms the lower blocks of
# diag(beta) Kdot from the key tiles it loads anyway (wy.py), and the output kernel forms
# P = (Q K^T) o D as FLA's chunk_fwd_o does (output.py); neither matrix goes through memory. A forward
# that keeps its intermediates has the output kernel store P in the intermediates' dtype (every
# consumer rounds P to it before its products), and a backward that recomputes the forward runs the
# output kernel in a P-only mode. Kdot is then nowhere in memory: wy_bwd.py takes its terms from K, so
# this holds only with the split backward (SPLIT_WY_BACKWARD, FUSED_SCORES_BACKWARD). Off: decayed_scores
# writes Kdot and P (fp32), as it always does for per-channel gates and the single wy_backward.
# HCCOMPILE_DELTA_RULE_FUSED_SCORES_FORWARD=0 (read at import) turns it off; the attribute is read when
# a Plan is made (and by the op's fake for the kept layout), so benchmarks time both in one process.
FUSED_SCORES_FORWARD = os.environ.get("HCCOMPILE_DELTA_RULE_FUSED_SCORES_FORWARD", "1") != "0"
GATE_CODES = {"none": 0, "scalar": 1, "channel": 2}
# wy_solve reading decayed_scores' Kdot (per-channel gates, or FUSED_SCORES_FORWARD off): its diagonal
# [BC, BC] blocks of L loaded into registers once, before the substitution, whose steps then take their
# rows by a masked sum (as the FORM_KDOT path does), rather than one row load from memory per step on
# the substitution's chain (wy.py). On one H200 (session 45, tune_delta_rule.py, KDA fwd+bwd) the row
# loads took 4.493 against 4.443 ms at B4 T4096 H16 D128, 10.084 against 9.945 at B1 T32768. Read when
# a kernel is launched.
REGISTER_DIAGONAL_BLOCKS = True
# decayed_scores for per-channel gates with one program per chunk (scores_chunk.py), loading the chunk's
# key and gate tiles once for its sub-chunks, rather than one program per sub-chunk (scores.py). On one
# H200 (session 45, tune_delta_rule.py, KDA fwd+bwd): B4 T4096 H16 D128 4.321 against 4.443 ms, B1
# T32768 9.702 against 9.945. decayed_scores_backward likewise (scores.py's CHUNK_PROGRAM: a program
# takes its chunk's sub-chunks one after another): on one H200 (session 46,
# benchmarks/analysis/chunk_scores_backward.py, KDA fwd+bwd, at 4 warps) B1 T32768 9.189 against 9.386
# ms (the kernel 1.838 against 2.051), B4 T4096 4.066 against 4.170; at 8 warps, or with key tiles of
# 32, it was slower than one program per sub-chunk. Read when a kernel is launched.
CHUNK_SCORE_PROGRAMS = True
# KDA's backward state sweep reading Q e^G and K e^(G_last - G) formed chunk-parallel before it
# (decayed_keys.py) instead of forming them in every step of every value-tile program (an fp32 [BT, K]
# gate tile and 2 BT K exps a step, repeated by a head's eight 16-wide value tiles): sm_90, Triton 3.6,
# 140 registers for the sweep where the other takes 253. The same results bit for bit. On one H200
# (session 47, tune_delta_rule.py, KDA fwd+bwd) B1 T32768 H16 D128 8.991 against 9.624 ms (0.934x), B4
# T4096 4.133 against 4.319 (0.957x). HCCOMPILE_DELTA_RULE_PREPARED_CHANNEL_SWEEP=0 (read at import)
# turns it off; read when a backward launches.
PREPARED_CHANNEL_SWEEP = os.environ.get("HCCOMPILE_DELTA_RULE_PREPARED_CHANNEL_SWEEP", "1") == "1"
# The split backward's per-head key gradients (dqkw.py's complete dq, and the dk that wy_bwd.py
# completes from dqkw.py's partial sum; the partial itself: HALF_DK_PARTIAL) in the half inputs' dtype rather than fp32,
# as FLA stores them (R6a of benchmarks/analysis/gdn_traffic_2026-11-26.md): the l2norm backward
# reads half the bytes, and without the in-kernel l2norm they are written into the op's dq and dk
# themselves (no copy). Only without GVA (the value heads' sum stays fp32) and with the split
# backward. On one H200 (session 47, benchmarks/delta_rule.py, GDN fwd+bwd, two rounds) B1 T32768 H16
# D128 3.729 / 3.736 against 3.807 / 3.817 ms, B4 T4096 1.570 / 1.569 against 1.611 / 1.609; gradients
# 2.8e-3 (relative RMS) from the fp32 heads', FLA's 4.0e-3. HCCOMPILE_DELTA_RULE_HALF_KEY_GRADIENTS=0
# (read at import) turns it off; the attribute is read when a Plan is made.
HALF_KEY_GRADIENTS = os.environ.get("HCCOMPILE_DELTA_RULE_HALF_KEY_GRADIENTS", "1") == "1"
# The in-chunk inverse A = (I + L)^-1 that wy_solve writes and the backward reads, stored in the
# intermediates' dtype rather than fp32 (item 5 of benchmarks/analysis/gdn_traffic_2026-11-30_h200.md):
# where the split backward forms dL from A rounded to that dtype (wy_bwd.WY_BWD_HALF_DL), every reader
# rounds A before its products (wy_solve's reload for W and U~, wy_bwd's), so storing it rounded gives
# the same results bit for bit (a test compares both), half its bytes written and read, and half the
# memory a kept A holds (64 MB instead of 128 at B1 T32768 H16 per layer). Per-channel gates and the
# single wy_backward (wy.py) form dL from the fp32 A and keep it. HCCOMPILE_DELTA_RULE_HALF_INVERSE=0
# (read at import) turns it off; the attribute is read when a Plan is made (and by the op's fake).
HALF_INVERSE = os.environ.get("HCCOMPILE_DELTA_RULE_HALF_INVERSE", "1") == "1"
# A scalar gate's chunk-local sums formed by the kernels around them instead of two launches of
# gate_cumsum.py's kernel of their own (item 7 of benchmarks/analysis/gdn_traffic_2026-11-30_h200.md):
# the forward's G by wy_solve, its first reader where the forward forms Kdot itself
# (fused_scores_forward, no kept intermediates), and the backward's reverse sum of dG by wy_bwd.py,
# which completes dG (the split backward). Two launches fewer a GDN fwd+bwd (host-bound below B4
# T4096). HCCOMPILE_DELTA_RULE_FOLDED_GATE_SUMS=0 (read at import) turns it off; the attribute is
# read when the launches are made.
FOLDED_GATE_SUMS = os.environ.get("HCCOMPILE_DELTA_RULE_FOLDED_GATE_SUMS", "1") == "1"
# wy_solve in two launches, as FLA splits its solve from recompute_w_u (item 4 of
# benchmarks/analysis/gdn_traffic_2026-11-30_h200.md): the solve (A only) at wy_solve_options' warps,
# then W and U~ from the stored A (the kept-A path) at WY_FORM_WARPS, a memory-bound pass that the
# solve's 2 warps run latency-bound (wy_solve 0.466 ms at GDN B1 T32768 H16 D128 on one H200, FLA's
# three kernels 0.371). Off: on one H200 (session 50, diag_gdn-tune_…596b916.jsonl) GDN's fwd+bwd at B1
# T32768 H16 D128 took 0.998x / 0.995x / 0.995x the single launch's at 2 / 4 / 8 warps, for one launch more.
# HCCOMPILE_DELTA_RULE_SPLIT_WY_SOLVE=1 (read at import) turns it on; the attributes are read when the
# forward launches.
SPLIT_WY_SOLVE = os.environ.get("HCCOMPILE_DELTA_RULE_SPLIT_WY_SOLVE", "0") == "1"
# dk's partial sum, which dqkw.py writes and wy_bwd.py reads back and completes, stored in the half
# inputs' dtype rather than fp32 where the key gradients are (half_key_gradients): 2 of its 4 bytes a
# element each way (item 5 of benchmarks/analysis/gdn_traffic_2026-11-30_h200.md, 0.06 ms at the
# bandwidth floor at GDN B1 T32768 H16 D128), for one more rounding of the partial before the sum (FLA
# adds two bf16 dk's). On one H200 (session 50, tune_delta_rule.py, diag_gdn-tune_…46eb77c.jsonl): GDN
# fwd+bwd at B1 T32768 H16 D128 3.885 against 3.938 ms (0.986x); the gradients pass the float64 tests'
# tolerances either way (test_half_key_gradients_match_float64_recurrence).
# HCCOMPILE_DELTA_RULE_HALF_DK_PARTIAL=0 (read at import) turns it off; read when a Plan is made.
HALF_DK_PARTIAL = os.environ.get("HCCOMPILE_DELTA_RULE_HALF_DK_PARTIAL", "1") == "1"
# dU's local part, scale P^T dO, formed by a chunk-parallel kernel before the backward state sweep
# (local_du.py, FLA's dv_local) and read by the sweep in place of P and the product, which sit off the
# sweep's chain but add to every chunk step (benchmarks/analysis/sweep_step_work.py on one H200, GDN B1
# T32768 H16 D128: the sweep 0.675 ms reading the local part against 0.853 forming it; KDA 1.338 against
# 1.230, slower, so per-channel gates keep the product in the sweep). Timed on one H200 (session 51,
# tune_delta_rule.py, diag_local-du_…f2f9d4a.jsonl), GDN fwd+bwd: B1 T32768 H16 D128 3.803 against 3.870
# ms (0.983x; the sweep 0.670 ms and the new launch 0.106), B4 T4096 H16 D128 1.956 against 1.646
# (1.188x). B1's sweep is 128 programs (16 heads x 8 value tiles of 16), one wave of the H200's 132
# multiprocessors, so each step's latency is the sweep's time and taking work off the step pays; B4's
# is 256 (64 walks x 4 tiles of 32), two waves, where the GPU gains nothing (busy 1.529 against 1.494
# ms: the sweep 0.016 ms faster, the launch 0.051) and the host-bound eager step pays ~0.28 ms of wall
# for one more backward launch on autograd's device thread (diag_local-du-b4-profile_…6c96e5f.txt). So by
# default (None) it is on when the backward sweep's grid fits one wave (local_du_wanted). HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL=1 / 0 (read at
# import) forces it on / off; read when a backward launches.
_LOCAL_DU_SETTINGS = {"1": True, "0": False, "auto": None}
_local_du_env = os.environ.get("HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL", "auto")
if _local_du_env not in _LOCAL_DU_SETTINGS:
    raise ValueError(f"HCCOMPILE_DELTA_RULE_LOCAL_DU_KERNEL: expected one of 1, 0, auto, got {_local_du_env!r}")
LOCAL_DU_KERNEL: bool | None = _LOCAL_DU_SETTINGS[_local_du_env]
WY_FORM_WARPS = 4


def check_kernel_inputs(problem: DeltaRuleProblem, chunk_size, **named) -> None:
    """Checks beyond shapes: dtypes, devices, head-dim limits and the chunk size."""
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size!r}")
    for name, dim in (("q", problem.key_dim), ("v", problem.value_dim)):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {dim} exceeds the supported maximum {MAX_HEAD_DIM}")
    device = named["q"].device
    for name, tensor in named.items():
        if tensor is None:
            continue
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}: dtype {tensor.dtype} is not supported; expected one of float16, bfloat16, float32"
            )
        if name in ("k", "v") and tensor.dtype != named["q"].dtype:
            raise TypeError(f"{name}: dtype {tensor.dtype} differs from q's dtype {named['q'].dtype}")
        if tensor.device != device:
            raise ValueError(f"{name}: device {tensor.device} differs from q's device {device}")


def block_size(dim: int, limit: int = MAX_TILE) -> int:
    return min(max(MIN_DOT_DIM, next_power_of_2(dim)), limit)


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def narrow_for_occupancy(block_v: int, walks: int, value_dim: int, device: torch.device,
                         floor: int = MIN_DOT_DIM) -> int:
    """Halves a sweep's value tile, not below `floor`, while `walks` (sequences x value heads)
    times the tile count would fill at most half of SWEEP_MIN_PROGRAMS programs (see there)."""
    target = _multiprocessor_count(device) if SWEEP_MIN_PROGRAMS is None else SWEEP_MIN_PROGRAMS
    while block_v > floor and 2 * walks * cdiv(value_dim, block_v) <= target:
        block_v //= 2
    return block_v


def local_du_wanted(sweep_programs: int, device: torch.device) -> bool:
    """Whether the backward sweep reads dU's local part from local_du.py's launch (LOCAL_DU_KERNEL, or by
    default when the sweep's `sweep_programs` fit one wave of the device's multiprocessors)."""
    if LOCAL_DU_KERNEL is not None:
        return LOCAL_DU_KERNEL
    return sweep_programs <= _multiprocessor_count(device)


def intermediate_dtype_for(input_dtype: torch.dtype) -> torch.dtype:
    """Plan.intermediate_dtype for inputs of `input_dtype` (the ops' fakes ask it without a plan)."""
    if input_dtype == torch.float16 or (input_dtype == torch.bfloat16 and BF16_INTERMEDIATES):
        return input_dtype
    return torch.float32


def kept_state_rows(batch, time, chunk_size: int, num_sequences: int | None = None):
    """Rows of the chunk states h a forward keeps for its backward: one per chunk, for a
    variable-length batch (B = 1, num_sequences given) the bound cdiv(T, BT) + N, and at least 2.
    The ops' fakes compute it from shapes alone, and it is the same number whether the forward was
    traced (symbolic sizes) or not (_triton.kept_rows). Rows past the batch's chunk count are never
    written or read."""
    rows = batch * ((time + chunk_size - 1) // chunk_size)
    if num_sequences is not None:
        rows = rows + num_sequences
    return kept_rows(rows)


def fused_scores_forward_for(gate: str, switch: bool | None = None, split: bool | None = None) -> bool:
    """Plan.fused_scores_forward for a gate kind; `switch` and `split` None read FUSED_SCORES_FORWARD
    and SPLIT_WY_BACKWARD now (the ops' fakes ask it without a plan). Only with the split backward:
    wy.py's single wy_backward reads Kdot from memory (see Plan.fused_scores_forward)."""
    switch = FUSED_SCORES_FORWARD if switch is None else switch
    split = SPLIT_WY_BACKWARD if split is None else split
    return switch and split and FUSED_SCORES_BACKWARD and gate != "channel"


def inverse_dtype_for(gate: str, input_dtype: torch.dtype, split: bool | None = None,
                      half: bool | None = None) -> torch.dtype:
    """Plan.inverse_dtype for a gate kind and inputs of `input_dtype`; `split` and `half` None read
    SPLIT_WY_BACKWARD and HALF_INVERSE now (the ops' fakes ask it without a plan), as does
    wy_bwd.WY_BWD_HALF_DL (read at every call: its fp32 dL needs the fp32 A)."""
    from . import wy_bwd  # imports this module

    split = SPLIT_WY_BACKWARD if split is None else split
    half = HALF_INVERSE if half is None else half
    stored = intermediate_dtype_for(input_dtype)
    if (half and split and FUSED_SCORES_BACKWARD and gate != "channel" and wy_bwd.WY_BWD_HALF_DL
            and stored != torch.float32):
        return stored
    return torch.float32


def normed_qk_dtype_for(input_dtype: torch.dtype) -> torch.dtype:
    """Plan.normed_qk_dtype for inputs of `input_dtype`."""
    if input_dtype == torch.bfloat16 and intermediate_dtype_for(input_dtype) == torch.float32:
        return torch.float16
    return intermediate_dtype_for(input_dtype)


@dataclass
class Plan:
    """Launch geometry shared by the forward and backward launchers (chunk.py's and cp.py's)."""

    problem: DeltaRuleProblem
    chunk_size: int
    num_chunks: int  # over all sequences
    chunks_per_row: int  # NT, for fixed-length batches
    chunk_table: torch.Tensor | None  # [num_chunks, 2] (sequence, chunk) for varlen
    chunk_offsets: torch.Tensor | None  # [N] first global chunk of each sequence, for varlen
    cu_seqlens: torch.Tensor | None
    gate_code: int
    input_dtype: torch.dtype  # q's (and k's, v's)
    dummy: torch.Tensor  # stands in for absent optional tensors
    launch: Callable = direct  # wraps a kernel before its launch (see make_plan)
    # SPLIT_WY_BACKWARD when the plan was made (see split_wy_backward)
    split_wy_switch: bool = field(default_factory=lambda: SPLIT_WY_BACKWARD)
    # FUSED_SCORES_FORWARD when the plan was made (see fused_scores_forward)
    fused_forward_switch: bool = field(default_factory=lambda: FUSED_SCORES_FORWARD)
    # HALF_KEY_GRADIENTS when the plan was made (see half_key_gradients)
    half_key_switch: bool = field(default_factory=lambda: HALF_KEY_GRADIENTS)
    # HALF_INVERSE when the plan was made (see inverse_dtype)
    half_inverse_switch: bool = field(default_factory=lambda: HALF_INVERSE)
    # HALF_DK_PARTIAL when the plan was made (see dk_partial_dtype)
    half_dk_partial_switch: bool = field(default_factory=lambda: HALF_DK_PARTIAL)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def intermediate_dtype(self) -> torch.dtype:
        """dtype of the stored intermediates that feed the tensor-core products (l2normed q and
        k, W, U~, U, h, dh, dU), hence of those products' operands: fp16 for fp16 inputs, as FLA
        does; bf16 for bf16 inputs unless BF16_INTERMEDIATES is off (see there); fp32 otherwise.
        States, accumulators, gates and the scores stay fp32 either way; the in-chunk inverse
        takes inverse_dtype."""
        return intermediate_dtype_for(self.input_dtype)

    @property
    def normed_qk_dtype(self) -> torch.dtype:
        """dtype of the in-kernel l2-normed q and k: the intermediates', except fp16 for bf16
        inputs whose intermediates are fp32. A unit vector's elements need no more range than
        fp16's, and its 10 mantissa bits are as many as the tf32 products they feed keep; half
        the bytes of fp32 in every kernel that reads q or k, and the state sweeps then fit two
        software-pipelining stages (state.state_launch_options). Compiled for sm_90 (Triton 3.8, bf16
        with l2norm), state_backward's spills went from 320/400 to 96/232 bytes per thread at
        K = 128 (scalar/channel gates), state_forward's stay 0 with the second stage."""
        return normed_qk_dtype_for(self.input_dtype)

    @property
    def half_dots(self) -> bool:
        """Whether the products take half operands (the kernels without a stored intermediate to
        take the dtype from are told so)."""
        return self.intermediate_dtype != torch.float32

    @property
    def scores_half_dots(self) -> bool:
        """half_dots of the score kernels. With per-channel gates their factored diagonal blocks
        hold factors up to e^FACTOR_SPAN_LIMIT (scores.py), past fp16's range: fp16 intermediates take fp32
        (tf32) operands there, bf16 ones (fp32's range) stay half."""
        return self.half_dots and not (self.gate_code == GATE_CODES["channel"]
                                       and self.intermediate_dtype == torch.float16)

    @property
    def fused_scores_backward(self) -> bool:
        """Whether wy_backward takes decayed_scores_backward's work (FUSED_SCORES_BACKWARD; never
        with per-channel gates, whose decays take sub-chunk programs)."""
        return FUSED_SCORES_BACKWARD and self.gate_code != GATE_CODES["channel"]

    @property
    def split_wy_backward(self) -> bool:
        """Whether the backward runs dqkw.py's and wy_bwd.py's kernels instead of wy.py's
        wy_backward: SPLIT_WY_BACKWARD (as it was when the plan was made) on the fused-scores path
        (no gate or a scalar one, FUSED_SCORES_BACKWARD on); per-channel gates and the unfused
        path keep wy_backward."""
        return self.split_wy_switch and self.fused_scores_backward

    @property
    def half_key_gradients(self) -> bool:
        """Whether the backward's per-head dq and dk are in the input dtype (HALF_KEY_GRADIENTS, as
        it was when the plan was made): half inputs, no GVA, the split backward."""
        return (self.half_key_switch and self.split_wy_backward and self.problem.group_size == 1
                and self.input_dtype in (torch.float16, torch.bfloat16))

    @property
    def dk_partial_dtype(self) -> torch.dtype:
        """dtype of dk's per-head partial sum between dqkw.py and wy_bwd.py: the input dtype where the
        key gradients are half and HALF_DK_PARTIAL was on when the plan was made, else fp32."""
        return self.input_dtype if self.half_key_gradients and self.half_dk_partial_switch else torch.float32

    @property
    def fused_scores_forward(self) -> bool:
        """Whether the forward forms Kdot in wy_solve and P in the output kernel instead of launching
        decayed_scores (FUSED_SCORES_FORWARD, as it was when the plan was made; never with
        per-channel gates, whose decays take sub-chunk programs), only where the backward is split
        (split_wy_backward): wy_bwd.py takes L's terms from K, while wy.py's single wy_backward reads
        Kdot. Its variant taking them from K was wrong on the H100 (Triton 3.6, GDN B1 T32768 H16
        D128 bf16: gradients off by 0.22 relative RMS against the Kdot-reading kernels'; session 24),
        so it was removed; a backward given intermediates without Kdot whose plan takes the single
        kernel has decayed_scores form Kdot again (chunk.py)."""
        return fused_scores_forward_for(self.problem.gate, self.fused_forward_switch, self.split_wy_switch)

    @property
    def inverse_dtype(self) -> torch.dtype:
        """dtype of the stored in-chunk inverse A: the intermediates' where every reader rounds A to it
        before its products (HALF_INVERSE, as it was when the plan was made, with the split backward
        and wy_bwd.WY_BWD_HALF_DL), fp32 otherwise (see inverse_dtype_for)."""
        return inverse_dtype_for(self.problem.gate, self.input_dtype, self.split_wy_switch, self.half_inverse_switch)

    @property
    def scores_dtype(self) -> torch.dtype:
        """dtype of the stored P: the intermediates' where the output kernel stores it
        (fused_scores_forward), fp32 where decayed_scores does. Its readers round it to the
        intermediates' dtype for their products, so decayed_scores storing that dtype gives the same
        results (bitwise, KDA bf16 on the CPU interpreter), but on one H200 (session 45, KDA B1
        T32768 H16 D128) decayed_scores took 0.813 ms storing bf16 P against 0.669 storing fp32 (its
        [16, 64] row tiles stored from the products' registers), and the whole step gained nothing."""
        return self.intermediate_dtype if self.fused_scores_forward else torch.float32

    @property
    def dot_precision(self) -> str:
        """input_precision of the products with fp32 operands: exact for fp32 inputs (tf32, the GPU
        default, would cost about three digits), tf32 for half inputs."""
        return "ieee" if self.input_dtype == torch.float32 else "tf32"

    def score_gradients(self, fused: bool, batch, time, value_heads, empty: Callable):
        """wy_backward's dKdot and dP ([B, T, HV, BT] fp32, allocated by `empty(*shape)`) for
        decayed_scores_backward; the dummy for both when wy_backward takes their products itself
        (`fused`: fused_scores_backward, read once by the caller for all its launches)."""
        if fused:
            return self.dummy, self.dummy
        shape = (batch, time, value_heads, self.chunk_size)
        return empty(*shape), empty(*shape)

    def chunk_args(self):
        table = self.chunk_table if self.chunk_table is not None else self.dummy
        seqlens = self.cu_seqlens if self.cu_seqlens is not None else self.dummy
        return table, seqlens


@functools.lru_cache(maxsize=16)
def _dummy(device: torch.device) -> torch.Tensor:
    """Stands in for absent optional tensors; never read or written by the kernels. One per
    device instead of an allocation and a fill on every call."""
    return torch.zeros(2, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=64)
def _varlen_chunk_tables(lengths: tuple[int, ...], chunk_size: int, device: torch.device):
    """(chunk_table [chunks, 2] (sequence, chunk), chunk_offsets [N]) as int32 device tensors.
    Cached by the sequence lengths: a training loop that repeats its packing (or a benchmark)
    pays the host-to-device copies once. The kernels only read them."""
    counts = [cdiv(length, chunk_size) for length in lengths]
    pairs = [(seq, chunk) for seq, count in enumerate(counts) for chunk in range(count)]
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    chunk_table = torch.tensor(pairs or [(0, 0)], dtype=torch.int32, device=device)
    chunk_offsets = torch.tensor(offsets, dtype=torch.int32, device=device)
    return chunk_table, chunk_offsets


def make_plan(problem: DeltaRuleProblem, chunk_size: int, cu_seqlens, q: torch.Tensor,
              launch: Callable = direct, dummy: torch.Tensor | None = None) -> Plan:
    """`launch` wraps each kernel before its launch: `direct`, or torch's wrap_triton when the
    launches are traced for Inductor (lowering/_launch.py; fixed-length rows only). `dummy`: a
    float32 tensor of at least 2 elements for the absent optional tensors (default: a cached one)."""
    device = q.device
    chunk_table = chunk_offsets = None
    if cu_seqlens is not None:
        lengths = tuple(eos - bos for _, bos, eos in problem.sequences)
        chunk_table, chunk_offsets = _varlen_chunk_tables(lengths, chunk_size, device)
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
        num_chunks = sum(cdiv(length, chunk_size) for length in lengths)
    else:
        num_chunks = problem.batch * cdiv(problem.time, chunk_size)
    if dummy is None:
        # traced: a buffer of the graph's own (a cached tensor would be a fake one, kept)
        dummy = torch.empty(2, dtype=torch.float32, device=device) if launch is not direct else _dummy(device)
    return Plan(
        problem=problem,
        chunk_size=chunk_size,
        num_chunks=num_chunks,
        chunks_per_row=cdiv(problem.time, chunk_size),
        chunk_table=chunk_table,
        chunk_offsets=chunk_offsets,
        cu_seqlens=cu_seqlens,
        gate_code=GATE_CODES[problem.gate],
        input_dtype=q.dtype,
        dummy=dummy,
        launch=launch,
    )
