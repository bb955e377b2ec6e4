"""Three real DHT nodes on 127.0.0.1: records propagate, expire, and cannot be forged; peers join a run.

Node 1 is the coordinator (publishes the run config, serves run info); node 2 is started directly
with the run id; node 3 joins knowing only node 1's multiaddrs (join_run), like `swarm-peer`.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import hivemind
import pytest
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.config import OptimizerConfig, RunConfig
from swarm.dht import (
    BackgroundLoop,
    BootstrapError,
    Identity,
    InvalidMultiaddr,
    PeerMetricsRecord,
    RunConfigNotFound,
    RunConfigRecord,
    RunInfo,
    ServerRecord,
    ServerState,
    SwarmDHTError,
    SwarmRecords,
    join_run,
    load_identity,
    peer_id,
    request_run_info,
    serve_run_info,
    start_dht,
    visible_maddrs,
)
from swarm.dht.keys import dht_key
from swarm.routing.pings import ping
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

RUN_ID = "dht-test"
CONFIG = RunConfig(run_id=RUN_ID, optimizer=OptimizerConfig(lr=3e-4))
PROPAGATION_TIMEOUT = 20.0  # a record stored by one node becomes visible to another
JOIN_TIMEOUT = 30.0
FAILED_BOOTSTRAP_BOUND = 20.0  # a join against a dead address must give up at least this fast
SHORT_TTL = 3.0


@dataclass
class Node:
    dht: hivemind.DHT
    identity: Identity
    records: SwarmRecords
    peer_id: str


@dataclass
class Swarm:
    coordinator: Node
    node2: Node
    node3: Node
    coordinator_maddrs: list[str]
    loop: BackgroundLoop
    joined_info: RunInfo
    joined_config: RunConfig


def _node(dht: hivemind.DHT, identity: Identity) -> Node:
    return Node(dht, identity, SwarmRecords(dht, RUN_ID, identity), peer_id(dht))


def _made_up_peer_id() -> str:
    identity = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    return PeerID.from_identity(identity.SerializeToString()).to_base58()


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# These run first, while no node of the module fixture is up (at most 3 nodes at a time).
def test_join_against_dead_address_fails_fast():
    dead = f"/ip4/127.0.0.1/tcp/{_unused_port()}/p2p/{_made_up_peer_id()}"
    with BackgroundLoop() as loop:
        started = time.monotonic()
        with pytest.raises(BootstrapError, match="is the coordinator running"):
            join_run([dead], load_identity(None), loop, timeout=JOIN_TIMEOUT, startup_timeout=JOIN_TIMEOUT)
        assert time.monotonic() - started < FAILED_BOOTSTRAP_BOUND


def test_bad_multiaddr_is_a_clear_error():
    with BackgroundLoop() as loop:
        with pytest.raises(InvalidMultiaddr, match="not-an-address"):
            join_run(["not-an-address"], load_identity(None), loop, timeout=JOIN_TIMEOUT)
        with pytest.raises(InvalidMultiaddr, match="/p2p/"):
            start_dht(RUN_ID, load_identity(None), ["/ip4/127.0.0.1/tcp/1"])


def test_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SwarmDHTError, match=f"tcp/{port}: the port is taken"):
            start_dht(RUN_ID, load_identity(None), host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"])


def test_the_dht_process_ends_on_sigterm_even_where_its_parent_only_sets_a_flag_on_it():
    # swarm-local handles SIGTERM by setting an event; its forked DHT process used to inherit that, so
    # hivemind's shutdown could not stop it and swarm-local waited for it forever at exit
    import os
    import signal

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        dht = start_dht(RUN_ID, load_identity(None))
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:
        os.kill(dht.pid, signal.SIGTERM)
        dht.join(JOIN_TIMEOUT)
        assert not dht.is_alive(), "the DHT process outlived SIGTERM"
    finally:
        if dht.is_alive():
            dht.kill()
        dht.shutdown()


@pytest.fixture(scope="module")
def swarm():
    loop = BackgroundLoop("test-dht-loop").start()
    dhts: list[hivemind.DHT] = []
    try:
        identity1 = load_identity(None)
        dhts.append(start_dht(RUN_ID, identity1))
        coordinator = _node(dhts[0], identity1)
        assert coordinator.records.publish_run_config(CONFIG, ttl=300)
        serve_run_info(coordinator.dht, loop, RunInfo(RUN_ID, identity1.owner_key, coordinator.peer_id))
        maddrs = visible_maddrs(coordinator.dht)

        identity2 = load_identity(None)
        dhts.append(start_dht(RUN_ID, identity2, initial_peers=maddrs))
        identity3 = load_identity(None)
        dht3, info, config = join_run(maddrs, identity3, loop, timeout=JOIN_TIMEOUT)
        dhts.append(dht3)
        yield Swarm(coordinator, _node(dhts[1], identity2), _node(dht3, identity3), maddrs, loop, info, config)
    finally:
        loop.stop()
        for dht in reversed(dhts):
            dht.shutdown()


def _server_record(node: Node, stage: int, throughput: float = 10.0) -> ServerRecord:
    return ServerRecord(peer_id=node.peer_id, stage=stage, state=ServerState.ONLINE, throughput=throughput)


def test_join_run_returns_the_coordinators_config(swarm):
    assert swarm.joined_config == CONFIG
    assert swarm.joined_info == RunInfo(RUN_ID, swarm.coordinator.identity.owner_key, swarm.coordinator.peer_id)


def test_any_peer_that_knows_the_run_can_be_an_initial_peer(swarm):
    serve_run_info(swarm.node3.dht, swarm.loop, swarm.joined_info)
    node3_maddrs = visible_maddrs(swarm.node3.dht)
    assert request_run_info(swarm.node2.dht, swarm.loop, node3_maddrs, timeout=10) == swarm.joined_info
    # node 2 serves no run info: asking it fails, bounded, with the reason
    with pytest.raises(BootstrapError, match="told which run"):
        request_run_info(swarm.node3.dht, swarm.loop, visible_maddrs(swarm.node2.dht), timeout=2)


def test_server_record_propagates_then_expires(swarm):
    record = _server_record(swarm.node2, stage=0)
    assert swarm.node2.records.announce_server(record, ttl=SHORT_TTL)
    wait_until(lambda: swarm.node3.records.lookup_servers(0) == [record], PROPAGATION_TIMEOUT, 0.2, "record")
    assert swarm.node3.records.lookup_all_servers(2) == {0: [record], 1: []}
    wait_until(lambda: swarm.node3.records.lookup_servers(0) == [], SHORT_TTL + PROPAGATION_TIMEOUT, 0.2, "expiry")


def test_peer_cannot_overwrite_another_peers_server_record(swarm):
    original = _server_record(swarm.node2, stage=1, throughput=10.0)
    assert swarm.node2.records.announce_server(original, ttl=60)
    wait_until(lambda: swarm.node3.records.lookup_servers(1) == [original], PROPAGATION_TIMEOUT, 0.2, "record")

    # node 3 writes under node 2's subkey, with a later expiration: without signature checks it would win
    forged = _server_record(swarm.node2, stage=1, throughput=1e6)
    stored = swarm.node3.dht.store(
        dht_key(RUN_ID, "stage1"),
        subkey=swarm.node2.records.local_owner_key,
        value=forged.to_wire(),
        expiration_time=get_dht_time() + 120,
    )
    assert not stored
    for node in (swarm.coordinator, swarm.node2, swarm.node3):
        assert node.records.lookup_servers(1) == [original]


def test_peer_cannot_overwrite_the_run_config(swarm):
    coordinator_key = swarm.coordinator.records.local_owner_key
    hijacked = RunConfig(run_id=RUN_ID, optimizer=OptimizerConfig(lr=1.0))
    forged = RunConfigRecord(run_id=RUN_ID, config_yaml=hijacked.to_yaml(), coordinator_peer_id=swarm.node2.peer_id)
    stored = swarm.node2.dht.store(
        dht_key(RUN_ID, "config"), subkey=coordinator_key, value=forged.to_wire(), expiration_time=get_dht_time() + 600
    )
    assert not stored
    for node in (swarm.coordinator, swarm.node2, swarm.node3):
        assert node.records.fetch_run_config(coordinator_key) == CONFIG
    assert swarm.node3.records.fetch_run_config(None) == CONFIG  # the only one published
    with pytest.raises(RunConfigNotFound, match="signed by the coordinator"):
        swarm.node3.records.fetch_run_config(swarm.node2.records.local_owner_key)


def test_record_breaking_the_schema_is_rejected(swarm):
    key = dht_key(RUN_ID, "stage2")
    bad = {**_server_record(swarm.node2, stage=2).to_wire(), "stage": "2"}  # signed by its owner, but mistyped
    assert not swarm.node2.dht.store(
        key, subkey=swarm.node2.records.local_owner_key, value=bad, expiration_time=get_dht_time() + 60
    )
    for node in (swarm.coordinator, swarm.node3):
        assert node.dht.get(key, latest=True) is None
        assert node.records.lookup_servers(2) == []


def test_metrics_are_visible_to_the_coordinator(swarm):
    metrics = PeerMetricsRecord(
        peer_id=swarm.node3.peer_id, role="trainer", step=5, samples_per_second=7.5, samples=320, time=time.time()
    )
    assert swarm.node3.records.publish_metrics(metrics, ttl=60)
    wait_until(lambda: metrics in swarm.coordinator.records.lookup_metrics(), PROPAGATION_TIMEOUT, 0.2, "metrics")


def test_a_trainer_times_a_round_trip_to_servers_and_skips_those_that_do_not_answer(swarm):
    # swarm.routing.pings: a DHT ping of each server, for routing to servers not tried yet
    nobody = _made_up_peer_id()
    # (the bound is for a loaded machine; a round trip on loopback takes milliseconds)
    trips = ping(swarm.node3.dht, [swarm.node2.peer_id, swarm.coordinator.peer_id, nobody], timeout=10.0)
    assert set(trips) == {swarm.node2.peer_id, swarm.coordinator.peer_id}
    assert all(0 < seconds < 10.0 for seconds in trips.values())
    assert ping(swarm.node3.dht, []) == {}
