"""BoundedStorage: what a DHT node keeps for others stays within bytes, entries and lifetime, shared fairly."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.averaging.progress import ProgressRecord
from swarm.config import RunConfig
from swarm.dht import (
    CheckpointRecord,
    ExpertHostRecord,
    HeldCheckpoint,
    PeerMetricsRecord,
    RunCheckpointRecord,
    RunCheckpointStage,
    RunConfigRecord,
    ServerRecord,
    ServerState,
    SwarmKey,
    load_identity,
)
from swarm.dht import storage as storage_module
from swarm.dht.keys import MAX_RECORD_LIFETIME, MAX_SUBKEY_BYTES
from swarm.dht.schemas import MAX_HELD_CHECKPOINTS, MAX_HOSTED_EXPERTS, MAX_STAGES
from swarm.dht.storage import (
    ENTRY_OVERHEAD,
    OTHER_VALUE_BYTES,
    RUN_RECORD,
    STORAGE_LIMITS,
    BoundedStorage,
    PoolLimits,
    StorageLimits,
    install_bounded_storage,
)

RUN_KEY, RUN_KEY2, OTHER_KEY = (DHTID.generate(source=name) for name in ("run_stage0", "run_stage1", "elsewhere"))
HONEST, STRANGER, COORDINATOR = (load_identity(None).owner_key for _ in range(3))
CHARGE = 100 + len(HONEST) + ENTRY_OVERHEAD  # of a 100-byte value under an owner marker


def bounded(run_budget: int = 10**9, other_budget: int = 10**9, max_subkeys: int = 1000, **kwargs) -> BoundedStorage:
    limits = StorageLimits(run=PoolLimits(run_budget, max_subkeys, RUN_RECORD),
                           other=PoolLimits(other_budget, max_subkeys, OTHER_VALUE_BYTES))
    return BoundedStorage(limits, run_keys=[RUN_KEY, RUN_KEY2] + [DHTID.generate(source=f"run{i}") for i in range(50)],
                          **kwargs)


def run_key(i: int) -> DHTID:
    return DHTID.generate(source=f"run{i}")


def subkeys(storage: BoundedStorage, key: DHTID) -> list:
    return sorted(subkey for subkey, _ in storage.get(key).value.items())


def later(seconds: float = 60.0) -> float:
    return get_dht_time() + seconds


def test_lifetime_size_and_shape_are_bounded_at_every_key():
    storage = bounded()
    assert storage.store(OTHER_KEY, b"x", later(MAX_RECORD_LIFETIME - 5), subkey=b"a")
    assert not storage.store(OTHER_KEY, b"x", later(MAX_RECORD_LIFETIME + 5), subkey=b"b")  # 30 days, say
    assert not storage.store(OTHER_KEY, b"x", later(-1), subkey=b"c")  # expired already
    assert not storage.store(OTHER_KEY, b"x" * (OTHER_VALUE_BYTES + 1), later(), subkey=b"d")
    assert storage.store(RUN_KEY, b"x" * RUN_RECORD, later(), subkey=HONEST)  # a run record may be larger
    assert not storage.store(RUN_KEY, b"x" * (RUN_RECORD + 1), later(), subkey=STRANGER)
    assert not storage.store(OTHER_KEY, b"x", later(), subkey=b"k" * (MAX_SUBKEY_BYTES + 1))
    assert not storage.store(OTHER_KEY, b"x", later(), subkey=("a tuple", "of any size"))
    assert storage.entries == 2


def test_a_key_holds_at_most_max_subkeys_and_a_newcomer_takes_the_latest_expiring_place():
    storage = bounded(max_subkeys=4)
    for i in range(4):
        assert storage.store(OTHER_KEY, b"v", later(100 + i), subkey=b"peer%d" % i)
    assert not storage.store(OTHER_KEY, b"v", later(200), subkey=b"later")  # lives longer than any held: refused
    assert storage.store(OTHER_KEY, b"v", later(50), subkey=b"sooon")  # replaces the one that lives longest
    assert subkeys(storage, OTHER_KEY) == [b"peer0", b"peer1", b"peer2", b"sooon"]


def test_the_largest_holder_loses_first_and_cannot_grow_while_the_pool_is_full():
    storage = bounded(run_budget=10 * CHARGE)
    for i in range(10):  # one stranger's key fills the pool, a record at each of ten run keys
        assert storage.store(run_key(i), b"s" * 100, later(), subkey=STRANGER)
    assert not storage.store(run_key(10), b"s" * 100, later(), subkey=STRANGER)  # it holds the most: no more
    assert storage.store(RUN_KEY, b"h" * 100, later(), subkey=HONEST)  # an honest newcomer finds room
    assert storage.get(run_key(0)) is None  # the stranger's oldest went
    assert storage.get(RUN_KEY).value.get(HONEST) is not None
    assert storage.used_bytes <= 10 * CHARGE


def test_ties_go_to_what_is_held():
    storage = bounded(run_budget=2 * CHARGE)
    assert storage.store(RUN_KEY, b"h" * 100, later(), subkey=HONEST)
    assert storage.store(RUN_KEY2, b"s" * 100, later(), subkey=STRANGER)
    assert not storage.store(run_key(0), b"c" * 100, later(), subkey=COORDINATOR)  # as large as each: refused
    # renewing a held record never needs room: the pool stays full, the renewal goes in
    assert storage.store(RUN_KEY, b"H" * 100, later(120), subkey=HONEST)
    assert storage.get(RUN_KEY).value.get(HONEST).value == b"H" * 100
    assert not storage.store(RUN_KEY, b"old", later(60), subkey=HONEST)  # an older copy changes nothing


def test_trusted_records_are_never_dropped_nor_refused_for_room():
    storage = bounded(run_budget=3 * CHARGE, trusted=[COORDINATOR])
    for i in range(3):
        assert storage.store(run_key(i), b"s" * 100, later(), subkey=STRANGER)
    for i in range(3, 8):  # the coordinator's records go in, the stranger's make room, then the pool overflows
        assert storage.store(run_key(i), b"c" * 100, later(), subkey=COORDINATOR)
    assert all(storage.get(run_key(i)) is not None for i in range(3, 8))
    assert not any(storage.get(run_key(i)) for i in range(3))
    assert not storage.store(RUN_KEY, b"h" * 100, later(), subkey=HONEST)  # no untrusted holder to make room


def test_a_signer_trusted_later_keeps_what_it_holds():
    storage = bounded(run_budget=3 * CHARGE)
    for i in range(3):  # the coordinator holds the most (it is not known as the coordinator yet)
        assert storage.store(run_key(i), b"c" * 100, later(), subkey=COORDINATOR)
    storage.trust([COORDINATOR])
    assert not storage.store(RUN_KEY, b"h" * 100, later(), subkey=HONEST)  # it may no longer make room from them
    assert all(storage.get(run_key(i)) is not None for i in range(3))


def test_expired_entries_free_their_bytes(monkeypatch):
    storage = bounded()
    now = get_dht_time()
    assert storage.store(RUN_KEY, b"x" * 100, now + 10, subkey=HONEST)
    assert storage.store(OTHER_KEY, b"x", now + 20)
    assert storage.used_bytes > 0
    monkeypatch.setattr(storage_module, "get_dht_time", lambda: now + 30)
    assert len(storage) == 0 and storage.used_bytes == 0 and storage.entries == 0


def test_renewals_do_not_accumulate_memory():
    storage = bounded()
    start = get_dht_time()
    storage.store(RUN_KEY, b"x" * 100, start + 1, subkey=HONEST)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):  # a stranger replaying ever later copies of one record
            assert storage.store(RUN_KEY, b"x" * 100, start + 2 + i / 1000, subkey=HONEST)
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert growth < 50_000, f"{growth} bytes kept by 20,000 renewals of one entry"
    assert storage.entries == 1


def test_a_read_is_a_copy_and_hivemind_plain_and_dictionary_rules_hold():
    storage = bounded()
    assert storage.store(OTHER_KEY, b"plain", later(10))
    assert not storage.store(OTHER_KEY, b"v", later(5), subkey=b"a")  # the plain value lives longer
    assert storage.store(OTHER_KEY, b"v", later(20), subkey=b"a")  # a later dictionary replaces it
    found = storage.get(OTHER_KEY)
    assert isinstance(found.value, DictionaryDHTValue) and found.value.get(b"a").value == b"v"
    found.value.store(b"merged", b"w", later(30))  # what a caller merges into a read stays out
    assert storage.get(OTHER_KEY).value.get(b"merged") is None
    whole = DictionaryDHTValue()
    whole.store(b"b", b"w", later(25))
    assert storage.store(OTHER_KEY, whole, later(25))  # a cached search result: its entries, one by one
    assert subkeys(storage, OTHER_KEY) == [b"a", b"b"]
    del storage[OTHER_KEY]
    assert OTHER_KEY not in storage and storage.used_bytes == 0


def test_keys_learned_as_the_runs_drop_what_was_held_there_unchecked():
    storage = BoundedStorage(StorageLimits(PoolLimits(10**6, 10, RUN_RECORD), PoolLimits(10**6, 10, 256)))
    assert storage.store(RUN_KEY, b"plain", later())  # before the run is known, a run key is any other key
    storage.set_run_keys([RUN_KEY])
    assert RUN_KEY not in storage and storage.used_bytes == 0


def test_install_moves_what_a_node_held_within_the_bounds():
    protocol = SimpleNamespace(storage=DHTLocalStorage(), cache=DHTLocalStorage())
    protocol.storage.store(OTHER_KEY, b"kept", later())
    protocol.storage.store(RUN_KEY, b"x" * 100, later(), subkey=HONEST)
    protocol.cache.store(OTHER_KEY, b"x" * 10_000, later())  # too large to keep
    install_bounded_storage(protocol, [COORDINATOR], [RUN_KEY])
    assert isinstance(protocol.storage, BoundedStorage) and isinstance(protocol.cache, BoundedStorage)
    assert protocol.storage.get(OTHER_KEY).value == b"kept"
    assert protocol.storage.get(RUN_KEY).value.get(HONEST).value == b"x" * 100
    assert OTHER_KEY not in protocol.cache
    bounded_storage = protocol.storage
    install_bounded_storage(protocol, [HONEST])  # again: the same storage, one more trusted signer
    assert protocol.storage is bounded_storage and bounded_storage.trusted == {COORDINATOR, HONEST}


@pytest.mark.parametrize("flood", [10_000])
def test_a_flood_of_made_up_keys_stays_within_the_budget(flood):
    storage = bounded(other_budget=100 * (200 + 16 + ENTRY_OVERHEAD))
    for i in range(flood):
        storage.store(DHTID.generate(source=f"junk{i}"), b"j" * 200, later(600))
    assert storage.used_bytes <= 100 * (200 + 16 + ENTRY_OVERHEAD) and storage.entries <= 100
    assert storage.store(OTHER_KEY, b"1", later(5), subkey=b"peer")  # an averager's declaration still goes in


def _signed(value: dict, signer: RSASignatureValidator, owner: bytes) -> tuple[bytes, bytes]:
    """(subkey, value) as a node stores them: msgpack'd, the value signed by its owner."""
    record = DHTRecord(RUN_KEY.to_bytes(), MSGPackSerializer.dumps(owner), MSGPackSerializer.dumps(value), later())
    return owner, signer.sign_value(record)


