"""Rebalancing: a stage server moves to another stage when that raises the swarm's bottleneck enough.

The rule (pure: `plan_move`), read from the servers' records, claims capped as placement counts them:

- a server never leaves its stage without a serving server (JOINING or ONLINE; a pinned server, --stage K,
  counts, and is never the one that moves);
- the others of its own stage count at most what it measured itself (its own claim, which it knows is true):
  a stranger announcing a huge throughput there cannot make its stage look served enough to pull honest
  servers off it (elsewhere claims count capped, as placement counts them). Unless trainers say more:
  each trainer publishes the work each server answered it lately (`served`, swarm.routing.balancer), and
  when at least MIN_WITNESSES trainers that used this stage say how a stage-mate's work compares with this
  server's, a mate that served more counts at this server's throughput times the lower median of those
  ratios (never above its capped claim). Work counts only if it was answered and used (spot-checked now and
  then), so it is measured, not claimed; a lone lying trainer can only lower a ratio (a lower median of two
  or more). A ratio below 1 lowers nothing: on a stage with room to spare trainers give the fastest idle
  server nearly everything, and two equal servers came out 50x apart (bench/rebalance.py), so served work
  says who is faster, not by how much less the other is. Without this, a slow server never left a stage
  whose other servers were faster, and the best placement can need exactly that (bench/rebalance.py);
- it moves to the stage where the swarm's bottleneck (the least stage throughput) would be highest after
  the move, if that fills a stage nobody serves, or raises the bottleneck to at least MOVE_GAIN times what
  it is (below that, moves cost more than they win; Petals moves at ~1.33x of a fully rebalanced swarm,
  but one move at a time can need exactly 1.33x: two slow and one fast server on one stage, one fast on
  the next, 5 | 3, move a slow one: 4 | 4);
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

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from swarm.dht import PeerMetricsRecord, ServerRecord

from .placement import SERVING_STATES, counted_claims

EMPTY = "empty stage"  # a move's reason when it fills a stage nobody serves
MOVE_GAIN = 1.2  # the least gain in the swarm's bottleneck throughput a move must bring
MIN_WITNESSES = 2  # trainers whose served work must speak for a stage-mate before it counts above this server
AVOID_PERIODS = 10  # periods no move goes to a stage whose state a move there could not get
PERIOD_SPREAD = 0.5  # a check comes after the mean period times a uniform factor in [1 - spread, 1 + spread]
SETTLE_MAX = 10.0  # seconds, at most, between a confirmed move and its last check


@dataclass(frozen=True)
class Move:
    stage: int  # where to
    reason: str  # said in the log and the move counter's label: "empty stage" or "bottleneck"
    before: float  # the swarm's bottleneck throughput now
    after: float  # ... and after the move
    scale: float = 1.0  # set as the server leaves: its announced over its measured-now throughput (ServerOptions)


Served = Sequence[Mapping[str, float]]  # per trainer: server peer id -> work it answered lately, of one stage


def served_on(trainers: Sequence[PeerMetricsRecord], stage: int) -> list[dict[str, float]]:
    """Per trainer that lists any work on `stage`, the work each server of that stage answered it lately."""
    found = []
    for record in trainers:
        work = {s.peer_id: s.work for s in record.served or () if s.stage == stage and s.work > 0}
        if work and record.role == "trainer":
            found.append(work)
    return found


def witnessed(mate: str, me: str, served: Served) -> float | None:
    """How many times this server's throughput the trainers' served work puts `mate` at (the lower median over
    trainers that got work from either; inf where one got work from the mate only), or None if fewer than
    MIN_WITNESSES trainers can say."""
    ratios = []
    for work in served:
        mine, theirs = work.get(me, 0.0), work.get(mate, 0.0)
        if mine > 0:
            ratios.append(theirs / mine)
        elif theirs > 0:
            ratios.append(math.inf)
    if len(ratios) < MIN_WITNESSES:
        return None
    return sorted(ratios)[(len(ratios) - 1) // 2]


def plan_move(servers: Mapping[int, Sequence[ServerRecord]], num_stages: int, me: str,
              served: Served = (), view: dict | None = None) -> Move | None:
    """Where the server `me` should move now, by the rule of the module docstring (None: stay). `served`: what
    trainers got answered lately by the servers of `me`'s stage (served_on). A `view` dict is filled with what
    the plan was made of (describe() says it in a line)."""
    serving = {stage: [r for r in records if r.state in SERVING_STATES]
               for stage, records in servers.items() if 0 <= stage < num_stages}
    counted = counted_claims(serving)
    here = next((stage for stage, records in serving.items() if any(r.peer_id == me for r in records)), None)
    if here is None or len(serving[here]) < 2:
        return None
    mine = counted[me]
    for r in serving[here]:  # see the module docstring: what it leaves behind, it counts by its own measure,
        if r.peer_id == me:  # or by several trainers' word
            continue
        ratio = witnessed(r.peer_id, me, served)
        if ratio is None or ratio <= 1.0:
            counted[r.peer_id] = min(counted[r.peer_id], mine)
        elif not math.isinf(ratio):
            counted[r.peer_id] = min(counted[r.peer_id], mine * ratio)
        if view is not None:
            view.setdefault("mates", {})[r.peer_id] = (counted[r.peer_id], ratio)
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
    if view is not None:
        view.update(here=here, mine=mine, totals=totals, best=(stage, after_min), witnesses=len(served))
    if empty and not serving.get(stage):
        return Move(stage, EMPTY, before, after_min)
    if before > 0 and after_min >= MOVE_GAIN * before:
        return Move(stage, "bottleneck", before, after_min)
    return None


def describe(view: Mapping) -> str:
    """A plan's view (plan_move's `view`) in one line, for the log."""
    if "totals" not in view:
        return "nothing to plan (alone on its stage, or not serving)"
    mates = ", ".join(f"{peer[-6:]} {counted:.1f}" + (" (capped at its own)" if ratio is None else f" (x{ratio:.2f})")
                      for peer, (counted, ratio) in sorted(view.get("mates", {}).items()))
    stage, after = view["best"]
    totals = " | ".join(f"{t:.1f}" for t in view["totals"])
    return (f"stages at {totals} samples/s (this one {view['mine']:.1f} on stage {view['here']}; its stage-mates "
            f"counted {mates}, by {view['witnesses']} trainers' work); the best move, to stage {stage}, makes the "
            f"bottleneck {after:.1f} from {min(view['totals']):.1f}")


class Rebalancer:
    """Checks, a random period apart, whether this server should move; a move only when two checks in a row
    name the same stage (see the module docstring)."""

    def __init__(self, period: float, rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic):
        self.period = period
        self._rng = rng or random.Random()
        self._clock = clock
        self._last: Move | None = None
        self.view: dict = {}  # what the last check's plan was made of (describe)
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

    def settle(self, move: Move, servers: Mapping[int, Sequence[ServerRecord]], num_stages: int, me: str,
               served: Served = ()) -> bool:
        """Whether `move` still holds on records read after settle_wait (the last check before leaving)."""
        plan = plan_move(servers, num_stages, me, served)
        return plan is not None and plan.stage == move.stage

    def check(self, servers: Mapping[int, Sequence[ServerRecord]], num_stages: int, me: str,
              served: Served = ()) -> Move | None:
        """The move to make now, if this check and the one before it both plan it."""
        self.view = {}
        plan = plan_move(servers, num_stages, me, served, self.view)
        if plan is not None and self._avoided.get(plan.stage, 0.0) > self._clock():
            plan = None
        if plan is not None and plan.reason == EMPTY:  # urgent: the settle check is the second read
            self._last = None
            return plan
        confirmed = plan is not None and self._last is not None and plan.stage == self._last.stage
        self._last = None if confirmed else plan
        return plan if confirmed else None
