"""When a server's next checkpoint is due: one rule for stage servers and expert servers alike."""

from __future__ import annotations

import time
from collections.abc import Callable

from swarm.config import CheckpointConfig


class CheckpointSchedule:
    """Due once `every_steps` optimizer steps or `every_seconds` seconds have passed since the last checkpoint
    written or restored (whichever comes first; 0 turns that trigger off), and never twice for one step."""

    def __init__(self, settings: CheckpointConfig, clock: Callable[[], float] = time.monotonic):
        self.every_steps, self.every_seconds = settings.every_steps, settings.every_seconds
        self._clock = clock
        self.last_step = -1  # the step of the newest checkpoint written or restored (-1: none yet)
        self.last_time = clock()

    def restart_clock(self) -> None:
        """Count the seconds from now (a server that starts serving)."""
        self.last_time = self._clock()

    def due(self, step: int) -> bool:
        if step <= self.last_step:
            return False
        by_steps = self.every_steps > 0 and step - max(self.last_step, 0) >= self.every_steps
        by_time = self.every_seconds > 0 and self._clock() - self.last_time >= self.every_seconds
        return by_steps or by_time

    def done(self, step: int) -> None:
        """A checkpoint of `step` was written (its time is now) or restored."""
        self.last_step, self.last_time = step, self._clock()

    def restored(self, step: int) -> None:
        """A checkpoint of `step` was loaded: the next is due counting steps from it (the clock runs on)."""
        self.last_step = step
