"""Where records live in the DHT, and the validators that guard them.

Every key is ``{run_id}_{field}``; fields are ``config``, ``metrics``, ``run_checkpoint``, ``experts``
(expert host records), ``stage0`` .. ``stage255`` (server records), ``checkpoints0`` .. ``checkpoints255``
(who holds which stage checkpoints) and ``expert_checkpoints0`` .. ``expert_checkpoints63`` (who holds which
expert checkpoints). Each key holds a dictionary whose subkeys are owner markers
(``[owner:ssh-rsa ...]``): hivemind's RSASignatureValidator then accepts a subkey's value only if it is
signed by that owner, so a peer can write its own server record, metrics or checkpoint list, never
another peer's (readers that trust only the coordinator for the config or the run checkpoint pick its
owner marker).

Every DHT node of a run, and every reader, also applies RunRecordGuard to the run's keys and to each
stage's averaging progress key (``{run_id}_stage{k}_averaging.progress``, read by averaging/tracker.py). Stock
hivemind would let a stranger wipe a key with one plain value (no subkey) of a later expiry, fill it
with any number of subkeys that merely contain its marker, or sign a record naming another peer's id.
The guard accepts only subkeys that are exactly an owner marker (one record per signer per key), an
expiry at most MAX_RECORD_LIFETIME ahead, values of at most MAX_RECORD_BYTES, and a claimed peer id
that is the signer's own: a peer signs with its libp2p key (identity.py), so its peer id is a hash of
the public key in the marker.

hivemind validators see only hashed keys, so the schema enumerates every field name up front.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any

import multihash
import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm.config import (
    MAX_EXPERTS,  # expert checkpoint keys enumerated in the schema
    MAX_RECORD_TTL,
)
from swarm.dht.schemas import (
    MAX_STAGES,  # stage keys enumerated in the schema; a run may use any number of stages up to this
    CheckpointRecord,
    ExpertHostRecord,
    PeerMetricsRecord,
    RunCheckpointRecord,
    RunConfigRecord,
    SentFieldsOnly,
    ServerRecord,
)
from swarm.hivemind_internals import public_key_der, schema_count

CONFIG_FIELD = "config"
METRICS_FIELD = "metrics"
RUN_CHECKPOINT_FIELD = "run_checkpoint"
EXPERTS_FIELD = "experts"


def stage_field(stage: int) -> str:
    """Schema field (and key suffix) holding the server records of one stage."""
    if not 0 <= stage < MAX_STAGES:
        raise ValueError(f"stage must be in [0, {MAX_STAGES}), got {stage}")
    return f"stage{stage}"


def checkpoints_field(stage: int) -> str:
    """Schema field (and key suffix) holding the checkpoint lists of one stage's holders."""
    if not 0 <= stage < MAX_STAGES:
        raise ValueError(f"stage must be in [0, {MAX_STAGES}), got {stage}")
    return f"checkpoints{stage}"


def expert_checkpoints_field(expert: int) -> str:
    """Schema field (and key suffix) holding the checkpoint lists of one expert's holders."""
    if not 0 <= expert < MAX_EXPERTS:
        raise ValueError(f"expert must be in [0, {MAX_EXPERTS}), got {expert}")
    return f"expert_checkpoints{expert}"


def part_checkpoints_field(part: str, index: int) -> str:
    """The checkpoint lists' field of a stage (`part` "stage") or an expert (`part` "expert")."""
    return checkpoints_field(index) if part == "stage" else expert_checkpoints_field(index)


def averaging_prefix(run_id: str, stage: int) -> str:
    """The DHT key prefix (and P2P namespace) of one stage's averaging."""
    return f"{run_id}_stage{stage}_averaging"


def expert_averaging_prefix(run_id: str, expert: int) -> str:
    """The DHT key prefix (and P2P namespace) of the averaging among the hosts of one expert."""
    return f"{run_id}_expert{expert}_averaging"


PROGRESS_SUFFIX = ".progress"


