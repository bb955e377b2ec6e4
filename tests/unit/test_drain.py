"""A due batch waits for the backwards of forwards run on its parameters (swarm.drain), and no longer."""

from __future__ import annotations

import asyncio
import threading

import torch

from swarm.backend import StageBackend
from swarm.config import RunConfig
from swarm.drain import (
    MIN_ROUNDS,
    MIN_TRIPS,
    PARDON_SECONDS,
    ROUND_MARGIN,
    STEP_POLL,
    TRIP_FACTOR,
    BatchDrain,
    InFlight,
    RoundTimes,
    wait_for_step,
)
from swarm.model import build_stage
from swarm.optim import StageOptimizer

ME, THEM = "me", "them"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drain(max_seconds: float = 0.5) -> tuple[BatchDrain, Clock, list]:
    clock, asked = Clock(), []
    return BatchDrain(max_seconds, lambda: asked.append(clock.now), clock=clock), clock, asked


def test_a_due_batch_waits_for_forwards_on_its_parameters_and_counts_them_in():
    d, clock, _ = drain()
    d.forwarded((ME, 1), step=3, look_ahead=False)  # on the batch's parameters
    d.forwarded((ME, 2), step=2, look_ahead=True)  # during the round that made step 3, on its look-ahead
    d.forwarded((ME, 3), step=2, look_ahead=False)  # before that round: stale whatever happens, not waited for
    assert d.hold(3) == 0.5
    clock.now += 0.1
    assert d.returned((ME, 3)) is False
    assert d.returned((ME, 1)) is True and d.hold(3) is not None
    assert d.returned((ME, 2)) is True and d.hold(3) is None  # all back: the batch closes
    assert (d.waits, d.drained, d.timed_out) == (1, 2, 0)
    d.forwarded((ME, 4), step=3, look_ahead=False)
    assert d.returned((ME, 4)) is False  # no batch waits now: it counts towards the next as ever


def test_nothing_on_its_way_closes_at_once_and_a_forward_ahead_is_not_waited_for():
    d, _, asked = drain()
    assert d.hold(0) is None
    d.forwarded((ME, 1), step=0, look_ahead=False)
    assert d.hold(1) is None  # run on the parameters before step 1: nothing to win by waiting
    assert asked == [] and d.waits == 0


def test_the_wait_ends_at_its_limit_and_asks_again_and_a_caller_that_missed_it_is_excused():
    d, clock, _ = drain(max_seconds=0.05)  # (real timer: short)
    asked = threading.Event()
    d._recheck = asked.set
    d.forwarded((THEM, 1), step=0, look_ahead=False)
    assert d.hold(0) is not None
    assert asked.wait(10), "the drain never asked to look at the batch again"
    clock.now += 0.05
    assert d.hold(0) is None and d.timed_out == 1
    assert d.returned((THEM, 1)) is False  # too late for that batch
    # the same caller's next forward is not waited for, another caller's is
    d.forwarded((THEM, 2), step=1, look_ahead=False)
    assert d.hold(1) is None
    d.forwarded((ME, 3), step=2, look_ahead=False)
    d.forwarded((THEM, 4), step=2, look_ahead=False)
    assert d.hold(2) is not None and d.returned((ME, 3)) and d.hold(2) is None
    clock.now += PARDON_SECONDS
    d.forwarded((THEM, 5), step=3, look_ahead=False)
    assert d.hold(3) is not None  # pardoned


def test_the_limit_follows_measured_trips_up_to_its_cap():
    d, clock, _ = drain(max_seconds=0.5)
    assert d.limit() == 0.5  # nothing measured yet
    for i in range(MIN_TRIPS * 2):
        d.forwarded((ME, i), step=0, look_ahead=False)
        clock.now += 0.1
        d.returned((ME, i))
    assert abs(d.limit() - TRIP_FACTOR * 0.1) < 1e-9
    d.forwarded((ME, "old"), step=1, look_ahead=False)
    clock.now += TRIP_FACTOR * 0.1
    assert d.hold(1) is None  # out longer than any trip measured: not waited for


def test_pending_forwards_are_bounded():
    d, _, _ = drain()
    for i in range(5000):
        d.forwarded((THEM, i), step=0, look_ahead=False)
    assert len(d._pending) <= 1024


def config(**optimizer) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 8},
        "stages": {"num_stages": 2},
        "optimizer": {"batch_size": 4, "micro_batch_size": 2, "warmup_steps": 0, "lookahead": False, **optimizer},
    })


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))


