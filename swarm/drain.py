"""A stage's step boundary kept clean: its batch waits for the backwards of forwards it already ran, and new
forwards wait for the step.

A stage that is not the last runs a micro-batch's forward, and its backward comes back one pipeline
trip later. When the stage's batch fills in between, that backward's samples would count towards the
step after, computed on the parameters of before the step: one step stale (weight stashing keeps the
gradient consistent, not fresh). Instead the server puts off closing the batch until the backwards of
the forwards it ran on the batch's parameters are back, waiting at most a little longer than its own
forwards' backwards take to come back (measured here), and counts them into the batch: the step takes
a few samples more than a batch, and none of them is stale. A forward ahead (run on the parameters the
next step is predicted to make) belongs to the batch after and is never waited for.

A forward (or the last stage's call) that comes while the stage's batch is closing (due, or its round under
way) waits for the step, at most `optimizer.step_wait_seconds` (wait_for_step): it then runs on the parameters
the step made instead of a prediction of them (look-ahead), and its samples are not late. On these two cores
it costs no samples/s at batch 16, where rounds are short (README, Learning).

Where rounds are long (thin links: a round at 20 Mbit/s takes about a second), a forward that comes while the
round runs waits on past `step_wait_seconds`, for as long as this server's rounds usually take (RoundTimes: the
median of its last rounds, a quarter more), at most `optimizer.round_wait_seconds`: while it waits, its
activations and their backward stay off the links the round needs (bench/wan.py at 20 Mbit/s: rounds at
1.34-1.36 x their bytes-over-rate bound with forwards running beside them, 1.22-1.27 x with forwards waiting, for
14-18% fewer samples/s), and its samples are fresh. A round that runs past what rounds usually take (stalled:
a member gone) is not waited out.

So does a forward that comes, in a stage with other servers, while this server's forwards in flight already
fill the batch (InFlight): its backward would come after the step, so it would run ahead, on the parameters the
step is predicted to make from this server's share of the batch. That share is often small, or none (the
moments alone), and such predictions were poor (gradients at a cosine of 0.68-0.90 with the true ones, early
in tiny.yaml at batch 16), as harmful as a step stale (bench/stage_lag.py). It waits for the step instead, at most
`optimizer.ahead_wait_seconds`. The forwards in flight it waits for are those of callers whose backwards come:
each backward that comes adds a point to its caller (up to `RETURN_CREDIT`), each forward whose backward never
came (dropped two steps on) takes `MISS_COST`, and a caller below zero is not counted. Honest trainers miss a
few (a reply a spot check did not use is retried elsewhere, its backward too); a caller holding back more than
a third of its forwards cannot make others wait for them.

Strangers: a caller's forwards whose backward never comes (gone elsewhere, or held back on purpose)
cost one wait of at most `max_seconds` per batch; a caller whose backwards missed a wait is not waited
for again until `PARDON_SECONDS` have passed, so a lone caller cannot slow every batch down. The round wait
is timed by this server's own rounds alone: a member that drags every round out (already slowing the stage's
steps as much) makes forwards wait at most `round_wait_seconds` a round, and one round it stalls moves the median
of nine not at all.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from typing import NamedTuple, Protocol

MAX_PENDING = 1024  # forwards remembered (the oldest forgotten first): a caller cannot grow this without bound
TRIPS_KEPT = 64  # forward-to-backward times the wait is measured from
MIN_TRIPS = 8  # before this many, a wait lasts max_seconds at most
TRIP_QUANTILE = 0.9
TRIP_FACTOR = 1.5  # a wait lasts this times the quantile (a trip through a loaded pipeline varies)
PARDON_SECONDS = 60.0
MAX_CALLERS = 4096  # callers remembered for missing a wait, or for their forwards' backwards (InFlight)
RETURN_CREDIT = 16  # InFlight: the most a caller's returned backwards stand for
MISS_COST = 2  # InFlight: what a forward whose backward never came costs its caller
STEP_POLL = 0.005  # how often a waiting forward looks whether its stage has stepped
ROUNDS_KEPT = 9  # RoundTimes: the last rounds whose median is what a round usually takes
MIN_ROUNDS = 3  # before this many, no round is waited out past step_wait_seconds
ROUND_MARGIN = 1.25  # a forward waits for a round to this times what rounds usually take


class InFlight:
    """This server's forwards whose backward is still to come, and how many samples they hold (see the module's
    docstring). Written on the compute thread; `samples` is read by forwards waiting on the event loop."""

    def __init__(self, limit: int = MAX_PENDING):
        self._forwards: collections.OrderedDict[Hashable, tuple[int, int, bool]] = collections.OrderedDict()
        self._credit: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # caller: its points
        self._limit = limit
        self.samples = 0  # of the forwards counted: their callers' backwards come

    def add(self, key: Hashable, n: int, step: int) -> int:
        """A forward of `n` samples at `step`; returns the samples counted in flight before it. Forwards of two
        steps before or more are dropped: their backward never came, which costs their callers."""
        for old in [k for k, (_, at, _) in self._forwards.items() if at < step - 1]:
            self._pop(old)
            self._add_credit(_caller(old), -MISS_COST)
        self._pop(key)  # (the same forward again counts once)
        before = self.samples
        counted = self._credit.get(_caller(key), 0) >= 0
        self._forwards[key] = (n, step, counted)
        self.samples += n if counted else 0
        while len(self._forwards) > self._limit:
            self._pop(next(iter(self._forwards)))
        return before

    def returned(self, key: Hashable) -> None:
        """Its backward came."""
        if key in self._forwards:
            self._pop(key)
            self._add_credit(_caller(key), 1)

    def _pop(self, key: Hashable) -> None:
        entry = self._forwards.pop(key, None)
        if entry is not None and entry[2]:
            self.samples -= entry[0]

    def _add_credit(self, caller: Hashable, points: int) -> None:
        self._credit[caller] = min(RETURN_CREDIT, self._credit.get(caller, 0) + points)
        self._credit.move_to_end(caller)
        while len(self._credit) > MAX_CALLERS:
            self._credit.popitem(last=False)


class Pending(NamedTuple):
    started: float  # monotonic
    step: int  # the stage's step when the forward ran
    look_ahead: bool  # on the look-ahead parameters of a round under way: the step after `step`'s


class BatchDrain:
    """Which of this server's forwards a due batch waits for, and for how long (one per stage backend; every method
    on its compute thread)."""

    def __init__(self, max_seconds: float, recheck: Callable[[], object], clock=time.monotonic):
        self.max_seconds = max_seconds
        self._recheck = recheck  # asks the compute thread to look at the batch again (once a wait ends)
        self._timer: threading.Timer | None = None
        self._clock = clock
        self._pending: collections.OrderedDict[Hashable, Pending] = collections.OrderedDict()
        self._trips: collections.deque[float] = collections.deque(maxlen=TRIPS_KEPT)
        self._awaited: set[Hashable] = set()
        self._deadline: float | None = None
        self._missed: collections.OrderedDict[Hashable, float] = collections.OrderedDict()  # caller: when
        self.waits = 0  # batches whose close was put off
        self.drained = 0  # backwards that came in time to count towards the batch they were waited for by
        self.timed_out = 0  # waits that ended with backwards still missing
        self.excused = 0  # forwards of the batch not waited for: their caller had missed a wait lately

    def forwarded(self, key: Hashable, step: int, look_ahead: bool) -> None:
        """A forward whose backward follows ran on the step's parameters (or on the look-ahead ones)."""
        self._pending[key] = Pending(self._clock(), step, look_ahead)
        self._pending.move_to_end(key)
        while len(self._pending) > MAX_PENDING:
            self._pending.popitem(last=False)

    def returned(self, key: Hashable) -> bool:
        """Its backward came: whether the batch due now waits for it (its samples count towards that batch)."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            self._trips.append(self._clock() - pending.started)
        if key in self._awaited:
            self._awaited.discard(key)
            self.drained += 1
            return True
        return False

    def limit(self) -> float:
        """The longest a due batch waits: TRIP_FACTOR x the TRIP_QUANTILE of the trips measured, at most max_seconds."""
        trip = _quantile(self._trips, TRIP_QUANTILE, MIN_TRIPS)
        return self.max_seconds if trip is None else min(self.max_seconds, TRIP_FACTOR * trip)

    def hold(self, step: int) -> float | None:
        """The batch of `step` (to be applied to the parameters of `step`) is due: None to close it now, else the
        seconds left to wait for the backwards of forwards that ran on its parameters."""
        now = self._clock()
        if self._deadline is None:
            limit = self.limit()
            belong = [key for key, p in self._pending.items() if self._belongs(p, step) and now - p.started < limit]
            self._awaited = {key for key in belong if not self._excused(key, now)}
            self.excused += len(belong) - len(self._awaited)
            if not self._awaited:
                return None
            self._deadline = now + limit
            self.waits += 1
        if self._awaited and now < self._deadline:
            left = self._deadline - now
            if self._timer is None or not self._timer.is_alive():  # nothing else may ask again when none comes
                self._timer = threading.Timer(left, self._recheck)
                self._timer.daemon = True
                self._timer.start()
            return left
        self.closed(now)
        return None

    def closed(self, now: float | None = None) -> None:
        """The batch closed (or the wait ended): callers still awaited missed it."""
        if self._awaited:
            self.timed_out += 1
            now = self._clock() if now is None else now
            for key in self._awaited:
                caller = _caller(key)
                self._missed[caller] = now
                self._missed.move_to_end(caller)
            while len(self._missed) > MAX_CALLERS:
                self._missed.popitem(last=False)
        self._awaited = set()
        self._deadline = None

    def summary(self) -> str:
        """What the waits did, for the log when the server stops."""
        return (f"{self.waits} batches waited, {self.drained} backwards came in time, {self.timed_out} waits ended "
                f"with some missing; {self.excused} forwards not waited for (their caller had missed a wait)")

    @staticmethod
    def _belongs(p: Pending, step: int) -> bool:
        # on the parameters of `step`: run at that step, or during the round that made it, on its look-ahead
        return p.step == step or (p.look_ahead and p.step == step - 1)

    def _excused(self, key: Hashable, now: float) -> bool:
        missed = self._missed.get(_caller(key))
        return missed is not None and now - missed < PARDON_SECONDS


def _caller(key: Hashable) -> Hashable:
    """Who sent a forward: servers key them (caller, request id)."""
    return key[0] if isinstance(key, tuple) and key else key


class RoundTimes:
    """How long this server's averaging rounds take, and how long the one under way has left by that (rounds run
    on the averaging thread; forwards read `left` on the event loop)."""

    def __init__(self, kept: int = ROUNDS_KEPT, clock: Callable[[], float] = time.monotonic):
        self._took: collections.deque[float] = collections.deque(maxlen=kept)
        self._started: float | None = None
        self._clock = clock
        self._lock = threading.Lock()

    def begin(self) -> None:
        self._started = self._clock()

    def end(self) -> None:
        started, self._started = self._started, None
        if started is not None:
            with self._lock:
                self._took.append(self._clock() - started)

    def usual(self) -> float | None:
        """The median of the last rounds (None: fewer than MIN_ROUNDS so far)."""
        with self._lock:
            took = list(self._took)
        return _quantile(took, 0.5, MIN_ROUNDS)

    def left(self) -> float | None:
        """Seconds until the round under way reaches ROUND_MARGIN x what rounds usually take (<= 0: past it);
        None while no round runs or too few have run."""
        started, usual = self._started, self.usual()
        if started is None or usual is None:
            return None
        return started + ROUND_MARGIN * usual - self._clock()


def _quantile(times: Iterable[float], q: float, at_least: int) -> float | None:
    """The `q` quantile of `times` (the value at that rank, none interpolated); None with fewer than `at_least`."""
    ordered = sorted(times)
    if len(ordered) < at_least:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Stepper(Protocol):
    def samples_to_step(self) -> int | None: ...


async def wait_for_step(stepper: _Stepper, limit: float, clock=time.monotonic, poll: float = STEP_POLL,
                        sleep=asyncio.sleep, in_flight: InFlight | None = None, ahead_limit: float = 0.0,
                        rounds: RoundTimes | None = None, round_limit: float = 0.0) -> bool:
    """Wait while the stage's batch is closing (no samples to go, or a round or a download under way), at most
    `limit` seconds, or while a round runs until it has taken what `rounds` usually take, at most `round_limit`
    seconds in all; and while the samples `in_flight` fill what the batch still needs (a forward now would count
    after the step), at most `ahead_limit` seconds in all. Whether it had to wait. (Its step is what a forward
    that comes now should run on.)"""
    started, waited, cap = clock(), False, limit
    while True:
        try:
            needed = stepper.samples_to_step()
        except Exception:  # noqa: BLE001 - a stepper shutting down: the request goes on and meets that
            return waited
        closing = needed is None or needed <= 0
        if not closing and in_flight is not None and in_flight.samples >= needed:
            cap = max(cap, ahead_limit)  # (once waiting for the step, also through its round)
        elif not closing:
            return waited
        left = rounds.left() if rounds is not None and round_limit > 0 else None
        if left is not None and left > 0:
            cap = max(cap, min(round_limit, clock() - started + left))
        if clock() - started >= cap:
            return waited
        waited = True
        await sleep(poll)
