"""An MoE swarm as separate programs on 127.0.0.1: coordinator, a server per stage, two expert servers
(experts 0-2 and 2-3: expert 2 on both) and a trainer. It learns; then an expert server is SIGKILLed
mid-run: training goes on without its experts, and they come back with a new `--experts auto` server.

The swarm is started once for the module; the tests run in order.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from swarm.config import MoEConfig, RunConfig
from tests.procs import REPO_ROOT, Coordinator, Peer, ProcSet, free_port, http_get, start_coordinator, start_peer

pytestmark = [pytest.mark.timeout(300), pytest.mark.swarms]  # make test-swarms

START_TIMEOUT = 150.0  # exec to "serving stage K" / "hosting experts" (imports, join, build)
FIRST_LOSS_TIMEOUT = 90.0
LOSS_DROP_TIMEOUT = 120.0
PROGRESS_TIMEOUT = 90.0  # for the run to take a few more steps
EXPIRY_TIMEOUT = 30.0  # a killed host's record to expire (record_ttl) and /status to show it
LOSS_DROP = 0.8
LOSS_CEILING = 4.2
HOSTING_LINE = r"hosting experts \[([\d, ]+)\] of MoE blocks .* as (\S+) "
HOSTED = ("0,1,2", "2,3")


@dataclass
class MoESwarm:
    coordinator: Coordinator
    servers: list[Peer]
    experts: list[Peer]
    trainer: Peer

    def status(self) -> dict[str, Any]:
        body = http_get(self.coordinator.metrics_port, "/status")
        return {} if body is None else json.loads(body)

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        try:
            return self.coordinator.proc.wait_until(predicate, timeout, what)
        except AssertionError as e:
            procs = [*self.servers, *self.experts, self.trainer]
            raise AssertionError(f"{e}\nlast /status: {self.status()}\n"
                                 + "\n".join(p.proc.describe() for p in procs)) from None


def hosts_of(status: dict[str, Any], expert: int) -> set[str]:
    return {h["peer_id"] for h in status.get("experts", [{}] * (expert + 1))[expert].get("hosts", [])
            if h["state"] == "ONLINE"}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    config = RunConfig.load(REPO_ROOT / "configs" / "tiny.yaml")
    config.run_id = "moeswarm"
    config.model.moe = MoEConfig(every=2, num_experts=4, top_k=2, capacity_factor=1.5, expert_hidden=128,
                                 expert_servers=True, k_min=1)
    config.network.announce_period = 1.0
    config.network.record_ttl = 6.0
    config.network.timeout_floor = 3.0
    config.optimizer.round_wait_seconds = 1.0  # (a forward's wait stays under half of the floor)
    config.data.max_bytes = 300_000
    config.validate()
    workdir = tmp_path_factory.mktemp("moeswarm")
    path = workdir / "moe.yaml"
    config.save(path)
    procs = ProcSet(workdir)
    try:
        coordinator = start_coordinator(procs, path, metrics_port=free_port())
        experts = [start_peer(procs, coordinator, "--role", "expert", "--experts", hosted) for hosted in HOSTED]
        for peer in experts:
            peer.peer_id = peer.proc.wait_for_line(HOSTING_LINE, START_TIMEOUT, stream="stderr").group(2)
        servers = [start_peer(procs, coordinator, "--role", "server", "--stage", str(stage)) for stage in (0, 1)]
        for stage, server in enumerate(servers):
            assert server.wait_serving() == stage
        trainer = start_peer(procs, coordinator, "--role", "trainer", "--trainer-index", "0")
        yield MoESwarm(coordinator, servers, experts, trainer)
    finally:
        procs.stop_all()


def test_an_moe_swarm_with_expert_servers_learns(swarm: MoESwarm):
    status = swarm.wait_for(lambda: swarm.status().get("expert_hosts") == 2 and swarm.status(), 30.0,
                            "/status to list both expert servers")
    assert hosts_of(status, 2) == {p.peer_id for p in swarm.experts} and status["unhosted_experts"] == []
    first = swarm.wait_for(lambda: swarm.status().get("loss"), FIRST_LOSS_TIMEOUT, "a first loss report")
    target = min(LOSS_DROP * first, LOSS_CEILING)
    swarm.wait_for(lambda: (swarm.status().get("loss") or target) < target, LOSS_DROP_TIMEOUT,
                   f"the loss to fall from {first:.3f} below {target:.3f}")
    for peer in swarm.experts:  # every micro-batch's backward reaches every expert server
        assert (peer.metric("swarm_expert_requests_total", kind="backward", status="ok") or 0) > 0
        assert (peer.metric("swarm_expert_step") or 0) >= 1


def test_sigkill_of_an_expert_server_does_not_stop_training_and_auto_brings_its_experts_back(swarm: MoESwarm):
    dead = swarm.experts[1]  # experts 2 and 3: expert 3 has no other host
    step_at_kill = swarm.status()["step"]
    loss_at_kill = swarm.status()["loss"]
    dead.proc.signal_group(signal.SIGKILL)  # the server, its DHT process and its p2pd: as if the machine vanished
    dead.proc.wait(10.0)

    # Its record expires; meanwhile the stage servers' calls to it fail and they go on without expert 3.
    swarm.wait_for(lambda: swarm.status().get("unhosted_experts") == [3], EXPIRY_TIMEOUT,
                   "/status to show expert 3 without a host")
    swarm.wait_for(lambda: swarm.status()["step"] >= step_at_kill + 3, PROGRESS_TIMEOUT,
                   f"the run to go on past step {step_at_kill + 3} without expert 3")
    assert not swarm.trainer.proc.has_exited(), swarm.trainer.proc.describe()
    lost = sum(server.metric("swarm_moe_unavailable_slots_total") or 0 for server in swarm.servers)
    assert lost > 0, "no slot was counted as going without its expert"
    assert swarm.status()["loss"] < max(loss_at_kill * 1.1, LOSS_CEILING)

    # A new expert server with --experts auto takes the experts served least: 3 (no host), then one of the others,
    # whichever its host's announced throughput, shared among the experts it hosts, serves least.
    procs = ProcSet(swarm.coordinator.proc.stdout_path.parent)
    try:
        joiner = start_peer(procs, swarm.coordinator, "--role", "expert", "--experts", "auto", "--expert-count", "2")
        line = joiner.proc.wait_for_line(HOSTING_LINE, START_TIMEOUT, stream="stderr")
        chosen = [int(e) for e in line.group(1).split(",")]
        assert len(chosen) == 2 and 3 in chosen, chosen
        joiner.peer_id = line.group(2)
        assert "state of step" in joiner.proc.stderr()  # the other came from its live host
        swarm.wait_for(lambda: hosts_of(swarm.status(), 3) == {joiner.peer_id}, 30.0, "expert 3 hosted again")
        step = swarm.status()["step"]
        swarm.wait_for(lambda: swarm.status()["step"] >= step + 2, PROGRESS_TIMEOUT, "two more steps")
        assert (joiner.metric("swarm_expert_requests_total", kind="backward", status="ok") or 0) > 0
        assert swarm.status()["unhosted_experts"] == []
    finally:
        procs.stop_all()
