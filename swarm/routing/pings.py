"""Round trips to stage servers, for routing: what a call to a server not yet tried spends on the network.

A trainer takes an untried server's claimed throughput for its compute (StageBalancer); what its calls also
spend on the network differs more between servers than anything else once they are far apart: each call opens
a fresh libp2p stream, and each 256 KiB window of a message past its first waits a round trip. So the trainer
pings each server it has not timed (its DHT node, which shares the server's p2p daemon and so its links and
relays) and the balancer counts that round trip for each window of what the call carries
(`StageBalancer.network_seconds`). bench/sim found it: with speeds tenfold apart and peers on four continents,
trainers that knew each untried server's round trip finished their micro-batches 1.23 x later than trainers
routed by an oracle where they had been 1.62 x (README, A simulator of a large swarm).

A ping only sets where a server stands until it is measured, as a claim does: a server answering pings fast
and calls slowly is tried once and then judged by its calls; one answering pings slowly only loses work.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Iterable
from typing import Any

import hivemind
from hivemind.p2p import PeerID

from swarm.config import RunConfig
from swarm.dht.node import call_in_dht
from swarm.protocol import BACKWARD, FORWARD

PING_TIMEOUT = 5.0  # seconds a server has to answer a ping
PING_SLACK = 2.0  # seconds beyond that for the round of pings to come back from the DHT process
MAX_PINGS = 32  # servers pinged per lookup: a trainer joining a large swarm times it over a few lookups
REPING_AFTER = 600.0  # seconds after which a server's round trip is measured again
WIRE_ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TOKEN_BYTES = 4  # token ids travel as int32 (swarm.protocol.codec)


def stage_wire_bytes(config: RunConfig, stage: int) -> dict[str, tuple[float, float]]:
    """Bytes per sample a call to `stage` sends and its reply brings, by kind (as RemotePipeline sends them):
    token ids into stage 0, hidden states elsewhere; a backward carries its inputs and the outputs' gradient;
    the last stage's single call (a backward) carries the targets and brings back its inputs' gradient."""
    seq = config.model.seq_len
    hidden = seq * config.model.d_model * WIRE_ITEM_BYTES.get(config.stages.wire, 4)
    tokens = seq * TOKEN_BYTES
    inputs = tokens if stage == 0 else hidden
    back = 0 if stage == 0 else hidden  # (token ids have no gradient)
    if stage == config.stages.num_stages - 1:
        return {FORWARD: (inputs + tokens, 4), BACKWARD: (inputs + tokens, back)}
    return {FORWARD: (inputs, hidden), BACKWARD: (inputs + hidden, back)}


async def _ping_in_dht(peers: list[str], timeout: float, _dht: Any, node: Any) -> dict[str, float]:
    """(In the DHT process.) Seconds each of `peers` took to answer a DHT ping; those that did not answer within
    `timeout` are left out."""
    async def one(peer: str) -> tuple[str, float | None]:
        began = time.perf_counter()
        answered = await asyncio.wait_for(node.protocol.call_ping(PeerID.from_base58(peer)), timeout)
        return peer, (time.perf_counter() - began) if answered is not None else None

    results = await asyncio.gather(*(one(peer) for peer in peers), return_exceptions=True)
    return {peer: seconds for result in results if not isinstance(result, BaseException)
            for peer, seconds in [result] if seconds is not None}


def ping(dht: hivemind.DHT, peers: Iterable[str], timeout: float = PING_TIMEOUT) -> dict[str, float]:
    """Round trips (seconds) to `peers`, pinged at once through this peer's DHT node; those that did not answer
    within `timeout` are left out."""
    peers = list(peers)
    if not peers:
        return {}
    return call_in_dht(dht, functools.partial(_ping_in_dht, peers, timeout), timeout + PING_SLACK)


class RoundTrips:
    """Which servers a trainer should ping next: those it never timed or timed over REPING_AFTER ago, at most
    MAX_PINGS a lookup, drawn at random (so that a peer that never answers does not hold the others back)."""

    def __init__(self, clock=time.monotonic, rng: random.Random | None = None):
        self.clock, self.rng = clock, rng or random.Random()
        self.pinged: dict[str, float] = {}  # peer -> when last pinged (answered or not)

    def due(self, peers: Iterable[str]) -> list[str]:
        now = self.clock()
        due = sorted(p for p in set(peers) if now - self.pinged.get(p, -float("inf")) >= REPING_AFTER)
        chosen = self.rng.sample(due, min(len(due), MAX_PINGS))
        for peer in chosen:
            self.pinged[peer] = now
        return chosen

    def forget(self, alive: Iterable[str]) -> None:
        """Drop what is kept of servers no longer listed (the table stays as large as the swarm)."""
        alive = set(alive)
        for peer in [p for p in self.pinged if p not in alive]:
            del self.pinged[peer]
