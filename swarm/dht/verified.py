"""Records checked once, not at every read: what a DHT node's validators already accepted.

A run's records are read over and over while they do not change: each stage's progress record every
second by every server of the stage (more often while a group forms), the server records by every
trainer, the checkpoint lists by every peer. hivemind checks every record a lookup returns, each
subkey of a dictionary apart: an RSA signature verified, msgpack and a pydantic schema parsed, our
owner rules applied (swarm.dht.keys). In a 2 x 2 swarm at batch 16 that was 40% of each DHT
process's CPU, on cores the stages compute on (README, Learning: what a round costs the machine).

`RememberedValidator` holds the node's validators and remembers, by a digest of the whole record
(key, subkey, value and expiry, each length-prefixed), the records they accepted; the same bytes
again pass without being checked. That is sound because every check is a function of those bytes,
and the only ones that read the clock (an expiry at most MAX_RECORD_LIFETIME ahead) stay true as
time passes. Changing one byte (a new value, signature or expiry) makes another digest, checked in
full. A refused record is never remembered, so a stranger's forgery costs its full check each time
(as before) and cannot evict much: at most REMEMBERED records are kept, the least recently seen
dropped first. Validators added later (a run's own, once it is known) forget everything remembered,
since they may refuse what was accepted without them.

It is the only validator hivemind's DHT is given: every other one is merged into it (`merge_with`),
so hivemind's own extend() (DHT.add_validators, and ours in swarm.dht.node) goes through it too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase

REMEMBERED = 4096  # accepted records remembered: a run's records are a few per peer, renewed each announce period


def record_digest(record: DHTRecord) -> bytes:
    """A digest of every byte a validator sees: key, subkey, value and expiry, each length-prefixed."""
    digest = hashlib.blake2b(digest_size=20)
    for part in (record.key, record.subkey, record.value, repr(float(record.expiration_time)).encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()


class RememberedValidator(RecordValidatorBase):
    """The node's validators (a CompositeValidator), with the records they accepted remembered."""

    def __init__(self, validators: Iterable[RecordValidatorBase] = (), remembered: int = REMEMBERED):
        if remembered < 1:
            raise ValueError(f"remembered must be at least 1, got {remembered}")
        self.inner = CompositeValidator(validators)
        self.remembered = remembered
        self._accepted: OrderedDict[bytes, None] = OrderedDict()
        self.recalled = 0  # records that passed as accepted before

    def validate(self, record: DHTRecord) -> bool:
        digest = record_digest(record)
        if digest in self._accepted:
            self._accepted.move_to_end(digest)
            self.recalled += 1
            return True
        if not self.inner.validate(record):
            return False
        self._accepted[digest] = None
        while len(self._accepted) > self.remembered:
            self._accepted.popitem(last=False)
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.inner.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.inner.strip_value(record)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Take in any validator added later; what was accepted without it is checked again."""
        self.inner.extend([other])
        self._accepted.clear()
        return True

    def __len__(self) -> int:
        return len(self._accepted)
