"""A stranger running stock hivemind (none of our code) attacks a run's DHT records; the run goes on.

Real DHT nodes on 127.0.0.1: a coordinator, an honest server's node, and an attacker whose node
stores whatever it likes at every key of the run, both unsigned (plain values, unsigned subkeys,
far-future expiries, garbage) and signed with its own key (a flood of ONLINE servers under subkeys
that merely contain its owner marker, a record naming the honest server's peer id, infinite
throughput, an oversized value). After each attack a newcomer joins as `swarm-peer` does and finds
the coordinator's config, and every reader lists exactly the honest server.
"""

from __future__ import annotations

import functools
import pickle

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from swarm.config import OptimizerConfig, RunConfig
from swarm.dht import (
    BackgroundLoop,
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
from swarm.dht.keys import MAX_RECORD_BYTES, dht_key, run_fields
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(150)

RUN_ID = "attacked-run"
CONFIG = RunConfig(run_id=RUN_ID, optimizer=OptimizerConfig(lr=3e-4))
JOIN_TIMEOUT = 30.0
PROPAGATION_TIMEOUT = 20.0
FAKE_SERVERS = 500
FAR = 10 * 24 * 3600.0  # ten days


@pytest.fixture(scope="module")
def run():
    loop = BackgroundLoop("test-dht-attacks").start()
    dhts: list[hivemind.DHT] = []
    try:
        coordinator = load_identity(None)
        dhts.append(start_dht(RUN_ID, coordinator))
        coordinator_records = SwarmRecords(dhts[0], RUN_ID, coordinator)
        assert coordinator_records.publish_run_config(CONFIG, ttl=600)
        info = RunInfo(RUN_ID, coordinator.owner_key, peer_id(dhts[0]))
        serve_run_info(dhts[0], loop, info)
        maddrs = visible_maddrs(dhts[0])

        server = load_identity(None)
        dhts.append(start_dht(RUN_ID, server, initial_peers=maddrs))
        server_records = SwarmRecords(dhts[1], RUN_ID, server)
        honest = ServerRecord(peer_id=server.peer_id, stage=0, state=ServerState.ONLINE, throughput=10.0)
        assert server_records.announce_server(honest, ttl=600)
        wait_until(lambda: coordinator_records.lookup_servers(0) == [honest], PROPAGATION_TIMEOUT, 0.2, "honest record")

        attacker_key = load_identity(None)  # only its key: the attacker's node is stock hivemind
        signing = hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                               record_validators=[RSASignatureValidator(attacker_key.signing_key)])
        dhts.append(signing)
        unsigned = hivemind.DHT(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        dhts.append(unsigned)
        yield dict(loop=loop, maddrs=maddrs, info=info, honest=honest, attacker=attacker_key, signing=signing,
                   unsigned=unsigned, readers=[coordinator_records, server_records], dhts=dhts)
    finally:
        close_replica(loop, dhts[0])
        loop.stop()
        for dht in reversed(dhts):
            dht.shutdown()


async def _shutdown_replica(dht: hivemind.DHT) -> None:
    await (await dht.replicate_p2p()).shutdown()


def close_replica(loop: BackgroundLoop, dht: hivemind.DHT) -> None:
    """Shut down this process's replica of `dht`'s P2P on the loop that used it: left to the garbage collector,
    it would close its tasks from a thread with no event loop (an "Exception ignored" warning)."""
    loop.run(_shutdown_replica(dht), JOIN_TIMEOUT)


async def _store_many(keys: list, subkeys: list, values: list, expiration: float, _dht, node) -> None:
    await node.store_many(keys, values, expiration, subkeys=subkeys)


async def _store_padded(key: str, subkey: bytes, value: dict, pad: int, expiration: float, _dht, node) -> None:
    # built in the DHT process: a value this large cannot cross hivemind's command pipe (see store_many)
    await node.store(key, dict(value, padding="x" * pad), expiration, subkey=subkey)


def store_many(dht: hivemind.DHT, items: list[tuple[str, object, object]], expires_in: float) -> None:
    """Store (key, subkey, value) items from `dht` in batches, as an attacker's script would.

    Each call into the DHT process stays under 16 KiB pickled: hivemind reads its command pipe without
    blocking, and a longer message arrives in two writes and is lost.
    """
    batch: list = []
    for item in items + [None]:
        if item is None or len(pickle.dumps(batch + [item])) > 12_000:
            if batch:
                keys, subkeys, values = map(list, zip(*batch))
                dht.run_coroutine(functools.partial(_store_many, keys, subkeys, values, get_dht_time() + expires_in))
            batch = []
        if item is not None:
            batch.append(item)


def assert_run_unharmed(run) -> None:
    """A newcomer joins as swarm-peer does and gets the coordinator's config; readers see only the honest server."""
    newcomer = load_identity(None)
    dht, info, config = join_run(run["maddrs"], newcomer, run["loop"], timeout=JOIN_TIMEOUT)
    try:
        assert info == run["info"] and config == CONFIG
        readers = run["readers"] + [SwarmRecords(dht, RUN_ID, newcomer)]
        for records in readers:
            assert records.lookup_all_servers(2) == {0: [run["honest"]], 1: []}
            assert records.fetch_run_config(run["info"].coordinator_key) == CONFIG
    finally:
        close_replica(run["loop"], dht)
        dht.shutdown()


def test_unsigned_values_at_every_run_key_wipe_nothing(run):
    items = []
    for field in run_fields():
        key = dht_key(RUN_ID, field)
        items += [(key, None, None), (key, None, "garbage"), (key, b"anonymous", {"peer_id": "x"})]
    store_many(run["unsigned"], items, FAR)
    # the attacker's own node keeps what it stored: the honest ones must not, and readers must skip it
    wait_until(lambda: run["unsigned"].get(dht_key(RUN_ID, "config"), latest=True) is not None, 10, 0.2,
               "the attacker's own copy")
    assert_run_unharmed(run)


def test_one_key_cannot_announce_many_servers_or_speak_for_another(run):
    attacker = run["attacker"]
    fake = dict(stage=0, state="ONLINE", throughput=1e9, step=0, role="server", version="0.1.0")
    key = dht_key(RUN_ID, "stage0")
    flood = [(key, b"fake%d" % i + attacker.owner_key, dict(fake, peer_id=f"QmFake{i}")) for i in range(FAKE_SERVERS)]
    store_many(run["signing"], flood, 600)
    store_many(run["signing"], [
        (key, attacker.owner_key, dict(fake, peer_id=run["honest"].peer_id)),  # speaks for the honest server
        (key, attacker.owner_key, dict(fake, peer_id=attacker.peer_id, throughput=float("inf"))),
        (dht_key(RUN_ID, "config"), attacker.owner_key, dict(run_id=RUN_ID, config_yaml="x: 1",
                                                              coordinator_peer_id=attacker.peer_id)),
    ], 600)
    store_many(run["signing"], [(key, attacker.owner_key, dict(fake, peer_id=attacker.peer_id))], FAR)
    run["signing"].run_coroutine(functools.partial(_store_padded, key, attacker.owner_key,
                                                   dict(fake, peer_id=attacker.peer_id), MAX_RECORD_BYTES,
                                                   get_dht_time() + 600))
    assert_run_unharmed(run)
