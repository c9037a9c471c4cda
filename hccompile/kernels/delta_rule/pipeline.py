"""Chunk counters between a state sweep and a chunk-parallel consumer that runs beside it (issue 20).

A sweep is a chain of dependent chunk steps that leaves most of each SM idle (GDN B1 T32768 H16:
state_forward 0.53 ms on 128 programs, one per SM), while its consumer waits for the whole sweep
although the consumer of chunk c needs only the states up to c. With plan.PIPELINED_OUTPUT the forward
sweep counts each chunk's state and corrected values done, and the output kernel's program for that
chunk waits for the count before it reads them; launched with programmatic dependent launch (Hopper:
the sweep lets its dependent kernel start at once, `gdc_launch_dependents`), the output kernel's
programs take the SM room the sweep leaves and follow it chunk by chunk.

Counters: one int32 per (chunk, value head, sweep value tile), zero before the sweep. The tile's program
adds one per thread once its stores for the chunk are issued, each thread's add with release semantics
at GPU scope, so that it orders that thread's own earlier stores; the chunk is ready when every tile's
counter has reached the sweep's thread count (SIGNAL_THREADS, from the sweep's launch options), read with
acquire semantics. No CTA barrier on the sweep's chain: one inside
its loop stops Triton's software pipelining of the sweep's loads (sm_90, Triton 3.6: 113 KiB of shared
memory, the pipelined buffers, became 22 KiB). A sweep program adds for a chunk at the top of its next
step (its stores of one step ago have drained by then, so the release costs little on the chain) and
for the last chunk after its final-state store, so that every write of the sweep precedes some add a
consumer waits for.

Deadlock freedom: a consumer waits only for sweep programs, every sweep program is running before any
consumer program can start (PDL starts the dependent kernel once every program of the sweep has
started and triggered; without PDL, after the sweep), and sweep programs wait for nothing.

Under Triton's interpreter programs run one after another, the sweep first: the counts are complete
before any consumer looks, and a consumer's wait reads at most MAX_SPINS times; a consumer whose count
is short then writes NaN, so the tests see a counter read from the wrong slot (and read the counters
themselves to see that every one is complete).
"""

from __future__ import annotations

from .._triton import tl, triton

if triton is not None:

    @triton.jit
    def _signal_chunk(flags_ptr, slot, tile, tiles, THREADS: tl.constexpr):
        """Adds THREADS (the program's thread count: one element per thread) to the counter of sweep value
        tile `tile` of `slot` (global chunk x value heads + head; `tiles` counters a slot), each thread's
        add releasing its own earlier stores."""
        ptrs = flags_ptr + (slot.to(tl.int64) * tiles + tile) + tl.zeros([THREADS], dtype=tl.int64)
        tl.atomic_add(ptrs, tl.full([THREADS], 1, dtype=tl.int32), sem="release", scope="gpu")

    @triton.jit
    def _chunk_count(flags_ptr, slot, tiles, threads, TILES: tl.constexpr):
        """How many of the `tiles` counters of `slot` have reached `threads` (TILES: a power of 2 >= tiles)."""
        tile = tl.arange(0, TILES)
        live = tile < tiles
        counts = tl.atomic_add(flags_ptr + slot.to(tl.int64) * tiles + tile, 0, mask=live, sem="acquire",
                               scope="gpu")
        return tl.sum((live & (counts >= threads)).to(tl.int32), axis=0)

    @triton.jit
    def _wait_chunk(flags_ptr, slot, tiles, threads, TILES: tl.constexpr, MAX_SPINS: tl.constexpr):
        """Returns once every one of the `tiles` counters of `slot` has reached `threads`, with whether they
        have. MAX_SPINS 0: no bound (a GPU), so always true; otherwise at most that many reads (the
        interpreter)."""
        done = _chunk_count(flags_ptr, slot, tiles, threads, TILES)
        if MAX_SPINS == 0:
            while done < tiles:
                done = _chunk_count(flags_ptr, slot, tiles, threads, TILES)
        else:
            spins = 1
            while (done < tiles) & (spins < MAX_SPINS):
                done = _chunk_count(flags_ptr, slot, tiles, threads, TILES)
                spins += 1
        # every thread's loads after the acquire
        tl.debug_barrier()
        return done >= tiles
