"""RememberedValidator: a record the node's validators accepted passes again unchecked, and nothing else does."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.dht import load_identity
from swarm.dht.keys import dht_key, make_validators, run_validators
from swarm.dht.verified import RememberedValidator, record_digest

RUN_ID = "remembered-run"
ALICE, MALLORY = load_identity(None), load_identity(None)


class Counting(RecordValidatorBase):
    """Counts the records it is asked about; refuses those whose value is b"bad"."""

    def __init__(self):
        self.asked = 0

    def validate(self, record: DHTRecord) -> bool:
        self.asked += 1
        return record.value != b"bad"


def plain(value: bytes = b"ok", subkey: bytes = b"s", expiration: float = 100.0) -> DHTRecord:
    return DHTRecord(b"k" * 20, subkey, value, expiration)


def server_record(signer: RSASignatureValidator, owner: bytes, peer_id: str, step: int = 0) -> DHTRecord:
    value = dict(peer_id=peer_id, stage=0, state="ONLINE", throughput=10.0, step=step, role="server", version="0.1.0")
    unsigned = DHTRecord(DHTID.generate(source=dht_key(RUN_ID, "stage0")).to_bytes(), MSGPackSerializer.dumps(owner),
                         MSGPackSerializer.dumps(value), get_dht_time() + 30)
    return dataclasses.replace(unsigned, value=signer.sign_value(unsigned))


def test_an_accepted_record_is_checked_once_and_any_changed_byte_is_checked_again():
    counting = Counting()
    remembered = RememberedValidator([counting])
    record = plain()
    assert remembered.validate(record) and remembered.validate(record) and remembered.validate(record)
    assert counting.asked == 1 and remembered.recalled == 2
    for changed in (plain(value=b"ok2"), plain(subkey=b"t"), plain(expiration=101.0),
                    DHTRecord(b"j" * 20, b"s", b"ok", 100.0)):
        assert remembered.validate(changed)
    assert counting.asked == 5
    # the fields are length-prefixed: moving a byte from one field to the next is another record
    assert record_digest(DHTRecord(b"ab", b"c", b"v", 1.0)) != record_digest(DHTRecord(b"a", b"bc", b"v", 1.0))


def test_a_refused_record_is_never_remembered():
    counting = Counting()
    remembered = RememberedValidator([counting])
    for _ in range(3):
        assert not remembered.validate(plain(value=b"bad"))
    assert counting.asked == 3 and len(remembered) == 0


def test_at_most_the_bound_is_remembered_the_least_recently_seen_dropped_first():
    counting = Counting()
    remembered = RememberedValidator([counting], remembered=2)
    a, b, c = plain(value=b"a"), plain(value=b"b"), plain(value=b"c")
    for record in (a, b, a, c):  # a seen again after b: b is the oldest when c comes
        remembered.validate(record)
    assert len(remembered) == 2 and counting.asked == 3
    remembered.validate(a)
    assert counting.asked == 3
    remembered.validate(b)
    assert counting.asked == 4
    with pytest.raises(ValueError):
        RememberedValidator([counting], remembered=0)


def test_validators_added_later_are_merged_in_and_what_was_accepted_is_checked_again():
    first, later = Counting(), Counting()
    chain = CompositeValidator([RememberedValidator([first])])  # how hivemind's DHT holds it
    chain.extend([later])  # DHT.add_validators, swarm.dht.node.add_run_validators
    record = plain()
    assert chain.validate(record) and chain.validate(record)
    assert (first.asked, later.asked) == (1, 1)
    chain.extend([Counting()])
    assert chain.validate(record)
    assert first.asked == 2


def test_the_run_chain_still_binds_records_to_their_signer():
    """The real chain every node runs (signature, owner rules, schema), behind the memory."""
    alice = RSASignatureValidator(ALICE.signing_key)
    mallory = RSASignatureValidator(MALLORY.signing_key)
    node = CompositeValidator([RememberedValidator(make_validators(None, ALICE.signing_key))])
    node.extend(run_validators(RUN_ID))
    own = server_record(mallory, MALLORY.owner_key, MALLORY.peer_id)
    assert node.validate(own) and node.validate(own)
    assert not node.validate(server_record(mallory, MALLORY.owner_key, ALICE.peer_id))  # naming another's id
    forged = server_record(mallory, ALICE.owner_key, ALICE.peer_id)  # Alice's marker, Mallory's signature
    assert not node.validate(forged) and not node.validate(forged)
    honest = server_record(alice, ALICE.owner_key, ALICE.peer_id)
    assert node.validate(honest)
    tampered = dataclasses.replace(honest, value=honest.value.replace(b"ONLINE", b"JOINED"))  # signature kept
    assert not node.validate(tampered)
    # what a node signs and strips goes through the chain unchanged
    unsigned = dataclasses.replace(honest, value=MSGPackSerializer.dumps({"peer_id": ALICE.peer_id}))
    signed = dataclasses.replace(unsigned, value=node.sign_value(unsigned))
    assert node.strip_value(signed) == unsigned.value
