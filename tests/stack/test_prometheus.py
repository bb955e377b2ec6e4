"""A real Prometheus finds every peer of a real swarm through the coordinator, and every endpoint lints clean."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.procs import http_get

pytestmark = pytest.mark.timeout(400)

SERIES_TIMEOUT = 60.0  # targets up to a series present in Prometheus


def test_every_peer_is_discovered_labelled_and_up(stack, prometheus):
    def every_peer() -> dict | None:  # (a DHT lookup may miss a record for a moment: ask again)
        groups = {group["labels"]["peer_id"]: group for group in stack.get_json("/sd") or []}
        return groups if len(groups) == len(stack.peers) + 1 else None

    listed = stack.wait_for(every_peer, SERIES_TIMEOUT, "/sd to list every peer")
    roles = sorted(group["labels"]["role"] for group in listed.values())
    assert roles == ["coordinator", "server", "server", "server", "server", "trainer"], listed

    def all_up() -> dict | None:  # Prometheus re-reads /sd every 2 s here
        up = {t["labels"]["peer_id"]: t for t in prometheus.targets() if t["health"] == "up"}
        return up if up.keys() == listed.keys() else None

    up = prometheus.wait_for(all_up, SERIES_TIMEOUT, "every listed peer's target up")
    for peer, target in up.items():
        labels = listed[peer]["labels"]
        assert target["labels"]["role"] == labels["role"]
        assert target["labels"].get("stage") == labels.get("stage")
        assert target["scrapeUrl"] == f"http://{listed[peer]['targets'][0]}/metrics"


def test_swarm_and_per_stage_series_are_queryable(stack, prometheus):
    loss = prometheus.wait_for(lambda: prometheus.query("swarm_loss"), SERIES_TIMEOUT, "swarm_loss")
    assert 0 < float(loss[0]["value"][1]) < 10
    stages = prometheus.wait_for(lambda: prometheus.query("swarm_stage_step"), SERIES_TIMEOUT, "swarm_stage_step")
    assert sorted(s["metric"]["stage"] for s in stages) == ["0", "1"]
    # per-server series carry the stage label that discovery gave their target
    queue = prometheus.wait_for(lambda: prometheus.query('sum by (stage) (swarm_server_queue_depth{role="server"})'),
                                SERIES_TIMEOUT, "queue depth by stage")
    assert sorted(s["metric"]["stage"] for s in queue) == ["0", "1"]
    steps = prometheus.query("max by (stage) (swarm_server_step)")
    assert all(float(s["value"][1]) >= 1 for s in steps), steps


def test_every_metrics_endpoint_passes_promtool_without_warnings(stack, prometheus):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: run `make test-stack`"
    ports = [stack.port, *stack.peer_ports]
    for port in ports:
        body = http_get(port, "/metrics")
        assert body, f"no /metrics on port {port}"
        lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30)
        assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), \
            f"port {port}: promtool says (exit {lint.returncode}):\n{lint.stdout}{lint.stderr}"
