"""StageKeeper: a server's checkpoints of its stage, written, announced, served, and restored from.

- written: every ``checkpoint.every_steps`` steps or ``checkpoint.every_seconds`` seconds (whichever
  comes first), once more when the server stops, and when the stage has stopped stepping for
  ``checkpoint.idle_seconds`` with steps no checkpoint holds (its trainers gone: a server killed then loses
  nothing). The state is copied on the stage's compute
  thread right after a step (the only moment it is known whole) and written to disk on a thread of
  its own, so compute never waits for the disk; a write still under way when the next is due is
  not queued behind (the next step after it finishes is written instead);
- announced: a CheckpointRecord in the DHT lists the checkpoints this server holds, renewed every
  announce period;
- served: to any peer that asks by manifest id, from this stage's checkpoint directory only;
- restored from: a server whose stage has no live server takes the newest checkpoint it can get,
  from its own disk or any holder in the DHT (servers and the coordinator), verified file by file.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from swarm.checkpoint.claims import believed, step_bound
from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.manifest import MANIFEST_NAME, StageManifest, manifest_id
from swarm.checkpoint.schedule import CheckpointSchedule
from swarm.checkpoint.serving import serve_checkpoints
from swarm.checkpoint.store import StageCheckpoints
from swarm.checkpoint.transfer import fetch_newest
from swarm.config import CheckpointConfig, RunConfig
from swarm.dht import BackgroundLoop, SwarmRecords, online_steps
from swarm.dht.schemas import CheckpointRecord, HeldCheckpoint
from swarm.state import StageState, StateInfo, StateRejected

log = logging.getLogger(__name__)

LOOP_CALL_TIMEOUT = 30.0  # registering the checkpoint service
FETCH_TIMEOUT = 300.0  # fetching one checkpoint from one holder
FINAL_WRITE_TIMEOUT = 60.0  # the checkpoint written when the server stops
MAX_ANNOUNCED = 8  # checkpoints listed in this server's record (newest first)


class KeeperMetrics:
    """The checkpoint metrics of one server, labelled by what each keeper keeps ("0": stage 0, "expert3")."""

    def __init__(self, registry: CollectorRegistry):
        self.writes = Counter("swarm_checkpoint_writes", "Checkpoints of the stage this server wrote to its disk",
                              ["stage", "outcome"], registry=registry)
        self.write_seconds = Histogram("swarm_checkpoint_write_seconds", "Time to write one checkpoint (beside "
                                       "compute)", ["stage"], registry=registry)
        self.step = Gauge("swarm_checkpoint_step", "Step of the newest checkpoint this server wrote or resumed "
                          "from", ["stage"], registry=registry)


@dataclass(frozen=True)
class KeeperScope:
    """What a keeper knows of its run besides the checkpoint section, computed once from the run's config."""

    run_id: str
    part: str  # "stage" or "expert": what the keeper's state is
    state_hash: str  # RunConfig.state_hash: the states its checkpoints hold fit every run with it
    count: int  # how many of its part the run has: its stages, or its experts per block
    num_stages: int  # the stages whose ONLINE servers bound the steps a claim may make believable
    record_ttl: float  # of its checkpoint records, renewed every announce_period
    announce_period: float

    @classmethod
    def of(cls, config: RunConfig, part: str = "stage") -> KeeperScope:
        if part not in ("stage", "expert"):
            raise ValueError(f"a keeper keeps a stage's or an expert's checkpoints, not {part!r}'s")
        count = config.model.moe.num_experts if part == "expert" else config.stages.num_stages
        return cls(config.run_id, part, config.state_hash(), count, config.stages.num_stages,
                   config.network.record_ttl, config.network.announce_period)


