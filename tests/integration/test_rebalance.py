"""A stage whose servers all die is served again by a server moving from another stage (rebalancing).

Real programs on 127.0.0.1: a coordinator keeping the run's checkpoints, a server pinned to each stage of a
two-stage run (--stage K), one more server placed and moved by the swarm (--stage auto, a rebalancing
check every ~2 s), and a trainer. The server pinned to the stage the movable one is not on is SIGKILLed:
once its record expires, the movable server leaves its stage (the pinned one there stays), takes the dead
stage's state from the coordinator's checkpoint, and the run keeps stepping.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from swarm.config import RunConfig
from tests.procs import ProcSet, start_coordinator, start_peer

pytestmark = pytest.mark.swarms  # make test-swarms

EVERY = 4  # steps between checkpoints
TRAINED = 6  # steps before the kill
TRAIN_TIMEOUT = 120.0
PULL_TIMEOUT = 60.0  # the coordinator pulling a checkpoint of the stage to be killed
MOVE_TIMEOUT = 120.0  # the record expiring (5 s), two checks (~2 s each), leaving, fetching the checkpoint, serving
SERVING = re.compile(r"serving stage (\d+) of")
MOVING = re.compile(r"moving from stage (\d+) to stage (\d+) \(([a-z ]+)\)")
PULLED = "pulled the checkpoint of stage {stage} at step"


def write_config(tiny_config_path: Path, tmp_path: Path) -> Path:
    config = RunConfig.load(tiny_config_path)
    config.run_id = "rebalance"
    config.checkpoint.every_steps = EVERY
    config.checkpoint.every_seconds = 600.0
    path = tmp_path / "run.yaml"
    config.validate()
    config.save(path)
    return path


def stage_of(peer) -> int | None:
    """The stage the server said it serves last."""
    found = SERVING.findall(peer.proc.stderr())
    return int(found[-1]) if found else None


def step(peer) -> float:
    return peer.metric("swarm_server_step") or 0.0


@pytest.mark.timeout(480)
def test_a_server_moves_to_a_stage_whose_servers_all_died_and_the_run_goes_on(procs: ProcSet,
                                                                                tiny_config_path: Path,
                                                                                tmp_path: Path):
    config_path = write_config(tiny_config_path, tmp_path)
    coordinator = start_coordinator(procs, config_path, "--checkpoint-dir", str(tmp_path / "coordinator"))
    pinned = [start_peer(procs, coordinator, "--role", "server", "--stage", str(k),
                         "--checkpoint-dir", str(tmp_path / f"pinned{k}")) for k in (0, 1)]
    for peer in pinned:
        peer.wait_serving()
    movable = start_peer(procs, coordinator, "--role", "server", "--rebalance-period", "2",
                         "--checkpoint-dir", str(tmp_path / "movable"))
    movable.wait_serving()
    trainer = start_peer(procs, coordinator, "--role", "trainer", "--trainer-index", "0", "--in-flight", "2")
    pinned[1].proc.wait_until(lambda: step(pinned[1]) >= TRAINED, TRAIN_TIMEOUT, f"stage 1 at step {TRAINED}")

    # (a move before the kill is allowed, if the rule finds one: the victim is whichever stage it is not on)
    here = stage_of(movable)
    victim_stage = 1 - here
    coordinator.proc.wait_until(lambda: PULLED.format(stage=victim_stage) in coordinator.proc.stderr(),
                                PULL_TIMEOUT, f"the coordinator pulling a checkpoint of stage {victim_stage}")
    here = stage_of(movable)
    victim_stage = 1 - here
    assert PULLED.format(stage=victim_stage) in coordinator.proc.stderr()
    moves_before = len(MOVING.findall(movable.proc.stderr()))
    pinned[victim_stage].proc.kill()

    movable.proc.wait_until(lambda: len(MOVING.findall(movable.proc.stderr())) > moves_before
                            and stage_of(movable) == victim_stage, MOVE_TIMEOUT,
                            f"the movable server moving to stage {victim_stage} and serving it")
    source, target, reason = MOVING.findall(movable.proc.stderr())[-1]
    assert (int(source), int(target), reason) == (here, victim_stage, "empty stage")
    assert "resumed from the checkpoint of step" in movable.proc.stderr()  # the stage's state, not fresh weights
    assert movable.metric("swarm_server_moves_total", reason="empty stage") == 1
    resumed = step(movable)
    assert resumed >= EVERY  # the checkpoint of a trained stage
    # the stage it left keeps its pinned server; the trainer's run goes on through both stages
    stayed = pinned[here]
    stayed_at = step(stayed)
    movable.proc.wait_until(lambda: step(movable) >= resumed + 2 and step(stayed) >= stayed_at + 2, TRAIN_TIMEOUT,
                            "both stages stepping again after the move")
    assert trainer.proc.popen.poll() is None, trainer.proc.describe()
