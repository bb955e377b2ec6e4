"""A whole swarm as separate programs on 127.0.0.1: coordinator, one server per stage, one trainer.

The swarm is started once for the module; the tests run in order: first training (the loss falls,
the metrics show it), then a server is stopped with SIGTERM and must leave gracefully.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from swarm.config import RunConfig
from swarm.traffic import wire_bytes_per_sample
from swarm.trainer import default_in_flight
from tests.procs import (
    LOCALHOST,
    Coordinator,
    Proc,
    ProcSet,
    free_port,
    group_members,
    http_get,
    metric,
    metric_in,
    start_coordinator,
)

pytestmark = pytest.mark.timeout(240)

SERVER_START_TIMEOUT = 150.0  # exec to "serving stage K" (imports, join, build and time the stage)
ONLINE_TIMEOUT = 30.0  # a server serving to its ONLINE record in the coordinator's /status
FIRST_LOSS_TIMEOUT = 60.0  # both stages ONLINE to the trainer's first loss report in /status
LOSS_DROP_TIMEOUT = 90.0  # first loss report to a clearly lower one
OFFLINE_TIMEOUT = 20.0  # SIGTERM to the server's OFFLINE record in /status (announce + status refresh)
SHUTDOWN_TIMEOUT = 30.0  # SIGTERM to exit, and then to the last process of its group gone
LOSS_DROP = 0.8  # the loss must fall below this fraction of its first report...
LOSS_CEILING = 4.0  # ...and below this (an untrained byte model's loss is ln 256 = 5.55)
SERVING_LINE = r"serving stage (\d+) of \d+ .* as (\S+)$"


@dataclass
class Swarm:
    coordinator: Coordinator
    servers: list[Proc]  # index: stage
    server_ids: list[str]
    server_ports: list[int]
    trainer: Proc
    trainer_port: int

    @property
    def procs(self) -> list[Proc]:
        return [self.coordinator.proc, *self.servers, self.trainer]

    def status(self) -> dict[str, Any] | None:
        body = http_get(self.coordinator.metrics_port, "/status")
        return None if body is None else json.loads(body)

    def loss(self) -> float | None:
        return (self.status() or {}).get("loss")

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """helpers.wait_until, failing with the last /status and every program's output."""
        try:
            return self.coordinator.proc.wait_until(predicate, timeout, what)
        except AssertionError as e:
            others = "\n".join(proc.describe() for proc in self.procs[1:])
            raise AssertionError(f"{e}\nlast /status: {self.status()}\n{others}") from None


def server_states(status: dict[str, Any] | None) -> dict[str, str]:
    """peer id -> state, for every server record in a /status document."""
    if status is None:
        return {}
    return {server["peer_id"]: server["state"] for stage in status["stages"] for server in stage["servers"]}


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, tiny_config_path: Path):
    num_stages = RunConfig.load(tiny_config_path).stages.num_stages
    procs = ProcSet(tmp_path_factory.mktemp("e2e"))
    try:
        coordinator = start_coordinator(procs, tiny_config_path, metrics_port=free_port())
        join = ("--initial-peers", *coordinator.maddrs, *LOCALHOST)
        ports = [free_port() for _ in range(num_stages)]
        servers = [procs.start("swarm-peer", *join, "--role", "server", "--stage", str(stage),
                               "--metrics-port", str(port)) for stage, port in enumerate(ports)]
        trainer_port = free_port()
        trainer = procs.start("swarm-peer", *join, "--role", "trainer", "--trainer-index", "0",
                              "--metrics-port", str(trainer_port))
        server_ids = []
        for stage, server in enumerate(servers):
            line = server.wait_for_line(SERVING_LINE, SERVER_START_TIMEOUT, stream="stderr")
            assert int(line.group(1)) == stage, server.describe()
            server_ids.append(line.group(2))
        yield Swarm(coordinator, servers, server_ids, ports, trainer, trainer_port)
    finally:
        procs.stop_all()


def test_training_lowers_the_loss_and_metrics_show_the_swarm(swarm: Swarm):
    port = swarm.coordinator.metrics_port
    expected = {peer_id: "ONLINE" for peer_id in swarm.server_ids}
    swarm.wait_for(lambda: expected.items() <= server_states(swarm.status()).items(), ONLINE_TIMEOUT,
                   "every stage's server to be ONLINE in /status")
    status = swarm.status()
    assert status["run_id"] == "tiny"
    assert [stage["stage"] for stage in status["stages"]] == list(range(len(swarm.servers)))

    first = swarm.wait_for(swarm.loss, FIRST_LOSS_TIMEOUT, "a first loss report")
    target = min(LOSS_DROP * first, LOSS_CEILING)
    swarm.wait_for(lambda: (swarm.loss() or target) < target, LOSS_DROP_TIMEOUT,
                   f"the loss to fall from {first:.3f} below {target:.3f}")

    status = swarm.status()
    assert status["step"] > 0 and status["samples_per_second"] > 0, status
    for stage in range(len(swarm.servers)):
        assert metric(port, "swarm_servers", stage=str(stage), state="ONLINE") == 1.0, http_get(port, "/metrics")
    for server_port in swarm.server_ports:  # every micro-batch runs a backward on every stage
        ok = metric(server_port, "swarm_server_requests_total", kind="backward", status="ok")
        assert ok is not None and ok > 0, http_get(server_port, "/metrics")


