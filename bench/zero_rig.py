"""The rig bench/zero.py measures on: DHT peers on 127.0.0.1, stage replicas with a plain and a sharded
StageAverager, and stepping them together; shared by its in-process parts and its member processes
(bench/zero_apart.py)."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P
from prometheus_client import CollectorRegistry

from swarm.averaging import INITIAL_ROUND, ProgressChannel, StageAverager, averaging_prefix
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, SwarmRecords, load_identity, peer_id, start_dht, visible_maddrs
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.state import StageState

STAGE = 1  # bytes and time: stage 1 of configs/small.yaml
HOST = ["/ip4/127.0.0.1/tcp/0"]
READY_TIMEOUT = 30.0  # every averager sees the stage's full batch through the DHT or its channel
LOOP_TIMEOUT = 30.0  # replicating a DHT's P2P on its loop
POLL = 0.02
LOSS_REPLICAS = 2  # r in the loss part (ZeroConfig's default)
DRIFT = 1e-4  # loss part: parameters further apart than this (max abs) count as diverged
ATTEMPTS = 2  # a pair of groups whose round failed is measured once more, on fresh groups
PARTS = ("bytes", "time", "loss")
MB = 1e6


@dataclass
class Peer:
    """One machine of the benchmark: a DHT node, its loop and P2P replica, its signing identity."""

    dht: object
    loop: BackgroundLoop
    p2p: P2P
    records: SwarmRecords
    peer_id: str


def start_peer(run_id: str, initial: Sequence[str], stack: contextlib.ExitStack) -> Peer:
    """A peer (joined through `initial`, if any), shut down when `stack` closes (its DHT, then its loop)."""
    loop = BackgroundLoop("zerobench-loop").start()
    stack.callback(loop.stop)
    identity = load_identity(None)
    dht = start_dht(run_id, identity, initial_peers=list(initial), host_maddrs=HOST)
    stack.callback(dht.shutdown)  # before loop.stop: callbacks unwind in reverse
    p2p = loop.run(dht.replicate_p2p(), LOOP_TIMEOUT)
    return Peer(dht, loop, p2p, SwarmRecords(dht, run_id, identity), peer_id(dht))


@contextlib.contextmanager
def running_peers(run_id: str, n: int) -> Iterator[list[Peer]]:
    """n peers in this process, the others joined through the first; each shut down on exit."""
    with contextlib.ExitStack() as stack:
        peers: list[Peer] = []
        initial: list[str] = []
        for _ in range(n):
            peers.append(start_peer(run_id, initial, stack))
            initial = initial or visible_maddrs(peers[0].dht)
        yield peers


class Replica:
    """One StageAverager (its own module, optimizer and metrics registry) on one peer."""

    def __init__(self, peer: Peer, config: RunConfig, stage: int, stack: contextlib.ExitStack):
        self.stage = stage
        module = build_stage(config, stage)
        optimizer = StageOptimizer(module, config.optimizer)
        self.registry = CollectorRegistry()
        self.averager = StageAverager(StageState(module, optimizer, stage, INITIAL_ROUND), peer.dht, config.averaging,
                                      run_id=config.run_id, owner_key=peer.records.local_owner_key,
                                      peer_id=peer.peer_id,
                                      registry=self.registry)
        stack.callback(self.averager.shutdown)
        channel = ProgressChannel(peer.p2p, peer.loop, averaging_prefix(config.run_id, stage))
        self.averager.start(lambda: None, channel)  # this benchmark calls step() itself

    @property
    def module(self) -> torch.nn.Module:
        return self.averager.optimizer.module

    @property
    def params(self) -> list[torch.Tensor]:
        return self.averager.optimizer.params

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name, {"stage": str(self.stage)}) or 0.0

    def counters(self) -> tuple[float, float, float]:
        return (self.metric("swarm_averaging_round_seconds_sum"),
                self.metric("swarm_averaging_round_start_seconds_sum"),
                self.metric("swarm_averaging_bytes_sent_total"))


def group(peers: Sequence[Peer], config: RunConfig, stage: int, stack: contextlib.ExitStack) -> list[Replica]:
    """One replica per peer (created on the main thread: each forks its averaging process)."""
    return [Replica(peer, config, stage, stack) for peer in peers]


def derived(base: RunConfig, run_id: str, *, zero: bool, replicas: int = 2, batch_size: int | None = None) -> RunConfig:
    """`base` under another run id, codec none, zero on or off (chunk size as `base` has it)."""
    config = RunConfig.from_dict({**base.to_dict(), "run_id": run_id})
    config.averaging.compression = "none"
    config.averaging.zero.enabled = zero
    config.optimizer.name, config.optimizer.beta1 = "adamw", 0.9  # sharded rounds run AdamW: both sides do
    config.averaging.zero.replicas = replicas
    if batch_size is not None:
        config.optimizer.batch_size = batch_size
    return config.validate()


def together(calls: list[Callable[[], object]]) -> list[tuple[float, object]]:
    """Run the calls at once on threads; (seconds, result) of each."""
    barrier = threading.Barrier(len(calls))

    def timed(call: Callable[[], object]) -> tuple[float, object]:
        barrier.wait()
        started = time.perf_counter()
        result = call()
        return time.perf_counter() - started, result

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(timed, calls))


def whole_step(averager: StageAverager) -> dict | None:
    """Close the batch (the round runs beside), wait for the round, apply it: a server's step, end to end."""
    if averager.step() is not None or not averager.busy:
        raise RuntimeError("the batch did not go to a round")
    config = averager.config
    deadline = time.monotonic() + READY_TIMEOUT + config.matchmaking_timeout + config.allreduce_timeout
    while not averager.ready:
        if time.monotonic() > deadline:
            raise RuntimeError("the round did not end in time")
        time.sleep(0.001)
    return averager.step()


