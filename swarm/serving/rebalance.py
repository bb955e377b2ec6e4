"""Rebalancing: a stage server moves to another stage when that raises the swarm's bottleneck enough.

The rule (pure: `plan_move`), read from the servers' records, claims capped as placement counts them:

- a server never leaves its stage without a serving server (JOINING or ONLINE; a pinned server, --stage K,
  counts, and is never the one that moves);
- the others of its own stage count at most what it measured itself (its own claim, which it knows is true):
  a stranger announcing a huge throughput there cannot make its stage look served enough to pull honest
  servers off it (elsewhere claims count capped, as placement counts them);
- it moves to the stage where the swarm's bottleneck (the least stage throughput) would be highest after
  the move, if that fills a stage nobody serves, or raises the bottleneck to at least MOVE_GAIN times what
  it is (Petals moves at ~1.33x; below that, moves cost more than they win);
- `Rebalancer` acts on a plan only when two consecutive checks, a random period apart (around the
  mean period), both name the same stage: one stale read, or one record that lies, does not move anyone,
  and servers that could move at once check at different moments. A stage nobody serves cannot wait two
  periods (the pipeline stops there): such a plan goes straight to the last check below, which reads the
  records again (a lie cannot make a stage look empty; a lookup that missed its records would have to
  miss them twice). A confirmed move is checked once more
  after a short random pause (`settle`), on records read then: two servers of one stage that confirmed
  together rarely also settle together, and the second sees the first leaving (OFFLINE) and stays. If both
  leave anyway, their stage is empty and the next checks of other servers fill it.
- A server that moves stores a JOINING record on the stage it goes to, with the throughput it measured where
  it was, before it goes OFFLINE (`StageServer.announce_move`): others count it there at once, not only
  once it is ONLINE there (a joiner's record says 0 until it has measured itself), and do not follow it
  to the same stage. bench/rebalance.py saw two servers of two other stages move to the slow stage together
  before this. The record is a claim like any other (anyone can store one), counted capped as claims are.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from swarm.dht import ServerRecord

from .placement import SERVING_STATES, counted_claims

EMPTY = "empty stage"  # a move's reason when it fills a stage nobody serves
MOVE_GAIN = 1.33  # the least gain in the swarm's bottleneck throughput a move must bring
AVOID_PERIODS = 10  # periods no move goes to a stage whose state a move there could not get
PERIOD_SPREAD = 0.5  # a check comes after the mean period times a uniform factor in [1 - spread, 1 + spread]
SETTLE_MAX = 10.0  # seconds, at most, between a confirmed move and its last check


@dataclass(frozen=True)
class Move:
    stage: int  # where to
    reason: str  # said in the log and the move counter's label: "empty stage" or "bottleneck"
    before: float  # the swarm's bottleneck throughput now
    after: float  # ... and after the move


def plan_move(servers: Mapping[int, Sequence[ServerRecord]], num_stages: int, me: str) -> Move | None:
    """Where the server `me` should move now, by the rule of the module docstring (None: stay)."""
    serving = {stage: [r for r in records if r.state in SERVING_STATES]
               for stage, records in servers.items() if 0 <= stage < num_stages}
    counted = counted_claims(serving)
    here = next((stage for stage, records in serving.items() if any(r.peer_id == me for r in records)), None)
    if here is None or len(serving[here]) < 2:
        return None
    mine = counted[me]
    for r in serving[here]:  # see the module docstring: what it leaves behind, it counts by its own measure
        counted[r.peer_id] = min(counted[r.peer_id], mine)
    totals = [sum(counted[r.peer_id] for r in serving.get(stage, ())) for stage in range(num_stages)]
    empty = sum(1 for stage in range(num_stages) if not serving.get(stage))
    best: tuple[float, int] | None = None
    for stage in range(num_stages):
        if stage == here:
            continue
        after = list(totals)
        after[here] -= mine
        after[stage] += mine
        if best is None or min(after) > best[0]:
            best = (min(after), stage)
    if best is None:
        return None
    before = min(totals)
    after_min, stage = best
    if empty and not serving.get(stage):
        return Move(stage, EMPTY, before, after_min)
    if before > 0 and after_min >= MOVE_GAIN * before:
        return Move(stage, "bottleneck", before, after_min)
    return None


class Rebalancer:
    """Checks, a random period apart, whether this server should move; a move only when two checks in a row
    name the same stage (see the module docstring)."""

    def __init__(self, period: float, rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic):
        self.period = period
        self._rng = rng or random.Random()
        self._clock = clock
        self._last: Move | None = None
        self._avoided: dict[int, float] = {}  # stage -> until when no move goes there

    def avoid(self, stage: int) -> None:
        """No move to `stage` for AVOID_PERIODS periods (a move there just failed: its state could not be had)."""
        self._avoided[stage] = self._clock() + AVOID_PERIODS * self.period
        self._last = None

    def next_wait(self) -> float:
        return self.period * self._rng.uniform(1 - PERIOD_SPREAD, 1 + PERIOD_SPREAD)

    def settle_wait(self) -> float:
        """The pause before a confirmed move's last check."""
        return self._rng.uniform(0, min(SETTLE_MAX, self.period / 2))

    def settle(self, move: Move, servers: Mapping[int, Sequence[ServerRecord]], num_stages: int, me: str) -> bool:
        """Whether `move` still holds on records read after settle_wait (the last check before leaving)."""
        plan = plan_move(servers, num_stages, me)
        return plan is not None and plan.stage == move.stage

    def check(self, servers: Mapping[int, Sequence[ServerRecord]], num_stages: int, me: str) -> Move | None:
        """The move to make now, if this check and the one before it both plan it."""
        plan = plan_move(servers, num_stages, me)
        if plan is not None and self._avoided.get(plan.stage, 0.0) > self._clock():
            plan = None
        if plan is not None and plan.reason == EMPTY:  # urgent: the settle check is the second read
            self._last = None
            return plan
        confirmed = plan is not None and self._last is not None and plan.stage == self._last.stage
        self._last = None if confirmed else plan
        return plan if confirmed else None