def test_a_stage_steps_on_the_backward_it_waited_for_with_its_gradient_of_the_same_parameters():
    run = config(drain_seconds=10.0)
    module = build_stage(run, 0)
    b = StageBackend(module, StageOptimizer(module, run.optimizer))
    try:
        x = [tokens(s) for s in range(3)]
        grad = torch.ones(2, 8, 16)
        # the exact gradient of the three micro-batches on the parameters of step 0
        reference = build_stage(run, 0)
        reference.load_state_dict(module.state_dict())
        for xi in x:
            reference(xi).backward(grad)
        expected = [p.grad.clone() / 6 for p in reference.parameters()]

        for i, xi in enumerate(x):
            b.forward_at(xi, keep=(ME, i))
        b.backward(x[0], grad, forward_step=0, key=(ME, 0))
        assert b.backward(x[1], grad, forward_step=0, key=(ME, 1)).step_stats is None  # full, waiting for the third
        assert b.step == 0 and b.drain.waits == 1
        result = b.backward(x[2], grad, forward_step=0, key=(ME, 2))
        assert result.step_stats is not None and result.step_stats["samples"] == 6 and b.step == 1
        assert not result.stashed  # no step came between its forward and its backward
        # the step's mean gradient over all six samples (its norm, in the step's stats), each of step 0's parameters
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected]))
        assert abs(result.step_stats["grad_norm"] - float(norm)) < 1e-4 * float(norm)
    finally:
        b.shutdown()


def test_without_a_drain_the_batch_closes_when_it_fills():
    run = config(drain_seconds=0)
    module = build_stage(run, 0)
    b = StageBackend(module, StageOptimizer(module, run.optimizer))
    try:
        for i in range(3):
            b.forward_at(tokens(i), keep=(ME, i))
        b.backward(tokens(0), torch.ones(2, 8, 16), forward_step=0, key=(ME, 0))
        assert b.backward(tokens(1), torch.ones(2, 8, 16), forward_step=0, key=(ME, 1)).step_stats is not None
        assert b.drain is None and b.step == 1
    finally:
        b.shutdown()


