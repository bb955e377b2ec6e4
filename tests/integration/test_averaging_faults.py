"""A server of a stage SIGKILLed (the whole program) while it takes part in an averaging round.

Real programs on 127.0.0.1: a coordinator, three servers of a one-stage run and a trainer. What
the servers did is read from their /metrics: their step, their averaging rounds by outcome, whether
a round is in progress, and a fingerprint of their parameters (sum and sum of squares).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from swarm.config import RunConfig
from tests.procs import Peer, ProcSet, free_port, start_coordinator, start_peer

SERVERS = 3
ROUNDS_TIMEOUT = 90.0  # from the servers' start to two rounds averaged by all three
IN_ROUND_TIMEOUT = 30.0  # for the victim to be caught inside a round
AFTER_KILL_TIMEOUT = 60.0  # for the survivors to take two steps more (their next round waits out the dead one)
AGREE_TIMEOUT = 60.0  # for the survivors to agree once training stops (a diverged one downloads the state)
TRAINER_STOP_TIMEOUT = 30.0
POLL = 0.02  # a round lasts a few tenths of a second here: look often to catch the victim inside one
FINGERPRINT_RTOL = 1e-6


def write_config(tiny_config_path: Path, tmp_path: Path) -> Path:
    config = RunConfig.load(tiny_config_path)
    config.stages.num_stages = 1
    config.averaging.progress_period = 0.5  # a dead server's progress record expires within 2.5 s
    path = tmp_path / "run.yaml"
    config.validate()
    config.save(path)
    return path


def value(peer: Peer, name: str, **labels: str) -> float:
    return peer.metric(name, stage="0", **labels) or 0.0


def succeeded(peer: Peer) -> float:
    return value(peer, "swarm_averaging_rounds_total", outcome="succeeded")


def step(peer: Peer) -> float:
    return peer.metric("swarm_server_step") or 0.0


def fingerprint(peer: Peer) -> tuple[float, float]:
    return (value(peer, "swarm_averaging_param_fingerprint", part="sum"),
            value(peer, "swarm_averaging_param_fingerprint", part="sum_of_squares"))


def agree(a: Peer, b: Peer) -> bool:
    """Same step and the same parameters (as far as their fingerprints tell), read twice to be sure
    neither was between two reads of the other."""
    first = (step(a), fingerprint(a), step(b), fingerprint(b))
    second = (step(a), fingerprint(a), step(b), fingerprint(b))
    if first != second or first[0] != first[2] or first[0] == 0:
        return False
    return all(math.isclose(x, y, rel_tol=FINGERPRINT_RTOL) for x, y in zip(first[1], first[3]))


# a minute of separate programs: make test-swarms and make test-repeat's loop, not make test (its 10-minute budget)
@pytest.mark.swarms
@pytest.mark.repeated
@pytest.mark.timeout(240)
def test_sigkill_of_a_server_during_a_round_leaves_the_others_training_and_in_sync(
        procs: ProcSet, tiny_config_path: Path, tmp_path: Path):
    config = write_config(tiny_config_path, tmp_path)
    coordinator = start_coordinator(procs, config, metrics_port=free_port())
    servers = [start_peer(procs, coordinator, "--role", "server", "--stage", "0") for _ in range(SERVERS)]
    for server in servers:
        server.wait_serving()
    trainer = start_peer(procs, coordinator, "--role", "trainer", "--trainer-index", "0", "--in-flight", "2")

    def all_averaged_twice() -> bool:
        return all(succeeded(s) >= 2 and value(s, "swarm_averaging_group_size") == SERVERS for s in servers)

    servers[0].proc.wait_until(all_averaged_twice, ROUNDS_TIMEOUT, "rounds averaged by all three servers")

    victim, survivors = servers[0], servers[1:]
    victim.proc.wait_until(lambda: value(victim, "swarm_averaging_round_in_progress") == 1, IN_ROUND_TIMEOUT,
                           "the victim to be inside an averaging round", interval=POLL)
    victim.proc.kill()  # SIGKILL to its whole process group: the program, its DHT, averaging and p2pd processes
    steps_at_kill = [step(s) for s in survivors]
    rounds_at_kill = [succeeded(s) for s in survivors]
    samples_at_kill = trainer.metric("swarm_trainer_samples_total") or 0.0

    for survivor, at_kill in zip(survivors, steps_at_kill):
        survivor.proc.wait_until(lambda s=survivor, n=at_kill: step(s) >= n + 2, AFTER_KILL_TIMEOUT,
                                 "a survivor to take two more steps")
    assert not any(s.proc.has_exited() for s in survivors), [s.proc.describe() for s in survivors]
    trainer.proc.wait_until(lambda: (trainer.metric("swarm_trainer_samples_total") or 0.0) > samples_at_kill,
                            AFTER_KILL_TIMEOUT, "the trainer to train on")  # past calls to the victim timing out
    # they went on averaging, with each other
    for survivor, at_kill in zip(survivors, rounds_at_kill):
        survivor.proc.wait_until(lambda s=survivor, n=at_kill: succeeded(s) > n, AFTER_KILL_TIMEOUT,
                                 "a survivor to average again after the kill")

    trainer.proc.stop(TRAINER_STOP_TIMEOUT)  # no more steps: the survivors must now hold the same state
    survivors[0].proc.wait_until(lambda: agree(*survivors), AGREE_TIMEOUT,
                                 "the survivors to hold the same step and parameters")
    for survivor in survivors:  # what happened to the round the victim died in (shown with pytest -rP)
        outcomes = {o: value(survivor, "swarm_averaging_rounds_total", outcome=o) for o in ("succeeded", "failed")}
        downloads = value(survivor, "swarm_averaging_state_downloads_total", outcome="succeeded")
        print(f"survivor: rounds {outcomes}, state downloads {downloads:.0f}")
        print("\n".join(line for line in survivor.proc.stderr().splitlines()
                        if "averag" in line.lower() or "caught up" in line))
