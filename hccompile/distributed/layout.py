"""Where every token lives under context parallelism: pieces, parts, chains and exchange slots.

Everything here is plain Python on host integers (no tensors, no device syncs), computed identically
on every rank from global information, so each rank knows every other rank's slots without asking.

Vocabulary:

* The global token stream (varlen: the concatenation of all sequences; fixed length: each row) is cut
  into *pieces*, contiguous token ranges in stream order. ``contiguous``: one piece per rank, rank r
  holds piece r. ``zigzag``: 2W pieces, rank r holds pieces r and 2W-1-r (the layout ring attention
  uses for causal load balance; the recurrence itself costs the same per token anywhere, but a model
  whose softmax layers shard this way can keep one layout for every layer).
* A *part* is one sequence's tokens inside one piece. A rank's local tokens are its parts in order:
  varlen: its pieces in global order, sequences in order inside each; fixed length: row by row, each
  row its pieces in global order. Locally every part is one kernel sequence (a *segment*).
* A sequence's nonempty parts in stream order form its *chain*. A part with a predecessor is
  *incoming* (its initial state comes from other ranks); a part with a successor is *outgoing* (it
  sends its summary). *Middle* parts are both: only they need the transition matrix M.
* Exchange *slots*: each rank sends one summary per outgoing part (forward) and one per incoming part
  (backward). Buffers have the same size on every rank (the maximum), so a summary's place in the
  all-gathered buffer is ``rank * slots + local slot``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "LAYOUTS",
    "Part",
    "Piece",
    "SegmentPlan",
    "build_segment_plan",
    "even_sizes",
    "make_pieces",
    "sequence_parts",
]

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of the stream (varlen) or of every row (fixed length), held by `owner`."""

    index: int
    owner: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Part:
    """Tokens [start, end) of sequence `sequence` inside piece `piece` (positions as in Piece)."""

    sequence: int
    piece: int
    owner: int
    start: int
    end: int


def even_sizes(total: int, count: int) -> list[int]:
    """`count` sizes summing to `total`, the first `total % count` one token longer."""
    base, extra = divmod(total, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def make_pieces(total: int, world_size: int, layout: str = "contiguous", sizes=None) -> tuple[Piece, ...]:
    """The pieces of a stream of `total` tokens over `world_size` ranks.

    `sizes` (contiguous only) gives each rank's token count explicitly; by default the split is even,
    with the remainder on the first ranks (uneven splits are fine).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if world_size < 1:
        raise ValueError(f"world_size: must be at least 1, got {world_size}")
    count = world_size if layout == "contiguous" else 2 * world_size
    if sizes is not None:
        if layout != "contiguous":
            raise ValueError("sizes: only for layout='contiguous' (zigzag splits evenly into 2W pieces)")
        sizes = [int(s) for s in sizes]
        if len(sizes) != world_size or any(s < 0 for s in sizes) or sum(sizes) != total:
            raise ValueError(f"sizes: expected {world_size} non-negative token counts summing to {total}, "
                             f"got {sizes}")
    else:
        sizes = even_sizes(total, count)
    pieces, start = [], 0
    for index, size in enumerate(sizes):
        owner = index if index < world_size else 2 * world_size - 1 - index
        pieces.append(Piece(index, owner, start, start + size))
        start += size
    return tuple(pieces)


def _piece_of_position(pieces: tuple[Piece, ...], position: int) -> Piece:
    """The piece a zero-length sequence at `position` belongs to: the last one starting at or before it."""
    chosen = pieces[0]
    for piece in pieces:
        if piece.start <= position:
            chosen = piece
    return chosen


def sequence_parts(bounds: list[tuple[int, int]], pieces: tuple[Piece, ...]) -> list[list[Part]]:
    """Each sequence's parts in stream order; a zero-length sequence is one empty part."""
    chains = []
    for index, (bos, eos) in enumerate(bounds):
        if eos == bos:
            piece = _piece_of_position(pieces, bos)
            chains.append([Part(index, piece.index, piece.owner, bos, eos)])
            continue
        chain = []
        for piece in pieces:
            lo, hi = max(bos, piece.start), min(eos, piece.end)
            if lo < hi:
                chain.append(Part(index, piece.index, piece.owner, lo, hi))
        chains.append(chain)
    return chains


@dataclass
class SegmentPlan:
    """One rank's local segments and its share of the exchange (what the CP kernels consume).

    Per local segment s (kernel sequence s over the flattened local tokens):
      bounds[s]         (first, end) local token
      incoming[s]       it continues a sequence from other ranks: its initial state is merged
      outgoing[s]       its sequence continues on other ranks: it sends a forward summary
      out_slot[s]       local forward slot, -1 when not outgoing; in_slot[s] likewise (backward)
      initial_row[s]    the user's initial_state row it starts from (it begins its sequence), or -1
      fwd_chain[s]      incoming: flat forward slots of every earlier part, in order; the first is
                        the sequence's first part (its H includes the initial state, its M is unused)
      bwd_chain[s]      outgoing: (flat backward slot, flat forward slot) of every later part, from
                        the sequence's last part back to the next one; the forward slot names the
                        part's M (-1 for the last part, whose M is unused)
    Per user row i (a local sequence as the caller sees it: a cu_seqlens entry, or a batch row):
      final_segment[i]  the segment whose end state is the row's final state (-1: none)
    Also per segment: sequence[s] (its global sequence, or batch row) and ends_sequence[s] (it holds
    the sequence's last token).
    """

    rank: int
    world_size: int
    bounds: tuple[tuple[int, int], ...]
    incoming: tuple[bool, ...]
    outgoing: tuple[bool, ...]
    out_slot: tuple[int, ...]
    in_slot: tuple[int, ...]
    out_slots: int
    in_slots: int
    with_transition: bool
    user_rows: int
    initial_row: tuple[int, ...]
    final_segment: tuple[int, ...]
    fwd_chain: tuple[tuple[int, ...], ...]
    bwd_chain: tuple[tuple[tuple[int, int], ...], ...]
    sequence: tuple[int, ...]
    ends_sequence: tuple[int, ...]
    # Ring exchange: every link between consecutive parts, grouped by (piece of the earlier part,
    # piece of the later part) in stream order: (sender, receiver, ((sender segment, receiver segment), ...)).
    links: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]
    # Device tensors derived from the plan, cached by the kernels (keyed by what they depend on).
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_segments(self) -> int:
        return len(self.bounds)

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1][1] if self.bounds else 0

    @property
    def middle(self) -> tuple[bool, ...]:
        return tuple(a and b for a, b in zip(self.incoming, self.outgoing))

    def cu_seqlens(self) -> list[int]:
        return [0] + [end for _, end in self.bounds]


