"""A private swarm: `swarm-coordinator --swarm-key FILE`; only peers with a copy of the file get in.

The programs run as people run them (like test_cli). Without the key a peer learns nothing from
the initial peer and cannot find the run config; with a wrong key neither; with the key it joins.

libp2p's identify protocol tells anyone who dials a peer every handler name it serves, so names
keep nobody out: every RPC of a private swarm's peers answers only callers that prove they hold the
key (swarm.dht.gate). A stranger, with no key or another, that names a stage server's forward,
its checkpoint reads, the DHT or run_info from what identify told it is refused, while a caller with
the key is answered by the same handlers; a stranger's DHT node cannot join at all. In depth, no
record a node of the swarm holds names the network id, and the run config it holds is sealed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from pathlib import Path

import hivemind
import msgpack
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import P2P, PeerID
from hivemind.proto import dht_pb2, runtime_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.averaging.process import step_bits
from swarm.averaging.progress import ProgressRecord
from swarm.config import RunConfig
from swarm.dht import (
    BackgroundLoop,
    BootstrapError,
    CheckpointRecord,
    ExpertHostRecord,
    HeldCheckpoint,
    PeerMetricsRecord,
    RunInfo,
    ServerRecord,
    ServerState,
    SwarmRecords,
    gate,
    join_run,
    load_identity,
    load_swarm_key,
    start_dht,
)
from swarm.dht.bootstrap import RUN_INFO_PURPOSE
from swarm.dht.keys import averaging_prefix, dht_key, progress_key
from swarm.dht.private import SEALED_PREFIX, SwarmKey
from tests.helpers import wait_until
from tests.integration.test_cli import CHECK_TIMEOUT, assert_clear_error, check_output
from tests.procs import LOCALHOST, ProcSet, start_coordinator, start_peer

pytestmark = pytest.mark.timeout(180)

RUN_ID = "private-test"
JOIN_TIMEOUT = "5"  # a peer without the key gives up this fast (no initial peer answers it)
PROPAGATION_TIMEOUT = 30.0
IDENTIFY = "/ipfs/id/1.0.0"  # libp2p's identify protocol: a peer's addresses and every protocol it serves
CALL_TIMEOUT = 20.0  # one call of the test's own peer (2 shared CPU cores)


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


@pytest.fixture(scope="module")
def server(private, tmp_path_factory: pytest.TempPathFactory):
    """A server of the private swarm (it serves forward, backward and its checkpoints), of the stage
    publish_every_kind_of_record leaves alone: its ghost records would keep a stage-0 server from starting."""
    coordinator, key_file = private
    procs = ProcSet(tmp_path_factory.mktemp("private-server"))
    try:
        peer = start_peer(procs, coordinator, "--role", "server", "--stage", "1", "--swarm-key", str(key_file))
        peer.wait_serving()
        yield peer
    finally:
        procs.stop_all()


@contextlib.contextmanager
def gated(swarm_key: SwarmKey | None):
    """This process's calls carry proofs of `swarm_key` (none: no gate), and so do the processes it forks."""
    if swarm_key is not None:
        gate.install(swarm_key)
    try:
        yield
    finally:
        gate.uninstall()


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


def test_a_strangers_dht_node_cannot_join(private, tmp_path: Path):
    coordinator, _ = private
    # stock hivemind, with no key, then with another (its DHT process inherits this process's gate)
    for n, other_key in enumerate((None, SwarmKey(b"\xab" * 32))):
        identity = tmp_path / f"stranger-{n}.id"
        P2P.generate_identity(str(identity))
        with gated(other_key), pytest.raises(RuntimeError, match="bootstrap failed"):
            hivemind.DHT(initial_peers=coordinator.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                         identity_path=str(identity), wait_timeout=3).shutdown()
        stranger = PeerID.from_identity(identity.read_bytes()).to_base58()
        coordinator.proc.wait_for_line(f"refused calls from peer {stranger}", CALL_TIMEOUT, stream="stderr")


