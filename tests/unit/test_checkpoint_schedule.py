"""One rule says when a checkpoint is due, for stage servers (StageKeeper) and expert servers alike."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

from swarm.checkpoint.keeper import KeeperScope, StageKeeper
from swarm.checkpoint.schedule import CheckpointSchedule
from swarm.config import CheckpointConfig, ModelConfig, MoEConfig, OptimizerConfig, RunConfig
from swarm.experts import ExpertHost, ExpertState


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_due_every_n_steps_counted_from_the_last_checkpoint():
    schedule = CheckpointSchedule(CheckpointConfig(every_steps=5, every_seconds=0), Clock())
    assert [step for step in range(1, 13) if schedule.due(step)] == list(range(5, 13))
    schedule.done(5)
    assert [step for step in range(1, 13) if schedule.due(step)] == [10, 11, 12]
    schedule.restored(40)  # a state loaded from a checkpoint: counting starts there
    assert not schedule.due(40) and not schedule.due(44) and schedule.due(45)


def test_every_steps_zero_turns_step_checkpoints_off_and_seconds_still_count():
    clock = Clock()
    schedule = CheckpointSchedule(CheckpointConfig(every_steps=0, every_seconds=60), clock)
    assert not any(schedule.due(step) for step in range(1, 1000))
    clock.now += 60
    assert schedule.due(3)
    schedule.done(3)
    assert not schedule.due(3) and not schedule.due(4)  # never twice for a step; the clock starts again
    clock.now += 59
    assert not schedule.due(900)
    clock.now += 1
    assert schedule.due(4)


def test_every_seconds_zero_counts_steps_only():
    clock = Clock()
    schedule = CheckpointSchedule(CheckpointConfig(every_steps=3, every_seconds=0), clock)
    clock.now += 10**6
    assert not schedule.due(2) and schedule.due(3)


@contextlib.contextmanager
def expert_keeper(every_steps: int, every_seconds: float, tmp_path: Path):
    """A StageKeeper of expert 1 of a real ExpertHost (no network: announcing is a no-op), and a function that
    sets the expert's step and hands it to the keeper as ExpertServer.backward does, waiting for the write."""
    config = RunConfig(
        model=ModelConfig(vocab_size=64, seq_len=4, n_layer=2, n_head=2, d_model=8,
                          moe=MoEConfig(every=1, num_experts=2, top_k=1, expert_servers=True)),
        optimizer=OptimizerConfig(batch_size=4, micro_batch_size=2),
        checkpoint=CheckpointConfig(every_steps=every_steps, every_seconds=every_seconds, keep=10),
    ).validate()
    host = ExpertHost(config, [1])
    records = SimpleNamespace(announce_checkpoints=lambda record, ttl: True)
    keeper = StageKeeper(ExpertState(host, 1), KeeperScope.of(config, "expert"), config.checkpoint, tmp_path, records,
                         None, "QmSelf")
    keeper._serving = True  # as after start(), without a service

    def step_to(step: int) -> None:
        for optimizer in host.optimizers.values():
            optimizer.step_count = step
        keeper.after_step(keeper.state.step)
        if keeper._writing is not None:
            keeper._writing.result(30)

    try:
        yield keeper, step_to
    finally:
        keeper.close()
        host.shutdown()


def written(keeper: StageKeeper) -> list[int]:
    return sorted(int(path.name.removeprefix("step")) for path in keeper.store.entries())


def test_an_expert_keeper_with_every_steps_zero_saves_by_time_and_does_not_divide_by_zero(tmp_path):
    with expert_keeper(0, 3600, tmp_path) as (keeper, step_to):
        for step in range(1, 60):
            step_to(step)  # the expert-only writer this replaced did `step % 0`: ZeroDivisionError on every step
        assert written(keeper) == []
        keeper.schedule.last_time -= 3600
        step_to(59)
        assert written(keeper) == [59]
        assert keeper.store.dir == tmp_path / "swarm" / "expert1"


def test_an_expert_keeper_saves_every_n_steps(tmp_path):
    with expert_keeper(25, 0, tmp_path) as (keeper, step_to):
        for step in range(1, 80):
            step_to(step)
        assert written(keeper) == [25, 50, 75]


def test_steps_left_unsaved_are_written_once_the_stage_has_been_idle(tmp_path):
    with expert_keeper(50, 0, tmp_path) as (keeper, step_to):
        snapshot = keeper.state.state_dict
        assert not keeper.save_idle(snapshot)  # never stepped: nothing of its own to save
        for step in range(1, 8):
            step_to(step)
        assert written(keeper) == []  # 50 steps apart: none due yet
        assert not keeper.save_idle(snapshot)  # it stepped a moment ago: more steps may come
        keeper._stepped_at -= keeper.settings.idle_seconds
        assert keeper.save_idle(snapshot)
        keeper._writing.result(30)
        assert written(keeper) == [7]
        assert not keeper.save_idle(snapshot)  # step 7 is saved: nothing more to write while idle
        step_to(8)
        keeper._stepped_at -= keeper.settings.idle_seconds
        keeper._stop.set()  # stopping: the last checkpoint is close()'s to write
        assert not keeper.save_idle(snapshot)


def test_idle_seconds_zero_never_writes_while_idle(tmp_path):
    with expert_keeper(50, 0, tmp_path) as (keeper, step_to):
        keeper.settings.idle_seconds = 0
        step_to(3)
        keeper._stepped_at -= 3600
        assert not keeper.save_idle(keeper.state.state_dict) and written(keeper) == []
