"""DHT record schemas, keys and validators, identity files, run info, BackgroundLoop: no processes."""

from __future__ import annotations

import asyncio
import os
import pickle
import stat

import pydantic.v1 as pydantic
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.dht import (
    MAX_STAGES,
    BackgroundLoop,
    ExpertHostRecord,
    InvalidMultiaddr,
    PeerMetricsRecord,
    RunConfigRecord,
    RunInfo,
    ServerRecord,
    ServerState,
    SwarmDHTError,
    load_identity,
    parse_maddrs,
)
from swarm.dht.keys import EXPERTS_FIELD, dht_key, peer_id_of_owner, schema_validator, stage_field
from swarm.dht.schemas import MAX_HOSTED_EXPERTS

RUN_ID = "unit-run"
GOOD_SERVER = dict(peer_id="QmPeer", stage=1, state="ONLINE", throughput=12.5, step=3, role="server", version="0.1.0",
                   metrics_addr="127.0.0.1:9100", reach="relayed", averaging_bytes_per_sample=12000.0, outer_step=None,
                   drift=None)
GOOD_EXPERT_HOST = dict(peer_id="QmPeer", experts=[0, 3, 5], state="ONLINE", throughput=8.0, step=2, role="expert",
                        version="0.1.0", metrics_addr="127.0.0.1:9200", reach="direct")
GOOD_METRICS = dict(peer_id="QmPeer", role="trainer", step=2, samples_per_second=4.0, samples=64, time=1.7e9)
OWNER = b"[owner:ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 test]"


def test_good_server_record_round_trips():
    record = ServerRecord(**GOOD_SERVER)
    assert record.state == ServerState.ONLINE and record.to_wire() == GOOD_SERVER
    assert ServerRecord.from_wire(record.to_wire()) == record


@pytest.mark.parametrize(
    "field, value",
    [
        ("stage", "1"),
        ("stage", -1),
        ("stage", 1.0),
        ("throughput", "12.5"),
        ("throughput", 12),
        ("throughput", -1.0),
        ("state", "BOGUS"),
        ("peer_id", 5),
        ("step", True),
    ],
)
def test_server_record_rejects_wrong_types(field, value):
    with pytest.raises(pydantic.ValidationError):
        ServerRecord(**{**GOOD_SERVER, field: value})
    assert ServerRecord.from_wire({**GOOD_SERVER, field: value}) is None


def test_good_expert_host_record_round_trips():
    record = ExpertHostRecord(**GOOD_EXPERT_HOST)
    assert record.to_wire() == GOOD_EXPERT_HOST and ExpertHostRecord.from_wire(record.to_wire()) == record
    minimal = ExpertHostRecord(peer_id="QmPeer", experts=list(range(MAX_HOSTED_EXPERTS)), state="JOINING",
                               throughput=0.0)
    assert minimal.role == "expert" and minimal.step == 0 and minimal.metrics_addr is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("experts", [1, 2, 1]),  # a set, sent as a list
        ("experts", [0, -1]),
        ("experts", [True]),
        ("experts", [1.0]),
        ("experts", ["1"]),
        ("experts", list(range(MAX_HOSTED_EXPERTS + 1))),
        ("experts", 3),
        ("experts", None),
        ("throughput", 8),
        ("throughput", float("inf")),
        ("state", "BOGUS"),
        ("metrics_addr", "127.0.0.1:65536"),
        ("metrics_addr", "http://127.0.0.1:9200"),
    ],
)
def test_expert_host_record_rejects_wrong_values(field, value):
    with pytest.raises(pydantic.ValidationError):
        ExpertHostRecord(**{**GOOD_EXPERT_HOST, field: value})
    assert ExpertHostRecord.from_wire({**GOOD_EXPERT_HOST, field: value}) is None


def test_unknown_fields_are_kept():
    wire = {**GOOD_SERVER, "gpu": "H100", "nested": {"a": [1, 2]}}
    record = ServerRecord.from_wire(wire)
    assert record is not None and record.gpu == "H100"
    assert record.to_wire() == wire


def test_from_wire_skips_garbage():
    assert ServerRecord.from_wire(b"not a dict") is None
    assert ServerRecord.from_wire({"peer_id": "x"}) is None  # required fields missing


def test_metrics_record_optional_fields_and_diverged_loss():
    assert PeerMetricsRecord(**GOOD_METRICS).stage is None
    assert PeerMetricsRecord(**GOOD_METRICS, loss=float("nan")).loss is None
    assert PeerMetricsRecord(**GOOD_METRICS, loss=2.5, stage=0).loss == 2.5
    with pytest.raises(pydantic.ValidationError):
        PeerMetricsRecord(**{**GOOD_METRICS, "samples_per_second": -1.0})


