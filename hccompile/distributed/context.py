"""The context-parallel (CP) context: who holds which tokens, built once on the host.

    ctx = build_cp_context(cu_seqlens, group=dist.group.WORLD)            # varlen, B = 1
    ctx = build_cp_context(seq_len=T, group=group, layout="zigzag")      # fixed-length rows, any B
    q_local = ctx.shard(q)                                               # the rank's tokens (dim 1)
    with hccompile.distributed.context_parallel(ctx):
        o, state = hccompile.chunk_gated_delta_rule(q_local, ..., cu_seqlens=ctx.cu_seqlens)

Everything is computed from host integers: the global cu_seqlens are read once (pass a CPU tensor
or a list to avoid even that device sync); the local cu_seqlens go to the device with a
non-blocking copy. Each rank computes every rank's plan identically, so no metadata is exchanged.
"""
from __future__ import annotations

from functools import cached_property

import torch
import torch.distributed as dist

from .exchange import all_gather_single
from .layout import LAYOUTS, SegmentPlan, build_segment_plan, make_pieces, sequence_parts

__all__ = ["CPContext", "STRATEGIES", "build_cp_context"]

STRATEGIES = ("all_gather", "scan", "ring")


def _host_ints(name: str, values) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(values.shape)}")
        if values.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name}: expected dtype int32 or int64, got {values.dtype}")
        values = values.tolist()  # a device sync if on GPU: pass a CPU tensor or a list
    return [int(x) for x in values]


