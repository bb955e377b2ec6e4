"""The simulator's network: regions and their latencies, peers' links, and messages over fresh libp2p streams.

A message waits for its sender's uplink (each uplink sends one message at a time, first come first served),
moves at the lesser of that uplink and the receiver's downlink, a STREAM_WINDOW at a time (each window past
the first waits for the receiver's update, a round trip, where its bytes went out sooner), and arrives one
region-to-region latency later; a relayed peer adds a relay detour to each of its messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from bench.sim.engine import Sim

REGIONS = ("na-east", "na-west", "europe", "asia")
# one-way milliseconds between regions (assumed, of the order of public cloud figures; design/internet.md)
ONE_WAY_MS = {
    ("na-east", "na-east"): 5, ("na-west", "na-west"): 5, ("europe", "europe"): 5, ("asia", "asia"): 5,
    ("na-east", "na-west"): 35, ("na-east", "europe"): 45, ("na-west", "europe"): 75,
    ("na-east", "asia"): 90, ("na-west", "asia"): 55, ("europe", "asia"): 110,
}


# Each call opens a fresh libp2p stream, whose yamux flow-control window starts at 256 KiB (go-yamux's initial
# stream window): a message past it waits a round trip for the receiver's window update (bench/stream_probe.py
# saw a call moving 1.2 MB at 100 ms one way take about five round trips). A message's framing and metadata
# beside its tensors: a few hundred bytes, assumed.
STREAM_WINDOW, MESSAGE_OVERHEAD = 256 * 1024, 512


def one_way(a: str, b: str) -> float:
    return ONE_WAY_MS.get((a, b), ONE_WAY_MS.get((b, a), 100)) / 1000


@dataclass(eq=False)
class Endpoint:
    region: str
    up: float  # bytes/s
    down: float
    relayed: bool = False
    up_free: float = 0.0  # when the uplink has sent everything queued on it


class Network:
    def __init__(self, sim: Sim, relay_detour: float):
        self.sim, self.relay_detour = sim, relay_detour

    def latency(self, src: Endpoint, dst: Endpoint) -> float:
        return one_way(src.region, dst.region) + (self.relay_detour if src.relayed or dst.relayed else 0.0)

    def transit(self, src: Endpoint, dst: Endpoint, nbytes: float) -> tuple[float, float]:
        """(seconds the sender's uplink is busy, seconds until the message arrives), from when it starts sending: it
        moves at the lesser of the two rates, and on a fresh stream one STREAM_WINDOW at a time, each after the
        receiver's window update for the one before (a round trip) where the bytes went out sooner than that."""
        rate = min(src.up, dst.down)
        latency = self.latency(src, dst)
        windows = max(1, math.ceil((nbytes + MESSAGE_OVERHEAD) / STREAM_WINDOW))
        took = nbytes / rate
        stalled = (windows - 1) * max(0.0, 2 * latency - STREAM_WINDOW / rate)  # waiting on updates, link idle
        return took, took + stalled + latency

    def delivery(self, src: Endpoint, dst: Endpoint, nbytes: float, after: float = 0.0) -> tuple[float, float]:
        """(when the sender's uplink is free again, when the message arrives) for a message sent `after` seconds
        from now, behind what the uplink already has queued."""
        start = max(self.sim.now + after, src.up_free)
        busy, arrives = self.transit(src, dst, nbytes)
        return start + busy, start + arrives

    def send(self, src: Endpoint, dst: Endpoint, nbytes: float, then: Callable[[], None]) -> None:
        src.up_free, arrives = self.delivery(src, dst, nbytes)
        self.sim.at(arrives, then)