def test_run_config_record():
    record = RunConfigRecord(run_id=RUN_ID, config_yaml="run_id: x\n", coordinator_peer_id="QmC")
    assert RunConfigRecord.from_wire(record.to_wire()) == record


def _dht_record(field: str, value, subkey: bytes = OWNER, run_id: str = RUN_ID) -> DHTRecord:
    key = DHTID.generate(source=dht_key(run_id, field)).to_bytes()
    dumps = MSGPackSerializer.dumps
    return DHTRecord(key, dumps(subkey), dumps(value), get_dht_time() + 10)


def test_schema_validator_checks_what_peers_store():
    validator = schema_validator(RUN_ID)
    assert validator.validate(_dht_record("stage1", GOOD_SERVER))
    assert validator.validate(_dht_record("stage1", {**GOOD_SERVER, "added_later": 1}))  # newer peer
    assert validator.validate(_dht_record("metrics", GOOD_METRICS))  # optional fields absent: older peer
    assert validator.validate(_dht_record("metrics", {**GOOD_METRICS, "stage": None, "loss": 1.0}))
    assert not validator.validate(_dht_record("stage1", {**GOOD_SERVER, "stage": "1"}))
    assert not validator.validate(_dht_record("stage1", {**GOOD_SERVER, "throughput": 12}))
    assert not validator.validate(_dht_record("stage1", {**GOOD_SERVER, "state": "BOGUS"}))
    assert not validator.validate(_dht_record("stage1", GOOD_SERVER, subkey=b"no owner marker"))
    assert not validator.validate(_dht_record("config", GOOD_SERVER))  # a server record is no config
    assert not validator.validate(_dht_record(f"stage{MAX_STAGES - 1}", {**GOOD_SERVER, "stage": None}))


def test_schema_validator_checks_expert_host_records():
    validator = schema_validator(RUN_ID)
    assert EXPERTS_FIELD == "experts"
    assert validator.validate(_dht_record(EXPERTS_FIELD, GOOD_EXPERT_HOST))
    older = {k: v for k, v in GOOD_EXPERT_HOST.items() if k not in ("step", "metrics_addr")}
    assert validator.validate(_dht_record(EXPERTS_FIELD, older))  # optional fields absent: older peer
    assert validator.validate(_dht_record(EXPERTS_FIELD, {**GOOD_EXPERT_HOST, "added_later": 1}))  # newer peer
    assert not validator.validate(_dht_record(EXPERTS_FIELD, {**GOOD_EXPERT_HOST, "experts": [2, 2]}))
    assert not validator.validate(_dht_record(EXPERTS_FIELD, {**GOOD_EXPERT_HOST, "experts": [True]}))
    assert not validator.validate(_dht_record(EXPERTS_FIELD, GOOD_EXPERT_HOST, subkey=b"no owner marker"))
    assert not validator.validate(_dht_record(EXPERTS_FIELD, GOOD_SERVER))  # a server record is no expert host
    assert not validator.validate(_dht_record("stage1", GOOD_EXPERT_HOST))  # nor the other way round


def test_schema_validator_survives_pickling_and_leaves_pydantic_alone():
    # DHT.add_validators pickles validators into the DHT process
    validator = pickle.loads(pickle.dumps(schema_validator(RUN_ID)))
    assert validator.validate(_dht_record("stage1", GOOD_SERVER))
    assert pydantic.BaseConfig.extra != pydantic.Extra.forbid  # hivemind patches Config of the schema only


def test_stage_field_bounds():
    assert stage_field(0) == "stage0" and stage_field(MAX_STAGES - 1) == f"stage{MAX_STAGES - 1}"
    for stage in (-1, MAX_STAGES):
        with pytest.raises(ValueError):
            stage_field(stage)


def test_parse_maddrs_errors_are_clear():
    peer = "/ip4/127.0.0.1/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    assert [str(m) for m in parse_maddrs([peer], "initial peer", need_peer_id=True)] == [peer]
    with pytest.raises(InvalidMultiaddr, match="garbage"):
        parse_maddrs(["garbage"], "initial peer")
    with pytest.raises(InvalidMultiaddr, match="/p2p/"):
        parse_maddrs(["/ip4/127.0.0.1/tcp/31337"], "initial peer", need_peer_id=True)


