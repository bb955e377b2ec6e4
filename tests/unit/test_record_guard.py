"""RunRecordGuard: what a DHT node of a run accepts at the run's keys, whatever a stranger stores there."""

from __future__ import annotations

import pickle

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.dht import load_identity
from swarm.dht.keys import (
    MAX_RECORD_BYTES,
    MAX_RECORD_LIFETIME,
    RunRecordGuard,
    dht_key,
    make_validators,
    progress_key,
)

RUN_ID = "guard-run"
ALICE, MALLORY = load_identity(None), load_identity(None)


def server(peer_id: str, **changes) -> dict:
    return dict(peer_id=peer_id, stage=0, state="ONLINE", throughput=10.0, step=0, role="server",
                version="0.1.0") | changes


def record(field: str, value, subkey=ALICE.owner_key, expires_in: float = 30.0, raw_value: bytes | None = None):
    key = DHTID.generate(source=dht_key(RUN_ID, field)).to_bytes()
    value_bytes = MSGPackSerializer.dumps(value) if raw_value is None else raw_value
    return DHTRecord(key, MSGPackSerializer.dumps(subkey), value_bytes, get_dht_time() + expires_in)


GUARD = RunRecordGuard(RUN_ID)


def test_a_signers_own_record_passes():
    assert GUARD.validate(record("stage0", server(ALICE.peer_id)))
    assert GUARD.validate(record("config", dict(run_id=RUN_ID, config_yaml="", coordinator_peer_id=ALICE.peer_id)))
    assert GUARD.validate(record("stage0", server(ALICE.peer_id), expires_in=MAX_RECORD_LIFETIME - 5))


@pytest.mark.parametrize("bad", [
    dict(subkey=None),  # a plain value: with a later expiry it would replace every server's record
    dict(subkey=b"x" + ALICE.owner_key),  # merely contains the marker: one key, any number of records
    dict(subkey=ALICE.owner_key + b"1"),
    dict(subkey=b"[owner:ssh-rsa AAAA]"),  # not a key
    dict(subkey=7),
    dict(expires_in=MAX_RECORD_LIFETIME + 60),  # would outlive its author by days
    dict(value=server(MALLORY.peer_id)),  # Alice's signature naming Mallory's peer id
    dict(value=dict(run_id=RUN_ID, config_yaml="", coordinator_peer_id=MALLORY.peer_id)),
    dict(value=[1, 2]),
    dict(raw_value=b"\xc1"),  # not msgpack
    dict(value=server(ALICE.peer_id, padding="x" * MAX_RECORD_BYTES)),
])
def test_what_a_stranger_stores_is_refused(bad):
    args = dict(value=server(ALICE.peer_id)) | bad
    assert not GUARD.validate(record("stage0", **args))


def test_keys_of_other_subsystems_pass_and_the_guard_pickles_small():
    other = DHTRecord(DHTID.generate(source="averaging.0b").to_bytes(), MSGPackSerializer.dumps(None), b"x",
                      get_dht_time() + 10)
    assert GUARD.validate(other)
    shipped = pickle.dumps(GUARD)
    assert len(shipped) < 1000  # DHT.add_validators sends it over a pipe that loses long messages
    assert pickle.loads(shipped).validate(record("stage0", server(ALICE.peer_id)))


def test_signed_chain_binds_the_peer_id_to_the_signer():
    """The whole chain every node runs: signature, guard, schema. Mallory signs with her own key."""
    alice_chain = CompositeValidator(make_validators(RUN_ID, ALICE.signing_key))
    mallory_signer = RSASignatureValidator(MALLORY.signing_key)

    def signed(signer, owner, value) -> DHTRecord:
        unsigned = record("stage0", value, subkey=owner)
        return DHTRecord(unsigned.key, unsigned.subkey, signer.sign_value(unsigned), unsigned.expiration_time)

    assert alice_chain.validate(signed(mallory_signer, MALLORY.owner_key, server(MALLORY.peer_id)))
    assert not alice_chain.validate(signed(mallory_signer, MALLORY.owner_key, server(ALICE.peer_id)))
    infinite = server(MALLORY.peer_id, throughput=float("inf"))  # would draw every trainer's work
    assert not alice_chain.validate(signed(mallory_signer, MALLORY.owner_key, infinite))
    assert not alice_chain.validate(record("stage0", server(ALICE.peer_id), subkey=ALICE.owner_key))  # unsigned


def test_a_stages_progress_key_is_guarded_too():
    def progress(value, subkey=ALICE.owner_key) -> DHTRecord:
        key = DHTID.generate(source=progress_key(RUN_ID, 3)).to_bytes()
        return DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), get_dht_time() + 10)

    assert GUARD.validate(progress({"peer_id": ALICE.peer_id, "step": 1}))
    assert GUARD.validate(progress(None))  # a server withdrawing its record as it leaves
    assert not GUARD.validate(progress(None, subkey=None))  # but no plain value in the key's place
    assert not GUARD.validate(progress({"peer_id": MALLORY.peer_id, "step": 1}))
