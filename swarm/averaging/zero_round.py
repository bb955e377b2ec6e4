"""One member's side of a sharded round (averaging.zero), over the stage's Mailbox (swarm.averaging.collective).

1. reduce-scatter: every member with samples sends the gradient sum of each chunk to each of its
   owners that hold its moments (its primary and co-owners: r of them, one with r = 1); an owner counts
   a member's claimed samples for at most `max_samples` (4 of the stage's batches, as the all-reduce's
   reducers do: swarm.averaging.robust) and leaves out a member's chunk with a non-finite value;
2. every owner sends every member its sum of squares of each chunk it computes (the global norm,
   for clipping);
3. each owner steps the chunks it computes; each primary sends each chunk's update to every
   member, and the moments themselves to targets that do not hold them yet (churn); each co-owner
   sends every member a hash of its own update (and, to a target receiving the moments, of them);
4. every member cross-checks (swarm.averaging.crosscheck): a chunk whose owners disagree, on its
   sum of squares or its update, stays as it was before the round unless a strict majority of its
   owners (r >= 3) backs the primary's result; the dispute names the owners.

Bytes per member, of the gradient's size: (r + 1)(n - 1)/n (an all-reduce: 2(n - 1)/n), plus 8 bytes a
chunk per co-owner and member. A round is all-or-nothing for each member: it returns an update for
every chunk (zero for a chunk left as it was), or raises RoundFailed and nothing changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.averaging.collective import CHECK, GRAD, NORM, STATE, UPDATE, Hyper, Item, Key, Mailbox, RoundFailed, _Inbox
from swarm.averaging.crosscheck import (
    Dispute,
    chunk_square_sums,
    digest,
    dropped,
    moments_digest,
    out_of_bound,
    owners_of,
    settle_norms,
    settle_updates,
)
from swarm.zero import ChunkMoments, Plan, adam_chunks, clip_coefficient, moments_bounded, update_bound


@dataclass
class RoundResult:
    """What a sharded round gives a member: the update of every chunk and its moments after the step."""

    update: torch.Tensor | None  # flat; None when the step is skipped (a non-finite gradient norm)
    moments: dict[int, ChunkMoments]  # the chunks this member owns after the round
    grad_norm: float
    bytes_sent: int = 0
    transfers_in: int = 0  # chunks whose moments came from another member
    transfers_out: int = 0
    fresh: list[int] = field(default_factory=list)  # chunks nobody held: stepped from zero moments
    disputes: list[Dispute] = field(default_factory=list)  # chunks whose owners disagreed (crosscheck)
    dropped: list[int] = field(default_factory=list)  # chunks left as they were: update 0, moments kept
    refused_moments: list[int] = field(default_factory=list)  # moments sent here a co-owner or AdamW contradicts
    capped: list[str] = field(default_factory=list)  # members that claimed more samples than counted
    left_out: dict[str, int] = field(default_factory=dict)  # member: chunks of its gradient left out (non-finite)


def run_round(mailbox: Mailbox, round_key: str, plan: Plan, me: str, grad_sums: torch.Tensor,
              moments: Mapping[int, ChunkMoments], hyper: Hyper, deadline: float,
              max_samples: float = math.inf) -> RoundResult:
    """This member's part of one sharded round (on the averaging thread); RoundFailed if it cannot end whole.
    A member's claimed samples count for at most `max_samples`."""
    inbox = mailbox.open_round(round_key, plan.members)
    try:
        return _Round(mailbox, inbox, round_key, plan, me, deadline).run(grad_sums, moments, hyper, max_samples)
    finally:
        mailbox.close_round(round_key)


