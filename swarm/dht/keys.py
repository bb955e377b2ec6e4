"""Where records live in the DHT, and the validators that guard them.

Every key is ``{run_id}_{field}``; fields are ``config``, ``metrics`` and ``stage0`` .. ``stage255``.
Each key holds a dictionary whose subkeys are owner markers (``[owner:ssh-rsa ...]``): hivemind's
RSASignatureValidator then accepts a subkey's value only if it is signed by that owner, so a peer can
write its own server record or metrics, never another peer's, and only the coordinator its config.

hivemind validators see only hashed keys, so the schema enumerates every field name up front.
"""

from __future__ import annotations

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from swarm.dht.schemas import PeerMetricsRecord, RunConfigRecord, SentFieldsOnly, ServerRecord

MAX_STAGES = 256  # stage keys enumerated in the schema; a run may use any number of stages up to this

CONFIG_FIELD = "config"
METRICS_FIELD = "metrics"


def stage_field(stage: int) -> str:
    """Schema field (and key suffix) holding the server records of one stage."""
    if not 0 <= stage < MAX_STAGES:
        raise ValueError(f"stage must be in [0, {MAX_STAGES}), got {stage}")
    return f"stage{stage}"


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
    **{stage_field(stage): _owned(ServerRecordAsSent) for stage in range(MAX_STAGES)},
)


def schema_validator(run_id: str) -> SchemaValidator:
    """Type-checks every record under `run_id`; keys of other subsystems (averaging) pass through."""
    return SchemaValidator(RunRecordsSchema, allow_extra_keys=True, prefix=run_id)


def make_validators(run_id: str | None, private_key: RSAPrivateKey) -> list[RecordValidatorBase]:
    """Signature checks (and signing of our own records), plus the schema once the run id is known."""
    validators: list[RecordValidatorBase] = [RSASignatureValidator(private_key)]
    if run_id is not None:
        validators.append(schema_validator(run_id))
    return validators
