"""A trainer's StageBalancer on a fake clock, and a one-trainer discrete-event run of simulated stage servers:
what tests/unit/test_balancer*.py share."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from swarm.protocol import BACKWARD, FORWARD
from swarm.routing.balancer import StageBalancer

SIZE = 8  # samples per micro-batch


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def balancer(clock: FakeClock, *peers: str, **kwargs) -> StageBalancer:
    b = StageBalancer(clock=clock, **kwargs)
    b.update_servers(peers)
    return b


@dataclass
class Server:
    """A simulated stage server: `delay` seconds that overlap (network, --inject-delay), then compute
    of `seconds_per_sample` one task at a time, first in first out; its first task takes `hiccup` more."""

    seconds_per_sample: float
    delay: float = 0.0
    hiccup: float = 0.0
    busy_until: float = float("-inf")


@dataclass
class Run:
    samples: Counter = field(default_factory=Counter)  # peer -> samples computed
    elapsed: float = 0.0

    def share(self, peer: str) -> float:
        return self.samples[peer] / sum(self.samples.values())

    @property
    def speed(self) -> float:
        return sum(self.samples.values()) / self.elapsed


def simulate(b: StageBalancer, clock: FakeClock, servers: dict[str, Server], in_flight: int, tasks: int,
             kind: str = FORWARD) -> Run:
    """One trainer sending `tasks` tasks, `in_flight` at a time, until all are answered (discrete events)."""
    run, events, started, sent = Run(), [], clock.now, 0

    def send() -> None:
        nonlocal sent
        if sent == tasks:
            return
        sent += 1
        ticket = b.choose(SIZE, kind)
        server = servers[ticket.peer_id]
        begins = max(clock.now + server.delay, server.busy_until)
        server.busy_until = begins + SIZE * server.seconds_per_sample + server.hiccup
        server.hiccup = 0.0
        heapq.heappush(events, (server.busy_until, ticket.seq, ticket))

    for _ in range(in_flight):
        send()
    while events:
        clock.now, _, ticket = heapq.heappop(events)
        b.report_success(ticket)
        run.samples[ticket.peer_id] += ticket.size
        send()
    run.elapsed = clock.now - started
    return run


def speeds(**seconds_per_sample: float) -> dict[str, Server]:
    return {peer: Server(s) for peer, s in seconds_per_sample.items()}


def measured(b: StageBalancer, clock: FakeClock, peer: str, seconds_per_sample: float) -> None:
    for kind in (FORWARD, BACKWARD):
        ticket = b.charge(peer, 10, kind)
        clock.now += 10 * seconds_per_sample
        b.report_success(ticket)
