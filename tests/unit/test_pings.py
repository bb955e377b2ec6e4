"""Round trips in routing (swarm.routing.pings, StageBalancer.network_seconds): an untried server's calls are
expected to spend a measured round trip for each stream window they carry; what a ping says stops counting once
the server is measured; which servers a trainer pings next."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from swarm.config import RunConfig
from swarm.protocol import BACKWARD, FORWARD
from swarm.routing.balancer import MAX_ROUND_TRIP, STREAM_WINDOW, StageBalancer
from swarm.routing.pings import MAX_PINGS, REPING_AFTER, RoundTrips, stage_wire_bytes
from tests.unit.balancer_sim import SIZE, FakeClock, Server, simulate

pytestmark = pytest.mark.timeout(30)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WINDOW_AND_A_BIT = STREAM_WINDOW + 1  # bytes per sample: a call of one sample carries two windows each way
CLAIM = 25.0  # samples/s of forward and backward, claimed by every server below


def _balancer(clock: FakeClock, **trips: float) -> StageBalancer:
    b = StageBalancer(clock=clock, wire_bytes={FORWARD: (WINDOW_AND_A_BIT, WINDOW_AND_A_BIT)})
    b.update_servers(list(trips), claims={peer: CLAIM for peer in trips})
    for peer, seconds in trips.items():
        b.measured_round_trip(peer, seconds)
    return b


def test_an_untried_servers_calls_are_expected_to_wait_a_round_trip_per_stream_window():
    clock = FakeClock()
    b = _balancer(clock, near=0.002, far=0.2)
    compute = 1 / (3 * CLAIM)  # a forward's share of the claimed forward and backward
    # two messages of two windows each: half a round trip each way, and one more for each window past a first
    assert b.expected_seconds("far", 1, FORWARD) == pytest.approx(compute + 3 * 0.2)
    assert b.expected_seconds("far", 2, FORWARD) == pytest.approx(2 * compute + 5 * 0.2)  # 3 windows each way
    assert b.choose(1, FORWARD).peer_id == "near"  # the same claim: the nearer one goes first


def test_without_wire_bytes_or_a_round_trip_an_untried_server_is_estimated_as_before():
    clock = FakeClock()
    plain = StageBalancer(clock=clock)
    plain.update_servers(["a"], claims={"a": CLAIM})
    plain.measured_round_trip("a", 0.2)
    told = _balancer(clock, a=0.2)
    told.servers["a"].round_trip = None
    for b in (plain, told):
        assert b.network_seconds("a", 1, FORWARD) is None
        assert b.expected_seconds("a", 4, FORWARD) == pytest.approx(4 * b.expected_seconds_per_sample("a", FORWARD))
    assert told.network_seconds("a", 1, BACKWARD) is None  # no wire bytes of that kind


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_round_trip_that_is_not_a_positive_number_changes_nothing(bad):
    b = _balancer(FakeClock(), a=0.05)
    b.measured_round_trip("a", bad)
    b.measured_round_trip("nobody", 0.01)  # not listed: ignored, nothing added
    assert b.servers["a"].round_trip == 0.05 and "nobody" not in b.servers
    b.measured_round_trip("a", 1e9)
    assert b.servers["a"].round_trip == MAX_ROUND_TRIP


def test_a_server_that_answers_pings_fast_and_calls_slowly_is_judged_by_its_calls():
    """A ping sets where an untried server stands, as a claim does, and no longer counts once it is measured: a
    server that answers pings at once (or fakes nothing but computes slowly) gets its probe, then nothing."""
    clock = FakeClock()
    b = _balancer(clock, a=0.05, b=0.05, sly=0.0001)
    servers = {"a": Server(0.01, delay=0.05), "b": Server(0.01, delay=0.05), "sly": Server(0.2)}
    run = simulate(b, clock, servers, in_flight=1, tasks=200)
    assert run.samples["sly"] == SIZE  # its one probe
    assert b.servers["sly"].measured
    assert b.expected_seconds("sly", SIZE, FORWARD) == pytest.approx(SIZE * 0.2, rel=0.05)  # its calls, not its ping


def test_wire_bytes_of_each_stage_follow_what_the_pipeline_sends():
    config = RunConfig.load(CONFIGS / "tiny.yaml")
    config.stages.num_stages = 3
    hidden = config.model.seq_len * config.model.d_model * 4  # float32 on the wire
    tokens = config.model.seq_len * 4  # int32 token ids
    first, middle, last = (stage_wire_bytes(config, k) for k in range(3))
    assert first == {FORWARD: (tokens, hidden), BACKWARD: (tokens + hidden, 0)}
    assert middle == {FORWARD: (hidden, hidden), BACKWARD: (2 * hidden, hidden)}
    assert last[BACKWARD] == (hidden + tokens, hidden)
    config.stages.wire_dtype = "bfloat16"
    assert stage_wire_bytes(config, 1)[FORWARD] == (hidden // 2, hidden // 2)


def test_a_trainer_pings_each_server_once_a_while_a_bounded_number_at_a_time():
    clock = FakeClock()
    trips = RoundTrips(clock, random.Random(0))
    servers = [f"s{i:03d}" for i in range(MAX_PINGS + 8)]
    first = trips.due(servers)
    assert len(first) == MAX_PINGS == len(set(first))
    second = trips.due(servers)
    assert sorted(second) == sorted(set(servers) - set(first))  # the rest, and nobody twice
    assert trips.due(servers) == []
    clock.now += REPING_AFTER
    assert len(trips.due(servers)) == MAX_PINGS  # due again
    trips.forget(servers[:3])
    assert set(trips.pinged) == set(servers[:3])
