"""Choosing a server of one stage: least accumulated virtual time, temporary bans. Pure logic, no I/O.

Each server has an estimate of its seconds per sample (an EMA over whole calls, network
included). Sending a task adds `task_size * seconds_per_sample` to the server's virtual time, and
each task goes to the server with the least virtual time, so servers receive work in proportion
to their measured speed. A server new to us starts at the current minimum and, with no estimate
yet, is assumed as fast as the fastest known one, so it is tried promptly. A failure bans a server
for `ban_base * 2**(failures-1)` seconds, capped at `ban_max`; a success resets the count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class ServerState:
    peer_id: str
    load: float = 0.0  # virtual time: seconds of work we have sent it
    seconds_per_sample: float | None = None  # EMA; None until the first call completes
    failures: int = 0
    banned_until: float = 0.0


class StageBalancer:
    """Server choice for one stage of the pipeline."""

    def __init__(
        self,
        ema_alpha: float = 0.1,
        ban_base: float = 15.0,
        ban_max: float = 300.0,
        default_seconds_per_sample: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ema_alpha = ema_alpha
        self.ban_base = ban_base
        self.ban_max = ban_max
        self.default_seconds_per_sample = default_seconds_per_sample
        self.clock = clock
        self.servers: dict[str, ServerState] = {}

    def update_servers(self, peer_ids: Iterable[str]) -> None:
        """Replace the set of known servers; newcomers enter at the current minimum load."""
        wanted = set(peer_ids)
        for gone in set(self.servers) - wanted:
            del self.servers[gone]
        floor = min((s.load for s in self.servers.values()), default=0.0)
        for peer_id in sorted(wanted - set(self.servers)):
            self.servers[peer_id] = ServerState(peer_id, load=floor)

    def available(self, exclude: Iterable[str] = ()) -> list[str]:
        """Servers that are not banned now and not excluded."""
        now, skip = self.clock(), set(exclude)
        return [p for p, s in self.servers.items() if s.banned_until <= now and p not in skip]

    def choose(self, task_size: int, exclude: Iterable[str] = ()) -> str | None:
        """The least-loaded available server (None if there is none); charges it for the task."""
        candidates = self.available(exclude)
        if not candidates:
            return None
        self._readmit(candidates)
        best = min(candidates, key=lambda p: (self.servers[p].load, p))
        self.servers[best].load += task_size * self.expected_seconds_per_sample(best)
        return best

    def _readmit(self, candidates: list[str]) -> None:
        # A server back from a ban kept its old, low load; without this it would get every task
        # until it caught up with the others.
        returning = [p for p in candidates if self.servers[p].banned_until > 0.0]
        if not returning:
            return
        steady = [self.servers[p].load for p in candidates if p not in returning]
        floor = min(steady, default=0.0)
        for p in returning:
            self.servers[p].banned_until = 0.0
            self.servers[p].load = max(self.servers[p].load, floor)

    def soonest_unbanned(self, exclude: Iterable[str] = ()) -> str | None:
        """The banned server whose ban ends first: the one to retry when every server is banned."""
        skip = set(exclude)
        banned = [s for p, s in self.servers.items() if p not in skip]
        return min(banned, key=lambda s: (s.banned_until, s.peer_id)).peer_id if banned else None

    def expected_seconds_per_sample(self, peer_id: str) -> float:
        own = self.servers[peer_id].seconds_per_sample
        if own is not None:
            return own
        known = [s.seconds_per_sample for s in self.servers.values() if s.seconds_per_sample is not None]
        return min(known, default=self.default_seconds_per_sample)

    def expected_seconds(self, peer_id: str, task_size: int) -> float:
        """How long a task of `task_size` samples should take on this server, by our estimate."""
        return task_size * self.expected_seconds_per_sample(peer_id)

    def timeout(self, peer_id: str, task_size: int, multiplier: float, floor: float, ceiling: float) -> float:
        """How long to wait for this server: a multiple of its expected time, within [floor, ceiling].

        A server we have never timed gets the ceiling, so a slow newcomer is measured, not banned.
        """
        if self.servers.get(peer_id) is None or self.servers[peer_id].seconds_per_sample is None:
            return ceiling
        return min(max(multiplier * self.expected_seconds(peer_id, task_size), floor), ceiling)

    def report_success(self, peer_id: str, task_size: int, seconds: float) -> None:
        state = self.servers.get(peer_id)
        if state is None:
            return
        sample = seconds / max(task_size, 1)
        if state.seconds_per_sample is None:
            state.seconds_per_sample = sample
        else:
            state.seconds_per_sample += self.ema_alpha * (sample - state.seconds_per_sample)
        state.failures = 0
        state.banned_until = 0.0

    def report_failure(self, peer_id: str) -> float:
        """Ban the server with exponential backoff; returns the ban's length in seconds."""
        state = self.servers.get(peer_id)
        if state is None:
            return 0.0
        state.failures += 1
        duration = min(self.ban_base * 2 ** (state.failures - 1), self.ban_max)
        state.banned_until = self.clock() + duration
        return duration
