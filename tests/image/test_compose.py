"""docker/compose.yaml starts a swarm that trains, with one command (podman-compose here).

Only the swarm's own services run: the Prometheus and Grafana images cannot be pulled on a machine
with no registry (the shipped Prometheus config is tested against a real swarm in tests/stack).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.procs import REPO_ROOT, http_get

pytestmark = pytest.mark.timeout(600)

IMAGE = os.environ.get("SWARM_TEST_IMAGE", "localhost/swarm-peer:test")
COMPOSE = REPO_ROOT / "docker" / "compose.yaml"
SERVICES = ["coordinator", "server-0a", "server-0b", "server-1a", "server-1b", "trainer"]
PORTS = [9400, 9101, 9102, 9103, 9104, 9110]  # the compose file's fixed metrics ports
COORDINATOR_PORT = 9400
UP_TIMEOUT = 300.0  # `up` to every peer discovered and a few steps taken
STEPS = 5


def podman_compose(project: str, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    compose = Path(sys.executable).parent / "podman-compose"
    env = {**os.environ, "SWARM_IMAGE": IMAGE}
    return subprocess.run([str(compose), "-p", project, "-f", str(COMPOSE), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO_ROOT)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the metrics servers bind: TIME_WAIT is free
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_compose_up_starts_a_swarm_that_trains_and_is_discovered():
    taken = [p for p in PORTS if not port_free(p)]
    assert not taken, f"compose.yaml's ports {taken} are in use on this machine; free them to run this test"
    project = f"swarmtest{secrets.token_hex(3)}"
    try:
        up = podman_compose(project, "up", "-d", *SERVICES)
        assert up.returncode == 0, up.stdout + up.stderr

        def status() -> dict:
            body = http_get(COORDINATOR_PORT, "/status")
            return json.loads(body) if body else {}

        def logs() -> str:
            return "\n".join(podman_compose(project, "logs", "--tail", "15", service).stdout for service in SERVICES)

        try:
            wait_until(lambda: len(json.loads(http_get(COORDINATOR_PORT, "/sd") or "[]")) == len(SERVICES),
                       UP_TIMEOUT, 0.5, "/sd to list every service")
            first = status()["step"]
            wait_until(lambda: status()["step"] >= first + STEPS, UP_TIMEOUT, 0.5, f"{STEPS} steps")
            # (each read of the DHT may miss a record for a moment: the full picture is waited for)
            def settled() -> bool:
                now = status()
                return (now.get("volunteers") == len(SERVICES) - 1 and now.get("loss") is not None
                        and [s["online"] for s in now.get("stages", [])] == [2, 2])

            wait_until(settled, UP_TIMEOUT, 0.5, "5 volunteers, a loss, and both stages with 2 servers online")
        except AssertionError as e:
            raise AssertionError(f"{e}\nlast /status: {status()}\n{logs()}") from None
    finally:
        down = podman_compose(project, "down", "--volumes", "--timeout", "10")
        assert down.returncode == 0, down.stdout + down.stderr
