"""A server's error reply is a claim, not a verdict on the request (issue 26, attack 3), with real programs
on 127.0.0.1: a coordinator, an honest server and a trainer, and a stranger's server that announces
itself ONLINE at the last stage and answers every call with `bad_request`, at once.

The stranger is built in the test from the library's own pieces: a peer of the run (tests/integration/
inproc.py), a StageService whose handler refuses everything, and its signed ONLINE record renewed
like a server's. Before the fix it won every choice (an untried newcomer, assumed as fast as the
fastest, never banned) and the trainer dropped every micro-batch: 0 samples/s.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from swarm.config import RunConfig
from swarm.dht import ServerRecord, ServerState
from swarm.protocol import BAD_REQUEST, RequestRejected, StageHandler, StageReply, StageRequest, register
from swarm.protocol import stage_namespace as namespace_of
from tests.integration.inproc import LOOP_CALL_TIMEOUT, Peer, running_peers
from tests.integration.test_routing_faults import (
    count,
    ok_requests,
    one_stage_with_a_trainer,
    samples_per_second,
)
from tests.procs import ProcSet

FAILED = "swarm_trainer_failed_micro_batches_total"
IN_FLIGHT = 4  # several micro-batches in flight: each worker would pick the untried stranger
WINDOW_SAMPLES = 320  # 40 micro-batches of 8: about 2.5 s here
WINDOWS = 3  # speeds compared: the best window of each phase (noise on the machine only slows a window)
MIN_RATIO = 0.8  # the figure: speed with the stranger / without
FIRST_CALL_TIMEOUT = 30.0  # the stranger's record read by the trainer (refresh every 2 s) to its first call
PROBE_SLACK = 20.0  # the stranger's first ban ended to its second call (a window ends, lookups, a slow machine)


class RefusingHandler(StageHandler):
    """Answers every forward and backward with `bad_request`, at once; counts the calls."""

    def __init__(self):
        self.calls = 0

    async def forward(self, request: StageRequest) -> StageReply:
        self.calls += 1
        raise RequestRejected(BAD_REQUEST, "every request is bad here")

    async def backward(self, request: StageRequest) -> StageReply:
        return await self.forward(request)


class RefusingServer:
    """A stranger's server of `stage`: ONLINE in the DHT for as long as it runs, useless to everyone."""

    def __init__(self, peer: Peer, config: RunConfig, stage: int):
        self.peer, self.config, self.stage = peer, config, stage
        self.handler = RefusingHandler()
        self._stop = threading.Event()
        self._announcer = threading.Thread(target=self._announce_forever, name="refuser-announcer", daemon=True)

    def start(self) -> None:
        p2p = self.peer.p2p()
        namespace = namespace_of(self.config.run_id, self.stage)
        self.peer.loop.run(register(p2p, self.handler, namespace), LOOP_CALL_TIMEOUT)
        self._announce()
        self._announcer.start()

    def stop(self) -> None:
        self._stop.set()
        self._announcer.join(timeout=LOOP_CALL_TIMEOUT)

    def _announce(self) -> None:
        record = ServerRecord(peer_id=self.peer.peer_id, stage=self.stage, state=ServerState.ONLINE.value,
                              throughput=1000.0, step=0)
        self.peer.records.announce_server(record, ttl=self.config.network.record_ttl)

    def _announce_forever(self) -> None:
        while not self._stop.wait(self.config.network.announce_period):
            self._announce()


@pytest.mark.timeout(120)
def test_a_server_refusing_every_call_gets_its_probes_and_training_goes_on(
        procs: ProcSet, tiny_config_path: Path, tmp_path: Path):
    coordinator, honest, trainer = one_stage_with_a_trainer(procs, tiny_config_path, tmp_path, in_flight=IN_FLIGHT)
    config = RunConfig.load(tmp_path / "run.yaml")  # the one stage is the last
    alone = max(samples_per_second(trainer, WINDOW_SAMPLES) for _ in range(WINDOWS))

    with running_peers(config.run_id, 1, coordinator.maddrs) as (peer,):
        stranger = RefusingServer(peer, config, stage=0)
        stranger.start()
        try:
            trainer.proc.wait_until(lambda: stranger.handler.calls >= 1, FIRST_CALL_TIMEOUT,
                                    "the trainer to call the stranger's server")
            first_call = time.monotonic()
            failed_before, honest_before = count(trainer, FAILED), ok_requests(honest)
            # Measured past the stranger's first ban, so its next probe is paid for in the windows too.
            last_window = first_call + config.network.ban_seconds + PROBE_SLACK
            with_stranger = []
            while len(with_stranger) < WINDOWS or (stranger.handler.calls < 2 and time.monotonic() < last_window):
                with_stranger.append(samples_per_second(trainer, WINDOW_SAMPLES))
            calls, elapsed = stranger.handler.calls, time.monotonic() - first_call
        finally:
            stranger.stop()

    summary = (f"{alone:.1f} samples/s without the stranger, {[round(s, 1) for s in with_stranger]} with it "
               f"(windows of {WINDOW_SAMPLES} samples); the stranger was called {calls} times in {elapsed:.0f} s, "
               f"the honest server answered {ok_requests(honest) - honest_before:.0f} calls")
    print(summary)  # shown with pytest -rP
    assert max(with_stranger) >= MIN_RATIO * alone, summary
    # Its first call, then one probe as each ban ends (the config's ban_seconds, doubling): no more, and
    # not shut out for good either.
    assert 2 <= calls <= probes(elapsed, config.network.ban_seconds), summary
    assert count(trainer, FAILED) == failed_before == 0.0, trainer.proc.describe()  # no micro-batch dropped


def probes(elapsed: float, ban: float) -> int:
    """Calls a server that fails each one at once gets in `elapsed` seconds from its first: one per ban."""
    calls, banned_until = 1, ban
    while banned_until <= elapsed:
        calls += 1
        ban *= 2
        banned_until += ban
    return calls
