"""A stranger announces a genuine checkpoint of zeros at step 9,999,999,999 and serves it: nobody takes it.

Real hivemind peers on 127.0.0.1, in one process: the coordinator's archive, an honest server of the
(one-stage) run that announces itself ONLINE at step 12 and holds its checkpoint of step 12, and a
stranger that announces itself ONLINE at step 9,999,999,999 and holds (and serves, byte-exact to its
own manifest) a checkpoint of zeros at that step. Before the trust rules the archive pulled the
stranger's within a second and made it the run's newest, swarm-export exported zeros, and a
restarting server whose disk held a newer honest checkpoint resumed from the stranger's.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from coordinator.archive import RunArchive
from swarm.averaging.progress import INITIAL_ROUND
from swarm.checkpoint.keeper import StageKeeper, held_checkpoints
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


def holder(peer: Peer, root: Path, config, step: int, tensors: dict[str, torch.Tensor]) -> StageCheckpoints:
    """`peer` writes a checkpoint of `tensors` at `step`, serves it, and announces it and itself ONLINE at `step`."""
    store = StageCheckpoints(root, RUN_ID, STAGE, keep=3)
    store.write(tensors, step=step, num_stages=1, state_hash=config.state_hash(), round_id="r", group=1)
    peer.loop.run(serve_checkpoints(peer.p2p(), RUN_ID, store.path_for), LOOP_CALL_TIMEOUT)
    record = CheckpointRecord(peer_id=peer.peer_id, stage=STAGE, state_hash=config.state_hash(),
                              checkpoints=held_checkpoints(store))
    assert peer.records.announce_checkpoints(record, ttl=120.0)
    server = ServerRecord(peer_id=peer.peer_id, stage=STAGE, state=ServerState.ONLINE.value, throughput=1.0,
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
        run = RunCheckpoints(tmp_path / "coordinator", RUN_ID, keep=3).newest_verified()
        assert run is not None and [e.step for e in run[0].stages] == [HONEST_STEP]

        capsys.readouterr()
        export_main(["--checkpoint-dir", str(tmp_path / "coordinator"), "--out", str(tmp_path / "model")])
        assert f"stage 0 step {HONEST_STEP})" in capsys.readouterr().out

        # A server restarting with a newer honest checkpoint on its own disk keeps it.
        own = replica(config)
        newer = {name: t + 1.0 for name, t in honest.items()}
        disk = StageCheckpoints(tmp_path / "restarter", RUN_ID, STAGE, keep=3)
        disk.write(newer, step=HONEST_STEP + 3, num_stages=1, state_hash=config.state_hash(), round_id="r", group=1)
        keeper = StageKeeper(own, config, tmp_path / "restarter", restarter.records, restarter.loop,
                             restarter.peer_id, trusted_holders=[coordinator.peer_id])
        assert keeper.restore(restarter.p2p()) == HONEST_STEP + 3
        assert torch.equal(own.state_dict()[1][next(iter(newer))], next(iter(newer.values())))

        # One with an empty disk takes the honest checkpoint (from the server), not the stranger's.
        empty = replica(config)
        keeper = StageKeeper(empty, config, tmp_path / "empty", restarter.records, restarter.loop,
                             restarter.peer_id, trusted_holders=[coordinator.peer_id])
        assert keeper.restore(restarter.p2p()) == HONEST_STEP
        info, tensors = empty.state_dict()
        assert isinstance(info, StateInfo) and info.step == HONEST_STEP
        assert all(torch.equal(tensors[name], honest[name]) for name in honest)
        assert re.search(f"ignoring a checkpoint claim: {stranger.peer_id}", caplog.text)
