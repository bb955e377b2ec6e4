"""RunArchive: the coordinator's full-model checkpoints.

With ``--checkpoint-dir``, the coordinator pulls each stage's newest checkpoint from the servers that
announce one (every byte verified against its manifest, a holder that serves wrong bytes skipped),
keeps them like a server does (``<dir>/<run_id>/stage<k>/``), and, whenever it holds a newer one of
any stage, assembles a run checkpoint of every stage (``<dir>/<run_id>/run/``, what ``swarm-export``
reads). In a run with expert servers it pulls each expert's newest checkpoint from its hosts the same
way (``<dir>/<run_id>/expert<e>/``), and puts each expert's newest in the run checkpoints. It
announces them all in the DHT and serves them, so a stage whose servers all vanished, or an expert
whose hosts all did, resumes from the coordinator. The coordinator is optional: without it, servers
still checkpoint on their own disks and serve each other.

Every checkpoint the archive verified it signs (swarm.checkpoint.signing) with its own key, kept at
``<dir>/<run_id>/coordinator.key``: a stage checkpoint once fetched and installed, a run checkpoint
once assembled. It uses, announces and serves only checkpoints signed by that key, so a checkpoint
directory that reached its disk any other way (copied in, left by an older version, restored from a
mirror) moves nothing; each such one is logged once. ``swarm-export`` takes only signed ones too.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from swarm.checkpoint.claims import believed, step_bound
from swarm.checkpoint.errors import CheckpointError, CheckpointExists
from swarm.checkpoint.keeper import MAX_ANNOUNCED
from swarm.checkpoint.manifest import MANIFEST_NAME, RunManifest, StageManifest, manifest_id
from swarm.checkpoint.serving import serve_checkpoints
from swarm.checkpoint.signing import (
    RUN_KIND,
    fingerprint,
    key_digest,
    key_path,
    load_or_create_key,
    part_kind,
    public_key_of,
    sign_checkpoint,
    verify_signature,
)
from swarm.checkpoint.store import RunCheckpoints, StageCheckpoints
from swarm.checkpoint.transfer import fetch_newest
from swarm.checkpoint.verify import check_stage, read_manifest, verify_run
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, SwarmRecords, online
from swarm.dht.schemas import (
    CheckpointRecord,
    HeldCheckpoint,
    RunCheckpointRecord,
    RunCheckpointStage,
)
from swarm.tenure import TenureBook

log = logging.getLogger("swarm.coordinator")

LOOP_CALL_TIMEOUT = 30.0
FETCH_TIMEOUT = 600.0  # one stage checkpoint from one holder
Part = tuple[str, int]  # what a checkpoint is of: ("stage", k) or ("expert", e)
# What a stage's checkpoint may weigh, per parameter of the model (4 bytes each for the parameter and
# its two moments, plus room for buffers and the safetensors header)
MAX_BYTES_PER_PARAM = 16
# A server that stopped keeps its word on the checkpoints it announced this long after it was last seen
# established (its final checkpoint is written as it leaves)
HOLDER_GRACE_PERIODS = 6
MAX_LOGGED_CLAIMS = 1000  # ignored claims (and unsigned checkpoints) remembered so that each is logged once
MAX_INTACT_IDS = 1000  # signed stage checkpoints seen to verify, remembered so that a poll does not rehash them


class RunArchive:
    """Pulls, verifies, keeps, serves and announces the run's checkpoints (see the module docstring).

    It takes the whole RunConfig, unlike the servers' components: a run checkpoint holds the run's config."""

    def __init__(self, config: RunConfig, root: Path, records: SwarmRecords, loop: BackgroundLoop, peer_id: str,
                 max_stage_bytes: int, max_expert_bytes: int | None = None):
        self.config, self.records, self.loop, self.peer_id = config, records, loop, peer_id
        self.state_hash = config.state_hash()
        keep = config.checkpoint.keep
        self.stages = {k: StageCheckpoints(root, config.run_id, k, keep) for k in range(config.stages.num_stages)}
        moe = config.model.moe
        self.experts = {e: StageCheckpoints(root, config.run_id, e, keep, part="expert")
                        for e in range(moe.num_experts)} if moe is not None and moe.expert_servers else {}
        self._stores: dict[Part, StageCheckpoints] = {
            **{("stage", k): store for k, store in self.stages.items()},
            **{("expert", e): store for e, store in self.experts.items()}}
        self.runs = RunCheckpoints(root, config.run_id, keep)
        # Its own key, not the libp2p identity's: that one may change every start, this must not.
        self.key_path = key_path(root, config.run_id)
        self._key = load_or_create_key(self.key_path)
        self._public_key = public_key_of(self._key)
        self.fingerprint = fingerprint(self._public_key)
        self._unsigned: set[str] = set()  # unsigned or foreign checkpoints already logged (bounded)
        self._intact_ids: set[tuple[str, str]] = set()  # (path, manifest id) of signed stage checkpoints that verify
        self._max_bytes = {"stage": max_stage_bytes,
                           "expert": max_stage_bytes if max_expert_bytes is None else max_expert_bytes}
        self._p2p: Any = None
        self._service: Any = None
        self._assembled: dict[Part, str] = {}  # the manifest id of each part of the newest run checkpoint
        self._lock = threading.Lock()
        # Who backs a checkpoint's step (swarm.checkpoint.claims): the stage's servers (the expert's hosts) as
        # this coordinator watched them, and the furthest step they made believable when last seen.
        self.min_tenure = config.averaging.min_tenure
        self._tenure = {key: TenureBook(grace=config.network.record_ttl) for key in self._stores}
        self._holders: dict[Part, dict[str, float]] = {key: {} for key in self._stores}  # peer -> last established
        self._bounds: dict[Part, int] = {}
        self._expert_hosts: list = []  # the ONLINE expert hosts, read at the start of each poll
        self._ignored: set[str] = set()  # claims already logged (bounded: cleared when it grows large)

    def start(self, p2p: Any) -> None:
        """Serve what this disk holds and announce it (a restarted coordinator is a holder at once)."""
        self._p2p = p2p
        log.info("signing checkpoints as %s (sha256 of the key %s, kept in %s)", self.fingerprint,
                 key_digest(self._public_key), self.key_path)
        self._service = self.loop.run(serve_checkpoints(p2p, self.config.run_id, self._resolve), LOOP_CALL_TIMEOUT)
        for path in self._signed(self.runs.entries(), RUN_KIND):  # the newest that verifies (tensors not read)
            try:
                manifest = verify_run(path, run_id=self.config.run_id, state_hash=self.state_hash,
                                      read_state=False).manifest
            except CheckpointError as e:
                log.warning("skipping run checkpoint %s: %s", path, e)
                continue
            self._assembled = _ids(manifest)
            log.info("holding the run checkpoint of step %d (%s)", manifest.step, path)
            break
        self.announce()

    def run(self, stop: threading.Event) -> None:
        """Poll and renew the records every announce period until `stop` is set."""
        while not stop.wait(self.config.network.announce_period):
            try:
                if not self.poll():
                    self.announce()  # (poll announced if anything came)
            except Exception as e:  # noqa: BLE001 - a DHT or disk hiccup: the next period tries again
                log.warning("checkpoint archive: %s", e)

    def poll(self) -> bool:
        """Pull any newer stage (or expert) checkpoint, then assemble a run checkpoint if one came; whether one
        was assembled. (Its stages at the same steps as the last one's, it is not: a run checkpoint is never
        replaced, so an expert's newer checkpoint waits for the stages' next.)"""
        with self._lock:
            self._expert_hosts = online(self.records.lookup_expert_hosts()) if self.experts else []
            pulled = [key for key in self._stores if self._pull(key)]
            assembled = bool(pulled) and self._assemble()
            if pulled:
                self.announce()
            return assembled

    def _pull(self, key: Part) -> bool:
        part, index = key
        store = self._stores[key]
        have = self._newest_step(key)
        records = [r for r in self.records.lookup_checkpoints(index, part=part) if r.peer_id != self.peer_id]
        records = self._believed(key, records)
        if not any(held.step > have for record in records for held in record.checkpoints):
            return False
        staging = store.new_temp_dir()
        try:
            fetched = self.loop.run(fetch_newest(self._p2p, records, self.config.run_id, staging,
                                                 expect_stage=index, expect_state_hash=self.state_hash,
                                                 max_bytes=self._max_bytes[part], min_step=have + 1,
                                                 expect_part=part, timeout=FETCH_TIMEOUT), 2 * FETCH_TIMEOUT)
        finally:
            if not (staging / MANIFEST_NAME).exists():
                shutil.rmtree(staging, ignore_errors=True)  # nothing came (or it was removed already)
        if fetched is None:
            return False
        staged, held, holder = fetched
        path = store.install(staged)
        try:  # fetch_newest verified every byte against the manifest; install verified the files again
            sign_checkpoint(path, self._key, kind=part_kind(part, index), run_id=self.config.run_id)
        except (CheckpointError, OSError) as e:  # unsigned, it stays unused: the next poll fetches it again
            log.error("could not sign the checkpoint of %s %d at step %d (%s): %s", part, index, held.step, path, e)
            return False
        log.info("pulled the checkpoint of %s %d at step %d from %s (%s)", part, index, held.step, holder, path)
        return True

    def _believed(self, key: Part, records: list[CheckpointRecord]) -> list[CheckpointRecord]:
        """The checkpoints of `key` whose step the stage's established servers (the expert's established hosts)
        back (claims.believed)."""
        part, index = key
        if part == "stage":
            servers = online(self.records.lookup_servers(index))
        else:
            servers = [r for r in self._expert_hosts if index in r.experts]  # (read once a poll)
        book, holders, now = self._tenure[key], self._holders[key], time.monotonic()
        book.observe(r.peer_id for r in servers)
        established = [r for r in servers if book.established(r.peer_id, self.min_tenure)]
        for r in established:
            holders[r.peer_id] = now
        grace = HOLDER_GRACE_PERIODS * self.config.network.announce_period
        for peer in [p for p, seen in holders.items() if now - seen > grace]:
            del holders[peer]
        bound = step_bound(r.step for r in established)
        if bound is not None:
            self._bounds[key] = bound
        kept, ignored = believed(records, bound=self._bounds.get(key), established=set(holders))
        if len(self._ignored) > MAX_LOGGED_CLAIMS:
            self._ignored.clear()
        for line in ignored:
            if line not in self._ignored:
                self._ignored.add(line)
                log.warning("ignoring a checkpoint claim: %s", line)
        return kept

    def _assemble(self) -> bool:
        """A run checkpoint of every stage's newest verified checkpoint, and of every expert's that has one,
        unless it would be the last one again."""
        newest: dict[Part, Path] = {}
        ids: dict[Part, str] = {}
        for key in self._stores:
            found = self._newest_intact(key)
            if found is None:
                if key[0] == "stage":
                    return False  # not every stage has a checkpoint yet
                continue  # an expert no host has checkpointed yet: in a later run checkpoint
            ids[key], newest[key] = found
        if ids == self._assembled:
            return False
        stages = {index: path for (part, index), path in newest.items() if part == "stage"}
        experts = {index: path for (part, index), path in newest.items() if part == "expert"}
        try:
            manifest, _, path = self.runs.write(self.config.to_yaml(), self.state_hash, stages, experts)
        except CheckpointExists as e:  # the same lowest step as one written before: that one stays as it is
            log.info("not writing a run checkpoint: %s", e)
            self._assembled = ids
            return False
        except (CheckpointError, OSError) as e:
            log.error("assembling a run checkpoint failed: %s", e)
            return False
        try:
            sign_checkpoint(path, self._key, kind=RUN_KIND, run_id=self.config.run_id)
        except (CheckpointError, OSError) as e:  # written but unsigned: nobody uses it; the next one is signed
            log.error("could not sign the run checkpoint %s: %s", path, e)
            return False
        self._assembled = ids
        log.info("run checkpoint of steps %s written (%s)%s", [e.step for e in manifest.stages], path,
                 f", with experts {[e.stage for e in manifest.experts]}" if manifest.experts else "")
        return True

    def announce(self) -> None:
        """Renew the records of what this coordinator holds."""
        ttl = self.config.network.record_ttl
        for (part, index), store in self._stores.items():
            held = _held(self._signed(store.entries(), part_kind(part, index))[:MAX_ANNOUNCED])
            if held:
                record = CheckpointRecord(peer_id=self.peer_id, stage=index, state_hash=self.state_hash,
                                          checkpoints=held, part=part)
                self.records.announce_checkpoints(record, ttl=ttl)
        newest = self._signed(self.runs.entries(), RUN_KIND)
        if newest:
            try:
                data = (newest[0] / MANIFEST_NAME).read_bytes()
                manifest = RunManifest.from_bytes(data)
            except (OSError, CheckpointError) as e:
                log.warning("not announcing the run checkpoint %s: %s", newest[0], e)
                return
            stages = [RunCheckpointStage(stage=e.stage, step=e.step, manifest_id=e.manifest_sha256)
                      for e in manifest.stages]
            record = RunCheckpointRecord(peer_id=self.peer_id, state_hash=self.state_hash,
                                         step=min(s.step for s in stages), manifest_id=manifest_id(data),
                                         stages=stages)
            self.records.announce_run_checkpoint(record, ttl=ttl)

    def close(self) -> None:
        if self._service is not None and self.loop.is_running:
            try:
                self.loop.run(self._service.remove_p2p_handlers(self._p2p, namespace=self._service.namespace),
                              LOOP_CALL_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - leaving anyway
                log.debug("removing the checkpoint service: %s", e)

    def _resolve(self, wanted: str) -> Path | None:
        """The signed stage (or expert) checkpoint with manifest id `wanted` (only what this archive vouches for is
        served)."""
        for (part, index), store in self._stores.items():
            path = store.path_for(wanted)
            if path is not None:
                return path if self._signed([path], part_kind(part, index)) else None
        return None

    def _signed(self, paths: list[Path], kind: str) -> list[Path]:
        """`paths` less those this archive did not sign as `kind`; each one left out is logged once."""
        kept = []
        for path in paths:
            try:
                verify_signature(path, kind=kind, run_id=self.config.run_id, expect=self._public_key)
            except CheckpointError as e:
                if len(self._unsigned) > MAX_LOGGED_CLAIMS:
                    self._unsigned.clear()
                line = f"{path}: {e}"
                if line not in self._unsigned:
                    self._unsigned.add(line)
                    log.warning("not using checkpoint %s, which this coordinator did not sign: %s", path, e)
                continue
            kept.append(path)
        return kept

    def _newest_intact(self, part_key: Part) -> tuple[str, Path] | None:
        """(manifest id, path) of the newest checkpoint of `part_key` here that this archive signed and whose files
        verify (its tensors are not read); remembered per manifest id, so a poll does not rehash them."""
        part, index = part_key
        store = self._stores[part_key]
        for path in self._signed(store.entries(), part_kind(part, index)):
            try:
                key = (str(path), manifest_id(read_manifest(path)))
                if key not in self._intact_ids:
                    check_stage(path, run_id=store.run_id, stage=index, state_hash=self.state_hash, part=part)
                    if len(self._intact_ids) > MAX_INTACT_IDS:
                        self._intact_ids.clear()
                    self._intact_ids.add(key)
            except CheckpointError as e:
                log.warning("skipping checkpoint %s: %s", path, e)
                continue
            return key[1], path
        return None

    def _newest_step(self, key: Part) -> int:
        """The step of the newest signed checkpoint of `key` here that verifies (-1: none)."""
        found = self._newest_intact(key)
        return int(found[1].name.removeprefix("step")) if found is not None else -1


def _ids(manifest: RunManifest) -> dict[Part, str]:
    """The manifest id of each stage and expert checkpoint a run checkpoint holds."""
    return {(entry.part, entry.stage): entry.manifest_sha256 for entry in manifest.stages + manifest.experts}


def _held(paths: list[Path]) -> list[HeldCheckpoint]:
    """What a CheckpointRecord lists for the stage checkpoints at `paths` (those whose manifest parses)."""
    held = []
    for path in paths:
        try:
            data = read_manifest(path)
            manifest = StageManifest.from_bytes(data)
        except CheckpointError as e:
            log.debug("not announcing %s: %s", path, e)
            continue
        held.append(HeldCheckpoint(step=manifest.step, manifest_id=manifest_id(data),
                                   size=sum(f.size for f in manifest.files.values())))
    return held
