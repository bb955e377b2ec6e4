"""Stochastic wiring under faults, with real programs on 127.0.0.1: a slow server, servers killed
in the middle of a request, and a stage left with no server at all.

Each test starts its own small swarm (a coordinator, a few servers and one trainer). Servers get
slow with `--inject-delay`; what the trainer did is read from the programs' /metrics, their logs
and the coordinator's /status.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from swarm.config import RunConfig
from swarm.routing.balancer import REPROBE_SPACING
from tests.helpers import wait_until
from tests.procs import Coordinator, Peer, ProcSet, free_port, http_get, start_coordinator, start_peer

FIRST_SAMPLES_TIMEOUT = 60.0  # every stage serving to the trainer's first trained micro-batch
PROGRESS_TIMEOUT = 60.0  # for the trainer to train a given number of samples more
# a victim serving to a request of the wanted kind in flight on it: a first call that fails (on loaded
# cores a libp2p stream now and then ends early) bans the victim for ban_base, 15 s, before its retry
IN_FLIGHT_TIMEOUT = 60.0
WAITING_TIMEOUT = 30.0  # a stage's last server killed to the trainer reporting it waits (record_ttl + refresh)
LOSS_TIMEOUT = 90.0  # for the loss in /status to fall below a target

# A minute or two of separate programs in all: make test-swarms, and make test-repeat's loop (not make test)
pytestmark = [pytest.mark.swarms, pytest.mark.repeated]

SAMPLES = "swarm_trainer_samples_total"
REQUESTS = "swarm_server_requests_total"


def write_config(tiny_config_path: Path, tmp_path: Path, num_stages: int, batch_size: int) -> Path:
    """The session's tiny config (announce every second, records live 5 s) with these stages and batch."""
    config = RunConfig.load(tiny_config_path)
    config.stages.num_stages = num_stages
    config.optimizer.batch_size = batch_size
    config.network.request_timeout = 20.0  # a call to a never-timed server waits at most this (the ceiling)
    path = tmp_path / "run.yaml"
    config.validate()
    config.save(path)
    return path


def count(peer: Peer, name: str, **labels: str) -> float:
    """A counter of the peer's; 0.0 until it has a sample (or /metrics answers)."""
    return peer.metric(name, **labels) or 0.0


def trainer_samples(trainer: Peer) -> float:
    return count(trainer, SAMPLES)


def ok_requests(server: Peer) -> float:
    return count(server, REQUESTS, status="ok")


def wait_for_samples(trainer: Peer, count: float, timeout: float = PROGRESS_TIMEOUT) -> float:
    """Wait until the trainer has trained `count` samples; returns how many it has then."""
    return trainer.proc.wait_until(lambda: (n := trainer_samples(trainer)) >= count and n, timeout,
                                   f"the trainer to train {count:.0f} samples")


def samples_per_second(trainer: Peer, samples: int) -> float:
    """The trainer's speed over its next `samples` samples, timed from its /metrics."""
    start, started = trainer_samples(trainer), time.monotonic()
    end = wait_for_samples(trainer, start + samples)
    return (end - start) / (time.monotonic() - started)


def best_samples_per_second(trainer: Peer, samples: int, windows: int) -> float:
    """The best speed of `windows` consecutive windows of `samples` samples: other work on the machine
    can only slow a window down, so the best one is the least disturbed."""
    return max(samples_per_second(trainer, samples) for _ in range(windows))


def log_lines(peer: Peer, pattern: str) -> int:
    """How many times the peer has logged a line matching `pattern` so far."""
    return len(re.findall(pattern, peer.proc.stderr()))


def wait_for_new_log(peer: Peer, pattern: str, seen: int, timeout: float) -> None:
    """Wait until the peer logs a line matching `pattern` beyond the `seen` it had logged before."""
    peer.proc.wait_until(lambda: log_lines(peer, pattern) > seen, timeout, f"a new log line {pattern!r}")


def status(coordinator: Coordinator) -> dict:
    body = http_get(coordinator.metrics_port, "/status")
    return {} if body is None else json.loads(body)


# --- a slow server ---------------------------------------------------------------------------------

SLOW_DELAY = 2.0  # seconds the slow server adds to every request; a normal one answers in ~0.05-0.3 s
SPEED_SAMPLES, SPEED_WINDOWS = 320, 3  # timed with and without the slow server: the best of 3 windows of 40
# micro-batches each (about 2-3 s per window here)
MAX_SLOW_SHARE = 0.25  # even (round-robin) routing would send the slow server half of the micro-batches
MIN_SPEED_RATIO = 0.5  # speed with the slow server added / speed with the normal one alone


