"""One worker thread that runs tasks in order, at most `max_queue` of them queued, how busy it was, and how long a
task given now should wait to start: what a stage backend (swarm.backend) and an expert host (swarm.experts)
share."""

from __future__ import annotations

import functools
import math
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from swarm.protocol.messages import BACKWARD, FORWARD
from swarm.threads import Owner

T = TypeVar("T")
UTILIZATION_WINDOW = 30.0  # seconds over which utilization() is measured
UTILIZATION_MARK_PERIOD = 1.0
TASK_SECONDS_ALPHA = 0.2  # weight of the newest task in the worker's mean task time (expected_wait)
# Refusing by time with no limit set (auto_max_wait): a server refuses a caller that has another server to go to
# while more than this many forwards of its stage's median server are queued ahead of the call (bench/sim, 1,000
# peers, 5 minutes: trips 83.30 s at 0.3, 84.15 at 0.5, against 82.78 with one limit of 1.0 s for every server)...
AUTO_WAIT_FORWARDS = 0.3
AUTO_WAIT_FLOOR = 0.5  # ...and never below this many seconds: a refusal costs the caller a round trip and a brief ban
# ...and only in a stage of at least this many servers: in one of two, a refusal bans the server refusing for that
# trainer and leaves the stage to one (bench/rebalance.py, 2 a stage, 9x slower servers among them: 33.8 samples/s
# refusing, 42.4 not)
AUTO_WAIT_MIN_SERVERS = 3


class Overloaded(RuntimeError):
    """The stage's task queue is full; the caller should try another server or later."""


OTHER_TASK = "other"  # the kind of a task submitted without one (state reads, steps, cache upkeep)


def wait_ahead(waiting: Mapping[str, int], means: Mapping[str, float], running: tuple[str, float] | None) -> float:
    """Seconds a task given now should wait before it starts: the tasks `waiting` (not started, by kind) at their
    kind's mean time (`means`; a kind not timed yet at the longest mean known), and what the `running` one (its
    kind, seconds it has run) has left of its kind's mean. 0 while no mean is known: nothing to go by."""
    if not means:
        return 0.0
    longest = max(means.values())
    ahead = sum(n * means.get(kind, longest) for kind, n in waiting.items())
    if running is not None:
        kind, ran = running
        ahead += max(0.0, means.get(kind, longest) - ran)
    return ahead


def seed_means(pair_seconds: float, last: bool) -> dict[str, float]:
    """A stage's mean task times before any request was timed, from its start-up measure (a forward and backward
    of a micro-batch took `pair_seconds`): a forward a third of it, a backward the rest (the whole of it on the
    last stage, whose one call does both)."""
    return {FORWARD: pair_seconds / 3, BACKWARD: pair_seconds if last else 2 * pair_seconds / 3}


def auto_max_wait(forward_seconds: float | None, own_throughput: float, stage_throughputs: Iterable[float]
                  ) -> float | None:
    """The wait past which a stage server refuses a caller that could go elsewhere, when the run sets no max_wait:
    AUTO_WAIT_FORWARDS forwards of the stage's median server (this server's mean forward, `forward_seconds`,
    scaled by its throughput over the median of the stage's announced `stage_throughputs`, its own among them),
    at least AUTO_WAIT_FLOOR. A fast server then turns callers away before a short queue that a slow one would
    still take: the bench/sim found one wait in seconds for every server (--max-wait 1.0) put trainers' trips at
    1.08 of an oracle's routing at 1,000 peers, and none at 1.27; the median is of claims, which a minority of
    liars does not move. None (no refusing by time) until the server has a forward time and a throughput, and
    while its stage has fewer than AUTO_WAIT_MIN_SERVERS (claims, its own among them)."""
    claims = [t for t in stage_throughputs if math.isfinite(t) and t > 0]
    if forward_seconds is None or not (math.isfinite(own_throughput) and own_throughput > 0) or \
            len(claims) < AUTO_WAIT_MIN_SERVERS:
        return None
    return max(AUTO_WAIT_FLOOR, AUTO_WAIT_FORWARDS * forward_seconds * own_throughput / statistics.median(claims))


