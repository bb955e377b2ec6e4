"""Prometheus discovery from DHT records, the announced metrics address, and the HTTP routes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from coordinator.discovery import MAX_TARGETS, discovery_targets, own_address, parse_networks
from swarm.dht import PeerMetricsRecord, ServerRecord
from swarm.metrics import MetricsServer, Reply, metrics_address


def server(peer: str, stage: int, addr: str | None, state: str = "ONLINE") -> ServerRecord:
    return ServerRecord(peer_id=peer, stage=stage, state=state, throughput=1.0, metrics_addr=addr)


def trainer(peer: str, addr: str | None) -> PeerMetricsRecord:
    return PeerMetricsRecord(peer_id=peer, role="trainer", step=0, samples_per_second=1.0, samples=1, time=1.0,
                             metrics_addr=addr)


def test_targets_carry_role_stage_and_peer_labels():
    groups = discovery_targets("run", {0: [server("s0", 0, "127.0.0.1:9101")], 1: [server("s1", 1, "127.0.0.1:9102")]},
                               [trainer("t", "127.0.0.1:9103")], coordinator=("127.0.0.1:9400", "c"))
    assert groups == [
        {"targets": ["127.0.0.1:9400"], "labels": {"role": "coordinator", "peer_id": "c", "run_id": "run"}},
        {"targets": ["127.0.0.1:9101"], "labels": {"role": "server", "stage": "0", "peer_id": "s0", "run_id": "run"}},
        {"targets": ["127.0.0.1:9102"], "labels": {"role": "server", "stage": "1", "peer_id": "s1", "run_id": "run"}},
        {"targets": ["127.0.0.1:9103"], "labels": {"role": "trainer", "peer_id": "t", "run_id": "run"}},
    ]


def test_offline_servers_and_peers_without_address_are_left_out():
    groups = discovery_targets("run", {0: [server("gone", 0, "127.0.0.1:1", "OFFLINE"), server("quiet", 0, None)]},
                               [trainer("t", None)])
    assert groups == []


def test_an_address_claimed_twice_is_listed_once_servers_first():
    groups = discovery_targets("run", {0: [server("s", 0, "10.0.0.1:9100")]}, [trainer("a", "10.0.0.1:9100")])
    assert [g["labels"]["peer_id"] for g in groups] == ["s"]


def test_targets_are_bounded():
    many = [server(f"s{i:05d}", 0, f"10.0.{i // 250}.{i % 250}:9100") for i in range(MAX_TARGETS + 10)]
    assert len(discovery_targets("run", {0: many}, [])) == MAX_TARGETS


@pytest.mark.parametrize("addr", ["http://10.0.0.1:80", "10.0.0.1", "10.0.0.1:0", "10.0.0.1:65536",
                                  "a:1/metrics", "user@a:1", "a:1\n", "-a:1", "x" * 300 + ":1", ""])
def test_records_with_a_bad_metrics_address_are_refused(addr):
    wire = {**server("s", 0, None).to_wire(), "metrics_addr": addr}
    assert ServerRecord.from_wire(wire) is None
    assert PeerMetricsRecord.from_wire({**trainer("t", None).to_wire(), "metrics_addr": addr}) is None


@pytest.mark.parametrize("addr", ["127.0.0.1:9100", "[::1]:9100", "peer-3.example.org:65535"])
def test_plain_addresses_are_accepted(addr):
    assert ServerRecord.from_wire({**server("s", 0, None).to_wire(), "metrics_addr": addr}).metrics_addr == addr


def test_own_address_comes_from_the_host_header():
    assert own_address("127.0.0.1:9400", 9400) == "127.0.0.1:9400"
    assert own_address("coordinator.example", 80) == "coordinator.example:80"
    assert own_address("[::1]", 9400) == "[::1]:9400"
    assert own_address("evil/path:1", 9400) is None
    assert own_address(None, 9400) is None


def test_metrics_address_prefers_a_given_host_then_routable_then_loopback():
    assert metrics_address(9100, "203.0.113.5", []) == "203.0.113.5:9100"
    assert metrics_address(9100, "2001:db8::1", []) == "[2001:db8::1]:9100"
    maddrs = ["/ip4/127.0.0.1/tcp/1/p2p/Qm", "/ip4/0.0.0.0/tcp/1", "/ip4/192.0.2.7/tcp/1/p2p/Qm"]
    assert metrics_address(9100, None, maddrs) == "192.0.2.7:9100"
    assert metrics_address(9100, None, ["/dns4/peer.example/tcp/1"]) == "peer.example:9100"
    assert metrics_address(9100, None, ["/ip4/127.0.0.1/tcp/1/p2p/Qm"]) == "127.0.0.1:9100"
    assert metrics_address(9100, None, []) == "127.0.0.1:9100"


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_server_routes_health_and_failures():
    problem = [None]

    def broken(_request):
        raise RuntimeError("boom")

    server = MetricsServer(CollectorRegistry(), 0, host="127.0.0.1", health=lambda: problem[0],
                           routes={"/echo": lambda r: Reply.json({"host": r.host, "query": r.query}),
                                   "/broken": broken})
    try:
        assert get(server.port, "/healthz") == (200, "ok\n")
        problem[0] = "its DHT process has exited"
        assert get(server.port, "/healthz") == (503, "unhealthy: its DHT process has exited\n")
        code, body = get(server.port, "/echo?x=1")
        assert code == 200 and json.loads(body) == {"host": f"127.0.0.1:{server.port}", "query": "x=1"}
        assert get(server.port, "/broken")[0] == 500
        assert get(server.port, "/metrics")[0] == 200  # still serving after a route failed
        code, body = get(server.port, "/nothing")
        assert code == 404 and "/metrics" in body
    finally:
        server.close()


def test_metrics_networks_keep_only_ip_addresses_inside_them():
    networks = parse_networks(["10.0.0.0/8", "::1"])
    servers = {0: [server("in", 0, "10.1.2.3:9100"), server("out", 0, "192.168.0.5:9100"),
                   server("name", 0, "peer.example:9100"), server("v6", 0, "[::1]:9100")]}
    groups = discovery_targets("run", servers, [trainer("t", "172.16.0.1:9100")],
                               coordinator=("coordinator.example:9400", "c"), networks=networks)
    # the coordinator is listed as Prometheus reached it, whatever the networks
    assert [g["labels"]["peer_id"] for g in groups] == ["c", "in", "v6"]
    assert len(discovery_targets("run", servers, [], networks=None)) == 4  # without the option: all


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "ten", "", "10.0.0.0/8/1"])
def test_a_bad_network_is_named(bad):
    with pytest.raises(ValueError, match="not an IP network"):
        parse_networks(["127.0.0.0/8", bad])
