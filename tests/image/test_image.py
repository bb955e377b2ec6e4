"""The volunteer image joins a swarm started on the host, configured by SWARM_* variables alone.

Run by `make test-image` (docker/test-image.sh builds the image first, with podman). The host runs
a coordinator, a server of stage 0 and a trainer; the container is the only server of stage 1, so
the run's step can advance only through it.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess

import pytest

from tests.procs import LOCALHOST, ProcSet, free_port, http_get, start_coordinator

pytestmark = pytest.mark.timeout(600)

IMAGE = os.environ.get("SWARM_TEST_IMAGE", "localhost/swarm-peer:test")
SERVE_TIMEOUT = 240.0  # container started to its server ONLINE in /status (imports, join, build the stage)
STEP_TIMEOUT = 120.0  # to the run's step passing a few steps through the container
OFFLINE_TIMEOUT = 60.0  # `podman stop` to the container's exit
STEPS = 3


def podman(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def host_swarm(tmp_path, tiny_config_path):
    procs = ProcSet(tmp_path)
    try:
        port = free_port()
        coordinator = start_coordinator(procs, tiny_config_path, metrics_port=port)
        join = ("--initial-peers", *coordinator.maddrs, *LOCALHOST)
        procs.start("swarm-peer", *join, "--role", "server", "--stage", "0", "--device", "cpu")
        procs.start("swarm-peer", *join, "--role", "trainer")
        yield procs, coordinator, port
    finally:
        procs.stop_all()


def status(port: int) -> dict:
    body = http_get(port, "/status")
    return json.loads(body) if body else {}


def test_a_container_joins_as_a_server_and_the_run_trains_through_it(host_swarm):
    procs, coordinator, port = host_swarm
    name = f"swarm-test-{secrets.token_hex(4)}"
    metrics_port = free_port()
    env = {"SWARM_INITIAL_PEERS": " ".join(coordinator.maddrs), "SWARM_ROLE": "server",
           "SWARM_HOST_MADDRS": LOCALHOST[1], "SWARM_METRICS_PORT": str(metrics_port)}
    flags = [f for key, value in env.items() for f in ("-e", f"{key}={value}")]
    container = procs.start("podman", "run", "--rm", "--name", name, "--network=host", *flags, IMAGE)
    try:
        def container_server() -> dict | None:
            if container.has_exited():  # (a peer that failed to start: no reason to wait out the timeout)
                raise AssertionError(f"the container exited:\n{container.describe()}")
            stage1 = [s for s in status(port).get("stages", []) if s["stage"] == 1]
            return next((s for s in stage1[0]["servers"] if s["state"] == "ONLINE"), None) if stage1 else None

        server = container.wait_until(container_server, SERVE_TIMEOUT, "the container to serve stage 1")
        first = status(port)["step"]
        container.wait_until(lambda: status(port)["step"] >= first + STEPS, STEP_TIMEOUT,
                             f"the run to take {STEPS} steps through the container")

        # Prometheus discovery lists the container under its own peer id, as a stage 1 server.
        def listed() -> dict | None:  # (a DHT lookup may miss a record for a moment)
            groups = {g["labels"]["peer_id"]: g for g in json.loads(http_get(port, "/sd") or "[]")}
            return groups if server["peer_id"] in groups else None

        targets = container.wait_until(listed, SERVE_TIMEOUT, "/sd to list the container")
        assert targets[server["peer_id"]]["labels"] == {"role": "server", "stage": "1", "peer_id": server["peer_id"],
                                                        "run_id": targets[server["peer_id"]]["labels"]["run_id"]}
        assert targets[server["peer_id"]]["targets"] == [f"127.0.0.1:{metrics_port}"]

        health = podman("healthcheck", "run", name)
        assert health.returncode == 0, f"HEALTHCHECK failed: {health.stdout}{health.stderr}"
        user = podman("exec", name, "id", "-u")
        assert user.stdout.strip() == "1000", user  # not root
        identity = podman("exec", name, "test", "-s", "/data/identity.key")
        assert identity.returncode == 0, "the identity is not kept in the /data volume"

        # `docker stop`: the server announces OFFLINE and exits cleanly
        stop = podman("stop", "--time", str(int(OFFLINE_TIMEOUT)), name, timeout=OFFLINE_TIMEOUT + 30)
        assert stop.returncode == 0, stop
        assert container.wait(OFFLINE_TIMEOUT) == 0, container.describe()
        assert "announcing OFFLINE" in container.stdout() + container.stderr()
    finally:
        podman("rm", "--force", "--time", "0", name)
