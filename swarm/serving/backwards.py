"""The retried-backward cache of a stage server: a retried backward is answered from its first run, so its
gradient is not accumulated twice."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from swarm.backend import BackwardResult

BACKWARD_CACHE_SIZE = 512  # recent backward results kept so a retried request is not counted twice
BACKWARD_CACHE_BYTES = 256 * 2**20  # ... and the most bytes of their result tensors kept


class RecentBackwards:
    """Backward tasks of recent requests, so a retried one is answered from the first run and its
    gradient is not accumulated twice; bounded in entries and in the bytes of the results held.

    Keyed by (caller peer id, request id). A result's bytes count once its task is done (a running
    task holds none yet; the backend's queue bounds how many run). The oldest entries go first;
    the newest is kept even if its result alone is over `max_bytes`. A failed task is forgotten at
    once: nothing was accumulated, so a retry must run again.
    """

    def __init__(self, max_entries: int = BACKWARD_CACHE_SIZE, max_bytes: int = BACKWARD_CACHE_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._tasks: OrderedDict[tuple, asyncio.Future[BackwardResult]] = OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self.bytes_held = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, key: tuple) -> asyncio.Future[BackwardResult] | None:
        return self._tasks.get(key)

    def add(self, key: tuple, task: asyncio.Future[BackwardResult]) -> None:
        self._tasks[key] = task
        task.add_done_callback(lambda done: self._settle(key, done))
        self._trim()

    def _settle(self, key: tuple, task: asyncio.Future[BackwardResult]) -> None:
        if self._tasks.get(key) is not task:  # already evicted
            return
        if task.cancelled() or task.exception() is not None:
            del self._tasks[key]
            return
        size = result_bytes(task.result())
        self._sizes[key] = size
        self.bytes_held += size
        self._trim()

    def _trim(self) -> None:
        while len(self._tasks) > self.max_entries or (self.bytes_held > self.max_bytes and len(self._tasks) > 1):
            key, _ = self._tasks.popitem(last=False)
            self.bytes_held -= self._sizes.pop(key, 0)


def result_bytes(result: BackwardResult) -> int:
    """Bytes a kept backward result holds: its gradient of the input (the rest is a few numbers)."""
    return 0 if result.grad_input is None else result.grad_input.untyped_storage().nbytes()
