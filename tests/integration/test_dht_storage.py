"""A stranger floods a coordinator's DHT node with 100 MiB from stock hivemind; its memory stays bounded.

Issue 26, attack 6: a stock hivemind node stored 96 MiB with a 30-day expiry in a coordinator's DHT
node in 6 s (+126 MiB RSS). Here the attacker's node (stock hivemind, its own RSA key) sends store
requests straight to the coordinator's node: signed records padded to the largest size the run's
guard accepts at every key of the run, small values at made-up keys (stored and cached), a key with
thousands of subkeys, and large values that would live for 30 days. The coordinator's DHT process
(the one that holds the storage) may grow by at most MAX_GROWTH in resident memory, and every
honest record (config, run checkpoint, servers, checkpoint lists, metrics, expert hosts, averaging
progress and declarations) is still held there and read by a newcomer; a server that comes after
the flood still finds room.
"""

from __future__ import annotations

import functools
import os

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.averaging.process import step_bits
from swarm.averaging.progress import ProgressRecord
from swarm.config import OptimizerConfig, RunConfig
from swarm.dht import (
    BackgroundLoop,
    CheckpointRecord,
    ExpertHostRecord,
    HeldCheckpoint,
    PeerMetricsRecord,
    RunCheckpointRecord,
    RunCheckpointStage,
    RunInfo,
    ServerRecord,
    ServerState,
    SwarmRecords,
    join_run,
    load_identity,
    peer_id,
    serve_run_info,
    start_dht,
    visible_maddrs,
)
from swarm.dht.keys import MAX_RECORD_BYTES, averaging_prefix, dht_key, progress_key, run_fields
from swarm.dht.schemas import MAX_STAGES
from swarm.dht.storage import CACHE_LIMITS, STORAGE_LIMITS
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
RUN_ID = "flooded-run"
CONFIG = RunConfig(run_id=RUN_ID, optimizer=OptimizerConfig(lr=3e-4))
FLOOD_BYTES = 100 * MiB
MAX_GROWTH = 16 * MiB  # resident memory the coordinator's DHT process may gain under the flood
TTL = 600.0
JOIN_TIMEOUT = 30.0
PROPAGATION_TIMEOUT = 20.0
HASH = "ab" * 32


# --- in the attacker's DHT process (stock hivemind): store straight into the target node ----------------

def _attacker_record(field: str, attacker: str) -> dict:
    """A record the run's guard and schema accept at `field`, signed by the attacker for itself."""
    number = int("".join(c for c in field if c.isdigit()) or 0)
    if field.startswith("stage"):
        return ServerRecord(peer_id=attacker, stage=number, state=ServerState.ONLINE, throughput=1.0).to_wire()
    if field.startswith("checkpoints"):
        return CheckpointRecord(peer_id=attacker, stage=number, state_hash=HASH, checkpoints=[]).to_wire()
    if field.startswith("expert_checkpoints"):
        return CheckpointRecord(peer_id=attacker, stage=number, part="expert", state_hash=HASH,
                                checkpoints=[]).to_wire()
    if field == "config":
        return dict(run_id=RUN_ID, config_yaml="x: 1", coordinator_peer_id=attacker)
    if field == "run_checkpoint":
        return RunCheckpointRecord(peer_id=attacker, state_hash=HASH, step=0, manifest_id=HASH, stages=[]).to_wire()
    if field == "experts":
        return ExpertHostRecord(peer_id=attacker, experts=[], state=ServerState.ONLINE, throughput=1.0).to_wire()
    if field == "metrics":
        return PeerMetricsRecord(peer_id=attacker, role="trainer", step=0, samples_per_second=0.0, samples=0,
                                 time=0.0).to_wire()
    return dict(peer_id=attacker)  # a stage's averaging progress