def test_a_dht_node_started_with_the_key_joins_without_gating_this_process(private):
    coordinator, key_file = private
    swarm_key = load_swarm_key(key_file)
    with pytest.raises(BootstrapError, match="is the swarm private\\? then start with --swarm-key"):
        start_dht(None, load_identity(None), coordinator.maddrs).shutdown()
    dht = start_dht(swarm_key.network_id(RUN_ID), load_identity(None), coordinator.maddrs, swarm_key=swarm_key)
    try:
        assert gate.installed() is None  # only the DHT process is gated
        config = SwarmRecords(dht, swarm_key.network_id(RUN_ID), load_identity(None),
                              swarm_key=swarm_key).fetch_run_config(None, timeout=CALL_TIMEOUT)
        assert config.run_id == swarm_key.network_id(RUN_ID)
    finally:
        dht.shutdown()


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


def test_no_record_a_node_of_the_swarm_holds_names_the_network_id(private):
    """Strangers cannot be nodes of the DHT any more (above); this is the depth behind that: should a record
    leave the swarm (a node's memory, a peer started without the gate), it names no network id."""
    coordinator, key_file = private
    swarm_key = load_swarm_key(key_file)
    network_id = swarm_key.network_id(RUN_ID)
    needles = [network_id.encode(), network_id.rsplit("-", 1)[1].encode()]  # the id, and its tag alone
    with gated(swarm_key), BackgroundLoop("test-private-swarm") as loop:
        # a stock hivemind node with the key (its DHT process inherits this process's gate), as a stranger once was;
        # the signature validator only strips signatures off what it reads
        holder = hivemind.DHT(initial_peers=coordinator.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                              record_validators=[RSASignatureValidator(load_identity(None).signing_key)])
        identity = load_identity(None)
        dht, _, config = join_run(coordinator.maddrs, identity, loop, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  swarm_key=swarm_key)
        try:
            published = publish_every_kind_of_record(dht, config.run_id, identity, swarm_key) + 1  # + the config
            # the holder is among every key's nearest nodes (3 nodes, 5 replicas): it holds all of them
            entries, found, sealed = wait_until(
                lambda: (lambda held: held if held[0] >= published and held[2] else None)(
                    holder.run_coroutine(functools.partial(_held_bytes, needles))), PROPAGATION_TIMEOUT, 0.5,
                "the holder's copies")
            assert found == [False, False], f"{entries} entries a node holds name the network id"
            # and the config it holds is sealed: it opens with the key only
            [record] = [item.value for item in holder.get(dht_key(network_id, "config"), latest=True).value.values()]
            assert record["config_yaml"].startswith(SEALED_PREFIX) and "model:" not in record["config_yaml"]
            assert RunConfig.from_yaml(swarm_key.open(record["config_yaml"])).run_id == network_id
        finally:
            dht.shutdown()
            holder.shutdown()


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


async def _identified(p2p: P2P, peer: PeerID) -> list[str]:
    """The handler names `peer` serves, as libp2p's identify tells anyone who dials it (no proof asked)."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer, IDENTIFY)
    identify = b""
    while chunk := await asyncio.wait_for(reader.read(65536), CALL_TIMEOUT):
        identify += chunk
    writer.close()
    return identified_protocols(identify)


async def _answers(p2p: P2P, peer: PeerID, name: str, request: runtime_pb2.ExpertRequest) -> list | str:
    """The frames a stream handler answers one request with (until it closes the stream), or why the call failed."""
    frames = []
    try:
        async for frame in await p2p.iterate_protobuf_handler(peer, name, request, runtime_pb2.ExpertResponse):
            frames.append(frame)
    except (ConnectionError, asyncio.IncompleteReadError):  # closed while our request was still being written
        pass
    except Exception as e:  # noqa: BLE001 - how the call failed is the outcome
        return f"{type(e).__name__}: {e}"
    return frames


async def _unary(p2p: P2P, peer: PeerID, name: str, request, reply_type) -> object:
    try:
        return await asyncio.wait_for(p2p.call_protobuf_handler(peer, name, request, reply_type), CALL_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - how the call failed is the outcome
        return f"{type(e).__name__}: {e}"


async def _reach(p2p: P2P, peer: PeerID) -> list[str]:
    """Dial `peer` and read what identify lists. libp2p finds a peer known only by its id through the initial
    peer's routing table, which takes a moment to fill: until then the dial fails, and we try again."""
    deadline = asyncio.get_running_loop().time() + CALL_TIMEOUT
    while True:
        try:
            return await _identified(p2p, peer)
        except Exception:  # noqa: BLE001 - p2pd's "failed to find any peer in table": not reachable yet
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