class _Round:
    """One member's side of one sharded round (see the module docstring for its four phases)."""

    def __init__(self, mailbox: Mailbox, inbox: _Inbox, round_key: str, plan: Plan, me: str, deadline: float):
        self.mailbox, self.inbox, self.round_key, self.plan, self.me = mailbox, inbox, round_key, plan, me
        self.layout, self.deadline, self.sent = mailbox.layout, deadline, 0
        self.chunks = range(self.layout.num_chunks)
        self.others = [m for m in plan.members if m != me]
        self.owners = [owners_of(plan, c) for c in self.chunks]
        # the chunks this member computes: as primary or co-owner (increasing: chunk-wise lists follow this order)
        self.computed = [c for c in self.chunks if me in self.owners[c]]

    def chunk_of(self, flat: torch.Tensor, c: int) -> torch.Tensor:
        start, end = self.layout.bounds(c)
        return flat[start:end]

    def send(self, items: list[Item]) -> None:
        self.sent += self.mailbox.send(self.round_key, items, self.deadline)

    def wait(self, keys: list[Key]) -> dict[Key, Any]:
        return self.inbox.wait(keys, self.deadline, self.mailbox.send_timeout)

    def run(self, grad_sums: torch.Tensor, moments: Mapping[int, ChunkMoments], hyper: Hyper,
            max_samples: float) -> RoundResult:
        plan, me, computed = self.plan, self.me, self.computed
        result = RoundResult(None, {}, math.nan, fresh=[c for c in computed if c not in moments])
        mean = self.reduce(grad_sums, max_samples, result)
        # 2. the global norm, from the chunks' sums of squares their owners agree on
        own_sums = chunk_square_sums(mean, [self.layout.chunk_numel(c) for c in computed])
        self.send([Item(peer, NORM, c, value=v) for c, v in zip(computed, own_sums) for peer in self.others])
        got = self.wait([(NORM, c, o) for c in self.chunks for o in self.owners[c] if o != me])
        sums = {(c, me): v for c, v in zip(computed, own_sums)}
        sums.update(((c, owner), value) for (_, c, owner), value in got.items())
        counted, disputes = settle_norms(plan, sums)
        result.grad_norm, scale = clip_coefficient(counted, hyper.grad_clip)
        if not math.isfinite(scale):  # every member sees the same norm: all skip this step
            result.moments, result.bytes_sent, result.disputes, result.fresh = dict(moments), self.sent, disputes, []
            return result
        # 3. every owner steps the chunks it computes
        if scale != 1.0:
            mean.mul_(scale)
        before = [moments[c] if c in moments else ChunkMoments.zeros(self.layout.chunk_numel(c)) for c in computed]
        stepped_list, updates = adam_chunks(before, list(mean.split([len(b.exp_avg) for b in before])),
                                            hyper.beta1, hyper.beta2, hyper.eps)
        stepped, update_of = dict(zip(computed, stepped_list)), dict(zip(computed, updates))
        own_digest = {c: digest(update_of[c]) for c in computed if len(self.owners[c]) > 1}
        got = self.exchange(stepped, update_of, own_digest, result)
        # 4. the cross-check
        theirs = [c for c in self.chunks if plan.primary[c] != me]
        update_of.update((c, got[(UPDATE, c, plan.primary[c])]) for c in theirs)
        digests = {}
        for c in self.chunks:
            if len(self.owners[c]) > 1:
                for o in self.owners[c]:
                    if o == me:
                        digests[(c, o)] = own_digest[c]
                    elif o == plan.primary[c]:
                        digests[(c, o)] = digest(update_of[c])
                    else:
                        digests[(c, o)] = got[(CHECK, c, o)][0]
        disputes += settle_updates(plan, digests)
        result.update = torch.cat([update_of[c] for c in self.chunks])
        if not math.isfinite(float(result.update.sum())):  # (a sum is finite if every element is, and cheap)
            raise RoundFailed("a non-finite update")
        disputes += out_of_bound(plan, result.update, self.layout, update_bound(hyper.beta1, hyper.beta2))
        result.disputes, result.dropped = disputes, dropped(disputes)
        for c in result.dropped:  # left as it was: no update, and its owners keep the moments they had
            self.chunk_of(result.update, c).zero_()
            stepped.pop(c, None)
            if c in moments:
                stepped[c] = moments[c]
        for c in [c for c in theirs if me in plan.receivers[c] and c not in result.dropped]:
            state = got[(STATE, c, plan.primary[c])]
            if moments_bounded(state, hyper.beta1, hyper.beta2) and \
                    all(got[(CHECK, c, q)][1] == moments_digest(state) for q in plan.co_owners[c]):
                stepped[c] = state
                result.transfers_in += 1
            else:
                result.refused_moments.append(c)
        result.moments = {c: stepped[c] for c in plan.owned_by(me) if c in stepped}
        result.bytes_sent = self.sent
        return result

    def reduce(self, grad_sums: torch.Tensor, max_samples: float, result: RoundResult) -> torch.Tensor:
        """1. reduce-scatter: gradient sums to every owner that computes the chunk; the mean of ours, each
        member's claim counted for at most `max_samples`, a member's chunk with a non-finite value left out
        (what was capped or left out goes into `result`). Every owner of a chunk gets the same bits."""
        plan, me = self.plan, self.me
        if plan.samples[me] > 0:
            self.send([Item(o, GRAD, c, (self.chunk_of(grad_sums, c),))
                       for c in self.chunks for o in self.owners[c] if o != me])
        senders = plan.senders()
        got = self.wait([(GRAD, c, s) for c in self.computed for s in senders if s != me])
        sizes = [self.layout.chunk_numel(c) for c in self.computed]
        counted = {s: min(plan.samples[s], max_samples) for s in senders}
        result.capped = [s for s in senders if counted[s] < plan.samples[s]]

        def part_of(sender: str, chunks: list[int]) -> torch.Tensor:
            """The sender's gradient sums of `chunks`, scaled down to the samples counted if it claimed more."""
            part = torch.cat([self.chunk_of(grad_sums, c) if sender == me else got[(GRAD, c, sender)] for c in chunks])
            return part.mul_(counted[sender] / plan.samples[sender]) if sender in result.capped else part

        mean = torch.zeros(sum(sizes))
        for sender in senders if self.computed else []:  # (in a fixed order: every owner adds the same numbers alike)
            mean += part_of(sender, self.computed)
        total = sum(counted.values())
        if bool(torch.isfinite(mean).all()):
            return mean.div_(total)
        # (rare) leave out each member's chunks with a non-finite value; a chunk nobody is left for stays
        # non-finite, and every member skips the step
        for c, piece in zip(self.computed, mean.split(sizes)):
            if bool(torch.isfinite(piece).all()):
                piece.div_(total)
                continue
            parts = {s: part_of(s, [c]) for s in senders}
            kept = [s for s in senders if bool(torch.isfinite(parts[s]).all())]
            for sender in senders:
                if sender not in kept:
                    result.left_out[sender] = result.left_out.get(sender, 0) + 1
            if kept and len(kept) < len(senders):
                piece.zero_()
                for sender in kept:
                    piece += parts[sender]
            piece.div_(sum(counted[s] for s in kept) if kept else total)
        return mean

    def exchange(self, stepped: dict[int, ChunkMoments], update_of: dict[int, torch.Tensor],
                 own_digest: dict[int, bytes], result: RoundResult) -> dict[Key, Any]:
        """3. each primary sends its chunks' updates (and moments to targets without them), each co-owner its
        digests; what came here from the others."""
        plan, me = self.plan, self.me
        outgoing = []
        for c in self.computed:
            if plan.primary[c] == me:
                outgoing += [Item(peer, UPDATE, c, (update_of[c],)) for peer in self.others]
                outgoing += [Item(peer, STATE, c, (stepped[c].exp_avg, stepped[c].exp_avg_sq), stepped[c].steps)
                             for peer in plan.receivers[c]]
                result.transfers_out += len(plan.receivers[c])
            else:
                sealed = moments_digest(stepped[c]) if plan.receivers[c] else b""
                outgoing += [Item(peer, CHECK, c, digest=own_digest[c] + (sealed if peer in plan.receivers[c] else b""))
                             for peer in self.others]
        self.send(outgoing)
        theirs = [c for c in self.chunks if plan.primary[c] != me]
        return self.wait([(UPDATE, c, plan.primary[c]) for c in theirs]
                         + [(CHECK, c, q) for c in self.chunks for q in plan.co_owners[c] if q != me]
                         + [(STATE, c, plan.primary[c]) for c in theirs if me in plan.receivers[c]])