def test_the_largest_honest_records_fit_with_room_to_spare():
    identity = load_identity(None)
    signer, peer = RSASignatureValidator(identity.signing_key), identity.peer_id
    config = RunConfig(run_id="r" * 64 + "-" + "f" * 24)
    config.stages.num_stages = MAX_STAGES
    held = [HeldCheckpoint(step=2**40, manifest_id="a" * 64, size=2**40)] * MAX_HELD_CHECKPOINTS
    stages = [RunCheckpointStage(stage=k, step=2**40, manifest_id="a" * 64) for k in range(MAX_STAGES)]
    address = "a" * 245 + ".example:65535"  # the longest metrics address a record takes
    records = {
        "config": RunConfigRecord(run_id=config.run_id, config_yaml=SwarmKey(b"k" * 32).seal(config.to_yaml()),
                                  coordinator_peer_id=peer),
        "run checkpoint": RunCheckpointRecord(peer_id=peer, state_hash="a" * 64, step=2**40, manifest_id="a" * 64,
                                              stages=stages),
        "server": ServerRecord(peer_id=peer, stage=255, state=ServerState.JOINING, throughput=1e9, step=2**40,
                               metrics_addr=address),
        "checkpoints": CheckpointRecord(peer_id=peer, stage=255, state_hash="a" * 64, checkpoints=held),
        "expert host": ExpertHostRecord(peer_id=peer, experts=list(range(MAX_HOSTED_EXPERTS)),
                                        state=ServerState.ONLINE, throughput=1e9, metrics_addr=address),
        "metrics": PeerMetricsRecord(peer_id=peer, role="trainer", step=2**40, samples_per_second=1e9,
                                     samples=2**50, time=get_dht_time(), stage=255, loss=1.5, metrics_addr=address),
        "progress": ProgressRecord(peer_id=peer, step=2**40, samples=2**40, round_id="a" * 64, group=2**20,
                                   priority=1e9, updated=get_dht_time(), fingerprint=[1e9, 1e9], averaging=True),
    }
    sizes = {name: len(_signed(record.to_wire(), signer, identity.owner_key)[1]) for name, record in records.items()}
    assert sizes["run checkpoint"] <= RUN_RECORD / 2, sizes  # the largest: every stage of a 256-stage run
    assert max(sizes.values()) == sizes["run checkpoint"], sizes
    assert len(identity.owner_key) <= MAX_SUBKEY_BYTES / 2
    # hivemind's averaging, at keys of no run: a float or None (state sources), a bool (group keys)
    peer_bytes = PeerID.from_base58(peer).to_bytes()
    assert max(len(MSGPackSerializer.dumps(v)) for v in (1e300, None, True)) <= OTHER_VALUE_BYTES / 16
    # a swarm of 1,000 peers, 64 stages x 8 servers (server, checkpoint list, progress, metrics each) and 488
    # trainers, every record at its largest and all on one node: the run's pool holds it, with room to spare;
    # the averaging keys too (a state source and a group key per server)
    marker = len(identity.owner_key)
    per_server = sum(sizes[n] + marker + ENTRY_OVERHEAD for n in ("server", "checkpoints", "metrics", "progress"))
    coordinator = sum(sizes[n] + marker + ENTRY_OVERHEAD for n in ("config", "run checkpoint", "metrics"))
    whole = (64 * 8 * per_server + 488 * (sizes["metrics"] + marker + ENTRY_OVERHEAD) + coordinator
             + 64 * (sizes["checkpoints"] + marker + ENTRY_OVERHEAD))  # the coordinator's archive, every stage
    assert whole <= STORAGE_LIMITS.run.budget * 0.9, whole
    averaging = 64 * 8 * 2 * (len(peer_bytes) + 9 + ENTRY_OVERHEAD)
    assert averaging <= STORAGE_LIMITS.other.budget * 0.75, averaging