class Needs:
    """A stepper whose stage needs what it is told, in turn."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def samples_to_step(self):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_a_forward_waits_while_its_stage_closes_a_batch_and_no_longer_than_its_limit():
    clock = Clock()

    async def tick(_):  # (the poll's sleep: time moves on instead)
        clock.now += STEP_POLL

    async def run(stepper, limit):
        return await wait_for_step(stepper, limit, clock=clock, poll=STEP_POLL, sleep=tick)

    assert asyncio.run(run(Needs(4), 1.0)) is False  # samples to go: at once
    start = clock.now
    assert asyncio.run(run(Needs(0, None, None, 8), 1.0)) is True  # due, then its round, then stepped
    assert abs(clock.now - start - 3 * STEP_POLL) < 1e-9
    start = clock.now
    assert asyncio.run(run(Needs(None), 0.1)) is True  # a round that does not end: the wait does
    assert abs(clock.now - start - 0.1) < STEP_POLL + 1e-9


def test_round_times_say_what_a_round_usually_takes_and_what_the_one_under_way_has_left():
    clock = Clock()
    times = RoundTimes(kept=5, clock=clock)
    assert times.left() is None  # no round under way
    for took in [0.8, 9.0][:MIN_ROUNDS - 1]:
        times.begin()
        clock.now += took
        times.end()
    times.begin()
    assert times.usual() is None and times.left() is None  # too few rounds to say
    clock.now += 1.0
    times.end()
    assert times.usual() == 1.0  # the median: one stalled round (9 s) does not move it
    times.begin()
    clock.now += 0.3
    assert abs(times.left() - (ROUND_MARGIN * 1.0 - 0.3)) < 1e-9
    clock.now += 1.0
    assert times.left() < 0  # past what rounds take: not waited out
    times.end()
    assert times.left() is None
    usual = times.usual()
    times.end()  # (an end with no round: nothing counted)
    assert times.usual() == usual


def test_a_forward_waits_out_a_round_as_long_as_rounds_take_here_and_no_longer_than_its_limit():
    clock = Clock()
    times = RoundTimes(clock=clock)
    for _ in range(MIN_ROUNDS):
        times.begin()
        clock.now += 1.0
        times.end()

    async def tick(_):
        clock.now += STEP_POLL

    async def run(stepper, round_limit=2.0):
        return await wait_for_step(stepper, 0.25, clock=clock, poll=STEP_POLL, sleep=tick, rounds=times,
                                   round_limit=round_limit)

    times.begin()
    start = clock.now
    assert asyncio.run(run(Needs(None))) is True  # a round that does not end: waited until 1.25 s into it
    assert abs(clock.now - start - ROUND_MARGIN) < STEP_POLL + 1e-9
    times.end()
    times.begin()
    clock.now += 0.5
    start = clock.now
    assert asyncio.run(run(Needs(*[None] * 40, 8))) is True  # it steps 0.2 s on: waited for
    assert abs(clock.now - start - 40 * STEP_POLL) < 1e-9
    times.end()
    times.begin()
    start = clock.now
    assert asyncio.run(run(Needs(None), round_limit=0.6)) is True  # never longer than round_limit
    assert abs(clock.now - start - 0.6) < STEP_POLL + 1e-9
    times.end()
    times.begin()
    start = clock.now
    assert asyncio.run(run(Needs(None), round_limit=0.0)) is True  # 0: step_wait alone
    assert abs(clock.now - start - 0.25) < STEP_POLL + 1e-9
    times.end()
    start = clock.now
    assert asyncio.run(run(Needs(0))) is True  # due, no round under way yet: step_wait alone
    assert abs(clock.now - start - 0.25) < STEP_POLL + 1e-9


def test_a_forward_waits_while_the_forwards_in_flight_fill_the_batch_through_its_round_and_to_its_own_limit():
    clock = Clock()

    async def tick(_):
        clock.now += STEP_POLL

    async def run(stepper, in_flight, limit=0.25, ahead_limit=1.0):
        return await wait_for_step(stepper, limit, clock=clock, poll=STEP_POLL, sleep=tick, in_flight=in_flight,
                                   ahead_limit=ahead_limit)

    flight = InFlight()
    flight.add((THEM, 1), 8, step=0)
    assert asyncio.run(run(Needs(16), flight)) is False  # what is in flight does not fill the batch: at once
    flight.add((ME, 1), 8, step=0)
    assert flight.samples == 16
    start = clock.now
    # filled by what is in flight, then due, then its round (past step_wait's 0.25 s), then stepped
    answers = [16] * 20 + [0] * 20 + [None] * 40 + [24]  # (stepped: a batch to fill again)
    assert asyncio.run(run(Needs(*answers), flight)) is True
    assert abs(clock.now - start - 80 * STEP_POLL) < 1e-9
    start = clock.now
    assert asyncio.run(run(Needs(8), flight)) is True  # a step that never comes: the wait ends at its own limit
    assert abs(clock.now - start - 1.0) < STEP_POLL + 1e-9
    assert asyncio.run(run(Needs(8), None)) is False  # (a forward whose backward does not follow: never)
    flight.returned((ME, 1))
    assert flight.samples == 8 and asyncio.run(run(Needs(16), flight)) is False


def test_in_flight_forgets_backwards_that_never_came_and_counts_no_caller_that_holds_back_a_third():
    flight = InFlight(limit=4)
    assert flight.add((THEM, 1), 8, step=0) == 0
    assert flight.add((ME, 1), 8, step=0) == 8
    flight.returned((ME, 1))
    assert flight.add((ME, 2), 8, step=0) == 8
    assert flight.add((ME, 2), 8, step=0) == 8 and flight.samples == 16  # (the same forward again counts once)
    flight.returned((ME, 2))
    assert flight.add((ME, 3), 8, step=2) == 0  # step 2: THEM's forward of step 0 never came back
    assert flight.samples == 8
    flight.add((THEM, 2), 8, step=2)  # THEM held back one forward of one: not counted (nobody waits on it)
    assert flight.samples == 8
    flight.returned((THEM, 2))  # one backward back: THEM is still below zero
    flight.add((THEM, 3), 8, step=2)
    assert flight.samples == 8
    flight.returned((THEM, 3))  # two: counted again
    flight.add((THEM, 4), 8, step=2)
    assert flight.samples == 16
    flight.returned((ME, 3))
    flight.returned((THEM, 4))
    flight.returned((THEM, 4))  # (a backward that comes twice, or for a forward never seen, earns nothing)
    flight.returned((THEM, 99))
    flight.add((THEM, 5), 8, step=2)
    flight.add((THEM, 6), 8, step=2)
    flight.add((THEM, 7), 8, step=2)
    flight.returned((THEM, 7))
    flight.add((THEM, 8), 8, step=4)  # two more missed (-4) against two more back (+2): below zero
    assert flight.samples == 0
    for i in range(10):  # bounded: the oldest are forgotten
        flight.add((ME, 10 + i), 1, step=4)
    assert flight.samples == 4


def test_only_a_replica_waits_for_forwards_in_flight_a_server_alone_in_its_stage_runs_ahead():
    """A server alone predicts the step from all of the batch so far; a replica from its share (often none)."""
    from types import SimpleNamespace

    from swarm.serving.stage import _replicated

    def stepper(group_size):
        return SimpleNamespace(view=lambda: SimpleNamespace(group_size=group_size))

    def broken():
        raise RuntimeError("shutting down")

    assert _replicated(stepper(2)) and not _replicated(stepper(1))
    assert not _replicated(object()) and not _replicated(SimpleNamespace(view=broken))  # (no averaging; closing)
