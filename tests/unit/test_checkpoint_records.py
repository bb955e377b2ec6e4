"""Checkpoint records (who holds which stage checkpoint; the run checkpoint) and choosing whom to fetch from.

Schemas, validators and the pure parts of swarm.checkpoint.transfer and .serving: no processes, no network.
"""

from __future__ import annotations

import asyncio
import pickle

import pydantic.v1 as pydantic
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.checkpoint.serving import ServingLimits, _Lease
from swarm.checkpoint.transfer import checkpoint_candidates
from swarm.checkpoint.wire import MAX_CHUNK_BYTES
from swarm.dht import MAX_STAGES, CheckpointRecord, HeldCheckpoint, RunCheckpointRecord
from swarm.dht.keys import checkpoints_field, dht_key, schema_validator
from swarm.dht.schemas import MAX_HELD_CHECKPOINTS

RUN_ID = "unit-run"
OWNER = b"[owner:ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7 test]"
ID_A, ID_B = "ab" * 32, "0123456789abcdef" * 4
HELD = dict(step=120, manifest_id=ID_A, size=4096)
GOOD = dict(peer_id="QmHolder", stage=1, part="stage", state_hash="5e" * 32, version="0.1.0",
            checkpoints=[HELD, dict(step=100, manifest_id=ID_B, size=0)])
GOOD_RUN = dict(peer_id="QmCoordinator", state_hash="5e" * 32, step=100, manifest_id=ID_B, version="0.1.0",
                stages=[dict(stage=0, step=100, manifest_id=ID_A), dict(stage=1, step=120, manifest_id=ID_B)])


def test_good_records_round_trip():
    record = CheckpointRecord(**GOOD)
    assert record.to_wire() == GOOD and CheckpointRecord.from_wire(GOOD) == record
    assert isinstance(record.checkpoints[0], HeldCheckpoint) and record.checkpoints[0].step == 120
    run = RunCheckpointRecord(**GOOD_RUN)
    assert run.to_wire() == GOOD_RUN and RunCheckpointRecord.from_wire(GOOD_RUN) == run
    assert CheckpointRecord(**{**GOOD, "checkpoints": []}).checkpoints == []  # a holder that just lost all
    older = {key: value for key, value in GOOD.items() if key != "part"}  # a peer from before expert checkpoints
    assert CheckpointRecord.from_wire(older).part == "stage"
    assert CheckpointRecord.from_wire({**GOOD, "part": "expert"}).part == "expert"


def _held(**changes) -> dict:
    return {**GOOD, "checkpoints": [{**HELD, **changes}]}


@pytest.mark.parametrize(
    "wire",
    [
        {**GOOD, "stage": "1"},
        {**GOOD, "stage": -1},
        {**GOOD, "part": "experts"},
        {**GOOD, "part": 1},
        {**GOOD, "part": None},
        {**GOOD, "peer_id": 5},
        {**GOOD, "state_hash": None},
        {**GOOD, "state_hash": "x" * 129},
        {**GOOD, "checkpoints": "not a list"},
        {**GOOD, "checkpoints": [HELD] * (MAX_HELD_CHECKPOINTS + 1)},
        {**GOOD, "checkpoints": [ID_A]},
        _held(step=1.0),
        _held(step=-1),
        _held(step=True),
        _held(size="4096"),
        _held(size=-1),
        _held(manifest_id=ID_A.upper()),  # lowercase only: ids are compared as strings
        _held(manifest_id=ID_A[:-1]),
        _held(manifest_id=ID_A + "0"),
        _held(manifest_id=ID_A + "\n"),
        _held(manifest_id=ID_A[:-1] + "g"),
        _held(manifest_id=bytes.fromhex(ID_A)),
    ],
)
def test_checkpoint_record_is_strict(wire):
    assert CheckpointRecord.from_wire(wire) is None
    with pytest.raises(pydantic.ValidationError):
        CheckpointRecord(**wire)


@pytest.mark.parametrize(
    "wire",
    [
        {**GOOD_RUN, "step": "100"},
        {**GOOD_RUN, "manifest_id": "not hex"},
        {**GOOD_RUN, "stages": [dict(stage=0, step=100)]},
        {**GOOD_RUN, "stages": [dict(stage=0, step=100, manifest_id=ID_A.upper())]},
        {**GOOD_RUN, "stages": [dict(stage=-1, step=100, manifest_id=ID_A)]},
        {**GOOD_RUN, "stages": [dict(stage=0, step=100, manifest_id=ID_A)] * (MAX_STAGES + 1)},
    ],
)
def test_run_checkpoint_record_is_strict(wire):
    assert RunCheckpointRecord.from_wire(wire) is None


def test_unknown_fields_are_kept_at_every_level():
    wire = {**GOOD, "region": "eu", "checkpoints": [{**HELD, "round_id": "r7"}]}
    record = CheckpointRecord.from_wire(wire)
    assert record is not None and record.region == "eu" and record.checkpoints[0].round_id == "r7"
    assert record.to_wire() == wire


