"""The simulator (bench/sim): exact where it can be computed by hand, and against a real swarm it was given."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.sim import network
from bench.sim import swarm as model
from bench.sim.swarm import Scenario, simulate
from bench.sim.validate import DEFAULT, simulated
from bench.sim.validate import LAB_RECORD as LAB
from swarm.protocol import BACKWARD, FORWARD

pytestmark = pytest.mark.timeout(120)

QUIET = dict(session=0.0, rebalance=False, links=(((8000, 8000), 1.0),), nat_share=0.0, regions=("here",),
             join_overhead=1.0, choose_spread=0.0, stage_state_bytes=0, wire_bytes_per_sample=0,
             token_bytes_per_sample=0, call_overhead=0.0)


def test_one_micro_batch_at_a_time_takes_the_sum_of_its_calls():
    # two stages of speed 1: a forward (1), the last stage's forward and backward (3), a backward from the
    # kept graph (2), each n x 0.01 s, and 4 one-way trips of 10 ms per call
    model.ONE_WAY_MS[("here", "here")] = 10
    scenario = Scenario(stages=2, servers=2, trainers=1, micro_batch=10, in_flight=1, seconds_per_sample=0.01,
                        **QUIET)
    _, [window] = simulate(scenario, 600.0, window=600.0, warmup=30.0, pinned=[(0, 1.0), (1, 1.0)])
    per_micro_batch = 10 * 0.01 * (1 + 3 + 2) + 3 * 2 * 0.010
    assert window.samples_per_second == pytest.approx(10 / per_micro_batch, rel=0.02)


def test_with_one_server_a_stage_every_choice_is_the_oracles_and_a_call_takes_what_it_expected():
    # routing: the chosen server's expected finish over the best one's; answered: how long calls took, from the
    # first choice, over the best expected finish then. One server a stage, one trainer, one micro-batch in
    # flight: no choice and no queue, so both are 1
    model.ONE_WAY_MS[("here", "here")] = 10
    scenario = Scenario(stages=2, servers=2, trainers=1, micro_batch=10, in_flight=1, seconds_per_sample=0.01,
                        **QUIET)
    swarm, [window] = simulate(scenario, 120.0, window=120.0, warmup=30.0, pinned=[(0, 1.0), (1, 1.0)])
    assert len(swarm.answered) > 100
    assert window.routing == pytest.approx(1.0, abs=1e-6)
    assert window.answered == pytest.approx(1.0, abs=1e-3)


def test_a_servers_backlog_counts_what_its_running_task_has_left():
    swarm = model.Swarm(Scenario(**QUIET))
    server = swarm.add_server(0, 1.0)
    server.state = "ONLINE"
    for _ in range(2):
        swarm.submit(server, 2.0, lambda: None, lambda *_: None)
    swarm.sim.run(0.5)
    assert server.backlog(swarm.sim.now) == pytest.approx(1.5 + 2.0)


def test_with_max_wait_a_server_refuses_while_its_tasks_ahead_at_their_mean_time_would_hold_a_call_longer():
    # a forward of 50 samples at 0.01 s on a speed-1 server: 0.5 s, the mean the server starts with (seed_means,
    # from the throughput it measures: a forward and backward, 1.5 s)
    swarm = model.Swarm(Scenario(max_wait=1.0, micro_batch=50, seconds_per_sample=0.01, **QUIET))
    server = swarm.add_server(0, 1.0)
    assert server.task_seconds == {FORWARD: 0.5, BACKWARD: 1.0}
    server.state = "ONLINE"
    refused = []
    for name in ("a", "b", "c", "d"):  # a runs; b waits 0.5 s, c 1.0 s (taken), d would wait 1.5 s
        swarm.submit(server, 0.5, lambda: None, lambda *brief, name=name: refused.append((name, brief)))
    swarm.submit(server, 1.0, lambda: None, lambda *brief: refused.append(("a backward", brief)), BACKWARD)
    swarm.sim.run(swarm.sim.now)
    assert refused == [("d", (True,)), ("a backward", (True,))]
    assert len(server.queue) == 2
    swarm.sim.run(swarm.sim.now + 0.75)  # a done, b half done: c waits 0.25 s more
    swarm.submit(server, 1.0, lambda: None, lambda *brief: refused.append(("then", brief)), BACKWARD)
    swarm.sim.run(swarm.sim.now)
    assert len(refused) == 2 and len(server.queue) == 2  # taken

    swarm.submit(server, 0.5, lambda: None, lambda *brief: refused.append(("patient", brief)), patient=True)
    swarm.sim.run(swarm.sim.now)
    assert len(refused) == 2 and len(server.queue) == 3  # a caller with nowhere else to go is taken however long


def test_as_auto_a_server_refuses_past_a_share_of_a_forward_of_its_stages_median_server_and_never_alone():
    # forwards of 400 samples at 0.01 s: 4 s on a speed-1 server, 2 s on the speed-2 one; the median claim of the
    # stage (speeds 1, 1 and 2) is speed 1's, so the limit is 0.3 x 4 = 1.2 s for all three
    swarm = model.Swarm(Scenario(max_wait=model.AUTO, micro_batch=400, seconds_per_sample=0.01, **QUIET))
    alone = swarm.add_server(1, 1.0)
    servers = [swarm.add_server(0, speed) for speed in (1.0, 1.0, 2.0)]
    for server in (alone, *servers):
        server.state = "ONLINE"
    swarm._version += 1  # (as a join does)
    assert [swarm._auto_wait(s) for s in servers] == pytest.approx([1.2, 1.2, 1.2])
    assert swarm._auto_wait(alone) is None
    # forwards, each counted at its server's mean forward (2 s on the speed-2 server): the second would wait 2 s
    refused = []
    for server in (alone, servers[2]):
        for name in ("runs", "would wait 2 s"):
            swarm.submit(server, 2.0, lambda: None,
                         lambda *brief, name=name, peer=server.peer_id: refused.append((peer, name)))
    swarm.sim.run(swarm.sim.now)
    assert refused == [(servers[2].peer_id, "would wait 2 s")]


def test_answered_counts_the_refusals_and_retries_of_a_call_from_its_first_choice():
    # two equal servers a stage, one refusing beyond one task queued: calls that are refused are answered later
    # than the oracle (which sends work only where it is taken) expected at their first choice
    model.ONE_WAY_MS[("here", "here")] = 1
    scenario = Scenario(stages=2, servers=4, trainers=4, micro_batch=4, in_flight=8, seconds_per_sample=0.01,
                        max_queue=1, **QUIET)
    swarm, [window] = simulate(scenario, 60.0, window=60.0, warmup=30.0,
                               pinned=[(0, 1.0), (0, 1.0), (1, 1.0), (1, 1.0)])
    assert swarm.failed_calls > 100
    assert window.answered > 1.1
    took = sum(a for a, _ in swarm.answered)
    assert took <= 60.0 * 4 * 8 * 1.01  # each trainer's 8 micro-batches in flight, one call at a time each


def test_routing_is_measured_while_stages_empty_and_fill_again():
    # a small swarm with churn (bench/sim/run.py's small case): stages lose their last server, a trainer still
    # calls one its last lookup listed, and both measures stay defined (a call can take less than the oracle expected
    # at its first choice: work queued ahead of it was dropped, or its server left and another took it sooner)
    scenario = Scenario(stages=8, servers=24, trainers=8, session=1800.0, seconds_per_sample=0.05, micro_batch=16,
                        in_flight=4, seed=0)
    swarm, windows = simulate(scenario, 3600.0)
    assert swarm.answered
    assert all(1.0 - 1e-9 <= w.routing < math.inf and 0.0 < w.answered < math.inf for w in windows)


def test_a_message_past_the_stream_window_waits_a_round_trip_per_window_where_the_bytes_go_out_sooner():
    model.ONE_WAY_MS[("here", "here")] = 50
    swarm = model.Swarm(Scenario(**QUIET))
    window = network.STREAM_WINDOW

    def link(mbit: float) -> model.Endpoint:
        return model.Endpoint("here", mbit * 1e6 / 8, mbit * 1e6 / 8)

    fast, slow = link(1000), link(10)
    # within one window: the bytes, then one way
    assert swarm.net.transit(fast, fast, window // 2)[1] == pytest.approx(window / 2 / 125e6 + 0.05)
    # four windows and a bit (the framing): four waits for an update, a round trip less the window's own bytes
    nbytes = 4 * window
    busy, arrives = swarm.net.transit(fast, fast, nbytes)
    assert busy == pytest.approx(nbytes / 125e6)
    assert arrives == pytest.approx(nbytes / 125e6 + 4 * (0.1 - window / 125e6) + 0.05)
    # at 10 Mbit/s a window takes 0.21 s to send, longer than the round trip: its update comes in time
    assert swarm.net.transit(slow, slow, nbytes)[1] == pytest.approx(nbytes / 1.25e6 + 0.05)
    # the uplink sends one message at a time: a second waits for the first's bytes, not for its updates
    first = swarm.net.delivery(fast, slow, nbytes)
    fast.up_free = first[0]
    assert swarm.net.delivery(fast, slow, 1000)[0] == pytest.approx(first[0] + 1000 / 1.25e6)


def test_stage_0_is_sent_token_ids_and_the_last_stage_targets_beside_the_hidden_states():
    # two stages, 4 samples a micro-batch: hidden states of 1000 bytes a sample, token ids of 10, links of 8 kB/s
    # (so the bytes are the trip): forward to stage 0 up 40 and down 4000, the last stage's call up 4000 + 40
    # and down 4000, the backward of stage 0 up 40 + 4000 and down nothing: 16,120 bytes at 8,000 bytes/s
    model.ONE_WAY_MS[("here", "here")] = 0
    scenario = Scenario(stages=2, servers=2, trainers=1, micro_batch=4, in_flight=1, seconds_per_sample=1e-6,
                        **{**QUIET, "links": (((0.064, 0.064), 1.0),), "wire_bytes_per_sample": 1000,
                           "token_bytes_per_sample": 10})
    _, [window] = simulate(scenario, 600.0, window=600.0, warmup=30.0, pinned=[(0, 1.0), (1, 1.0)])
    assert window.samples_per_second == pytest.approx(4 / (16_120 / 8000), rel=0.01)


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


def test_the_oracle_places_joiners_on_the_weakest_stage_and_refills_a_stage_its_last_server_left():
    model.ONE_WAY_MS[("here", "here")] = 1
    scenario = Scenario(stages=3, servers=6, trainers=1, micro_batch=4, in_flight=2, seconds_per_sample=0.01,
                        **{**QUIET, "oracle_placement": True, "speeds": ((1.0, 0.5), (0.25, 0.5))})
    swarm, windows = simulate(scenario, 60.0, window=60.0, warmup=60.0)
    assert windows[0].bottleneck == pytest.approx(windows[0].oracle)  # placed as well as the greedy oracle
    lone = min(swarm.servers_alive(), key=lambda s: sum(o.stage == s.stage for o in swarm.servers_alive()))
    stage = lone.stage
    swarm.leave(lone)
    assert any(s.stage == stage and s.state == "ONLINE" for s in swarm.servers_alive())  # at once, free of cost
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


@pytest.mark.parametrize("path", [DEFAULT, LAB], ids=["loopback", "lab-50ms"])
def test_the_simulator_reproduces_a_real_swarm_it_was_given_within_15_percent(path):
    record = json.loads(Path(path).read_text())
    assert record["runs"], f"{path} holds a measurement (bench/sim/measure.py)"
    for run in record["runs"]:
        ratio = simulated(record, run, minutes=10.0) / run["samples_per_second"]
        assert 0.85 <= ratio <= 1.15, (run, ratio)
