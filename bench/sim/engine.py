"""A discrete-event clock: callbacks run in time order (ties in the order they were scheduled)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Sim:
    def __init__(self):
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self.events = 0  # callbacks run so far

    def clock(self) -> float:
        return self.now

    def at(self, when: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._queue, (max(when, self.now), next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float) -> None:
        """Run every callback due up to `until`; the clock then reads `until`."""
        queue = self._queue
        while queue and queue[0][0] <= until:
            when, _, fn, args = heapq.heappop(queue)
            self.now = when
            self.events += 1
            fn(*args)
        self.now = until
