"""A private swarm: `swarm-coordinator --swarm-key FILE`; only peers with a copy of the file get in.

The programs run as people run them (like test_cli). Without the key a peer learns nothing from
the initial peer and cannot find the run config; with a wrong key neither; with the key it joins.
A stranger's DHT node (stock hivemind) finds nothing under the run's own id, and what it could hold
under the private id is sealed. No record a stranger's node holds, and no run_info answer a stranger
gets by calling the name the coordinator advertises (libp2p identify), names the network id.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.averaging.process import step_bits
from swarm.averaging.progress import ProgressRecord
from swarm.config import RunConfig
from swarm.dht import (
    BackgroundLoop,
    CheckpointRecord,
    ExpertHostRecord,
    HeldCheckpoint,
    PeerMetricsRecord,
    RunInfoServicer,
    ServerRecord,
    ServerState,
    SwarmRecords,
    join_run,
    load_identity,
    load_swarm_key,
)
from swarm.dht.keys import averaging_prefix, dht_key, progress_key
from swarm.dht.private import SEALED_PREFIX
from tests.helpers import wait_until
from tests.integration.test_cli import CHECK_TIMEOUT, assert_clear_error, check_output
from tests.procs import LOCALHOST, ProcSet, start_coordinator

pytestmark = pytest.mark.timeout(180)

RUN_ID = "private-test"
JOIN_TIMEOUT = "5"  # a peer without the key gives up this fast (no initial peer answers it)
PROPAGATION_TIMEOUT = 30.0
IDENTIFY = "/ipfs/id/1.0.0"  # libp2p's identify protocol: a peer's addresses and every protocol it serves


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory, tiny_config_path: Path):
    root = tmp_path_factory.mktemp("private")
    key_file = root / "swarm.key"
    procs = ProcSet(root)
    try:
        coordinator = start_coordinator(procs, tiny_config_path, "--run-id", RUN_ID, "--swarm-key", str(key_file))
        yield coordinator, key_file
    finally:
        procs.stop_all()


def test_the_coordinator_writes_a_private_key_file(private):
    _, key_file = private
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert len(key_file.read_text().strip()) == 64


def test_a_peer_with_the_key_joins(private, procs: ProcSet):
    coordinator, key_file = private
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", "--swarm-key", str(key_file),
                     *LOCALHOST, timeout=CHECK_TIMEOUT)
    _, config = check_output(proc)
    assert config.run_id == load_swarm_key(key_file).network_id(RUN_ID)


def test_a_peer_without_the_key_or_with_another_learns_nothing(private, procs: ProcSet, tmp_path: Path):
    coordinator, _ = private
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", "--join-timeout", JOIN_TIMEOUT,
                     *LOCALHOST, timeout=CHECK_TIMEOUT)
    assert_clear_error(proc, "swarm-peer", "--swarm-key")
    assert RUN_ID not in proc.stdout() + proc.stderr()
    other = tmp_path / "other.key"
    other.write_text("ab" * 32)
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", "--join-timeout", JOIN_TIMEOUT,
                     "--swarm-key", str(other), *LOCALHOST, timeout=CHECK_TIMEOUT)
    assert_clear_error(proc, "swarm-peer", "this --swarm-key")
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", "--swarm-key",
                     str(tmp_path / "missing.key"), *LOCALHOST, timeout=CHECK_TIMEOUT)
    assert_clear_error(proc, "swarm-peer", "missing.key", "does not exist")


def test_a_stranger_in_the_dht_cannot_read_the_run_config(private):
    coordinator, key_file = private
    # stock hivemind, with the signature validator only to strip signatures off what it reads
    stranger = hivemind.DHT(initial_peers=coordinator.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                            record_validators=[RSASignatureValidator(load_identity(None).signing_key)])
    try:
        assert stranger.get(dht_key(RUN_ID, "config"), latest=True) is None  # the run's own id finds nothing
        # even knowing the private id, what the DHT holds there is sealed
        found = stranger.get(dht_key(load_swarm_key(key_file).network_id(RUN_ID), "config"), latest=True)
        assert found is not None
        [record] = [item.value for item in found.value.values()]
        assert record["config_yaml"].startswith(SEALED_PREFIX) and "model:" not in record["config_yaml"]
        opened = RunConfig.from_yaml(load_swarm_key(key_file).open(record["config_yaml"]))
        assert opened.run_id.startswith(RUN_ID + "-")
    finally:
        stranger.shutdown()


def publish_every_kind_of_record(dht: hivemind.DHT, run_id: str, identity, swarm_key) -> int:
    """What a private swarm's server, trainer and expert host publish (swarm-peer's own calls); how many."""
    records = SwarmRecords(dht, run_id, identity, swarm_key=swarm_key)
    peer, hash_ = identity.peer_id, "ab" * 32
    assert records.announce_server(ServerRecord(peer_id=peer, stage=0, state=ServerState.ONLINE, throughput=1.0,
                                                metrics_addr="127.0.0.1:9100"), ttl=60)
    assert records.announce_checkpoints(CheckpointRecord(peer_id=peer, stage=0, state_hash=hash_, checkpoints=[
        HeldCheckpoint(step=3, manifest_id=hash_, size=10)]), ttl=60)
    assert records.publish_metrics(PeerMetricsRecord(peer_id=peer, role="server", step=3, samples_per_second=1.0,
                                                     samples=9, time=1.0, stage=0), ttl=60)
    assert records.announce_expert_host(ExpertHostRecord(peer_id=peer, experts=[0], state=ServerState.ONLINE,
                                                         throughput=1.0), ttl=60)
    progress = ProgressRecord(peer_id=peer, step=3, samples=9, round_id="r", group=1, priority=1.0)
    prefix, peer_bytes = averaging_prefix(run_id, 0), PeerID.from_base58(peer).to_bytes()
    for key, subkey, value in ((progress_key(run_id, 0), identity.owner_key, progress.to_wire()),
                               (f"{prefix}.all_averagers", peer_bytes, 1.0),
                               (f"{prefix}.0b{step_bits(3)}", peer_bytes, True)):
        assert dht.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + 60)
    return 7


async def _held_bytes(needles: list[bytes], _dht, node) -> tuple[int, list[bool], bool]:
    """In the stranger's DHT process: the entries its storage and cache hold, which needles their bytes
    (keys, subkeys, values) contain, and whether a sealed value is among them."""
    blob, entries = [], 0
    for held in (node.protocol.storage, node.protocol.cache):
        for key, item in held.items():
            pairs = item.value.items() if isinstance(item.value, DictionaryDHTValue) else [(None, item)]
            for subkey, sub in pairs:
                blob += [key.to_bytes(), MSGPackSerializer.dumps(subkey), sub.value]
                entries += 1
    blob = b"".join(blob)
    return entries, [needle in blob for needle in needles], SEALED_PREFIX.encode() in blob


def test_no_record_a_strangers_node_holds_names_the_network_id(private):
    coordinator, key_file = private
    swarm_key = load_swarm_key(key_file)
    network_id = swarm_key.network_id(RUN_ID)
    needles = [network_id.encode(), network_id.rsplit("-", 1)[1].encode()]  # the id, and its tag alone
    stranger = hivemind.DHT(initial_peers=coordinator.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    with BackgroundLoop("test-private-swarm") as loop:
        identity = load_identity(None)
        dht, _, config = join_run(coordinator.maddrs, identity, loop, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  swarm_key=swarm_key)
        try:
            published = publish_every_kind_of_record(dht, config.run_id, identity, swarm_key) + 1  # + the config
            # the stranger is among every key's nearest nodes (3 nodes, 5 replicas): it holds all of them
            entries, found, sealed = wait_until(
                lambda: (lambda held: held if held[0] >= published and held[2] else None)(
                    stranger.run_coroutine(functools.partial(_held_bytes, needles))), PROPAGATION_TIMEOUT, 0.5,
                "the stranger's copies")
            assert found == [False, False], f"{entries} entries a stranger holds name the network id"
        finally:
            dht.shutdown()
            stranger.shutdown()


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value, shift, at = value | (byte & 0x7F) << shift, shift + 7, at + 1
        if byte < 0x80:
            return value, at


def identified_protocols(message: bytes) -> list[str]:
    """The protocols field (3) of a length-prefixed libp2p Identify message."""
    end, at = _varint(message, 0)
    end += at
    protocols = []
    while at < end:
        tag, at = _varint(message, at)
        if tag & 7 == 0:
            _, at = _varint(message, at)
            continue
        length, at = _varint(message, at)  # every other field of Identify is length-delimited
        if tag >> 3 == 3:
            protocols.append(message[at:at + length].decode())
        at += length
    return protocols


async def _ask_as_a_stranger(maddrs: list[str]) -> tuple[list[str], bytes]:
    """A stranger with stock hivemind dials the coordinator, reads what it serves, calls its run_info."""
    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        peer = PeerID.from_base58(maddrs[0].rsplit("/p2p/", 1)[1])
        _, reader, writer = await p2p.call_binary_stream_handler(peer, IDENTIFY)
        identify = b""
        while chunk := await asyncio.wait_for(reader.read(65536), 10):
            identify += chunk
        writer.close()
        names = [name for name in identified_protocols(identify) if name.endswith("::RunInfoServicer.rpc_run_info")]
        stub = RunInfoServicer.get_stub(p2p, peer, namespace=names[0].split("::")[0])
        answer = await stub.rpc_run_info(runtime_pb2.ExpertInfo(), timeout=10)
        return names, answer.serialized_info
    finally:
        await p2p.shutdown()


def test_the_run_info_a_stranger_can_ask_for_names_nothing(private):
    coordinator, key_file = private
    names, answer = asyncio.run(_ask_as_a_stranger(coordinator.maddrs))
    assert names, "the coordinator no longer advertises run_info: then this test checks nothing"
    network_id = load_swarm_key(key_file).network_id(RUN_ID)
    assert answer.startswith(SEALED_PREFIX.encode())
    assert network_id.encode() not in answer and RUN_ID.encode() not in answer
