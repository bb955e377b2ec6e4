"""Publishing and reading a run's records (config, servers, expert hosts, metrics, checkpoints) over a hivemind DHT."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from swarm.config import ConfigError, RunConfig
from swarm.dht.errors import RunConfigInvalid, RunConfigNotFound
from swarm.dht.identity import Identity
from swarm.dht.keys import (
    CONFIG_FIELD,
    EXPERTS_FIELD,
    METRICS_FIELD,
    RUN_CHECKPOINT_FIELD,
    dht_key,
    part_checkpoints_field,
    peer_id_of_owner,
    stage_field,
)
from swarm.dht.node import peer_id, require_alive, wait_future
from swarm.dht.private import SEALED_RUN_ID, SwarmKey, is_sealed
from swarm.dht.schemas import (
    CheckpointRecord,
    ExpertHostRecord,
    PeerMetricsRecord,
    RunCheckpointRecord,
    RunConfigRecord,
    ServerRecord,
    WireRecord,
)

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT = 10.0  # one get or store, all DHT hops included


class SwarmRecords:
    """Sync access to one run's DHT records, written under this peer's owner marker.

    `identity` must be the one the DHT was started with: the DHT process signs with that key, and a
    record written under any other owner marker is rejected by every peer.
    """

    def __init__(self, dht: hivemind.DHT, run_id: str, identity: Identity, timeout: float = DEFAULT_REQUEST_TIMEOUT,
                 swarm_key: SwarmKey | None = None):
        self.dht, self.run_id, self.timeout = dht, run_id, timeout
        self.swarm_key = swarm_key  # a private swarm's: the run config is sealed with it
        self._owner_key = identity.owner_key
        self._peer_id: str | None = None

    @property
    def local_owner_key(self) -> bytes:
        """The owner marker (``[owner:ssh-rsa ...]``) this peer's records are stored under."""
        return self._owner_key

    # run config: written by the coordinator only
    def publish_run_config(self, config: RunConfig, ttl: float, timeout: float | None = None) -> bool:
        """Publish `config` as this (coordinator) peer's signed run config for `ttl` seconds."""
        if config.run_id != self.run_id:
            raise ValueError(f"config is for run {config.run_id!r}, these records are for {self.run_id!r}")
        if self._peer_id is None:
            self._peer_id = peer_id(self.dht, self._timeout(timeout))
        if self.swarm_key is None:
            run_id, text = self.run_id, config.to_yaml()
        else:  # a private swarm's run id is its network id: only the seal may hold it
            run_id, text = SEALED_RUN_ID, self.swarm_key.seal(config.to_yaml())
        record = RunConfigRecord(run_id=run_id, config_yaml=text, coordinator_peer_id=self._peer_id)
        return self._store(CONFIG_FIELD, record, ttl, timeout)

    def fetch_run_config(self, coordinator_key: bytes | None, timeout: float | None = None) -> RunConfig:
        """The run config signed by `coordinator_key` (None: the only one published; tests and tools).

        Raises RunConfigNotFound if there is none (yet), RunConfigInvalid if it cannot be used.
        """
        published = self._get_owned([CONFIG_FIELD], timeout)[0]
        others: tuple[str, ...] = ()
        if coordinator_key is not None:
            others = tuple(sorted(str(peer_id_of_owner(owner)) for owner in published if owner != coordinator_key))
            published = {owner: value for owner, value in published.items() if owner == coordinator_key}
        if not published:
            raise RunConfigNotFound(
                f"no run config for run {self.run_id!r} signed by the coordinator "
                f"({peer_id_of_owner(coordinator_key) if coordinator_key else 'any'}) is in the DHT: "
                "is the coordinator running, and did it finish starting?" + other_publishers(others), others)
        if len(published) > 1:
            raise RunConfigNotFound(
                f"{len(published)} peers published a run config for run {self.run_id!r}; "
                "say which coordinator to trust (its owner key)"
            )
        [value] = published.values()
        return self._parse_run_config(value)

    def _parse_run_config(self, value: Any) -> RunConfig:
        record = RunConfigRecord.from_wire(value)
        if record is None:
            raise RunConfigInvalid(f"the run config record of run {self.run_id!r} does not fit the schema")
        # a sealed config names its run inside the seal (checked below); older coordinators named it outside too
        sealed_here = record.run_id == SEALED_RUN_ID and is_sealed(record.config_yaml)
        if record.run_id != self.run_id and not sealed_here:
            raise RunConfigInvalid(f"the run config record says run {record.run_id!r}, expected {self.run_id!r}")
        ignored: list[str] = []  # settings of a newer version: this peer runs without them
        try:
            config = RunConfig.from_yaml(self._unsealed(record.config_yaml), ignored)
        except ConfigError as e:
            raise RunConfigInvalid(
                f"the coordinator's run config is not usable by this peer (version {record.version} published it): {e}"
            ) from None
        if config.run_id != self.run_id:
            raise RunConfigInvalid(f"the published run config is for run {config.run_id!r}, expected {self.run_id!r}")
        if ignored:
            logger.warning("the run config (published by version %s) has settings this version does not know; "
                        "ignoring them: %s", record.version, ", ".join(ignored))
        return config

    def _unsealed(self, text: str) -> str:
        if self.swarm_key is None:
            if is_sealed(text):
                raise RunConfigInvalid(f"the run config of run {self.run_id!r} is sealed: it is a private swarm, "
                                       "start with --swarm-key and a copy of its key")
            return text
        try:
            return self.swarm_key.open(text)
        except ValueError as e:
            raise RunConfigInvalid(f"the run config of run {self.run_id!r} could not be opened with this swarm key "
                                   f"({e})") from None

    # servers: one record per server per stage
    def announce_server(self, record: ServerRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store (or renew) this peer's record for `record.stage`, valid for `ttl` seconds."""
        return self._store(stage_field(record.stage), record, ttl, timeout)

    def lookup_servers(self, stage: int, timeout: float | None = None) -> list[ServerRecord]:
        """Servers of `stage` whose records are valid and unexpired."""
        return self._lookup_stages([stage], timeout)[stage]

    def lookup_all_servers(self, num_stages: int, timeout: float | None = None) -> dict[int, list[ServerRecord]]:
        """Servers of every stage 0 .. num_stages-1, looked up in parallel."""
        return self._lookup_stages(range(num_stages), timeout)

    def _lookup_stages(self, stages: Iterable[int], timeout: float | None = None) -> dict[int, list[ServerRecord]]:
        """Servers of each of `stages`; a record claiming another stage than its key's is ignored."""
        stages = list(stages)
        owned = self._get_owned([stage_field(stage) for stage in stages], timeout)
        found = {}
        for stage, records in zip(stages, owned):
            parsed = _parse_all(ServerRecord, records.values())
            found[stage] = [record for record in parsed if record.stage == stage]
        return found

    # expert hosts: one record per expert server, for all MoE blocks of the run
    def announce_expert_host(self, record: ExpertHostRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store (or renew) this peer's expert host record, valid for `ttl` seconds."""
        return self._store(EXPERTS_FIELD, record, ttl, timeout)

    def lookup_expert_hosts(self, timeout: float | None = None) -> list[ExpertHostRecord]:
        """Expert hosts whose records are valid and unexpired (every state: callers pick ONLINE ones)."""
        return _parse_all(ExpertHostRecord, self._get_owned([EXPERTS_FIELD], timeout)[0].values())

    # metrics: one record per peer
    def publish_metrics(self, record: PeerMetricsRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store (or renew) this peer's training metrics for `ttl` seconds."""
        return self._store(METRICS_FIELD, record, ttl, timeout)

    def lookup_metrics(self, timeout: float | None = None) -> list[PeerMetricsRecord]:
        """Latest valid metrics of every peer that published some."""
        return _parse_all(PeerMetricsRecord, self._get_owned([METRICS_FIELD], timeout)[0].values())

    # checkpoints: one list per holder per stage, and the coordinator's run checkpoint
    def announce_checkpoints(self, record: CheckpointRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store (or renew) the list of `record.stage` checkpoints (of expert `record.stage` if `record.part` is
        "expert") this peer holds, valid for `ttl` seconds."""
        return self._store(part_checkpoints_field(record.part, record.stage), record, ttl, timeout)

    def lookup_checkpoints(self, stage: int, timeout: float | None = None, part: str = "stage"
                           ) -> list[CheckpointRecord]:
        """Every peer's valid, unexpired list of the `stage` checkpoints (expert `stage`'s, with `part` "expert")
        it holds.

        A record claiming another stage (or part) than its key's is dropped. Its `peer_id` is the signer's own (every
        node checks it, keys.RunRecordGuard), so a peer can only announce what it holds itself; what it holds
        is still verified byte by byte against the announced manifest id (sha256) when fetched.
        """
        field = part_checkpoints_field(part, stage)
        parsed = _parse_all(CheckpointRecord, self._get_owned([field], timeout)[0].values())
        return [record for record in parsed if (record.part, record.stage) == (part, stage)]

    def announce_run_checkpoint(self, record: RunCheckpointRecord, ttl: float, timeout: float | None = None) -> bool:
        """Store (or renew) this (coordinator) peer's newest run checkpoint, valid for `ttl` seconds."""
        return self._store(RUN_CHECKPOINT_FIELD, record, ttl, timeout)

    def lookup_run_checkpoints(
        self, coordinator_key: bytes | None = None, timeout: float | None = None
    ) -> list[RunCheckpointRecord]:
        """Valid, unexpired run checkpoint records; only the one signed by `coordinator_key` if given."""
        published = self._get_owned([RUN_CHECKPOINT_FIELD], timeout)[0]
        if coordinator_key is not None:
            published = {owner: value for owner, value in published.items() if owner == coordinator_key}
        return _parse_all(RunCheckpointRecord, published.values())

    # plumbing
    def _timeout(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def _store(self, field: str, record: WireRecord, ttl: float, timeout: float | None) -> bool:
        require_alive(self.dht, f"storing {field} of run {self.run_id}")
        future = self.dht.store(
            key=dht_key(self.run_id, field),
            subkey=self._owner_key,
            value=record.to_wire(),
            expiration_time=get_dht_time() + ttl,
            return_future=True,
        )
        return bool(wait_future(future, self._timeout(timeout), f"storing {field} of run {self.run_id}"))

    def _get_owned(self, fields: list[str], timeout: float | None) -> list[dict[bytes, Any]]:
        """For each field, {owner marker: value} of its unexpired records (gets run in parallel)."""
        require_alive(self.dht, f"looking up run {self.run_id}")
        futures = [self.dht.get(dht_key(self.run_id, field), latest=True, return_future=True) for field in fields]
        deadline = time.monotonic() + self._timeout(timeout)
        try:
            results = [
                wait_future(future, max(0.0, deadline - time.monotonic()), f"looking up {field} of run {self.run_id}")
                for field, future in zip(fields, futures)
            ]
        finally:
            for future in futures:
                future.cancel()  # no-op for finished ones; frees the DHT process from the rest
        return [_unexpired_subkeys(result) for result in results]


def other_publishers(others: tuple[str, ...]) -> str:
    """What to tell a peer when peers other than its coordinator publish a config for the run."""
    if not others:
        return ""
    return (f" {len(others)} other peer(s) publish one ({', '.join(others[:3])}): a coordinator restarted with a "
            "new identity, or a stranger. A peer trusts only the coordinator its initial peer vouched for: to "
            "follow a new coordinator, join through its own address (and give a coordinator --identity so it "
            "keeps its identity across restarts)")


def _unexpired_subkeys(result: Any) -> dict[bytes, Any]:
    # hivemind returns ValueWithExpiration(value={subkey: ValueWithExpiration}) for dictionary keys
    if result is None or not isinstance(result.value, dict):
        return {}
    now = get_dht_time()
    return {
        subkey: item.value
        for subkey, item in result.value.items()
        if isinstance(subkey, bytes) and item.expiration_time > now
    }


def _parse_all(model: type[WireRecord], values: Iterable[Any]) -> list:
    parsed = [model.from_wire(value) for value in values]
    if None in parsed:
        logger.debug("skipped %d %s value(s) that do not fit the schema", parsed.count(None), model.__name__)
    return [record for record in parsed if record is not None]