def one_stage_with_a_trainer(procs: ProcSet, tiny_config_path: Path, tmp_path: Path,
                             in_flight: int) -> tuple[Coordinator, Peer, Peer]:
    """A run of one stage with one normal server, and a trainer past its start-up.

    One stage, so the trainer's speed is that stage's; a batch no run here fills, so no averaging
    round between servers blurs the timing.
    """
    config = write_config(tiny_config_path, tmp_path, num_stages=1, batch_size=100_000)
    coordinator = start_coordinator(procs, config, metrics_port=free_port())
    normal = start_peer(procs, coordinator, "--role", "server", "--stage", "0")
    trainer = start_peer(procs, coordinator, "--role", "trainer", "--trainer-index", "0", "--in-flight", str(in_flight))
    normal.wait_serving()
    wait_for_samples(trainer, 80, FIRST_SAMPLES_TIMEOUT)  # past start-up: the first calls are slower
    return coordinator, normal, trainer


def add_slow_server(procs: ProcSet, coordinator: Coordinator) -> Peer:
    """A server of stage 0 slowed by SLOW_DELAY, once the trainer has timed it (a newcomer is tried at
    once, as if it were fast)."""
    slow = start_peer(procs, coordinator, "--role", "server", "--stage", "0", "--inject-delay", str(SLOW_DELAY))
    slow.wait_serving()
    slow.proc.wait_until(lambda: ok_requests(slow) >= 1, PROGRESS_TIMEOUT,
                         "the trainer to send the slow server a micro-batch")
    return slow


@pytest.mark.timeout(150)
def test_a_slow_server_gets_few_micro_batches_and_does_not_slow_training(
        procs: ProcSet, tiny_config_path: Path, tmp_path: Path):
    coordinator, normal, trainer = one_stage_with_a_trainer(procs, tiny_config_path, tmp_path, in_flight=6)
    alone = best_samples_per_second(trainer, SPEED_SAMPLES, SPEED_WINDOWS)
    slow = add_slow_server(procs, coordinator)
    normal_before, slow_before = ok_requests(normal), ok_requests(slow)
    with_slow = best_samples_per_second(trainer, SPEED_SAMPLES, SPEED_WINDOWS)
    to_normal, to_slow = ok_requests(normal) - normal_before, ok_requests(slow) - slow_before

    share = to_slow / (to_normal + to_slow)
    summary = (f"normal server {to_normal:.0f} micro-batches, slow server {to_slow:.0f} (share {share:.2f}); "
               f"{alone:.1f} samples/s with the normal server alone, {with_slow:.1f} with the slow one added")
    print(summary)  # shown with pytest -rP
    assert share <= MAX_SLOW_SHARE, summary
    # The slow server's delay is not compute, so it can only add capacity: routing by expected finish
    # time sends it work only when the normal server's queue would take longer than its 2 s (or to
    # re-test it now and then), so the trainer never waits on it for long.
    assert with_slow >= MIN_SPEED_RATIO * alone, summary
    assert trainer.metric("swarm_trainer_failed_micro_batches_total") == 0.0, trainer.proc.describe()


ONE_IN_FLIGHT_SAMPLES = 240  # trained after the slow server's first answer: 30 micro-batches of 8
CLEAN_WINDOW_ATTEMPTS = 3


