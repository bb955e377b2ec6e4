"""The simulator (bench/sim): exact where it can be computed by hand, and against a real swarm it was given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim import swarm as model
from bench.sim.swarm import Scenario, simulate
from bench.sim.validate import DEFAULT, simulated

pytestmark = pytest.mark.timeout(120)

QUIET = dict(session=0.0, rebalance=False, links=(((8000, 8000), 1.0),), nat_share=0.0, regions=("here",),
             join_overhead=1.0, choose_spread=0.0, stage_state_bytes=0, wire_bytes_per_sample=0)


def test_one_micro_batch_at_a_time_takes_the_sum_of_its_calls():
    # two stages of speed 1: a forward (1), the last stage's forward and backward (3), a backward from the
    # kept graph (2), each n x 0.01 s, and 4 one-way trips of 10 ms per call
    model.ONE_WAY_MS[("here", "here")] = 10
    scenario = Scenario(stages=2, servers=2, trainers=1, micro_batch=10, in_flight=1, seconds_per_sample=0.01,
                        **QUIET)
    _, [window] = simulate(scenario, 600.0, window=600.0, warmup=30.0, pinned=[(0, 1.0), (1, 1.0)])
    per_micro_batch = 10 * 0.01 * (1 + 3 + 2) + 3 * 2 * 0.010
    assert window.samples_per_second == pytest.approx(10 / per_micro_batch, rel=0.02)


def test_many_in_flight_go_at_the_bottleneck_stage_and_work_spreads_by_speed():
    # stage 0 has a server of speed 1 and one of 0.5; stage 1 one of speed 3: stage 0 is the bottleneck,
    # 1.5 / (3 x 0.01) = 50 samples/s when the trainers keep it busy
    model.ONE_WAY_MS[("here", "here")] = 1
    scenario = Scenario(stages=2, servers=3, trainers=4, micro_batch=4, in_flight=8, seconds_per_sample=0.01,
                        **QUIET)
    swarm, windows = simulate(scenario, 300.0, window=300.0, warmup=60.0, pinned=[(0, 1.0), (0, 0.5), (1, 3.0)])
    assert windows[0].bottleneck == pytest.approx(50.0)
    assert windows[0].oracle == pytest.approx(50.0)  # no placement does better: 1.5 on one stage, 3 on the other
    assert 0.9 * 50 <= windows[0].samples_per_second <= 50 * 1.001


def test_a_server_moves_to_a_stage_nobody_serves_and_the_swarm_trains():
    model.ONE_WAY_MS[("here", "here")] = 1
    scenario = Scenario(stages=2, servers=3, trainers=2, micro_batch=4, in_flight=4, seconds_per_sample=0.01,
                        **{**QUIET, "rebalance": True}, rebalance_period=10.0)
    swarm, windows = simulate(scenario, 120.0, window=60.0, warmup=60.0)
    placed = sorted(s.stage for s in swarm.servers.values())
    assert placed in ([0, 0, 1], [0, 1, 1])
    lone = next(s for s in swarm.servers.values() if placed.count(s.stage) == 1)
    moves = sum(s.moves for s in swarm.servers.values())  # (the rule may have moved one already: speeds differ)
    swarm.leave(lone)
    swarm.sim.run(swarm.sim.now + 120.0)
    stages = sorted(s.stage for s in swarm.servers_alive())
    assert stages == [0, 1], stages  # one of the two others moved
    assert sum(s.moves for s in swarm.servers.values()) == moves + 1
    before = swarm.samples
    swarm.sim.run(swarm.sim.now + 30.0)
    assert swarm.samples > before


def test_a_server_queue_limit_refuses_work_that_then_goes_elsewhere():
    # 4 trainers with 8 micro-batches each in flight over two equal servers a stage: with max_queue 1 a server
    # holds at most one task waiting, refuses the rest as busy, and the refused calls are trained elsewhere
    model.ONE_WAY_MS[("here", "here")] = 1
    scenario = Scenario(stages=2, servers=4, trainers=4, micro_batch=4, in_flight=8, seconds_per_sample=0.01,
                        max_queue=1, **QUIET)
    swarm, windows = simulate(scenario, 120.0, window=120.0, warmup=30.0,
                              pinned=[(0, 1.0), (0, 1.0), (1, 1.0), (1, 1.0)])
    assert swarm.failed_calls > 100  # refused as busy (nobody leaves here)
    assert swarm.timed_out_calls == 0
    assert all(len(s.queue) <= 1 for s in swarm.servers.values())
    bottleneck = 2 * 1.0 / (3 * 0.01)  # two servers of speed 1 a stage
    # (a refusal bans the server for that trainer for a second: with both of a stage's servers refusing, it waits)
    assert windows[0].samples_per_second >= 0.6 * bottleneck


def test_an_adaptive_window_grows_while_the_trips_are_latency():
    # one trainer, fast servers 50 ms away: a micro-batch's trip is round trips, not compute, so the trainer's
    # InFlightWindow (as --in-flight auto) grows past its floor and trains faster than the floor fixed
    model.ONE_WAY_MS[("here", "here")] = 50

    def run(cap: int | None):
        scenario = Scenario(stages=2, servers=2, trainers=1, micro_batch=4, in_flight=1, in_flight_cap=cap,
                            seconds_per_sample=0.001, **QUIET)
        return simulate(scenario, 120.0, window=120.0, warmup=30.0, pinned=[(0, 1.0), (1, 1.0)])

    (fixed, [fixed_window]), (adaptive, [adaptive_window]) = run(None), run(8)
    assert fixed.trainers[0].window.limit == 1
    assert adaptive.trainers[0].window.limit > 1
    assert adaptive_window.samples_per_second > 2 * fixed_window.samples_per_second


def test_the_simulator_reproduces_a_real_swarm_it_was_given_within_15_percent():
    record = json.loads(Path(DEFAULT).read_text())
    assert record["runs"], "tests/data/sim_validation.json holds a measurement (bench/sim/measure.py)"
    for run in record["runs"]:
        ratio = simulated(record, run, minutes=10.0) / run["samples_per_second"]
        assert 0.85 <= ratio <= 1.15, (run, ratio)