def test_persistent_identity(tmp_path):
    path = tmp_path / "peer.id"
    first = load_identity(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = load_identity(path)
    assert again.owner_key == first.owner_key and again.peer_id == first.peer_id
    assert first.owner_key.startswith(b"[owner:ssh-rsa ")
    # the one key is the libp2p identity: the daemon derives the peer id the records are bound to
    assert PeerID.from_identity(path.read_bytes()).to_base58() == first.peer_id
    assert peer_id_of_owner(first.owner_key) == first.peer_id
    assert load_identity(None).owner_key != load_identity(None).owner_key


def test_identity_written_by_hivemind_is_read(tmp_path):
    path = tmp_path / "hivemind.id"
    P2P.generate_identity(str(path))  # how identities of earlier versions were made
    assert load_identity(path).peer_id == PeerID.from_identity(path.read_bytes()).to_base58()


def test_broken_identity_files_are_named(tmp_path):
    (tmp_path / "corrupt").write_bytes(b"garbage")
    with pytest.raises(SwarmDHTError, match="corrupt"):
        load_identity(tmp_path / "corrupt")
    ed25519 = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=b"k" * 64).SerializeToString()
    (tmp_path / "ed").write_bytes(ed25519)
    with pytest.raises(SwarmDHTError, match="Ed25519 key.*needs RSA"):
        load_identity(tmp_path / "ed")
    with pytest.raises(SwarmDHTError, match="does not exist"):
        load_identity(tmp_path / "missing-dir" / "peer.id")


def test_run_info_round_trip_and_malformed():
    info = RunInfo(RUN_ID, OWNER, "QmCoordinator")
    assert RunInfo.from_bytes(info.to_bytes()) == info
    for garbage in (b"\xc1", MSGPackSerializer.dumps({"run_id": 1}), MSGPackSerializer.dumps([1, 2])):
        with pytest.raises(ValueError):
            RunInfo.from_bytes(garbage)


def test_background_loop_runs_times_out_and_stops():
    loop = BackgroundLoop("test-loop").start()
    try:

        async def add(a, b):
            return a + b

        assert loop.run(add(2, 3), timeout=5) == 5
        cancelled = asyncio.Event()

        async def hang():
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

        with pytest.raises(TimeoutError):
            loop.run(hang(), timeout=0.2)
        assert loop.run(_is_set(cancelled), timeout=5)
    finally:
        loop.stop()
    assert not loop.is_running
    with pytest.raises(RuntimeError):
        loop.run(add(1, 1), timeout=1)


async def _is_set(event: asyncio.Event) -> bool:
    # the cancellation of a timed-out coroutine is scheduled on the loop, not instant
    await asyncio.wait_for(event.wait(), timeout=5)
    return True


def test_nothing_is_sent_to_a_dht_process_that_is_gone():
    """A request to a dead DHT process would sit in its pipe; once the pipe is full the next one blocks forever."""
    from swarm.dht import DHTProcessGone, SwarmRecords

    class DeadDHT:
        def is_alive(self) -> bool:
            return False

        def store(self, *args, **kwargs):
            raise AssertionError("sent to a dead DHT process")

        get = run_coroutine = store

    records = SwarmRecords(DeadDHT(), RUN_ID, load_identity(None))
    with pytest.raises(DHTProcessGone, match="not running"):
        records.announce_server(ServerRecord(**GOOD_SERVER), ttl=10)
    with pytest.raises(DHTProcessGone):
        records.lookup_servers(1)


@pytest.mark.parametrize("reach", ["public", "", 3, "DIRECT"])
def test_a_record_claiming_an_unknown_reach_is_refused(reach):
    assert ServerRecord.from_wire({**GOOD_SERVER, "reach": reach}) is None
    assert ExpertHostRecord.from_wire({**GOOD_EXPERT_HOST, "reach": reach}) is None


def test_a_record_without_reach_is_read_as_unknown():  # from a peer of an older version
    fields = {key: value for key, value in GOOD_SERVER.items() if key != "reach"}
    assert ServerRecord.from_wire(fields).reach is None


@pytest.mark.parametrize("field, value", [("outer_step", -1), ("outer_step", 1.5), ("drift", float("inf")),
                                          ("drift", -0.1), ("averaging_bytes_per_sample", float("nan")),
                                          ("averaging_bytes_per_sample", "many")])
def test_a_record_with_a_bad_averaging_figure_is_refused(field, value):
    assert ServerRecord.from_wire({**GOOD_SERVER, field: value}) is None


def test_a_record_of_the_low_communication_mode_reads_back():
    record = ServerRecord.from_wire({**GOOD_SERVER, "outer_step": 3, "drift": 0.01, "averaging_bytes_per_sample": 5.5})
    assert (record.outer_step, record.drift, record.averaging_bytes_per_sample) == (3, 0.01, 5.5)
