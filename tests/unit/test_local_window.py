"""LocalSwarm's timing window starts by what the trainers have trained, not by the step the DHT last heard of."""

from pathlib import Path

from coordinator.local_swarm import LocalSwarm
from swarm.config import RunConfig

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def swarm_with(trained: dict[int, float]) -> LocalSwarm:
    swarm = LocalSwarm.__new__(LocalSwarm)  # the window's rule alone: no processes
    swarm.config = RunConfig.load(str(CONFIG))
    swarm.trainer_ports = list(trained)
    swarm._scrape = lambda port: {"swarm_trainer_samples_total": trained[port]}
    return swarm


def test_the_window_starts_once_the_trainers_trained_a_tenth_of_the_run():
    batch = RunConfig.load(str(CONFIG)).optimizer.batch_size
    tenth = 5 * batch  # a tenth of 50 steps
    # a fast swarm's step in the DHT can already be the last: that alone starts nothing (there would be no window)
    assert not swarm_with({1: tenth / 2, 2: tenth / 2 - 1})._window_starts(50, 50)
    assert swarm_with({1: tenth / 2, 2: tenth / 2})._window_starts(0, 50)


def test_without_trainers_the_step_decides():
    swarm = swarm_with({})
    assert not swarm._window_starts(4, 50)
    assert swarm._window_starts(5, 50)