def build_segment_plan(chains: list[list[Part]], pieces: tuple[Piece, ...], rank: int, world_size: int,
                       rows: int | None = None) -> SegmentPlan:
    """The plan of `rank` from every sequence's chain.

    Varlen (`rows` None): every local part is its own user row. Fixed length (`rows` = B): chain b is
    row b, the local tokens are row-major (B rows of the rank's T_local tokens), user row = batch row.
    """
    # Local order of every rank's parts and their local token offsets.
    local: dict[int, list[Part]] = {r: [] for r in range(world_size)}
    if rows is None:
        by_piece: dict[int, list[Part]] = {}
        for chain in chains:
            for part in chain:
                by_piece.setdefault(part.piece, []).append(part)
        for piece in pieces:
            for part in sorted(by_piece.get(piece.index, []), key=lambda p: (p.start, p.sequence)):
                local[piece.owner].append(part)
    else:
        for chain in chains:  # chain b is row b, its parts in piece order
            for part in chain:
                local[part.owner].append(part)
    index_of = {id(part): i for parts in local.values() for i, part in enumerate(parts)}
    has_next = {id(part): j + 1 < len(chain) for chain in chains for j, part in enumerate(chain)}
    has_prev = {id(part): j > 0 for chain in chains for j, part in enumerate(chain)}
    local_out: dict[int, int] = {}
    local_in: dict[int, int] = {}
    out_slots = in_slots = 0
    for parts in local.values():
        outs = ins = 0
        for part in parts:
            if has_next[id(part)]:
                local_out[id(part)] = outs
                outs += 1
            if has_prev[id(part)]:
                local_in[id(part)] = ins
                ins += 1
        out_slots, in_slots = max(out_slots, outs), max(in_slots, ins)

    def flat_out(part: Part) -> int:
        return part.owner * out_slots + local_out[id(part)]

    def flat_in(part: Part) -> int:
        return part.owner * in_slots + local_in[id(part)]

    chain_of = {id(part): (chain, j) for chain in chains for j, part in enumerate(chain)}
    mine = local[rank]
    bounds, offset = [], 0
    for part in mine:
        size = part.end - part.start
        bounds.append((offset, offset + size))
        offset += size
    incoming, outgoing, out_slot, in_slot, initial_row, fwd_chain, bwd_chain = [], [], [], [], [], [], []
    user_row = list(range(len(mine))) if rows is None else [part.sequence for part in mine]
    for s, part in enumerate(mine):
        chain, j = chain_of[id(part)]
        incoming.append(j > 0)
        outgoing.append(j + 1 < len(chain))
        out_slot.append(local_out.get(id(part), -1))
        in_slot.append(local_in.get(id(part), -1))
        initial_row.append(user_row[s] if j == 0 else -1)
        fwd_chain.append(tuple(flat_out(p) for p in chain[:j]))
        later = chain[j + 1:]
        bwd_chain.append(tuple((flat_in(p), flat_out(p) if i > 0 else -1)
                               for i, p in enumerate(reversed(later))))
    user_rows = len(mine) if rows is None else rows
    final_segment = [-1] * user_rows
    for s in range(len(mine)):
        final_segment[user_row[s]] = s
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    owners: dict[tuple[int, int], tuple[int, int]] = {}
    for chain in chains:
        for earlier, later in zip(chain, chain[1:]):
            key = (earlier.piece, later.piece)
            groups.setdefault(key, []).append((index_of[id(earlier)], index_of[id(later)]))
            owners[key] = (earlier.owner, later.owner)
    links = tuple((owners[key][0], owners[key][1], tuple(groups[key])) for key in sorted(groups))
    with_transition = any(0 < j < len(chain) - 1 for chain in chains for j in range(len(chain)))
    return SegmentPlan(
        rank=rank, world_size=world_size, bounds=tuple(bounds), incoming=tuple(incoming),
        outgoing=tuple(outgoing), out_slot=tuple(out_slot), in_slot=tuple(in_slot), out_slots=out_slots,
        in_slots=in_slots, with_transition=with_transition, user_rows=user_rows, initial_row=tuple(initial_row),
        final_segment=tuple(final_segment), fwd_chain=tuple(fwd_chain), bwd_chain=tuple(bwd_chain),
        sequence=tuple(part.sequence for part in mine), ends_sequence=tuple(not flag for flag in outgoing),
        links=links,
    )
