"""Where records live in the DHT, and the validators that guard them.

Every key is ``{run_id}_{field}``; fields are ``config``, ``metrics``, ``run_checkpoint``, ``stage0`` ..
``stage255`` (server records) and ``checkpoints0`` .. ``checkpoints255`` (who holds which stage checkpoints).
Each key holds a dictionary whose subkeys are owner markers (``[owner:ssh-rsa ...]``): hivemind's
RSASignatureValidator then accepts a subkey's value only if it is signed by that owner, so a peer can
write its own server record, metrics or checkpoint list, never another peer's (readers that trust only
the coordinator for the config or the run checkpoint pick its owner marker).

hivemind validators see only hashed keys, so the schema enumerates every field name up front.
"""

from __future__ import annotations

from typing import Any

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from swarm.dht.schemas import (
    MAX_STAGES,  # stage keys enumerated in the schema; a run may use any number of stages up to this
    CheckpointRecord,
    PeerMetricsRecord,
    RunCheckpointRecord,
    RunConfigRecord,
    SentFieldsOnly,
    ServerRecord,
)
from swarm.hivemind_internals import schema_count

CONFIG_FIELD = "config"
METRICS_FIELD = "metrics"
RUN_CHECKPOINT_FIELD = "run_checkpoint"


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


def dht_key(run_id: str, field: str) -> str:
    """The raw DHT key of a schema field; SchemaValidator(prefix=run_id) hashes the same string."""
    return f"{run_id}_{field}"


def owner_key(private_key: RSAPrivateKey) -> bytes:
    """The owner marker of a signing key: the subkey under which its holder may write."""
    return RSASignatureValidator(private_key).local_public_key


# Validation twins: same fields, but compared as sent (see SentFieldsOnly). Module-level classes, so
# a SchemaValidator that holds them can be pickled into the DHT process (DHT.add_validators).
class ServerRecordAsSent(SentFieldsOnly, ServerRecord):
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
    **{RUN_CHECKPOINT_FIELD: _owned(RunCheckpointRecordAsSent)},
    **{stage_field(stage): _owned(ServerRecordAsSent) for stage in range(MAX_STAGES)},
    **{checkpoints_field(stage): _owned(CheckpointRecordAsSent) for stage in range(MAX_STAGES)},
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


def schema_validator(run_id: str) -> SchemaValidator:
    """Type-checks every record under `run_id`; keys of other subsystems (averaging) pass through."""
    return RunSchemaValidator(run_id)


def make_validators(run_id: str | None, private_key: RSAPrivateKey) -> list[RecordValidatorBase]:
    """Signature checks (and signing of our own records), plus the schema once the run id is known."""
    validators: list[RecordValidatorBase] = [RSASignatureValidator(private_key)]
    if run_id is not None:
        validators.append(schema_validator(run_id))
    return validators