def _dht_record(field: str, value, subkey: bytes = OWNER) -> DHTRecord:
    key = DHTID.generate(source=dht_key(RUN_ID, field)).to_bytes()
    dumps = MSGPackSerializer.dumps
    return DHTRecord(key, dumps(subkey), dumps(value), get_dht_time() + 10)


def test_schema_validator_checks_checkpoint_records():
    shipped = pickle.dumps(schema_validator(RUN_ID))  # as add_run_validators sends it to the DHT process
    assert len(shipped) < 4096  # hivemind's DHT process may lose a pipe message over 16 KiB
    validator = pickle.loads(shipped)
    last = checkpoints_field(MAX_STAGES - 1)
    assert validator.validate(_dht_record("checkpoints1", GOOD))
    assert validator.validate(_dht_record(last, {**GOOD, "stage": MAX_STAGES - 1}))
    assert validator.validate(_dht_record("run_checkpoint", GOOD_RUN))
    older = {key: value for key, value in GOOD.items() if key != "version"}  # optional field absent
    assert validator.validate(_dht_record("checkpoints1", older))
    newer = {**GOOD, "added_later": 1, "checkpoints": [{**HELD, "also_later": [1, 2]}]}
    assert validator.validate(_dht_record("checkpoints1", newer))
    assert not validator.validate(_dht_record("checkpoints1", _held(size=1.5)))
    assert not validator.validate(_dht_record("checkpoints1", _held(manifest_id="00")))
    assert not validator.validate(_dht_record("checkpoints1", {**GOOD, "checkpoints": [HELD] * 17}))
    assert not validator.validate(_dht_record("checkpoints1", GOOD, subkey=b"no owner marker"))
    assert not validator.validate(_dht_record("run_checkpoint", GOOD))  # a holder's list is no run checkpoint
    assert not validator.validate(_dht_record("stage1", GOOD))  # nor a server record
    assert not validator.validate(_dht_record("checkpoints1", GOOD_RUN))


def test_checkpoints_field_bounds():
    assert checkpoints_field(0) == "checkpoints0"
    for stage in (-1, MAX_STAGES):
        with pytest.raises(ValueError):
            checkpoints_field(stage)


def _record(peer_id: str, *held: tuple[int, str, int], stage: int = 1, state_hash: str = "5e" * 32,
            part: str = "stage"):
    checkpoints = [HeldCheckpoint(step=step, manifest_id=mid, size=size) for step, mid, size in held]
    return CheckpointRecord(peer_id=peer_id, stage=stage, state_hash=state_hash, checkpoints=checkpoints, part=part)


def test_candidates_newest_first_filtered_and_deduplicated():
    ID_C, ID_D = "cd" * 32, "de" * 32
    records = [
        _record("QmA", (100, ID_B, 10), (120, ID_A, 10), (100, ID_B, 10)),  # listed twice: tried once
        _record("QmB", (120, ID_A, 10), (90, ID_C, 10)),
        _record("QmC", (500, ID_D, 10), stage=2),  # another stage's record under this stage's key
        _record("QmX", (600, ID_D, 10), part="expert"),  # expert 1's: never a candidate for stage 1
        _record("QmD", (500, ID_D, 10), state_hash="00" * 32),  # another model shape
        _record("QmE", (400, ID_D, 10**9)),  # too big
        _record("QmSelf", (300, ID_D, 10)),
    ]
    found = checkpoint_candidates(records, stage=1, state_hash="5e" * 32, max_bytes=1000, exclude={"QmSelf"})
    assert [(held.step, holder) for held, holder in found] == [(120, "QmA"), (120, "QmB"), (100, "QmA"), (90, "QmB")]
    experts = checkpoint_candidates(records, stage=1, state_hash="5e" * 32, max_bytes=1000, part="expert")
    assert [(held.step, holder) for held, holder in experts] == [(600, "QmX")]
    newer = checkpoint_candidates(records, stage=1, state_hash="5e" * 32, max_bytes=1000, min_step=100)
    assert [(held.step, holder) for held, holder in newer] == [(300, "QmSelf"), (120, "QmA"), (120, "QmB"),
                                                               (100, "QmA")]


def test_lease_gives_its_slot_back_once_on_time_or_on_release():
    async def scenario():
        slots = asyncio.Semaphore(1)
        await slots.acquire()
        lease = _Lease(slots, duration=0.01)
        await asyncio.wait_for(slots.acquire(), 5)  # the peer stopped reading: its slot comes back anyway
        assert lease.expired
        lease.release()  # the transfer's own release afterwards must not free a second slot
        assert slots.locked()
        slots.release()
        await slots.acquire()
        early = _Lease(slots, duration=60)
        early.release()
        early.release()
        assert early.expired and not slots.locked()
        await slots.acquire()
        assert slots.locked()  # exactly one slot came back

    asyncio.run(scenario())


def test_serving_limits_keep_chunks_within_the_wire_limit():
    with pytest.raises(ValueError):
        ServingLimits(chunk_bytes=MAX_CHUNK_BYTES + 1)
    with pytest.raises(ValueError):
        ServingLimits(max_transfers=0)
