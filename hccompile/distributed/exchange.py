"""How the per-rank summaries travel and merge: all-gather + fold, all-gather + log-depth scan, ring.

An exchange sees one rank's run (kernels/delta_rule/cp.py: CPForward / CPBackward, or their
references) through four attributes: summaries_out ([out_slots, HV, K, V(+K)]: H | M of outgoing
segments), summaries_in ([in_slots, HV, K, V]: dH of incoming segments; None in the forward),
initial_states (it writes the merged S_in of incoming segments) and final_grads (backward: it adds
the merged dS_out of outgoing segments). start() begins the communication, finish() completes it
and merges; between the two the run does work that needs no remote state.

* AllGatherExchange: one asynchronous all-gather of every rank's summaries (forward and backward
  summaries in one buffer), then each rank folds its own chains: merge="fold" with the run's merge
  (the Triton kernel: one launch, chain length steps), merge="scan" by a log-depth tree of
  compositions (S_out = M S_in + H composes as (M2 M1, M2 H1 + H2); batched torch matmuls,
  ceil(log2 L) dependent steps instead of L, K^3 more work per step).
* RingExchange: point-to-point, in stream order: each outgoing segment's owner receives its S_in
  (if it has one), sends S_out = M S_in + H on; the backward runs the links in reverse with M^T.
  Bytes per hop are K V instead of the all-gather's W K (V + K), but the hops are sequential.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..compat import all_gather_single

__all__ = ["AllGatherExchange", "RingExchange", "all_gather_single", "merge_chains_scan", "new_exchange"]


def _skip(plan, run) -> bool:
    """No summary goes anywhere: every sequence is local to its rank (the same on every rank)."""
    return plan.out_slots == 0


class AllGatherExchange:
    def __init__(self, group, merge: str = "fold"):
        self.group, self.merge = group, merge
        self.work = None

    def start(self, run) -> None:
        plan = run.plan
        if _skip(plan, run):
            return
        parts = [run.summaries_out.reshape(-1)]
        if run.summaries_in is not None:
            parts.append(run.summaries_in.reshape(-1))
        self.send = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
        if plan.world_size == 1:  # zigzag on one rank: its own pieces follow each other
            self.gathered, self.work = self.send, None
            return
        self.gathered = self.send.new_empty(plan.world_size * self.send.numel())
        self.work = all_gather_single(self.gathered, self.send, group=self.group, async_op=True)

    def finish(self, run) -> None:
        plan = run.plan
        if _skip(plan, run):
            return
        if self.work is not None:
            self.work.wait()
        gathered = self.gathered.view(plan.world_size, -1)
        out_numel = run.summaries_out.numel()
        summaries_out = gathered[:, :out_numel].reshape(plan.world_size * plan.out_slots,
                                                        *run.summaries_out.shape[1:])
        summaries_in = None
        if run.summaries_in is not None:
            summaries_in = gathered[:, out_numel:].reshape(plan.world_size * plan.in_slots,
                                                           *run.summaries_in.shape[1:])
        merge = run.merge if self.merge == "fold" else merge_chains_scan
        merge(plan, "forward", summaries_out, None, run.initial_states, run.value_dim)
        if summaries_in is not None:
            merge(plan, "backward", summaries_out, summaries_in, run.final_grads, run.value_dim)


def merge_chains_scan(plan, direction: str, summaries_out: torch.Tensor, summaries_in: torch.Tensor | None,
                      out: torch.Tensor, value_dim: int) -> None:
    """cp.merge_chains by a log-depth reduction: chains padded with identities (I, 0) to a common
    length L, adjacent pairs composed level by level, all chains at once (batched matmuls)."""
    segments = [s for s in range(plan.num_segments)
                if (plan.incoming[s] if direction == "forward" else plan.outgoing[s])]
    if not segments:
        return
    dtype = out.dtype
    heads, key_dim = out.shape[1], out.shape[2]
    transitions = summaries_out[..., value_dim:].to(dtype)
    if direction == "forward":
        values = summaries_out[..., :value_dim].to(dtype)
        chains = [[(slot, slot) for slot in plan.fwd_chain[s]] for s in segments]
    else:
        values = summaries_in.to(dtype)
        transitions = transitions.transpose(-1, -2)
        chains = [list(plan.bwd_chain[s]) for s in segments]
    length = max(len(c) for c in chains)
    eye = torch.eye(key_dim, dtype=dtype, device=out.device).expand(heads, key_dim, key_dim)
    zero_m = torch.zeros(heads, key_dim, key_dim, dtype=dtype, device=out.device)
    zero_h = torch.zeros(heads, key_dim, value_dim, dtype=dtype, device=out.device)
    ms, hs = [], []
    for chain in chains:
        row_m, row_h = [], []
        for j, (h_slot, m_slot) in enumerate(chain):
            # The chain's first element starts the fold: its M is never applied.
            row_m.append(zero_m if j == 0 else transitions[m_slot])
            row_h.append(values[h_slot])
        row_m += [eye] * (length - len(chain))
        row_h += [zero_h] * (length - len(chain))
        ms.append(torch.stack(row_m))
        hs.append(torch.stack(row_h))
    m, h = torch.stack(ms), torch.stack(hs)  # [chains, L, HV, K, K], [chains, L, HV, K, V]
    while m.shape[1] > 1:
        if m.shape[1] % 2:
            m = torch.cat([m, eye.expand(m.shape[0], 1, *eye.shape)], dim=1)
            h = torch.cat([h, zero_h.expand(h.shape[0], 1, *zero_h.shape)], dim=1)
        first_m, first_h, then_m, then_h = m[:, 0::2], h[:, 0::2], m[:, 1::2], h[:, 1::2]
        m, h = then_m @ first_m, then_m @ first_h + then_h
    index = torch.tensor(segments)
    index = index.pin_memory().to(out.device, non_blocking=True) if out.is_cuda else index
    if direction == "forward":
        out.index_copy_(0, index, h[:, 0])
    else:
        out.index_add_(0, index, h[:, 0])


class RingExchange:
    """Point-to-point in stream order (see the module docstring). Links between parts on the same
    rank (zigzag's middle rank) are local copies."""

    def __init__(self, group):
        self.group = group

    def start(self, run) -> None:
        pass

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def finish(self, run) -> None:
        plan = run.plan
        if _skip(plan, run):
            return
        value_dim = run.value_dim
        out = run.summaries_out
        dtype = run.initial_states.dtype
        pending = []

        def transition(segment):
            return out[plan.out_slot[segment], :, :, value_dim:].to(dtype)

        for sender, receiver, pairs in plan.links:
            if plan.rank == sender:
                states = []
                for earlier, _ in pairs:
                    state = out[plan.out_slot[earlier], :, :, :value_dim].to(dtype)
                    if plan.incoming[earlier]:
                        state = transition(earlier) @ run.initial_states[earlier] + state
                    states.append(state)
                message = torch.stack(states).contiguous()
                if receiver == sender:
                    for (_, later), state in zip(pairs, message):
                        run.initial_states[later] = state
                else:
                    pending.append((dist.isend(message, self._peer(receiver), group=self.group), message))
            elif plan.rank == receiver:
                message = run.initial_states.new_empty(len(pairs), *run.initial_states.shape[1:])
                dist.irecv(message, self._peer(sender), group=self.group).wait()
                for (_, later), state in zip(pairs, message):
                    run.initial_states[later] = state
        if run.summaries_in is not None:
            received = {}
            for sender, receiver, pairs in reversed(plan.links):
                # Gradients flow from the later part's owner (receiver above) to the earlier's.
                if plan.rank == receiver:
                    grads = []
                    for _, later in pairs:
                        grad = run.summaries_in[plan.in_slot[later]].to(dtype)
                        if plan.outgoing[later]:
                            grad = transition(later).transpose(-1, -2) @ received[later] + grad
                        grads.append(grad)
                    message = torch.stack(grads).contiguous()
                    if receiver == sender:
                        for (earlier, _), grad in zip(pairs, message):
                            received[earlier] = grad
                            run.final_grads[earlier] += grad
                    else:
                        pending.append((dist.isend(message, self._peer(sender), group=self.group), message))
                elif plan.rank == sender:
                    message = run.final_grads.new_empty(len(pairs), *run.final_grads.shape[1:])
                    dist.irecv(message, self._peer(receiver), group=self.group).wait()
                    for (earlier, _), grad in zip(pairs, message):
                        received[earlier] = grad
                        run.final_grads[earlier] += grad
        for work, _message in pending:  # the message stays referenced until its send completes
            work.wait()


def new_exchange(ctx):
    if ctx.strategy == "ring":
        return RingExchange(ctx.group)
    return AllGatherExchange(ctx.group, merge="scan" if ctx.strategy == "scan" else "fold")
