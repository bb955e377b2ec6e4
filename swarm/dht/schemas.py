"""Record types stored in the DHT: pure pydantic (v1) models, no I/O.

hivemind's SchemaValidator accepts a record only if parsing it changes nothing, so every field is
strictly typed (``3`` is not a float, ``"1"`` is not an int). Records tolerate unknown fields:
a newer peer may add fields, an older one keeps them and still validates the record.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, TypeVar

import pydantic.v1 as pydantic
from pydantic.v1 import StrictStr, confloat, conint, conlist, constr

from swarm import __version__

NonNegativeInt = conint(strict=True, ge=0)
NonNegativeFloat = confloat(strict=True, ge=0.0, allow_inf_nan=False)  # `throughput: inf` would draw all work
FiniteFloat = confloat(strict=True, allow_inf_nan=False)
# `\Z`, not `$`: pydantic matches with re.match, and `$` would let a trailing newline through
Sha256Hex = constr(strict=True, regex=r"^[0-9a-f]{64}\Z")
StateHash = constr(strict=True, max_length=128)  # RunConfig.state_hash(); bounded, compared verbatim
# Where Prometheus scrapes a peer: "host:port", the host an IPv4 address, a DNS name or a bracketed IPv6
# address. Scrapers connect there, so nothing but a plain address gets in (no scheme, path or userinfo).
METRICS_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)"
                             r":([1-9][0-9]{0,4})\Z")
MAX_METRICS_ADDRESS = 262
MetricsAddress = constr(strict=True, max_length=MAX_METRICS_ADDRESS, regex=METRICS_ADDRESS.pattern)

MAX_STAGES = 256  # stages a run may have; keys.py enumerates this many stage keys in the schema
MAX_HELD_CHECKPOINTS = 16  # checkpoints one holder lists per stage (servers keep a few, default 3)
MAX_HOSTED_EXPERTS = 256  # expert indices one expert host may list; bounds the record's size
MAX_PEER_ID = 128  # characters of a peer id a ServedWork names (a base58 libp2p id is ~46-53)
MAX_SERVED_LISTED = 32  # servers one trainer's metrics record lists the work of (the most worked first)

RecordT = TypeVar("RecordT", bound="WireRecord")


class ServerState(str, Enum):
    """Life cycle of a server as announced in its record."""

    JOINING = "JOINING"  # downloading its stage's state; not ready for requests
    ONLINE = "ONLINE"  # serving forward/backward
    OFFLINE = "OFFLINE"  # leaving; routers should stop sending work


def online(records: Iterable[RecordT], other_than: str | None = None) -> list[RecordT]:
    """The records (server or expert host) that say ONLINE, but `other_than`'s (a peer id: usually one's own)."""
    return [r for r in records if r.state == ServerState.ONLINE.value and r.peer_id != other_than]


def online_steps(servers: Mapping[int, Iterable[RecordT]], other_than: str | None = None) -> list[int]:
    """The steps the ONLINE servers of every stage announce (claims, each its own: swarm.checkpoint.claims)."""
    return [r.step for found in servers.values() for r in online(found, other_than)]


def is_metrics_address(value: object) -> bool:
    """Whether `value` is a plain "host:port" that a record's `metrics_addr` accepts."""
    return (isinstance(value, str) and len(value) <= MAX_METRICS_ADDRESS and METRICS_ADDRESS.match(value) is not None
            and int(value.rsplit(":", 1)[1]) <= 65535)


def _check_port(address: str | None) -> str | None:
    if address is not None and int(address.rsplit(":", 1)[1]) > 65535:
        raise ValueError(f"port out of range in {address!r}")
    return address