@pytest.mark.timeout(150)
def test_with_one_micro_batch_in_flight_a_measured_slow_server_gets_no_work(
        procs: ProcSet, tiny_config_path: Path, tmp_path: Path):
    # Expected finish time: with nothing else outstanding, the fast server always answers first, so
    # once the slow one has answered its first call (a newcomer is tried at once) it gets nothing;
    # least accumulated virtual time would have sent it a share and made the trainer wait on it.
    coordinator, normal, trainer = one_stage_with_a_trainer(procs, tiny_config_path, tmp_path, in_flight=1)
    started = time.monotonic()
    slow = add_slow_server(procs, coordinator)
    # A call to the normal server that fails bans it for a while, and the slow one then rightly gets the
    # work; on loaded cores a libp2p stream between healthy peers now and then ends early (see README,
    # Averaging within a stage). So the claim is checked over a window in which no call failed.
    for _ in range(CLEAN_WINDOW_ATTEMPTS):
        trainer.proc.wait_until(lambda: trainer.metric("swarm_trainer_banned_servers") == 0, PROGRESS_TIMEOUT,
                                "the trainer to have no server banned")
        failures = trainer.metric("swarm_trainer_call_failures_total") or 0.0
        normal_before, slow_before = ok_requests(normal), ok_requests(slow)
        wait_for_samples(trainer, trainer_samples(trainer) + ONE_IN_FLIGHT_SAMPLES)
        to_normal, to_slow = ok_requests(normal) - normal_before, ok_requests(slow) - slow_before
        if (trainer.metric("swarm_trainer_call_failures_total") or 0.0) == failures:
            break
    else:
        pytest.fail(f"a call failed in each of {CLEAN_WINDOW_ATTEMPTS} windows: {trainer.proc.describe()}")
    # Bar the balancer's re-test of a measured server, once idle REPROBE_SPACING times its last answer's duration
    # (at least SLOW_DELAY here): on loaded cores the windows can outlast that (CI saw one re-test in a window);
    # and bar the newcomer's one probe where the window began before the slow server had answered anything (its
    # record can reach the trainer late on loaded cores: CI saw that probe fall in the window, 2026-12-06)
    elapsed = time.monotonic() - started
    allowed = int(elapsed // (REPROBE_SPACING * SLOW_DELAY)) + (1 if slow_before == 0 else 0)
    assert to_slow <= allowed and to_normal >= ONE_IN_FLIGHT_SAMPLES / 8, (to_normal, to_slow, slow_before, elapsed)
    assert trainer.metric("swarm_trainer_failed_micro_batches_total") == 0.0, trainer.proc.describe()


# --- servers killed in the middle of a request -----------------------------------------------------

VICTIM_DELAY = 1.0  # seconds a victim holds each request, so one is in flight when it is killed
# The forward's victim shares stage 0 with a server exactly as slow, so routing by expected finish
# time sends it its share of forwards (a server slower than the others would get one probe, then
# nothing); shorter, so the rest of the run is not slow.
FORWARD_VICTIM_DELAY = 0.3
LOSS_DROP = 0.9  # after the kills the loss must fall below this fraction of its first report


def kill_while_in_flight(trainer: Peer, victim: Peer, stage: int, kind: str) -> None:
    """SIGKILL the victim's whole process group while it holds a `kind` request of `stage`, then wait
    until the trainer sees that call fail (it bans the victim and retries the call elsewhere)."""
    failed = rf"stage {stage} {kind} on {victim.peer_id[-8:]} failed"
    wait_until(lambda: count(victim, "swarm_server_requests_in_flight", kind=kind) > 0, IN_FLIGHT_TIMEOUT,
               what=f"a {kind} request in flight on the victim",
               explain=lambda: f"\n--- the victim:\n{victim.proc.describe()}\n--- the trainer (banned servers "
                               f"{trainer.metric('swarm_trainer_banned_servers')}):\n{trainer.proc.describe()}")
    seen = log_lines(trainer, failed)
    victim.proc.kill()
    wait_for_new_log(trainer, failed, seen, PROGRESS_TIMEOUT)


@pytest.mark.timeout(240)
def test_servers_killed_mid_forward_and_mid_backward_do_not_stop_training(
        procs: ProcSet, tiny_config_path: Path, tmp_path: Path):
    config = write_config(tiny_config_path, tmp_path, num_stages=2, batch_size=32)
    coordinator = start_coordinator(procs, config, metrics_port=free_port())
    # Stage 0 gets forwards (and backwards); the last stage only the fused forward+backward, so the
    # forward's victim is on stage 0 and the backward's on stage 1.
    slow = ("--inject-delay", str(FORWARD_VICTIM_DELAY))
    # Stage 1's first server is as slow: a trainer's calls then queue there, and the backward's victim, an untried
    # newcomer, is expected to answer sooner and is tried. With a fast stage 1 that answered every call at once, the
    # trainer once kept choosing it for the whole minute the test waits (CI, 2026-12-08)
    servers = [start_peer(procs, coordinator, "--role", "server", "--stage", "0", *slow),
               start_peer(procs, coordinator, "--role", "server", "--stage", "1", *slow)]
    forward_victim = start_peer(procs, coordinator, "--role", "server", "--stage", "0", *slow)
    # several in flight: with one, the fastest idle server takes every call, and of two equally slow
    # servers which one that is depends on noise in their timings
    trainer = start_peer(procs, coordinator, "--role", "trainer", "--trainer-index", "0", "--in-flight", "4")
    for server in (*servers, forward_victim):
        server.wait_serving()
    first_loss = coordinator.proc.wait_until(lambda: status(coordinator).get("loss"), FIRST_SAMPLES_TIMEOUT,
                                             "a first loss report in /status")
    kill_while_in_flight(trainer, forward_victim, 0, "forward")

    # a newcomer is tried at once, before it is known to be slow: its first backward is held a second
    backward_victim = start_peer(procs, coordinator, "--role", "server", "--stage", "1",
                                 "--inject-delay", str(VICTIM_DELAY))
    backward_victim.wait_serving()
    kill_while_in_flight(trainer, backward_victim, 1, "backward")
    loss_at_kill = coordinator.proc.wait_until(lambda: status(coordinator).get("loss"), PROGRESS_TIMEOUT,
                                               "a loss report in /status")

    wait_for_samples(trainer, trainer_samples(trainer) + 160)
    # Lower than when the last victim died (a stage that lost its state would be back near ln 256 =
    # 5.5), and well below the first report.
    target = min(loss_at_kill, LOSS_DROP * first_loss)
    coordinator.proc.wait_until(lambda: (status(coordinator).get("loss") or target) < target, LOSS_TIMEOUT,
                                f"the loss to fall below {target:.3f} (first report {first_loss:.3f}, "
                                f"{loss_at_kill:.3f} when the last victim died)")
    assert not trainer.proc.has_exited(), trainer.proc.describe()
    assert trainer.metric("swarm_trainer_failed_micro_batches_total") == 0.0, trainer.proc.describe()


# --- a stage with no server, then a new one --------------------------------------------------------

WAITING_LINE = r"stage 1 has no ONLINE server"
RESUMING_LINE = r"stage 1 has a server again; resuming"

@pytest.mark.timeout(150)
def test_trainer_waits_for_a_stage_with_no_server_and_resumes_when_one_joins(
        procs: ProcSet, tiny_config_path: Path, tmp_path: Path):
    config = write_config(tiny_config_path, tmp_path, num_stages=2, batch_size=16)
    coordinator = start_coordinator(procs, config, metrics_port=free_port())
    first, last = [start_peer(procs, coordinator, "--role", "server", "--stage", str(stage)) for stage in (0, 1)]
    trainer = start_peer(procs, coordinator, "--role", "trainer", "--trainer-index", "0")
    first.wait_serving()
    last.wait_serving()
    wait_for_samples(trainer, 1, FIRST_SAMPLES_TIMEOUT)
    # The gauge is set at each server lookup, so it may still count a stage that had no server at start.
    trainer.proc.wait_until(lambda: trainer.metric("swarm_trainer_waiting_stages") == 0, WAITING_TIMEOUT,
                            "the trainer to report no stage waiting")

    # The trainer may have logged both lines already at start-up, before stage 1's server was up.
    waiting, resuming = log_lines(trainer, WAITING_LINE), log_lines(trainer, RESUMING_LINE)
    last.proc.kill()  # stage 1's only server, without a word: its record expires record_ttl later
    trainer.proc.wait_until(lambda: count(trainer, "swarm_trainer_waiting_stages") >= 1, WAITING_TIMEOUT,
                            "the trainer to report a stage it waits for")
    wait_for_new_log(trainer, WAITING_LINE, waiting, WAITING_TIMEOUT)
    stalled = trainer_samples(trainer)

    # The stage died before its first checkpoint: the new server may only start it fresh when told to
    replacement = start_peer(procs, coordinator, "--role", "server", "--stage", "1", "--fresh")
    replacement.wait_serving()
    wait_for_new_log(trainer, RESUMING_LINE, resuming, PROGRESS_TIMEOUT)
    wait_for_samples(trainer, stalled + 80)
    trainer.proc.wait_until(lambda: trainer.metric("swarm_trainer_waiting_stages") == 0, WAITING_TIMEOUT,
                            "the trainer to report no stage waiting")
    assert not trainer.proc.has_exited(), trainer.proc.describe()
    assert ok_requests(replacement) > 0, replacement.proc.describe()
    assert trainer.metric("swarm_trainer_failed_micro_batches_total") == 0.0, trainer.proc.describe()
