"""The simulator's servers and their tasks (bench/sim/swarm.py says what is modelled and what is the project's own)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.sim.network import Endpoint
from swarm.protocol import FORWARD
from swarm.serving.rebalance import Rebalancer

if TYPE_CHECKING:
    from bench.sim.swarm import Scenario


@dataclass(eq=False)
class Task:
    seconds: float
    done: Callable[[], None]
    fail: Callable[[], None]
    cancelled: bool = False  # its caller gave up before it started: it is skipped
    kind: str = FORWARD  # its call's (a real server's worker keeps a mean time per kind)
    ends: float | None = None  # when it is done, once it has started


@dataclass(eq=False)
class Server:
    peer_id: str
    speed: float
    link: Endpoint
    pinned: bool = False
    stage: int | None = None
    state: str = "JOINING"
    alive: bool = True
    queue: deque = field(default_factory=deque)  # tasks waiting, first come first served
    current: Task | None = None  # the task computing now
    rebalancer: Rebalancer | None = None
    moves: int = 0
    task_seconds: dict[str, float] = field(default_factory=dict)  # its mean task time by kind, as a real server's
    # worker keeps it (Worker.task_seconds), seeded from its measured throughput as StageServer seeds it
    incoming: float = 0.0  # seconds of work sent to it and not arrived yet (what an oracle routing also knows)

    def backlog(self, now: float) -> float:
        """Seconds of work queued, and what the one computing has left."""
        left = max(0.0, self.current.ends - now) if self.current is not None else 0.0
        return sum(t.seconds for t in self.queue if not t.cancelled) + left

    def throughput(self, scenario: Scenario) -> float:
        """Samples/s of a forward and backward, as the server announces (its own measure)."""
        return self.speed / (3 * scenario.seconds_per_sample)