async def _flood(target: str, owner: bytes, attacker: str, scale: float, _dht, node) -> int:
    """Send about `scale` * 100 MiB of store requests to `target`; returns the bytes sent."""
    peer, protocol, sent = PeerID.from_base58(target), node.protocol, 0

    async def send(keys, values, expiration, subkeys=None, in_cache=False) -> None:
        nonlocal sent
        await protocol.call_store(peer, keys, values, expiration, subkeys=subkeys, in_cache=in_cache)
        sent += sum(map(len, values)) + sum(len(s) for s in subkeys or ())

    # 1. at every key of the run, its own signed record, padded to just under the guard's limit (less where the run
    # has so many keys that this part would pass 48 MiB: the flood stays the 100 MiB it says), stored (~48 MiB) and
    # cached (~12 MiB, a quarter of the keys)
    fields = [(dht_key(RUN_ID, f), f) for f in run_fields()]
    fields += [(progress_key(RUN_ID, k), "") for k in range(MAX_STAGES)]
    padding = min(MAX_RECORD_BYTES - 1000, 48 * MiB // len(fields) - 200)
    fields = fields[:max(1, int(len(fields) * scale))]
    expiration, subkey = get_dht_time() + TTL, MSGPackSerializer.dumps(owner)
    for start in range(0, len(fields), 16):
        keys, values = [], []
        for key, field in fields[start:start + 16]:
            padded = dict(_attacker_record(field, attacker), padding="x" * padding)
            value = MSGPackSerializer.dumps(padded)
            key_id = DHTID.generate(source=key)
            values.append(protocol.record_validator.sign_value(DHTRecord(key_id.to_bytes(), subkey, value, expiration)))
            keys.append(key_id)
        await send(keys, values, expiration, subkeys=[owner] * len(keys))
        if start % 64 == 0:
            await send(keys, values, expiration, subkeys=[owner] * len(keys), in_cache=True)
    # 2. made-up keys: small values, stored (25 MiB) and cached (8 MiB); 3. one key, 1 KB subkeys (2 MiB)
    for total, in_cache in ((25 * MiB, False), (8 * MiB, True), (2 * MiB, None)):
        for _ in range(max(1, int(total * scale) // (4000 * 200))):
            if in_cache is None:
                keys = [DHTID.generate(source=f"one-key-{os.getpid()}")] * 4000
                subkeys = [os.urandom(1000) for _ in keys]
            else:
                keys, subkeys = [DHTID.generate(source=os.urandom(16)) for _ in range(4000)], None
            await send(keys, [os.urandom(200) for _ in keys], get_dht_time() + TTL, subkeys=subkeys,
                       in_cache=bool(in_cache))
    # 4. made-up keys: 64 KiB values that would live for 30 days (10 MiB)
    for _ in range(max(1, int(10 * MiB * scale) // MiB)):
        await send([DHTID.generate(source=os.urandom(16)) for _ in range(16)], [os.urandom(64 << 10)] * 16,
                   get_dht_time() + 30 * 24 * 3600.0)
    return sent


# --- in the coordinator's DHT process ---------------------------------------------------------------------

async def _held(wanted: list[tuple[str, bytes]], _dht, node) -> list[bool]:
    """Whether the node's own storage holds each (key, subkey)."""
    found = []
    for key, subkey in wanted:
        item = node.protocol.storage.get(DHTID.generate(source=key))
        found.append(item is not None and isinstance(item.value, DictionaryDHTValue)
                     and item.value.get(subkey) is not None)
    return found


async def _storage_bytes(_dht, node) -> tuple[int | None, int | None]:
    return getattr(node.protocol.storage, "used_bytes", None), getattr(node.protocol.cache, "used_bytes", None)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.fixture
def run():
    loop = BackgroundLoop("test-dht-storage").start()
    dhts: list[hivemind.DHT] = []
    try:
        coordinator = load_identity(None)
        dhts.append(start_dht(RUN_ID, coordinator))
        maddrs = visible_maddrs(dhts[0])
        info = RunInfo(RUN_ID, coordinator.owner_key, peer_id(dhts[0]))
        serve_run_info(dhts[0], loop, info)
        server = load_identity(None)
        dhts.append(start_dht(RUN_ID, server, initial_peers=maddrs))
        attacker = load_identity(None)
        dhts.append(hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                                 record_validators=[RSASignatureValidator(attacker.signing_key)]))
        yield dict(loop=loop, maddrs=maddrs, info=info, coordinator=coordinator, server=server, attacker=attacker,
                   dhts=dhts)
    finally:
        loop.stop()
        for dht in reversed(dhts):
            dht.shutdown()


def publish_honest_records(run) -> list[tuple[str, bytes]]:
    """Every kind of record the project publishes, from the coordinator and a server; their (key, subkey)."""
    coordinator, server = run["coordinator"], run["server"]
    by_coordinator = SwarmRecords(run["dhts"][0], RUN_ID, coordinator)
    by_server = SwarmRecords(run["dhts"][1], RUN_ID, server)
    held = HeldCheckpoint(step=5, manifest_id=HASH, size=100)
    assert by_coordinator.publish_run_config(CONFIG, ttl=TTL)
    assert by_coordinator.announce_run_checkpoint(RunCheckpointRecord(
        peer_id=coordinator.peer_id, state_hash=HASH, step=5, manifest_id=HASH,
        stages=[RunCheckpointStage(stage=0, step=5, manifest_id=HASH)]), ttl=TTL)
    assert by_server.announce_server(ServerRecord(peer_id=server.peer_id, stage=0, state=ServerState.ONLINE,
                                                  throughput=10.0, step=5), ttl=TTL)
    assert by_server.announce_checkpoints(CheckpointRecord(peer_id=server.peer_id, stage=0, state_hash=HASH,
                                                           checkpoints=[held]), ttl=TTL)
    assert by_server.publish_metrics(PeerMetricsRecord(peer_id=server.peer_id, role="server", step=5,
                                                       samples_per_second=3.0, samples=100, time=1.0), ttl=TTL)
    assert by_server.announce_expert_host(ExpertHostRecord(peer_id=server.peer_id, experts=[0, 1],
                                                           state=ServerState.ONLINE, throughput=3.0), ttl=TTL)
    progress = ProgressRecord(peer_id=server.peer_id, step=5, samples=10, round_id="r", group=1, priority=1.0)
    server_dht, peer_bytes = run["dhts"][1], PeerID.from_base58(server.peer_id).to_bytes()
    prefix = averaging_prefix(RUN_ID, 0)
    stores = [(progress_key(RUN_ID, 0), server.owner_key, progress.to_wire()),
              (f"{prefix}.all_averagers", peer_bytes, 1.0), (f"{prefix}.0b{step_bits(5)}", peer_bytes, True)]
    for key, subkey, value in stores:
        assert server_dht.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + TTL)
    fields = ["config", "run_checkpoint"], ["stage0", "checkpoints0", "metrics", "experts"]
    return ([(dht_key(RUN_ID, f), coordinator.owner_key) for f in fields[0]]
            + [(dht_key(RUN_ID, f), server.owner_key) for f in fields[1]] + [(k, s) for k, s, _ in stores])


def test_a_100_mib_flood_grows_the_dht_process_by_at_most_16_mib_and_keeps_every_honest_record(run):
    coordinator_dht, attacker = run["dhts"][0], run["attacker"]
    honest = publish_honest_records(run)
    wait_until(lambda: all(coordinator_dht.run_coroutine(functools.partial(_held, honest))), PROPAGATION_TIMEOUT,
               0.2, "the coordinator's node to hold every honest record")
    flood = functools.partial(_flood, peer_id(coordinator_dht), attacker.owner_key, attacker.peer_id)
    run["dhts"][2].run_coroutine(functools.partial(flood, 0.01))  # every code path once, before measuring
    before = rss(coordinator_dht.pid)
    sent = run["dhts"][2].run_coroutine(functools.partial(flood, 1.0))
    growth = rss(coordinator_dht.pid) - before
    storage, cache = coordinator_dht.run_coroutine(_storage_bytes)
    print(f"flood of {sent / MiB:.1f} MiB: DHT process RSS +{growth / MiB:.1f} MiB; "
          f"storage {storage} bytes, cache {cache} bytes charged")
    assert sent >= FLOOD_BYTES * 0.99
    assert growth <= MAX_GROWTH, f"the coordinator's DHT process grew by {growth / MiB:.1f} MiB"
    assert storage <= STORAGE_LIMITS.run.budget + STORAGE_LIMITS.other.budget
    assert cache <= CACHE_LIMITS.run.budget + CACHE_LIMITS.other.budget
    assert all(coordinator_dht.run_coroutine(functools.partial(_held, honest)))

    # a newcomer reads every honest record; a server that comes now still finds room on the flooded node
    newcomer = load_identity(None)
    dht, info, config = join_run(run["maddrs"], newcomer, run["loop"], timeout=JOIN_TIMEOUT)
    run["dhts"].append(dht)
    assert info == run["info"] and config == CONFIG
    records = SwarmRecords(dht, RUN_ID, newcomer)
    server = run["server"]
    # (the attacker's own records, signed by it and naming it, are as readable as any peer's)
    assert server.peer_id in [r.peer_id for r in records.lookup_servers(0)]
    assert server.peer_id in [r.peer_id for r in records.lookup_checkpoints(0)]
    assert server.peer_id in [r.peer_id for r in records.lookup_metrics()]
    assert server.peer_id in [r.peer_id for r in records.lookup_expert_hosts()]
    assert [r.peer_id for r in records.lookup_run_checkpoints(run["coordinator"].owner_key)] == [
        run["coordinator"].peer_id]
    late = ServerRecord(peer_id=newcomer.peer_id, stage=1, state=ServerState.ONLINE, throughput=1.0)
    assert records.announce_server(late, ttl=TTL)
    late_key = [(dht_key(RUN_ID, "stage1"), newcomer.owner_key)]
    wait_until(lambda: coordinator_dht.run_coroutine(functools.partial(_held, late_key))[0], PROPAGATION_TIMEOUT,
               0.2, "the flooded node to hold a server record announced after the flood")