def hand_over(replica: Replica, grads: list[torch.Tensor], samples: int, what: str) -> None:
    replica.averager.accumulate(grads, samples)
    if replica.averager.held_samples:
        raise RuntimeError(f"{what}: a replica held its samples for the next step")


def wait_full(replicas: Sequence[Replica], n: int, what: str) -> None:
    """Until each of `replicas` sees the stage's full batch and all n members (through the DHT or its channel)."""
    batch_size = replicas[0].averager.batch_size
    deadline = time.monotonic() + READY_TIMEOUT
    while not all(r.averager.view().samples >= batch_size and r.averager.view().group_size == n for r in replicas):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the averagers did not see the stage's batch within {READY_TIMEOUT:g}s")
        time.sleep(POLL)


def check_stats(stats: Sequence[dict | None], n: int, what: str) -> None:
    if any(not s or s.get("averaging") != "succeeded" or s.get("group_size") != n for s in stats):
        raise RuntimeError(f"{what}: a round did not average all {n}: {list(stats)}")


def round_times(deltas: Sequence[Sequence[float]], steps: Sequence[float]) -> dict:
    """The members' counter deltas (round, formed, sent) and whole-step seconds, as one round's numbers."""
    return {"round": max(d[0] for d in deltas), "formed": min(d[1] for d in deltas),  # the last member's
            "sent": statistics.mean(d[2] for d in deltas), "step": max(steps)}


def one_round(replicas: list[Replica], grads: list[list[torch.Tensor]], samples: list[int], what: str) -> dict:
    """Hand each replica its gradient sums (copies), wait until every one sees the full batch and the
    whole group, then step them all at once; the round's and the step's times."""
    n = len(replicas)
    for replica, mine, count in zip(replicas, grads, samples):
        hand_over(replica, [g.clone() for g in mine], count, what)
    wait_full(replicas, n, what)
    before = [r.counters() for r in replicas]
    results = together([lambda r=r: whole_step(r.averager) for r in replicas])
    check_stats([s for _, s in results], n, what)
    deltas = [[a - b for a, b in zip(r.counters(), c)] for r, c in zip(replicas, before)]
    return {**round_times(deltas, [seconds for seconds, _ in results]),
            "spread": spread([fingerprint(r.params) for r in replicas])}


def random_grads(replicas: list[Replica], generator: torch.Generator) -> list[list[torch.Tensor]]:
    return [[torch.randn(p.shape, generator=generator) for p in r.params] for r in replicas]


def max_param_diff(a: Replica, b: Replica) -> float:
    return max_diff(a.params, b.params)


def max_diff(one: Sequence[torch.Tensor], other: Sequence[torch.Tensor]) -> float:
    with torch.no_grad():
        return max(float((x - y).abs().max()) for x, y in zip(one, other))


def flatten(params: Sequence[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.detach().flatten() for p in params])


def fingerprint(params: Sequence[torch.Tensor]) -> tuple[float, float]:
    """The sum and the sum of squares of the parameters (in float64): equal on replicas that agree."""
    flat = flatten(params).double()
    return float(flat.sum()), float(flat.square().sum())


def spread(fingerprints: Sequence[tuple[float, float]]) -> float:
    """How far the members' fingerprints are from the first's, relative (0.0: identical)."""
    first = fingerprints[0]
    return max(abs(x - y) / max(abs(y), 1e-30) for other in fingerprints[1:] for x, y in zip(other, first))



def alternating(i: int) -> list[str]:
    """The order of the two sides in timed round i: each goes first every other time."""
    return ["plain", "zero"] if i % 2 == 0 else ["zero", "plain"]


def medians(runs: dict[str, list[dict]]) -> dict:
    return {f"{name}_{key}": statistics.median(x[key] for x in rounds)
            for name, rounds in runs.items() for key in ("round", "step", "formed", "sent", "cpu_own", "cpu_children")
            if key in rounds[0]}