def _named(served: list[str]) -> dict[str, str]:
    """What a stranger learns from identify: the names of the RPCs it then calls."""
    ends = {"forward": "::StageService.rpc_forward", "read": "::CheckpointServer.rpc_read",
            "dht": "DHTProtocol.rpc_ping", "run_info": "::RunInfoServicer.rpc_run_info"}
    found = {what: [name for name in served if name.endswith(end)] for what, end in ends.items()}
    assert all(found.values()), f"identify no longer lists one of {ends}: then this test checks nothing ({served})"
    return {what: names[0] for what, names in found.items()}


async def _call_everything(coordinator: str, server: str, swarm_key: SwarmKey | None) -> tuple[str, dict]:
    """From a fresh peer holding `swarm_key` (or none): a stage forward and a checkpoint read on the server, a DHT
    ping and run_info on the coordinator, each by the name identify gave; the peer's id and each call's outcome."""
    p2p = await P2P.create(initial_peers=[coordinator], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        coordinator_id, server_id = PeerID.from_base58(coordinator.rsplit("/p2p/", 1)[1]), PeerID.from_base58(server)
        names = _named([*await _reach(p2p, coordinator_id), *await _reach(p2p, server_id)])
        junk = runtime_pb2.ExpertRequest(uid="x", metadata=b"not a request")
        read = runtime_pb2.ExpertRequest(metadata=msgpack.packb({"manifest_id": "0" * 64, "file": "x", "offset": 0}))
        with gated(swarm_key):
            outcomes = {
                "forward": await _answers(p2p, server_id, names["forward"], junk),
                "checkpoint read": await _answers(p2p, server_id, names["read"], read),
                "dht": await _unary(p2p, coordinator_id, names["dht"], dht_pb2.PingRequest(), dht_pb2.PingResponse),
                "run_info": await _unary(p2p, coordinator_id, names["run_info"], runtime_pb2.ExpertInfo(),
                                         runtime_pb2.ExpertInfo),
            }
        return p2p.peer_id.to_base58(), outcomes
    finally:
        await p2p.shutdown()


def test_a_stranger_is_refused_by_every_rpc_identify_names_and_a_peer_with_the_key_is_served(private, server):
    coordinator, key_file = private
    swarm_key = load_swarm_key(key_file)
    for other_key in (None, SwarmKey(b"\xab" * 32)):
        stranger, refused = asyncio.run(_call_everything(coordinator.maddrs[0], server.peer_id, other_key))
        # a stream is closed before its handler reads a byte (no reply frame); a unary call says why
        refusals = {what: outcome == [] if what in ("forward", "checkpoint read") else gate.REFUSED in str(outcome)
                    for what, outcome in refused.items()}
        assert all(refusals.values()), f"refused: {refusals}; outcomes: {refused}"
        server.proc.wait_for_line(f"refused calls from peer {stranger}", CALL_TIMEOUT, stream="stderr")
    # the same calls with the key: every handler answers
    _, served = asyncio.run(_call_everything(coordinator.maddrs[0], server.peer_id, swarm_key))
    assert len(served["forward"]) >= 1 and len(served["checkpoint read"]) >= 1, served
    assert isinstance(served["dht"], dht_pb2.PingResponse), served
    answer = served["run_info"].serialized_info
    assert answer.startswith(SEALED_PREFIX.encode()) and RUN_ID.encode() not in answer
    assert RunInfo.from_bytes(swarm_key.open_bytes(answer, RUN_INFO_PURPOSE)).run_id == swarm_key.network_id(RUN_ID)
