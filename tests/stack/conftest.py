"""A real local swarm, a real Prometheus scraping it, and where the suite keeps its artifacts.

This suite needs programs that `make test` does not: Debian's `prometheus` and `promtool`, the
system `chromium` with playwright, and node for the dashboard schema. `make test-stack` installs
them (docker/install-test-tools.sh) and runs it. The swarm (coordinator, two servers per stage, one
trainer) and the Prometheus are started once for the whole suite.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from swarm.config import RunConfig
from tests.procs import LOCALHOST, REPO_ROOT, Coordinator, Proc, ProcSet, free_port, http_get, start_coordinator

SERVERS_PER_STAGE = 2  # so every stage averages and the averaging panels have data
START_TIMEOUT = 180.0  # programs started to every peer listed by /sd and the first optimizer step
PROMETHEUS_START_TIMEOUT = 30.0
TARGETS_UP_TIMEOUT = 60.0  # Prometheus started to every discovered target scraped and up
HTTP_TIMEOUT = 5.0
SCRAPE_INTERVAL = "1s"  # the shipped config scrapes every 5 s; the test wants series within seconds


@dataclass
class StackSwarm:
    coordinator: Coordinator
    peers: list[Proc]
    port: int  # the coordinator's metrics/status/web port
    peer_ports: list[int] = field(default_factory=list)  # /metrics of every server and trainer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get_json(self, path: str) -> Any:
        body = http_get(self.port, path)
        return None if body is None else json.loads(body)

    def status(self) -> dict[str, Any] | None:
        return self.get_json("/status")

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Wait on a condition; on failure show the last /status and the tail of every program's output."""
        try:
            return self.coordinator.proc.wait_until(predicate, timeout, what, interval=0.5)
        except AssertionError as e:
            others = "\n".join(proc.describe() for proc in self.peers)
            raise AssertionError(f"{e}\nlast /status: {self.status()}\n{others}") from None


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Where the suite keeps what a person may want to look at afterwards (screenshots, configs)."""
    path = Path(os.environ.get("SWARM_TEST_ARTIFACTS", REPO_ROOT / "build" / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_config_path: Path):
    num_stages = RunConfig.load(tiny_config_path).stages.num_stages
    procs = ProcSet(tmp_path_factory.mktemp("stack"))
    try:
        port = free_port()
        coordinator = start_coordinator(procs, tiny_config_path, metrics_port=port)
        join = ("--initial-peers", *coordinator.maddrs, *LOCALHOST)
        peers, peer_ports = [], []
        for stage in range(num_stages):
            for _ in range(SERVERS_PER_STAGE):
                peer_ports.append(free_port())
                peers.append(procs.start("swarm-peer", *join, "--role", "server", "--stage", str(stage),
                                         "--device", "cpu", "--metrics-port", str(peer_ports[-1])))
        peer_ports.append(free_port())
        peers.append(procs.start("swarm-peer", *join, "--role", "trainer", "--metrics-port", str(peer_ports[-1])))
        swarm = StackSwarm(coordinator, peers, port, peer_ports)
        expected = len(peers) + 1  # and the coordinator itself
        swarm.wait_for(lambda: len(swarm.get_json("/sd") or []) == expected, START_TIMEOUT,
                       f"/sd to list all {expected} peers")
        swarm.wait_for(lambda: (swarm.status() or {}).get("step", 0) >= 1, START_TIMEOUT, "the first step")
        yield swarm
    finally:
        procs.stop_all()


class Prometheus:
    """A running Prometheus and its HTTP query API."""

    def __init__(self, proc: Proc, port: int):
        self.proc = proc
        self.port = port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=HTTP_TIMEOUT) as reply:
            document = json.loads(reply.read())
        assert document["status"] == "success", document
        return document["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar) of `expr` now: the `data.result` of /api/v1/query."""
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]

    def targets(self) -> list[dict[str, Any]]:
        return self.api("targets")["activeTargets"]

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        return self.proc.wait_until(predicate, timeout, what, interval=0.5)


def prometheus_config(shipped: Path, sd_url: str) -> dict[str, Any]:
    """The shipped docker/prometheus.yml, pointed at this swarm's coordinator and scraping every second.

    Only the discovery URL and the intervals change: the jobs, relabelling and the rest are tested as shipped.
    """
    config = yaml.safe_load(shipped.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = SCRAPE_INTERVAL
    for job in config["scrape_configs"]:
        for sd in job.get("http_sd_configs", []):
            sd["url"] = sd_url
            sd["refresh_interval"] = "2s"
    return config


@pytest.fixture(scope="session")
def prometheus(stack: StackSwarm, tmp_path_factory: pytest.TempPathFactory, artifacts: Path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: run `make test-stack`, which installs it"
    workdir = tmp_path_factory.mktemp("prometheus")
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(prometheus_config(REPO_ROOT / "docker" / "prometheus.yml",
                                                            f"{stack.url}/sd")))
    shutil.copy(config_path, artifacts / "prometheus.yml")
    port = free_port()
    procs = ProcSet(workdir)
    try:
        proc = procs.start("prometheus", f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
                           f"--web.listen-address=127.0.0.1:{port}")
        server = Prometheus(proc, port)
        server.wait_for(lambda: http_get(port, "/-/ready") is not None, PROMETHEUS_START_TIMEOUT, "Prometheus ready")
        expected = len(stack.peers) + 1  # and the coordinator
        server.wait_for(lambda: sum(t["health"] == "up" for t in server.targets()) == expected, TARGETS_UP_TIMEOUT,
                        f"all {expected} discovered targets up")
        yield server
    finally:
        procs.stop_all()