def bytes_and_samples(port: int, samples_metric: str) -> tuple[float, float]:
    """(forward + backward bytes sent, samples), both read in one scrape of the peer's /metrics."""
    body = http_get(port, "/metrics") or ""
    sent = sum(metric_in(body, "swarm_bytes_sent_total", kind=kind) for kind in ("forward", "backward"))
    return sent, metric_in(body, samples_metric)


def test_bytes_sent_per_sample_match_the_formula(swarm: Swarm, tiny_config_path: Path):
    """What each peer sends per sample is the README's formula (swarm.traffic.wire_bytes_per_sample) plus a
    little metadata; the DHT's bytes are counted too. One server per stage: each ran every sample's backward."""
    config = RunConfig.load(tiny_config_path)
    model = config.model
    expected = wire_bytes_per_sample(model.seq_len, model.d_model, len(swarm.servers), 4)  # wire_dtype float32
    trainer_port = swarm.trainer_port
    # Bytes are counted as they are sent, samples when their backward is done: a scrape sees up to the
    # trainer's micro-batches in flight on one side and not the other. Measured once they are a tenth at most.
    in_flight = default_in_flight(config) * config.optimizer.micro_batch_size
    swarm.wait_for(lambda: (metric(trainer_port, "swarm_trainer_samples_total") or 0) >= 10 * in_flight,
                   FIRST_LOSS_TIMEOUT, f"{10 * in_flight} trained samples")
    measured = {"trainer": bytes_and_samples(trainer_port, "swarm_trainer_samples_total")}
    for stage, port in enumerate(swarm.server_ports):
        measured[f"stage {stage}"] = bytes_and_samples(port, "swarm_server_samples_total")
    for who, (sent, samples) in measured.items():
        # above the payload: metadata, a retried call
        assert expected[who] * (samples - in_flight) <= sent <= 1.1 * expected[who] * (samples + in_flight), \
            (who, sent / samples, samples, expected)
    for port in [*swarm.server_ports, trainer_port, swarm.coordinator.metrics_port]:
        assert (metric(port, "swarm_bytes_sent_total", kind="dht") or 0) > 0


def test_prometheus_discovery_lists_every_peer_with_its_labels(swarm: Swarm):
    port = swarm.coordinator.metrics_port

    def listed() -> dict[str, dict] | None:
        groups = {g["labels"]["peer_id"]: g for g in json.loads(http_get(port, "/sd") or "[]")}
        return groups if len(groups) == len(swarm.servers) + 2 else None  # servers, the trainer, the coordinator

    groups = swarm.wait_for(listed, ONLINE_TIMEOUT, "/sd to list every peer")
    coordinator = groups.pop(swarm.coordinator.peer_id)
    assert coordinator == {"targets": [f"127.0.0.1:{port}"],
                           "labels": {"role": "coordinator", "peer_id": swarm.coordinator.peer_id, "run_id": "tiny"}}
    for stage, (peer_id, server_port) in enumerate(zip(swarm.server_ids, swarm.server_ports)):
        assert groups.pop(peer_id) == {"targets": [f"127.0.0.1:{server_port}"], "labels": {
            "role": "server", "stage": str(stage), "peer_id": peer_id, "run_id": "tiny"}}
    [trainer] = groups.values()
    assert trainer["labels"]["role"] == "trainer"
    assert http_get(int(trainer["targets"][0].rsplit(":", 1)[1]), "/healthz") == "ok\n"


def test_sigterm_takes_a_server_offline_then_it_exits_cleanly(swarm: Swarm):
    server, peer_id, stage = swarm.servers[-1], swarm.server_ids[-1], len(swarm.servers) - 1
    assert server_states(swarm.status()).get(peer_id) == "ONLINE", swarm.status()

    server.send_signal(signal.SIGTERM)
    # Only the server can sign its record, so seeing OFFLINE means it announced so while shutting down.
    # The gauges are refreshed together with /status, and the record expires record_ttl after the exit.
    port = swarm.coordinator.metrics_port
    swarm.wait_for(lambda: server_states(swarm.status()).get(peer_id) == "OFFLINE"
                   and metric(port, "swarm_servers", stage=str(stage), state="OFFLINE") == 1.0,
                   OFFLINE_TIMEOUT, f"stage {stage}'s server to be OFFLINE in /status and /metrics")
    server.wait_until(server.has_exited, SHUTDOWN_TIMEOUT, "the server to exit after SIGTERM")
    server.wait_until(lambda: not group_members(server.pid), SHUTDOWN_TIMEOUT,
                      "the server's DHT process and p2pd daemon to exit")
    assert server.wait(0) == 0, server.describe()
