"""How many micro-batches a trainer keeps in flight: enough to cover the round trips it measures.

On loopback a micro-batch's trip through the pipeline is almost all compute, and the default count
(a sixteenth of a batch, at least one) keeps the stages busy when several trainers share them.
Across the internet each of its three calls (stage 0 forward, the last stage's forward and backward,
stage 0 backward, more with more stages) waits a round trip as well, and the stages sit idle unless
more micro-batches travel at once: the bandwidth-delay product of the pipeline. A fixed count tuned
on loopback pays the latency instead of hiding it.

InFlightWindow finds the count from the trips it measures, as TCP Vegas does for packets: the
shortest trip seen lately (`base`) is what a micro-batch takes with no queue anywhere; while the
trips of the last round stay within GROW_BELOW of it, adding one more micro-batch adds work the
stages had time for, so the window grows by one; once they exceed SHRINK_ABOVE of it, micro-batches
are queueing at some stage, and it shrinks by one. It never goes below `floor` (the loopback
default) nor above `cap` (a batch's worth: more would only make gradients staler). Pure logic: the
trainer feeds it trip times and asks it how many may travel.

At its cap, a window whose trips still leave the stages room is bounded by latency, not compute: each
message then waits round trips the samples in flight cannot cover. Part of that is the transport's:
a libp2p stream over TCP starts with yamux's 256 KiB window, so a message above it (tiny.yaml's float32
activations of 8 samples are 256 KiB and their headers) waits one more round trip for a window
update. So at its cap the window may split each micro-batch into pieces that travel at once, each a
message within the stream window (`max_split`: none where a micro-batch's message fits already); the
samples in flight stay a batch's worth, so staleness does not grow (measured: README, Across the
internet).
A split window that shrinks back to its floor joins the pieces again.

It is opt-in (`--in-flight auto`): on one machine, where the round trips are compute, the trips of
a 2 x 2 swarm with two trainers did not lengthen enough to stop it at one more micro-batch each, and
the extra staleness cost validation loss (bench/convergence.py, batch 16: 1.20 of the reference at
the end against 1.14). Telling network from compute in a trip (a ping of each stage's server) would
let it be the default; not done yet.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque

AUTO_IN_FLIGHT = "auto"  # `--in-flight auto`: the window below; a number fixes it, nothing keeps the default
GROW_BELOW = 1.3  # recent trips within this factor of the shortest: the stages have room for one more
SHRINK_ABOVE = 2.0  # beyond this factor: micro-batches queue somewhere, one fewer
BASE_WINDOW = 256  # trips the shortest is taken over (old minima expire: a route may have got slower)


class InFlightWindow:
    """The number of micro-batches allowed in flight, adjusted once a round from measured trip times."""

    def __init__(self, floor: int, cap: int, adaptive: bool = True, max_split: int = 1):
        if floor < 1 or cap < floor:
            raise ValueError(f"need 1 <= floor <= cap, got floor {floor}, cap {cap}")
        if max_split < 1 or max_split & (max_split - 1):
            raise ValueError(f"max_split must be a power of two, got {max_split}")
        self.floor, self.cap, self.adaptive, self.max_split = floor, cap, adaptive, max_split
        self.limit = floor
        self.split = 1  # pieces each micro-batch travels in, at once
        self.active = 0
        self._trips: deque[float] = deque(maxlen=BASE_WINDOW)
        self._round: list[float] = []
        self._changed: asyncio.Condition | None = None  # made in the trainer's loop, on first use

    @property
    def base(self) -> float | None:
        return min(self._trips) if self._trips else None

    def record(self, seconds: float) -> None:
        """One micro-batch's whole trip (forward and backward through every stage) took `seconds`."""
        if not self.adaptive or not seconds > 0:
            return
        self._trips.append(seconds)
        self._round.append(seconds)
        if len(self._round) < 2 * self.limit:  # a round: every micro-batch in flight completed twice
            return
        recent = statistics.median(self._round)
        self._round.clear()
        base = self.base
        if recent <= GROW_BELOW * base and self.limit < self.cap:
            self.limit += 1
        elif recent <= GROW_BELOW * base and self.split < self.max_split:  # at the cap, latency-bound
            self._resplit(2 * self.split)
        elif recent >= SHRINK_ABOVE * base and self.limit > self.floor:
            self.limit -= 1
            if self.limit == self.floor and self.split > 1:  # queueing, not latency, bounds it now
                self._resplit(self.split // 2)

    def _resplit(self, split: int) -> None:
        self.split = split
        self._trips.clear()  # a piece's trip is not a whole micro-batch's: the shortest is measured anew

    async def acquire(self) -> None:
        """Wait until one more micro-batch may start (the trainer's workers call it before each)."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            await self._changed.wait_for(lambda: self.active < self.limit)
            self.active += 1

    async def release(self, seconds: float | None = None) -> None:
        """A micro-batch ended (its trip time if it completed); wakes a worker if the window allows."""
        if seconds is not None:
            self.record(seconds)
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            self.active -= 1
            self._changed.notify_all()