class StageKeeper:
    """Checkpoints of one stage replica (or, with `part` "expert", of one expert an expert host hosts: `state` is
    then its swarm.experts.ExpertState); create it once the state exists, `start` it once serving.

    Several keepers of one server share one KeeperMetrics (`metrics`), and one checkpoint service (the first
    serves, the others `start(p2p, serve=False)`; serve_checkpoints resolves through every keeper's store)."""

    def __init__(self, state: StageState, scope: KeeperScope, settings: CheckpointConfig, root: Path,
                 records: SwarmRecords, loop: BackgroundLoop, peer_id: str, registry: CollectorRegistry | None = None,
                 trusted_holders: Collection[str] = (), metrics: KeeperMetrics | None = None):
        self.state, self.scope, self.records, self.loop, self.peer_id = state, scope, records, loop, peer_id
        self.trusted_holders = frozenset(trusted_holders)  # the coordinator: it keeps only checkpoints it vetted
        self.part = part = scope.part
        self.label = f"{part} {state.stage}"  # for logs
        metric_label = str(state.stage) if part == "stage" else f"{part}{state.stage}"
        metrics = metrics or KeeperMetrics(registry or CollectorRegistry())
        self._writes = lambda outcome: metrics.writes.labels(stage=metric_label, outcome=outcome)
        self._write_seconds = metrics.write_seconds.labels(stage=metric_label)
        self._step_gauge = metrics.step.labels(stage=metric_label)
        self.count = scope.count
        self.settings = settings
        self.store = StageCheckpoints(root, scope.run_id, state.stage, settings.keep, part)
        self.state_hash = scope.state_hash
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"checkpoint{state.stage}")
        self._writing: Future | None = None
        self.schedule = CheckpointSchedule(settings)
        self._stop = threading.Event()
        self._announcer: threading.Thread | None = None
        self._service: Any = None
        self._serving = False  # start() ran: this keeper's checkpoints are announced (and served)
        self._p2p: Any = None
        self._submitting = threading.Lock()  # the compute thread's writes and the idle ones, one at a time
        self._stepped_at: float | None = None  # when the last step came (time.monotonic), None before any
        self._idle_snapshot: Callable[[], tuple[StateInfo, dict[str, torch.Tensor]]] | None = None
        self.written = 0  # checkpoints written by this server (for metrics and tests)

    # restore (before the server goes ONLINE)
    def restore(self, p2p: Any) -> int | None:
        """Load the newest checkpoint of the stage found on this disk or at a holder; its step, or None.

        This disk's newest is replaced only by a newer one that something besides its holder backs
        (:meth:`_believed`): a stranger announcing step 9,999,999,999 does not roll this server back.
        """
        local = self._newest_local()
        local_step = -1 if local is None else local[0].step
        try:
            remote = self._believed(self.records.lookup_checkpoints(self.state.stage, part=self.part))
        except Exception as e:  # noqa: BLE001 - the DHT is down: what is on disk is all there is
            log.warning("%s: could not look up checkpoints in the DHT: %s", self.label, e)
            remote = []
        if any(held.step > local_step for record in remote for held in record.checkpoints):
            fetched = self._fetch(p2p, remote, local_step + 1)
            if fetched is not None:
                local = fetched
        if local is None:
            return None
        manifest, tensors, path = local
        info = StateInfo(self.state.stage, manifest.step, manifest.round_id, manifest.group)
        try:
            self.state.load_state_dict(info, tensors)
        except StateRejected as e:
            raise CheckpointError(f"checkpoint {path} does not fit this {self.part}: {e}") from None
        self.schedule.restored(manifest.step)
        self._step_gauge.set(manifest.step)
        log.info("%s: resumed from the checkpoint of step %d (%s)", self.label, manifest.step, path)
        return manifest.step

    def _believed(self, remote: list[CheckpointRecord]) -> list[CheckpointRecord]:
        """The announced checkpoints worth fetching: the coordinator's, and others' up to the step the run's
        ONLINE servers (every stage: they step together) make believable (swarm.checkpoint.claims)."""
        if any(record.peer_id not in self.trusted_holders for record in remote):
            servers = self.records.lookup_all_servers(self.scope.num_stages)
            steps = online_steps(servers, other_than=self.peer_id)
        else:
            steps = []
        kept, ignored = believed(remote, bound=step_bound(steps), trusted=self.trusted_holders)
        for line in ignored:
            log.warning("%s: ignoring a checkpoint claim: %s", self.label, line)
        return kept

    def _newest_local(self) -> tuple[Any, dict[str, torch.Tensor], Path] | None:
        found = self.store.newest_verified(state_hash=self.state_hash)
        if found is None:
            return None
        manifest, _, tensors, path = found
        return manifest, tensors, path

    def _fetch(self, p2p: Any, remote: list[CheckpointRecord], min_step: int):
        staging = self.store.new_temp_dir()
        max_bytes = 2 * self.state.nbytes() + 2**20
        fetched = self.loop.run(fetch_newest(p2p, remote, self.scope.run_id, staging, expect_stage=self.state.stage,
                                             expect_state_hash=self.state_hash, max_bytes=max_bytes,
                                             min_step=min_step, expect_part=self.part, timeout=FETCH_TIMEOUT),
                                FETCH_TIMEOUT * 2)
        if fetched is None:
            log.warning("%s: no holder served a newer checkpoint than this disk's", self.label)
            return None
        staged, held, holder = fetched
        path = self.store.install(staged)
        log.info("%s: fetched the checkpoint of step %d from %s", self.label, held.step, holder)
        manifest, _, tensors = self.store.load(path, state_hash=self.state_hash)
        return manifest, tensors, path

    # serving
    def start(self, p2p: Any, serve: bool | Callable[[str], Path | None] = True, renew: bool = True,
              idle_snapshot: Callable[[], tuple[StateInfo, dict[str, torch.Tensor]]] | None = None) -> None:
        """Announce this stage's checkpoints in the DHT, and serve them to peers: `serve` True serves this
        keeper's, a function (manifest id -> directory) serves what it resolves (the keepers of one server
        share one service), False serves nothing (another keeper's service does). With `renew` False no
        thread of its own renews the record: the owner calls announce() (the keepers of one server, from
        its announcer); a new checkpoint is announced as soon as it is written either way. With `idle_snapshot`
        (the state, read on the compute thread) the renewing thread also writes steps left unsaved once the stage
        has not stepped for `checkpoint.idle_seconds` (save_idle)."""
        if serve:
            resolve = self.store.path_for if serve is True else serve
            self._service = self.loop.run(serve_checkpoints(p2p, self.scope.run_id, resolve), LOOP_CALL_TIMEOUT)
        self._serving = True
        self._p2p = p2p
        self._idle_snapshot = idle_snapshot
        self.schedule.restart_clock()
        if renew:
            self._announcer = threading.Thread(target=self._announce_forever, name="checkpoints", daemon=True)
            self._announcer.start()

    def after_step(self, step: int) -> None:
        """Called on the compute thread after every step: copy the state and write it, if one is due."""
        self._stepped_at = time.monotonic()
        with self._submitting:
            if self._stop.is_set() or (self._writing is not None and not self._writing.done()):
                return
            if self.schedule.due(step):
                self._writing = self._writer.submit(self._write, *self.state.state_dict())

    def save_idle(self, snapshot: Callable[[], tuple[StateInfo, dict[str, torch.Tensor]]]) -> bool:
        """Write the state if it holds steps no checkpoint does and the stage has not stepped for idle_seconds:
        a stage whose trainers left would otherwise keep those steps in memory only. Whether a write began."""
        stepped = self._stepped_at
        idle = self.settings.idle_seconds
        if (self._stop.is_set() or not self._serving or stepped is None or idle <= 0
                or self.state.step <= self.schedule.last_step or time.monotonic() - stepped < idle
                or (self._writing is not None and not self._writing.done())):
            return False
        info, tensors = snapshot()  # (on the compute thread, which may take it between two requests: no lock held)
        with self._submitting:
            if self._stop.is_set() or info.step <= self.schedule.last_step or \
                    (self._writing is not None and not self._writing.done()):
                return False
            log.info("%s: no step for %.0fs; writing step %d, which no checkpoint holds", self.label,
                     time.monotonic() - stepped, info.step)
            self._writing = self._writer.submit(self._write, info, tensors)
            return True

    def close(self, snapshot: Callable[[], tuple[StateInfo, dict[str, torch.Tensor]]] | None = None) -> None:
        """Stop announcing; with `snapshot` (the state, read between two requests), write a last checkpoint
        if this server served (start() ran) and training moved on since the newest."""
        self._stop.set()
        if self._writing is not None:
            self._writing.result(FINAL_WRITE_TIMEOUT)
        if snapshot is not None and self._serving and self.state.step > self.schedule.last_step:
            try:
                self._write(*snapshot())
            except Exception as e:  # noqa: BLE001 - stopping anyway; the previous checkpoint stays
                log.warning("%s: the last checkpoint could not be written: %s", self.label, e)
        self._writer.shutdown(wait=True)
        if self._service is not None and self.loop.is_running:
            try:
                self.loop.run(self._service.remove_p2p_handlers(self._p2p, namespace=self._service.namespace),
                              LOOP_CALL_TIMEOUT)
            except Exception as e:  # noqa: BLE001
                log.debug("removing the checkpoint service: %s", e)

    def _write(self, info: StateInfo, tensors: dict[str, torch.Tensor]) -> None:
        started = time.monotonic()
        try:
            _, _, path = self.store.write(tensors, step=info.step, num_stages=self.count,
                                          state_hash=self.state_hash, round_id=info.round_id, group=info.group)
        except (CheckpointError, OSError) as e:
            self._writes("failed").inc()
            log.error("%s: writing the checkpoint of step %d failed: %s", self.label, info.step, e)
            return
        self.schedule.done(info.step)
        self.written += 1
        self._writes("succeeded").inc()
        self._write_seconds.observe(time.monotonic() - started)
        self._step_gauge.set(info.step)
        log.info("%s: checkpoint of step %d written in %.2fs (%s)", self.label, info.step,
                 time.monotonic() - started, path)
        self.announce()

    # announcing
    def announce(self) -> bool:
        held = held_checkpoints(self.store)
        if not held:
            return True
        record = CheckpointRecord(peer_id=self.peer_id, stage=self.state.stage, state_hash=self.state_hash,
                                  checkpoints=held, part=self.part)
        return self.records.announce_checkpoints(record, ttl=self.scope.record_ttl)

    def _announce_forever(self) -> None:
        while not self._stop.wait(self.scope.announce_period):
            if self._idle_snapshot is not None:
                try:
                    self.save_idle(self._idle_snapshot)
                except Exception as e:  # noqa: BLE001 - the compute thread busy or stopping: the next period tries
                    log.warning("%s: an idle checkpoint could not be taken: %s", self.label, e)
            try:
                self.announce()
            except Exception as e:  # noqa: BLE001 - a DHT hiccup must not stop the renewals
                log.warning("announcing checkpoints failed: %s", e)


def held_checkpoints(store: StageCheckpoints, limit: int = MAX_ANNOUNCED) -> list[HeldCheckpoint]:
    """What a CheckpointRecord lists for `store`: its newest checkpoints (at most `limit`) that parse."""
    held = []
    for path in store.entries()[:limit]:
        try:
            data = (path / MANIFEST_NAME).read_bytes()
            manifest = StageManifest.from_bytes(data)
        except (OSError, CheckpointError) as e:
            log.debug("not announcing %s: %s", path, e)
            continue
        held.append(HeldCheckpoint(step=manifest.step, manifest_id=manifest_id(data),
                                   size=sum(f.size for f in manifest.files.values())))
    return held
