"""A stranger announces a genuine checkpoint of zeros at step 9,999,999,999 and serves it: nobody takes it.

Real hivemind peers on 127.0.0.1, in one process: the coordinator's archive, an honest server of the
(one-stage) run that announces itself ONLINE at step 12 and holds its checkpoint of step 12, and a
stranger that announces itself ONLINE at step 9,999,999,999 and holds (and serves, byte-exact to its
own manifest) a checkpoint of zeros at that step. Before the trust rules the archive pulled the
stranger's within a second and made it the run's newest, swarm-export exported zeros, and a
restarting server whose disk held a newer honest checkpoint resumed from the stranger's.

And one that needs no network at all: a valid stage checkpoint of zeros dropped into the coordinator's
own checkpoint directory by hand (or left there by an older version, or restored from a mirror) is
not assembled into a run checkpoint after a restart, since the coordinator did not sign it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from coordinator.archive import RunArchive
from swarm.averaging.progress import INITIAL_ROUND
from swarm.checkpoint.keeper import KeeperScope, StageKeeper, held_checkpoints
from swarm.checkpoint.serving import serve_checkpoints
from swarm.checkpoint.store import RunCheckpoints, StageCheckpoints
from swarm.dht import CheckpointRecord, ServerRecord, ServerState
from swarm.export import main as export_main
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.state import StageState, StateInfo
from tests.helpers import wait_until
from tests.integration.inproc import LOOP_CALL_TIMEOUT, Peer, running_peers, tiny_config

pytestmark = pytest.mark.timeout(120)

RUN_ID = "trust-ckpt"
STAGE = 0
HONEST_STEP, LIE_STEP = 12, 9_999_999_999
SEE_TIMEOUT = 20.0
PULL_TIMEOUT = 40.0


def replica(config) -> StageState:
    module = build_stage(config, STAGE)
    return StageState(module, StageOptimizer(module, config.optimizer), STAGE, INITIAL_ROUND)


def holder(peer: Peer, root: Path, config, step: int, tensors: dict[str, torch.Tensor], stage: int = STAGE,
           serve: bool = True) -> StageCheckpoints:
    """`peer` writes a checkpoint of `tensors` at `step`, serves it (unless it does already), and announces it
    and itself ONLINE at `step`."""
    store = StageCheckpoints(root, config.run_id, stage, keep=3)
    store.write(tensors, step=step, num_stages=config.stages.num_stages, state_hash=config.state_hash(),
                round_id="r", group=1)
    if serve:
        peer.loop.run(serve_checkpoints(peer.p2p(), config.run_id, store.path_for), LOOP_CALL_TIMEOUT)
    record = CheckpointRecord(peer_id=peer.peer_id, stage=stage, state_hash=config.state_hash(),
                              checkpoints=held_checkpoints(store))
    assert peer.records.announce_checkpoints(record, ttl=120.0)
    server = ServerRecord(peer_id=peer.peer_id, stage=stage, state=ServerState.ONLINE.value, throughput=1.0,
                          step=step)
    assert peer.records.announce_server(server, ttl=120.0)
    return store


def test_a_far_ahead_checkpoint_is_ignored_by_the_archive_export_and_a_restarting_server(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO)
    config = tiny_config(RUN_ID, num_stages=1)
    honest_info, honest = replica(config).state_dict()
    zeros = {name: torch.zeros_like(t) for name, t in honest.items()}
    with running_peers(RUN_ID, 4) as (coordinator, server, stranger, restarter):
        holder(server, tmp_path / "server", config, HONEST_STEP, honest)
        holder(stranger, tmp_path / "stranger", config, LIE_STEP, zeros)
        wait_until(lambda: len(coordinator.records.lookup_checkpoints(STAGE)) == 2, SEE_TIMEOUT, interval=0.2,
                   what="both checkpoint records")

        archive = RunArchive(config, tmp_path / "coordinator", coordinator.records, coordinator.loop,
                             coordinator.peer_id, max_stage_bytes=2**30)
        corrupt = archive.stages[STAGE].dir / "step9999999990"  # a broken directory of a high step on its disk
        corrupt.mkdir(parents=True)
        (corrupt / "manifest.json").write_text("{not json")
        archive.start(coordinator.p2p())
        try:
            # the honest server is established after averaging.min_tenure of the archive watching it
            wait_until(lambda: archive.poll() or archive.stages[STAGE].newest_intact(), PULL_TIMEOUT, interval=0.3,
                       what="the archive pulling the honest checkpoint")
            for _ in range(3):  # more polls: still nothing of the stranger's
                archive.poll()
        finally:
            archive.close()
        stage_dir = archive.stages[STAGE].dir
        assert [p.name for p in archive.stages[STAGE].entries()] == [corrupt.name, f"step{HONEST_STEP:010d}"]
        assert not list(stage_dir.glob(".tmp-*")), "a poll left an empty staging directory behind"
        ignored = [r.getMessage() for r in caplog.records if "ignoring a checkpoint claim" in r.getMessage()]
        assert any(stranger.peer_id in line and f"step {LIE_STEP}, beyond step" in line for line in ignored), ignored
        found = RunCheckpoints(tmp_path / "coordinator", RUN_ID, keep=3).newest_verified()
        assert found is not None and [e.step for e in found[0].manifest.stages] == [HONEST_STEP]

        capsys.readouterr()
        export_main(["--checkpoint-dir", str(tmp_path / "coordinator"), "--out", str(tmp_path / "model")])
        assert f"stage 0 step {HONEST_STEP})" in capsys.readouterr().out

        # A server restarting with a newer honest checkpoint on its own disk keeps it.
        own = replica(config)
        newer = {name: t + 1.0 for name, t in honest.items()}
        disk = StageCheckpoints(tmp_path / "restarter", RUN_ID, STAGE, keep=3)
        disk.write(newer, step=HONEST_STEP + 3, num_stages=1, state_hash=config.state_hash(), round_id="r", group=1)
        keeper = StageKeeper(own, KeeperScope.of(config), config.checkpoint, tmp_path / "restarter", restarter.records,
                             restarter.loop, restarter.peer_id, trusted_holders=[coordinator.peer_id])
        assert keeper.restore(restarter.p2p()) == HONEST_STEP + 3
        assert torch.equal(own.state_dict()[1][next(iter(newer))], next(iter(newer.values())))

        # One with an empty disk takes the honest checkpoint (from the server), not the stranger's.
        empty = replica(config)
        keeper = StageKeeper(empty, KeeperScope.of(config), config.checkpoint, tmp_path / "empty", restarter.records,
                             restarter.loop, restarter.peer_id, trusted_holders=[coordinator.peer_id])
        assert keeper.restore(restarter.p2p()) == HONEST_STEP
        info, tensors = empty.state_dict()
        assert isinstance(info, StateInfo) and info.step == HONEST_STEP
        assert all(torch.equal(tensors[name], honest[name]) for name in honest)
        assert re.search(f"ignoring a checkpoint claim: {stranger.peer_id}", caplog.text)


def test_a_stage_checkpoint_put_on_the_coordinators_disk_by_hand_is_not_assembled(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    config = tiny_config("trust-disk", num_stages=2)
    honest = {k: replica_of(config, k) for k in range(2)}
    root = tmp_path / "coordinator"
    with running_peers(config.run_id, 3) as (coordinator, server0, server1):
        holder(server1, tmp_path / "server1", config, HONEST_STEP, honest[1], stage=1)
        # The coordinator pulls (and signs) stage 1's checkpoint; stage 0 has none yet, so no run checkpoint.
        archived(config, coordinator, root, lambda archive: archive.stages[1].entries())

        # While the coordinator is down, a valid, newer checkpoint of stage 1 (zeros) lands in its directory.
        dropped = StageCheckpoints(root, config.run_id, 1, keep=3).write(
            {name: torch.zeros_like(t) for name, t in honest[1].items()}, step=HONEST_STEP + 1, num_stages=2,
            state_hash=config.state_hash(), round_id="r", group=1)[2]
        # Stage 0's first checkpoint comes: the restarted coordinator pulls it and assembles a run checkpoint.
        holder(server0, tmp_path / "server0", config, HONEST_STEP, honest[0], stage=0)
        runs = RunCheckpoints(root, config.run_id, keep=3)
        archived(config, coordinator, root, lambda archive: runs.entries())

    found = runs.newest_verified()
    assert found is not None and [e.step for e in found[0].manifest.stages] == [HONEST_STEP, HONEST_STEP]
    assert all(torch.equal(found[0].stages[1][1][name], honest[1][name]) for name in honest[1])
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"not using checkpoint {dropped}")]
    assert len(skipped) == 1 and "is not signed" in skipped[0], skipped  # logged once, however many polls
    assert len(re.findall(r"signing checkpoints as ([0-9a-f]{16}) ", caplog.text)) == 2  # one key, kept
    assert len(set(re.findall(r"signing checkpoints as ([0-9a-f]{16}) ", caplog.text))) == 1


def replica_of(config, stage: int) -> dict[str, torch.Tensor]:
    module = build_stage(config, stage)
    return StageState(module, StageOptimizer(module, config.optimizer), stage, INITIAL_ROUND).state_dict()[1]


def archived(config, coordinator: Peer, root: Path, done: Callable[[RunArchive], object]) -> None:
    """Start a coordinator's archive on `root` (as a restarted coordinator would), poll until `done(archive)`,
    a few more times (nothing else comes of what is on its disk), and close it."""
    archive = RunArchive(config, root, coordinator.records, coordinator.loop, coordinator.peer_id,
                         max_stage_bytes=2**30)
    archive.start(coordinator.p2p())
    try:
        wait_until(lambda: archive.poll() or done(archive), PULL_TIMEOUT, interval=0.3, what="the archive pulling")
        for _ in range(3):
            archive.poll()
    finally:
        archive.close()