class WireRecord(pydantic.BaseModel):
    """Base of all DHT values: strict fields, unknown fields kept so peers of other versions interoperate."""

    class Config:
        extra = pydantic.Extra.allow
        use_enum_values = True  # a ServerState is stored (and compared) as its plain string
        allow_mutation = False

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able dict stored in the DHT (all fields, extras included)."""
        return self.dict()

    @classmethod
    def from_wire(cls: type[RecordT], value: Any) -> RecordT | None:
        """Parse a value read from the DHT; None if it does not fit (a bad record is skipped, not fatal)."""
        try:
            return cls.parse_obj(value)
        except (pydantic.ValidationError, TypeError):
            return None


DIRECT, RELAYED, UNREACHABLE = "direct", "relayed", "unreachable"  # how others reach a server (reachability.py)
REACH_VALUES = (DIRECT, RELAYED, UNREACHABLE)


def _check_reach(value: str | None) -> str | None:
    if value is not None and value not in REACH_VALUES:
        raise ValueError(f"reach must be one of {REACH_VALUES}")
    return value


class ServerRecord(WireRecord):
    """One server of one stage, renewed every announce period (DHT key ``stage{k}``)."""

    peer_id: StrictStr
    stage: NonNegativeInt
    state: ServerState
    throughput: NonNegativeFloat  # samples per second this server sustains
    step: NonNegativeInt = 0  # optimizer steps this server's stage replica has taken
    role: StrictStr = "server"
    version: StrictStr = __version__
    metrics_addr: MetricsAddress | None = None  # its /metrics, for the coordinator's Prometheus discovery
    reach: StrictStr | None = None  # direct, relayed (behind NAT) or unreachable, as its own check found; None: unknown
    averaging_bytes_per_sample: NonNegativeFloat | None = None  # what it sent in averaging rounds per sample it served
    # the low-communication mode (averaging.mode local): its stage's outer steps, and how far its weights are from
    # the slow weights (relative to them); shown in /status, never acted on
    outer_step: NonNegativeInt | None = None
    drift: NonNegativeFloat | None = None

    _port = pydantic.validator("metrics_addr", allow_reuse=True)(lambda v: _check_port(v))
    _reach = pydantic.validator("reach", allow_reuse=True)(_check_reach)


class ExpertHostRecord(WireRecord):
    """One expert server, hosting the listed expert indices in every MoE block of the run (DHT key ``experts``).

    Renewed every announce period, like a ServerRecord. `experts` is a set sent as a list: an index
    listed twice is refused rather than deduplicated, since SchemaValidator rejects any record that
    parsing changes.
    """

    peer_id: StrictStr
    experts: conlist(NonNegativeInt, max_items=MAX_HOSTED_EXPERTS)
    state: ServerState
    throughput: NonNegativeFloat  # samples per second this host sustains
    step: NonNegativeInt = 0  # optimizer steps its experts have taken
    role: StrictStr = "expert"
    version: StrictStr = __version__
    metrics_addr: MetricsAddress | None = None  # its /metrics, for the coordinator's Prometheus discovery
    reach: StrictStr | None = None  # as ServerRecord.reach

    _port = pydantic.validator("metrics_addr", allow_reuse=True)(lambda v: _check_port(v))
    _reach = pydantic.validator("reach", allow_reuse=True)(_check_reach)

    @pydantic.validator("experts")
    def _distinct(cls, experts: list[int]) -> list[int]:
        if len(set(experts)) != len(experts):
            raise ValueError("an expert index is listed more than once")
        return experts


class RunConfigRecord(WireRecord):
    """The run config, published by the coordinator (DHT key ``config``)."""

    run_id: StrictStr
    config_yaml: StrictStr
    coordinator_peer_id: StrictStr
    version: StrictStr = __version__


class ServedWork(WireRecord):
    """The work (forward samples' worth, a backward counting two) one trainer got answered by one server of one
    stage over the last SERVED_WINDOW seconds (swarm.routing.balancer), in replies it used."""

    peer_id: constr(strict=True, max_length=MAX_PEER_ID)
    stage: conint(strict=True, ge=0, lt=MAX_STAGES)
    work: NonNegativeFloat


class PeerMetricsRecord(WireRecord):
    """Training progress of one peer, read by the coordinator for swarm-wide gauges (DHT key ``metrics``)."""

    peer_id: StrictStr
    role: StrictStr
    step: NonNegativeInt
    samples_per_second: NonNegativeFloat
    samples: NonNegativeInt
    time: FiniteFloat  # unix time of the measurement
    stage: NonNegativeInt | None = None  # None for trainers, which touch every stage
    loss: confloat(strict=True) | None = None
    metrics_addr: MetricsAddress | None = None  # its /metrics, for the coordinator's Prometheus discovery
    # a trainer's: what the servers it used answered lately; a stage server weighs its stage-mates by these
    # (several trainers' word, never one's) when it decides whether to leave (swarm.serving.rebalance)
    served: conlist(ServedWork, max_items=MAX_SERVED_LISTED) | None = None

    _port = pydantic.validator("metrics_addr", allow_reuse=True)(lambda v: _check_port(v))

    @pydantic.validator("loss")
    def _finite_loss(cls, loss: float | None) -> float | None:
        # A diverged loss (nan/inf) is reported as "unknown": NaN != NaN, so SchemaValidator's
        # "parsing changed nothing" check would reject the whole record otherwise.
        return loss if loss is None or math.isfinite(loss) else None


class HeldCheckpoint(WireRecord):
    """One stage checkpoint a peer holds on its disk and serves (see docs/checkpoints.md)."""

    step: NonNegativeInt
    manifest_id: Sha256Hex  # sha256 of its manifest.json bytes: what a fetcher verifies against
    size: NonNegativeInt  # total bytes of the files the manifest lists


class CheckpointRecord(WireRecord):
    """The checkpoints of one stage that one peer holds, renewed periodically (DHT key ``checkpoints{k}``);
    with `part` "expert", of expert `stage` (DHT key ``expert_checkpoints{e}``)."""

    peer_id: StrictStr
    stage: NonNegativeInt
    part: constr(strict=True, regex="^(stage|expert)$") = "stage"  # absent (an older peer's): a stage
    state_hash: StateHash  # RunConfig.state_hash() of the run the checkpoints belong to
    checkpoints: conlist(HeldCheckpoint, max_items=MAX_HELD_CHECKPOINTS)
    version: StrictStr = __version__


class RunCheckpointStage(WireRecord):
    """One stage of a run checkpoint: which stage checkpoint it is made of."""

    stage: NonNegativeInt
    step: NonNegativeInt
    manifest_id: Sha256Hex


class RunCheckpointRecord(WireRecord):
    """A whole-run checkpoint the coordinator holds (DHT key ``run_checkpoint``)."""

    peer_id: StrictStr
    state_hash: StateHash
    step: NonNegativeInt  # the smallest stage step in it
    manifest_id: Sha256Hex  # sha256 of the run manifest.json bytes
    stages: conlist(RunCheckpointStage, max_items=MAX_STAGES)
    version: StrictStr = __version__


class SentFieldsOnly:
    """Mixin for the schema-validation twins of records: ``.dict()`` holds only the fields actually sent.

    SchemaValidator compares the parsed record with the raw one. Without this, a record from an older
    peer that lacks a newer optional field would parse to ``{..., field: None}``, differ from what was
    sent, and be rejected: old and new peers could no longer read each other.
    """

    def dict(self, **kwargs: Any) -> dict[str, Any]:
        kwargs["exclude_unset"] = True
        return super().dict(**kwargs)