class CPContext:
    """Context parallelism over a process group: the layout of tokens and the exchange strategy.

    Attributes (FLA's names where FLA has them):
      group, rank, world_size, layout ("contiguous" | "zigzag"), strategy ("all_gather" | "scan" | "ring")
      varlen            built from cu_seqlens (B = 1) rather than seq_len (fixed-length rows)
      pieces            every rank's token ranges (layout.Piece)
      cu_seqlens        varlen: this rank's local cu_seqlens on `device` (int32), else None
      cu_seqlens_cpu    the same on the host
      num_local_tokens  tokens per row on this rank (varlen: in total)
      is_first_rank / pre_num_ranks    of this rank's first local sequence: whether it starts there,
                                       and how many earlier ranks hold part of it
      is_last_rank / post_num_ranks    the same for the last local sequence, towards later ranks
    """

    def __init__(self, *, group, rank: int, world_size: int, layout: str, strategy: str, bounds=None,
                 seq_len: int | None = None, sizes=None, device=None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is outside the group of {world_size} ranks")
        self.group, self.rank, self.world_size = group, rank, world_size
        self.layout, self.strategy = layout, strategy
        self.varlen = bounds is not None
        total = bounds[-1][1] if self.varlen and bounds else (seq_len or 0)
        self.pieces = make_pieces(total, world_size, layout, sizes)
        if any(p.size == 0 for p in self.pieces):
            what = "tokens" if self.varlen else "seq_len"
            raise ValueError(f"{what}: {total} tokens cannot give every one of the {len(self.pieces)} pieces "
                             f"({world_size} ranks, layout {layout!r}) a token")
        self.total_tokens = total
        self.global_bounds = list(bounds) if self.varlen else None
        self.seq_len = None if self.varlen else total
        self.my_pieces = [p for p in self.pieces if p.owner == rank]
        self.num_local_tokens = sum(p.size for p in self.my_pieces)
        self.device = torch.device(device) if device is not None else None
        self._plans: dict[int, SegmentPlan] = {}
        if self.varlen:
            plan = self.plan(1)
            self.cu_seqlens_cpu = torch.tensor(plan.cu_seqlens(), dtype=torch.int32)
            if self.device is not None and self.device.type == "cuda":
                self.cu_seqlens = self.cu_seqlens_cpu.pin_memory().to(self.device, non_blocking=True)
            else:
                self.cu_seqlens = self.cu_seqlens_cpu.to(self.device or "cpu")
        else:
            self.cu_seqlens = self.cu_seqlens_cpu = None

    def __repr__(self) -> str:
        what = f"{len(self.global_bounds)} sequences" if self.varlen else f"rows of {self.seq_len}"
        return (f"CPContext(rank {self.rank}/{self.world_size}, {self.layout}, {self.strategy}, {what}, "
                f"{self.num_local_tokens} local tokens)")

    # -- plans

    def _chains(self, rows: int | None):
        if self.varlen:
            return sequence_parts(self.global_bounds, self.pieces)
        return sequence_parts([(0, self.seq_len)] * rows, self.pieces)

    def plan(self, batch: int = 1) -> SegmentPlan:
        """This rank's segment plan for `batch` rows (varlen: batch must be 1)."""
        if self.varlen and batch != 1:
            raise ValueError(f"q: a varlen CP context needs B == 1, got B={batch}")
        if batch not in self._plans:
            rows = None if self.varlen else batch
            self._plans[batch] = build_segment_plan(self._chains(rows), self.pieces, self.rank, self.world_size,
                                                    rows=rows)
        return self._plans[batch]

    def plans_of_all_ranks(self, batch: int = 1) -> list[SegmentPlan]:
        """Every rank's plan (for single-process simulation and tests)."""
        rows = None if self.varlen else batch
        chains = self._chains(rows)
        return [build_segment_plan(chains, self.pieces, r, self.world_size, rows=rows) for r in range(self.world_size)]

    # -- roles of the first and last local sequence

    @cached_property
    def _end_chains(self):
        chains = self._chains(None if self.varlen else 1)
        mine = [(chain, j) for chain in chains for j, part in enumerate(chain) if part.owner == self.rank]
        first = min(mine, key=lambda cj: (cj[0][cj[1]].piece, cj[0][cj[1]].start))
        last = max(mine, key=lambda cj: (cj[0][cj[1]].piece, cj[0][cj[1]].start))
        return first, last

    @property
    def pre_num_ranks(self) -> int:
        chain, j = self._end_chains[0]
        return len({p.owner for p in chain[:j]} - {self.rank})

    @property
    def post_num_ranks(self) -> int:
        chain, j = self._end_chains[1]
        return len({p.owner for p in chain[j + 1:]} - {self.rank})

    @property
    def is_first_rank(self) -> bool:
        chain, j = self._end_chains[0]
        return j == 0

    @property
    def is_last_rank(self) -> bool:
        chain, j = self._end_chains[1]
        return j == len(chain) - 1

    # -- moving tensors between the global and the local view

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a global tensor (token dim `dim`): its pieces in order."""
        if x.shape[dim] != self.total_tokens:
            raise ValueError(f"x: dim {dim} has {x.shape[dim]} tokens, the context {self.total_tokens}")
        return torch.cat([x.narrow(dim, p.start, p.size) for p in self.my_pieces], dim=dim)

    def unshard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The global tensor from every rank's local tokens (an all-gather; not differentiable)."""
        sizes = {r: sum(p.size for p in self.pieces if p.owner == r) for r in range(self.world_size)}
        longest = max(sizes.values())
        moved = x.movedim(dim, 0).contiguous()
        padded = moved.new_zeros(longest, *moved.shape[1:])
        padded[: moved.shape[0]] = moved
        gathered = padded.new_empty(self.world_size * longest, *moved.shape[1:])
        all_gather_single(gathered, padded, group=self.group)
        gathered = gathered.view(self.world_size, longest, *moved.shape[1:])
        offsets = {r: 0 for r in range(self.world_size)}
        parts = []
        for piece in self.pieces:
            parts.append(gathered[piece.owner, offsets[piece.owner]: offsets[piece.owner] + piece.size])
            offsets[piece.owner] += piece.size
        return torch.cat(parts).movedim(0, dim)

    def local_initial_state(self, initial_state: torch.Tensor) -> torch.Tensor:
        """The rows of a global initial_state [N, HV, K, V] that this rank's local sequences use
        (varlen: one row per local sequence; fixed length: the batch rows, unchanged). Rows of
        sequences that start on other ranks are passed along but not used. Differentiable."""
        if not self.varlen:
            return initial_state
        index = torch.tensor(self.plan(1).sequence, dtype=torch.int64).to(initial_state.device)
        return initial_state.index_select(0, index)

    def global_final_state(self, final_state: torch.Tensor) -> torch.Tensor:
        """Each global sequence's final state [N, HV, K, V] from every rank's local final states
        (the row of the rank holding the sequence's last token; an all-gather, not differentiable)."""
        rows = final_state.shape[0]
        plans = self.plans_of_all_ranks(1 if self.varlen else rows)
        longest = max(p.user_rows for p in plans)
        padded = final_state.new_zeros(longest, *final_state.shape[1:])
        padded[:rows] = final_state
        gathered = padded.new_empty(self.world_size * longest, *final_state.shape[1:])
        all_gather_single(gathered, padded, group=self.group)
        gathered = gathered.view(self.world_size, longest, *final_state.shape[1:])
        where = {}
        for owner, plan in enumerate(plans):
            for segment, sequence in enumerate(plan.sequence):
                if plan.ends_sequence[segment]:
                    where[sequence] = (owner, segment if self.varlen else sequence)
        return torch.stack([gathered[where[i]] for i in range(len(where))])


def build_cp_context(cu_seqlens=None, *, seq_len: int | None = None, group=None, layout: str = "contiguous",
                     strategy: str = "all_gather", sizes=None, device=None, rank: int | None = None,
                     world_size: int | None = None) -> CPContext:
    """A CP context over `group` (default: the world group).

    cu_seqlens: the global cumulative sequence lengths [N + 1] of a varlen batch (a list or a
        tensor; a CUDA tensor costs one device sync here, nowhere else). Sequences may cross any
        number of rank boundaries. Or
    seq_len: the length T of fixed-length rows [B, T] (any B, chosen per call).
    layout: "contiguous" (rank r holds the r-th slice of the tokens) or "zigzag" (2W slices, rank r
        holds slices r and 2W-1-r).
    strategy: how summaries travel: "all_gather" (one all-gather, each rank folds its predecessors),
        "scan" (the same all-gather, folded by a log-depth tree of compositions), "ring"
        (point-to-point, each state passed on in stream order: O(K V) bytes per hop, W-1 hops).
    sizes: contiguous only: each rank's token count (default: an even split, remainder first).
    device: where ctx.cu_seqlens goes (default: the current CUDA device for NCCL, else CPU).
    rank, world_size: override the group's (a context for a rank of a group that is not this
        process's; useful for planning and single-process tests, not for running collectives).
    """
    if (cu_seqlens is None) == (seq_len is None):
        raise ValueError("cu_seqlens: pass exactly one of cu_seqlens (varlen) and seq_len (fixed-length rows)")
    if rank is None or world_size is None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("group: torch.distributed is not initialised; call dist.init_process_group first "
                               "(or pass rank and world_size to plan without a group)")
        group = group if group is not None else dist.group.WORLD
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
        if device is None and dist.get_backend(group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
    bounds = None
    if cu_seqlens is not None:
        values = _host_ints("cu_seqlens", cu_seqlens)
        if len(values) < 2 or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"cu_seqlens: expected [0, ..., total] non-decreasing with at least 2 entries, "
                             f"got {values}")
        bounds = list(zip(values, values[1:]))
    elif int(seq_len) < 1:
        raise ValueError(f"seq_len: must be positive, got {seq_len}")
    return CPContext(group=group, rank=rank, world_size=world_size, layout=layout, strategy=strategy, bounds=bounds,
                     seq_len=None if seq_len is None else int(seq_len), sizes=sizes, device=device)
