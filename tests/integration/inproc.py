"""Several swarm peers in one test process, each a real DHT on 127.0.0.1 with its own loop.

A peer is what `swarm-peer` builds: a DHT node, the BackgroundLoop its P2P replica belongs to, and
SwarmRecords under its identity. Every peer after the first joins through the first one, so the
first peer's daemon holds a connection to each of the others (tests put the caller there).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import hivemind
import torch
from hivemind.p2p import P2P

from swarm.config import (
    AveragingConfig,
    DataConfig,
    ModelConfig,
    NetworkConfig,
    OptimizerConfig,
    RunConfig,
    StagesConfig,
)
from swarm.dht import BackgroundLoop, ServerState, SwarmRecords, load_identity, peer_id, start_dht, visible_maddrs
from swarm.serving import ServerOptions, StageServer
from swarm.trainer import Trainer
from tests.helpers import wait_until

HOST = ["/ip4/127.0.0.1/tcp/0"]
LOOP_CALL_TIMEOUT = 30.0  # replicating a DHT's P2P on its loop
ONLINE_TIMEOUT = 30.0  # a server's ONLINE record becomes visible to another peer
BACKEND_CALL_TIMEOUT = 30.0
# A server's word counts after this long (not the default 10 s, so that tests of honest stages need not
# wait; the trust tests set their own)
TEST_MIN_TENURE = 1.0  # a task on a stage's worker thread (it may queue behind a request)


def tiny_config(run_id: str, num_stages: int = 2, **optimizer) -> RunConfig:
    """A model small enough for 2 shared CPU cores, on a capped slice of the stdlib corpus."""
    return RunConfig(
        run_id=run_id,
        model=ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32),
        stages=StagesConfig(num_stages=num_stages),
        optimizer=OptimizerConfig(**{"batch_size": 8, "micro_batch_size": 4, **optimizer}),
        data=DataConfig(max_bytes=200_000),
        network=NetworkConfig(announce_period=2.0, record_ttl=30.0, request_timeout=30.0),
        averaging=AveragingConfig(min_tenure=TEST_MIN_TENURE),
    ).validate()


@dataclass
class Peer:
    dht: hivemind.DHT
    loop: BackgroundLoop
    records: SwarmRecords
    peer_id: str

    def p2p(self) -> P2P:
        """This peer's P2P replica, owned by its loop (as a trainer's or server's is)."""
        return self.loop.run(self.dht.replicate_p2p(), LOOP_CALL_TIMEOUT)


@contextlib.contextmanager
def running_peers(run_id: str, count: int, initial_peers: Sequence[str] = ()) -> Iterator[list[Peer]]:
    """Start `count` peers of run `run_id`, all joined through the first (or through `initial_peers`)."""
    with contextlib.ExitStack() as stack:
        peers: list[Peer] = []
        for _ in range(count):
            loop = BackgroundLoop("peer-loop").start()
            stack.callback(loop.stop)
            identity = load_identity(None)
            dht = start_dht(run_id, identity, initial_peers=initial_peers, host_maddrs=HOST)
            stack.callback(dht.shutdown)  # runs before loop.stop: callbacks unwind in reverse
            peers.append(Peer(dht, loop, SwarmRecords(dht, run_id, identity), peer_id(dht)))
            if not initial_peers:
                initial_peers = visible_maddrs(dht)
        yield peers


@contextlib.contextmanager
def stage_servers(config: RunConfig, peers: Sequence[Peer], stages: Sequence[int],
                  **options) -> Iterator[list[StageServer]]:
    """Start one StageServer of `stages[i]` on `peers[i]` (other ServerOptions from `options`); every started
    one is shut down on exit."""
    with contextlib.ExitStack() as stack:
        servers = []
        for peer, stage in zip(peers, stages, strict=True):
            server = StageServer(config, peer.dht, peer.records, peer.loop, ServerOptions(stage=stage, **options))
            stack.callback(server.shutdown)
            server.start()
            servers.append(server)
        yield servers


def train_bounded(trainer: Trainer, timeout: float) -> None:
    """Run the trainer to its max_samples; fail (and stop it) if that takes over `timeout` seconds."""
    stop = threading.Event()
    deadline = threading.Timer(timeout, stop.set)
    deadline.start()
    try:
        trainer.run(stop)
    finally:
        deadline.cancel()
    budget = trainer.options.max_samples
    assert not stop.is_set(), f"the trainer did not finish its {budget} samples within {timeout:g}s"


def wait_until_online(records: SwarmRecords, stages: Sequence[int], timeout: float = ONLINE_TIMEOUT) -> None:
    """Wait until `records`' peer sees an ONLINE server record for every one of `stages`."""

    def all_online() -> bool:
        found = records.lookup_all_servers(max(stages) + 1)
        return all(any(r.state == ServerState.ONLINE.value for r in found[stage]) for stage in stages)

    wait_until(all_online, timeout, interval=0.2, what=f"ONLINE servers of stages {list(stages)}")


def stage_state(server: StageServer) -> dict[str, torch.Tensor]:
    """A copy of the stage's parameters and buffers, read on its worker thread (between tasks)."""
    module = server.backend.module
    return server.backend.call(lambda: {k: v.clone() for k, v in module.state_dict().items()}, BACKEND_CALL_TIMEOUT)


def accumulated(server: StageServer) -> tuple[int, int]:
    """(samples counted, parameters holding a gradient) since the stage's last optimizer step."""
    backend = server.backend

    def read() -> tuple[int, int]:
        return backend.optimizer.samples, sum(p.grad is not None for p in backend.module.parameters())

    return backend.call(read, BACKEND_CALL_TIMEOUT)


def record_steps(server: StageServer) -> list[dict]:
    """Every optimizer step's stats of `server` from now on, via the backend's on_step hook (its logging kept)."""
    steps: list[dict] = []
    log_step = server.backend.on_step

    def on_step(stats: dict) -> None:
        steps.append(stats)
        if log_step is not None:
            log_step(stats)

    server.backend.on_step = on_step
    return steps
