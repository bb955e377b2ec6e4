"""One rule says when a checkpoint is due, for stage servers (StageKeeper) and expert servers alike."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from swarm.checkpoint.schedule import CheckpointSchedule
from swarm.config import CheckpointConfig
from swarm.serving import ExpertServer


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


def expert_server(every_steps: int, every_seconds: float, tmp_path: Path):
    """An ExpertServer as far as after_steps reads it: its config, checkpoint dir, host and schedule."""
    server = object.__new__(ExpertServer)
    checkpoint = CheckpointConfig(every_steps=every_steps, every_seconds=every_seconds)
    server.config = SimpleNamespace(checkpoint=checkpoint, run_id="run")
    server.options = SimpleNamespace(checkpoint_dir=tmp_path)
    saved = []

    class Host:
        step = 0

        def submit(self, fn):
            saved.append(self.step)
            return SimpleNamespace(add_done_callback=lambda callback: None)

    server.host = Host()
    server.schedule = CheckpointSchedule(checkpoint)
    return server, saved


def test_an_expert_server_with_every_steps_zero_saves_by_time_and_does_not_divide_by_zero(tmp_path):
    server, saved = expert_server(0, 3600, tmp_path)
    for step in range(1, 60):
        server.host.step = step
        server.after_steps()  # was `step % 0`: ZeroDivisionError on every step
    assert saved == []
    server.schedule.last_time -= 3600
    server.after_steps()
    assert saved == [59]


def test_an_expert_server_saves_every_n_steps(tmp_path):
    server, saved = expert_server(25, 0, tmp_path)
    for step in range(1, 80):
        server.host.step = step
        server.after_steps()
    assert saved == [25, 50, 75]