def progress_key(run_id: str, stage: int) -> str:
    """The DHT key of a stage's progress records (one per server, under its owner marker)."""
    return averaging_prefix(run_id, stage) + PROGRESS_SUFFIX


def dht_key(run_id: str, field: str) -> str:
    """The raw DHT key of a schema field; SchemaValidator(prefix=run_id) hashes the same string."""
    return f"{run_id}_{field}"


def owner_key(private_key: RSAPrivateKey) -> bytes:
    """The owner marker of a signing key: the subkey under which its holder may write."""
    return RSASignatureValidator(private_key).local_public_key


def peer_id_of_public_key(public_key: RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key: the sha2-256 multihash of its protobuf encoding."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_key_der(public_key)).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))).to_base58()


_OWNER_MARKER = re.compile(rb"\[owner:(ssh-rsa [A-Za-z0-9+/=]+)\]\Z")


@functools.lru_cache(maxsize=4096)
def peer_id_of_owner(marker: bytes) -> str | None:
    """The peer id whose key wrote under `marker`; None if `marker` is not exactly one owner marker."""
    match = _OWNER_MARKER.match(marker)
    if match is None:
        return None
    try:
        return peer_id_of_public_key(RSAPublicKey.from_bytes(match.group(1)))
    except Exception:  # not a parseable RSA key: cryptography raises several types
        return None


# Validation twins: same fields, but compared as sent (see SentFieldsOnly). Module-level classes, so
# a SchemaValidator that holds them can be pickled into the DHT process (DHT.add_validators).
class ServerRecordAsSent(SentFieldsOnly, ServerRecord):
    pass


class ExpertHostRecordAsSent(SentFieldsOnly, ExpertHostRecord):
    pass


class RunConfigRecordAsSent(SentFieldsOnly, RunConfigRecord):
    pass


class PeerMetricsRecordAsSent(SentFieldsOnly, PeerMetricsRecord):
    pass


class CheckpointRecordAsSent(SentFieldsOnly, CheckpointRecord):
    pass


class RunCheckpointRecordAsSent(SentFieldsOnly, RunCheckpointRecord):
    pass


class _SchemaConfig(pydantic.BaseConfig):
    # SchemaValidator sets `schema.Config.extra`; a schema without its own Config would have it
    # write into pydantic's global BaseConfig and change every other pydantic.v1 model.
    extra = pydantic.Extra.forbid


def _owned(record: type) -> tuple:
    return dict[BytesWithPublicKey, record] | None, None


RunRecordsSchema = pydantic.create_model(
    "RunRecordsSchema",
    __config__=_SchemaConfig,
    __module__=__name__,
    **{CONFIG_FIELD: _owned(RunConfigRecordAsSent), METRICS_FIELD: _owned(PeerMetricsRecordAsSent)},
    **{RUN_CHECKPOINT_FIELD: _owned(RunCheckpointRecordAsSent), EXPERTS_FIELD: _owned(ExpertHostRecordAsSent)},
    **{stage_field(stage): _owned(ServerRecordAsSent) for stage in range(MAX_STAGES)},
    **{checkpoints_field(stage): _owned(CheckpointRecordAsSent) for stage in range(MAX_STAGES)},
    **{expert_checkpoints_field(e): _owned(CheckpointRecordAsSent) for e in range(MAX_EXPERTS)},
)


class RunSchemaValidator(SchemaValidator):
    """The SchemaValidator of one run's records; pickled as just its run id.

    Pickled as is, it carries the hash of every one of its ~500 keys (~19 KB). hivemind's DHT process
    reads its command pipe without blocking, and multiprocessing sends a message over 16 KiB in two
    writes, so such a message (DHT.add_validators) can fail there with EAGAIN and be lost. Rebuilt
    from the run id on unpickling, it travels in a few hundred bytes.
    """

    def __init__(self, run_id: str):
        super().__init__(RunRecordsSchema, allow_extra_keys=True, prefix=run_id)
        self.run_id = run_id

    def __reduce_ex__(self, protocol: Any) -> Any:
        if schema_count(self) != 1:  # merged with another schema: only the full state describes it
            return super().__reduce_ex__(protocol)
        return RunSchemaValidator, (self.run_id,)


MAX_RECORD_BYTES = 64 * 1024  # one record's value: a run config of 256 stages is well under this
# How far ahead a record may expire, with a minute for clocks that disagree (record_ttl is at most MAX_RECORD_TTL)
MAX_RECORD_LIFETIME = MAX_RECORD_TTL + 60.0
PEER_ID_FIELDS = ("peer_id", "coordinator_peer_id")  # record fields that name the peer that wrote them


def run_fields() -> list[str]:
    """Every schema field of a run, i.e. the suffix of every key a run's records live under."""
    return list(RunRecordsSchema.__fields__)


class RunRecordGuard(RecordValidatorBase):
    """Accepts a record at a run key only as one signer's own record: see the module docstring.

    Runs after the signature check has verified and stripped the signature (priority 10), before the
    schema (0). Keys of other subsystems pass through. Pickled as just the run id, like RunSchemaValidator.
    """

    def __init__(self, run_id: str):
        self.run_id = run_id
        raw = [dht_key(run_id, field) for field in run_fields()] + [progress_key(run_id, k) for k in range(MAX_STAGES)]
        self._keys = frozenset(DHTID.generate(source=key).to_bytes() for key in raw)

    @property
    def key_ids(self) -> list[DHTID]:
        """The DHT ids of every key of the run."""
        return [DHTID.from_bytes(key) for key in self._keys]

    @property
    def priority(self) -> int:
        return 5

    def validate(self, record: DHTRecord) -> bool:
        if record.key not in self._keys:
            return True
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # msgpack raises several types on garbage
            return False
        signer = peer_id_of_owner(subkey) if isinstance(subkey, bytes) else None
        if signer is None:  # a plain value, or a subkey that merely contains a marker
            return False
        if record.expiration_time > get_dht_time() + MAX_RECORD_LIFETIME or len(record.value) > MAX_RECORD_BYTES:
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        if value is None:  # a record withdrawn by its owner (a server leaving its stage's progress)
            return True
        if not isinstance(value, dict):
            return False
        return all(value.get(field, signer) == signer for field in PEER_ID_FIELDS)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return RunRecordGuard, (self.run_id,)


MAX_SUBKEY_BYTES = 1024  # an owner marker of a 4096-bit RSA key is ~740 bytes, a peer id ~40
SIGNATURE_BYTES = 1024  # what a signature adds to a record's value (~270 bytes for a 2048-bit key)


class StoreBounds(RecordValidatorBase):
    """Refuses, at any key, a value no run record could be or an expiry further than any record's.

    Checked first (before signatures are verified or values parsed), so a flood of oversized or
    long-lived values costs a node little; storage.py bounds what it then keeps, key by key.
    """

    @property
    def priority(self) -> int:
        return 20

    def validate(self, record: DHTRecord) -> bool:
        return (len(record.value) <= MAX_RECORD_BYTES + SIGNATURE_BYTES and len(record.subkey) <= MAX_SUBKEY_BYTES + 8
                and record.expiration_time <= get_dht_time() + MAX_RECORD_LIFETIME)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, StoreBounds)


def schema_validator(run_id: str) -> SchemaValidator:
    """Type-checks every record under `run_id`; keys of other subsystems (averaging) pass through."""
    return RunSchemaValidator(run_id)


def run_validators(run_id: str) -> list[RecordValidatorBase]:
    """What guards one run's keys: the owner rules (RunRecordGuard) and the record schemas."""
    return [RunRecordGuard(run_id), schema_validator(run_id)]


def make_validators(run_id: str | None, private_key: RSAPrivateKey) -> list[RecordValidatorBase]:
    """Size and lifetime bounds, signature checks (and signing of our own records), plus the run's rules
    once the run id is known."""
    validators: list[RecordValidatorBase] = [StoreBounds(), RSASignatureValidator(private_key)]
    if run_id is not None:
        validators += run_validators(run_id)
    return validators