class Worker:
    """One worker thread that runs tasks in order, at most `max_queue` of them queued (more are refused
    at once with Overloaded), how busy it was, and how long a task given now should wait to start
    (`expected_wait`, from each kind's mean task time): what a stage backend and an expert host share.

    `slowdown` (fault injection, `swarm-peer --inject-slowdown`): each task holds the thread that many
    times as long as it computed, as on hardware that much slower; unlike `--inject-delay`, which delays
    each request but lets requests overlap, this takes throughput away.
    """

    def __init__(self, name: str, max_queue: int, slowdown: float = 1.0):
        if not (math.isfinite(slowdown) and slowdown >= 1.0):
            raise ValueError(f"slowdown must be a finite factor >= 1, got {slowdown}")
        self.name = name
        self.max_queue = max_queue
        self.slowdown = slowdown
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name.replace(" ", ""))
        self._lock = threading.Lock()
        self._queued = 0
        self.busy_seconds = 0.0  # compute time spent, for throughput estimates
        # kind -> mean seconds its tasks held the worker (TASK_SECONDS_ALPHA), once one ran (or seeded: seed_means)
        self.task_seconds: dict[str, float] = {}
        self._waiting: Counter[str] = Counter()  # tasks submitted and not started, by kind
        self._running: tuple[str, float] | None = None  # (kind, perf_counter when it started) of the task running
        self.cpu_seconds = 0.0  # CPU time the worker thread spent on tasks (torch's own threads not counted)
        self._busy_marks: deque[tuple[float, float]] = deque([(time.monotonic(), 0.0)])  # (when, busy_seconds)

    @property
    def queue_depth(self) -> int:
        return self._queued

    def submit(self, fn: Callable[..., T], *args: Any, kind: str = OTHER_TASK) -> Future[T]:
        """Queue `fn(*args)` on the worker thread, or raise Overloaded if the queue is full; `kind` (a request's:
        forward, backward) keeps a mean time of its own (expected_wait)."""
        with self._lock:
            if self._queued >= self.max_queue:
                raise Overloaded(f"{self.name} has {self._queued} tasks queued; try again later")
            self._queued += 1
            self._waiting[kind] += 1
        started = [False]
        future = self._executor.submit(self._timed, kind, started, fn, *args)
        future.add_done_callback(functools.partial(self._task_done, kind, started))
        return future

    def _task_done(self, kind: str, started: list[bool], _: Future) -> None:
        with self._lock:
            self._queued -= 1
            if not started[0]:  # cancelled before it ran
                self._waiting[kind] -= 1

    def _timed(self, kind: str, flag: list[bool], fn: Callable[..., T], *args: Any) -> T:
        started, cpu = time.perf_counter(), time.thread_time()
        with self._lock:
            self._waiting[kind] -= 1
            flag[0] = True
            self._running = (kind, started)
        try:
            return fn(*args)
        finally:
            if self.slowdown > 1.0:  # injected: the worker stays busy as slower hardware would
                time.sleep((self.slowdown - 1.0) * (time.perf_counter() - started))
            took = time.perf_counter() - started
            self.busy_seconds += took
            self.cpu_seconds += time.thread_time() - cpu
            with self._lock:
                mean = self.task_seconds.get(kind)
                self.task_seconds[kind] = took if mean is None else mean + TASK_SECONDS_ALPHA * (took - mean)
                self._running = None
            self._mark_busy()

    def expected_wait(self) -> float:
        """Seconds a task submitted now should wait before it starts (`wait_ahead`)."""
        with self._lock:
            waiting, means, running = dict(self._waiting), dict(self.task_seconds), self._running
        return wait_ahead(waiting, means, None if running is None else (running[0], time.perf_counter() - running[1]))

    def _mark_busy(self) -> None:
        now = time.monotonic()
        if now - self._busy_marks[-1][0] >= UTILIZATION_MARK_PERIOD:
            self._busy_marks.append((now, self.busy_seconds))
            while len(self._busy_marks) > 2 and now - self._busy_marks[1][0] >= UTILIZATION_WINDOW:
                self._busy_marks.popleft()

    def utilization(self) -> float:
        """Share of the last UTILIZATION_WINDOW seconds (or fewer, since start) the worker spent computing."""
        now, busy = time.monotonic(), self.busy_seconds
        then, busy_then = self._busy_marks[0]
        return min(1.0, (busy - busy_then) / (now - then)) if now > then else 0.0

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run `fn` on the worker thread (e.g. to read a consistent state) and wait for it."""
        return self.submit(fn).result(timeout)

    def hand_over(self, owner: Owner, timeout: float | None = None) -> None:
        """Make the worker thread the one that may change `owner`'s object from now on (swarm.threads)."""
        owner.hand_to(self.call(threading.current_thread, timeout))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
