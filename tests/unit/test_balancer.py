"""StageBalancer: where work goes (expected finish, claims, ties, relays) and what a task costs; tickets, bans,
lookups and probation are in test_balancer_bans.py."""

from __future__ import annotations

import pytest

from swarm.protocol import BACKWARD, FORWARD
from swarm.routing.balancer import BACKWARD_TO_FORWARD, CLAIM_OPTIMISM, StageBalancer
from tests.unit.balancer_sim import SIZE, FakeClock, Run, Server, balancer, measured, simulate, speeds

pytestmark = pytest.mark.timeout(30)


# --- where work goes ------------------------------------------------------------------------------

def test_one_in_flight_a_10x_slower_server_gets_nothing_after_its_probe():
    clock = FakeClock()
    # "a-slow" sorts first, so it also wins the first, unmeasured, tie
    b = balancer(clock, "a-slow", "b", "c")
    run = simulate(b, clock, speeds(**{"a-slow": 0.1, "b": 0.01, "c": 0.01}), in_flight=1, tasks=300)
    assert run.elapsed < b.reprobe_after  # before its estimate is due a re-test
    assert run.samples["a-slow"] <= SIZE


def test_a_slow_server_is_retested_rarely():
    clock = FakeClock()
    b = balancer(clock, "a", "b", "slow")
    run = simulate(b, clock, speeds(a=0.01, b=0.01, slow=0.1), in_flight=1, tasks=6000)  # ~8 minutes
    retests = run.samples["slow"] // SIZE - 1
    # stale after max(reprobe_after, 50 x its 0.8 s answer): its tasks take ~2% of the time
    assert 1 <= retests <= run.elapsed / 40
    assert run.samples["slow"] * 0.1 <= 0.025 * run.elapsed


def test_an_unlucky_first_answer_does_not_shut_a_server_out_for_good():
    clock = FakeClock()
    b = balancer(clock, "a", "b")
    servers = {"a": Server(0.01), "b": Server(0.01, hiccup=1.0)}  # b's first answer: 1.08 s instead of 0.08
    first = simulate(b, clock, servers, in_flight=2, tasks=300)
    assert first.share("b") < 0.05
    then = simulate(b, clock, servers, in_flight=2, tasks=2000)  # b is re-tested once its estimate is stale
    assert then.share("b") >= 0.3


def test_eight_in_flight_work_goes_in_proportion_to_speed():
    clock = FakeClock()
    b = balancer(clock, "fast", "slow")
    run = simulate(b, clock, speeds(fast=0.01, slow=0.03), in_flight=8, tasks=2000)
    assert 0.15 <= run.share("slow") <= 0.35  # 1/4 if proportional


def test_eight_in_flight_a_10x_slower_server_gets_little():
    clock = FakeClock()
    b = balancer(clock, "fast", "slow")
    run = simulate(b, clock, speeds(fast=0.01, slow=0.1), in_flight=8, tasks=2000)
    assert run.share("slow") <= 0.05


@pytest.mark.parametrize("in_flight", [1, 2, 4, 8])
@pytest.mark.parametrize("slow", [(0.1, 0.0), (0.01, 0.72)], ids=["slow compute", "slow delay"])
def test_a_10x_slow_server_does_not_slow_the_trainer(in_flight: int, slow: tuple[float, float]):
    """The bench's question (bench/slow_peer.py) on simulated servers: speed with the slow one / without."""
    def speed(with_slow: bool) -> float:
        clock = FakeClock()
        servers = speeds(a=0.01, b=0.01) | ({"c": Server(*slow)} if with_slow else {})
        b = balancer(clock, *servers)
        simulate(b, clock, servers, in_flight, tasks=20)  # the newcomers' probes
        return simulate(b, clock, servers, in_flight, tasks=1000).speed

    assert speed(with_slow=True) >= 0.95 * speed(with_slow=False)


def test_newcomer_is_tried_promptly_even_with_one_in_flight():
    clock = FakeClock()
    b = balancer(clock, "a")
    simulate(b, clock, speeds(a=0.01), in_flight=1, tasks=20)
    b.update_servers(["a", "z-new"])  # sorts last: would lose every tie if ties went by id only
    assert b.expected_seconds_per_sample("z-new", FORWARD) == pytest.approx(0.01)  # as fast as the fastest
    assert b.choose(SIZE, FORWARD).peer_id == "z-new"


def claims_of(servers: dict[str, Server], lie: dict[str, float] | None = None) -> dict[str, float]:
    """What each server's record would claim: samples/s of a forward and backward at its compute speed
    (a backward is BACKWARD_TO_FORWARD forwards), times `lie` where given."""
    return {peer: (lie or {}).get(peer, 1.0) / ((1 + BACKWARD_TO_FORWARD) * server.seconds_per_sample)
            for peer, server in servers.items()}


def test_a_newcomer_is_taken_to_be_as_fast_as_it_claims_scaled_by_what_claims_turned_out_to_be():
    clock = FakeClock()
    servers = speeds(a=0.01, b=0.01)
    b = StageBalancer(clock=clock)
    b.update_servers(servers, claims=claims_of(servers, lie={"a": 3.0, "b": 3.0}))  # both claim 3x their speed
    simulate(b, clock, servers, in_flight=2, tasks=40)
    slow = {"z-slow": Server(0.1)}
    overstated = claims_of(servers, lie={"a": 3.0, "b": 3.0})
    b.update_servers([*servers, *slow], claims=overstated | claims_of(slow, {"z-slow": 3.0}))
    # claimed 10x slower than a and b, and claims here overstate 3x: expected at its true speed (with the optimism)
    assert b.expected_seconds_per_sample("z-slow", FORWARD) == pytest.approx(0.1 / CLAIM_OPTIMISM, rel=0.05)
    assert b.expected_seconds_per_sample("z-slow", BACKWARD) == \
        pytest.approx(0.1 * BACKWARD_TO_FORWARD / CLAIM_OPTIMISM, rel=0.05)
    assert b.choose(SIZE, FORWARD).peer_id != "z-slow"  # not probed while faster servers are idle
    fast = {"z-fast": Server(0.005)}
    b.update_servers([*servers, *fast], claims=overstated | claims_of(fast, {"z-fast": 3.0}))
    assert b.choose(SIZE, FORWARD).peer_id == "z-fast"  # one claiming more speed is tried at once


def test_claims_spare_a_trainer_probing_every_slow_server():
    """20 servers, speeds tenfold apart (bench/sim found probes of slow newcomers were most of what routing
    lost): with the records' claims a trainer with one micro-batch in flight sends the slow ones nothing."""
    def run(with_claims: bool) -> Run:
        clock, servers = FakeClock(), {f"s{i:02d}": Server(0.01 if i < 2 else 0.1) for i in range(20)}
        b = StageBalancer(clock=clock)
        b.update_servers(servers, claims=claims_of(servers) if with_claims else None)
        return simulate(b, clock, servers, in_flight=1, tasks=100)

    blind, told = run(False), run(True)
    slow = [f"s{i:02d}" for i in range(2, 20)]
    assert sum(blind.samples[p] for p in slow) >= 17 * SIZE
    assert sum(told.samples[p] for p in slow) == 0
    assert told.speed > 2 * blind.speed


def test_a_lone_liars_claim_moves_no_other_servers_estimate():
    clock = FakeClock()
    servers = speeds(a=0.01, b=0.01, c=0.01, liar=0.02)
    claimed = claims_of(servers, lie={"liar": 1000.0})
    b = StageBalancer(clock=clock)
    b.update_servers(servers, claims=claimed)
    simulate(b, clock, servers, in_flight=4, tasks=200)
    assert b.servers["liar"].measured  # tried first, as its claim asks, then measured
    b.update_servers([*servers, "new"], claims=claimed | {"new": claimed["a"]})
    assert b.expected_seconds_per_sample("new", FORWARD) == pytest.approx(0.01 / CLAIM_OPTIMISM, rel=0.05)


def test_a_newcomer_whose_claim_came_out_somewhat_low_is_still_tried():
    clock = FakeClock()
    servers = speeds(a=0.01)
    b = StageBalancer(clock=clock)
    b.update_servers(servers, claims=claims_of(servers))
    simulate(b, clock, servers, in_flight=1, tasks=20)
    b.update_servers(["a", "z-new"], claims=claims_of(servers) | {"z-new": 0.7 * claims_of(servers)["a"]})
    assert b.choose(SIZE, FORWARD).peer_id == "z-new"


@pytest.mark.parametrize("claim", [0.0, -5.0, float("nan"), float("inf")])
def test_a_claim_that_is_no_speed_counts_as_none(claim: float):
    clock = FakeClock()
    b = balancer(clock, "a")
    simulate(b, clock, speeds(a=0.01), in_flight=1, tasks=20)
    b.update_servers(["a", "z-new"], claims={"z-new": claim})
    assert b.expected_seconds_per_sample("z-new", FORWARD) == pytest.approx(0.01)  # as fast as the fastest


def test_ties_between_equals_go_by_peer_id():
    b = balancer(FakeClock(), "b", "a", "c")
    assert [b.choose(SIZE, FORWARD).peer_id for _ in range(3)] == ["a", "b", "c"]


def test_trainers_with_their_own_tie_salt_spread_their_first_calls():
    # at start every server is untried and equal: by peer id alone every trainer would send its first call
    # to the same server (bench/sim: 40 trainers queued behind one another there)
    peers = [f"server{i:02d}" for i in range(20)]
    firsts = {balancer(FakeClock(), *peers, tie_salt=f"trainer{t}").choose(SIZE, FORWARD).peer_id for t in range(20)}
    assert len(firsts) >= 8, firsts
    assert balancer(FakeClock(), *peers).choose(SIZE, FORWARD).peer_id == "server00"  # no salt: by peer id
    salted = balancer(FakeClock(), *peers, tie_salt="trainer0")  # one trainer's order is its own, and stable
    assert [salted.choose(SIZE, FORWARD).peer_id for _ in range(20)] == sorted(
        peers, key=lambda p: salted._tie(p))


def test_a_relayed_server_loses_to_a_direct_one_as_fast_but_wins_when_clearly_faster():
    clock = FakeClock()
    b = StageBalancer(clock=clock)
    b.update_servers(["a-relayed", "b"], relayed=["a-relayed"])  # "a-relayed" would win a tie by id
    run = simulate(b, clock, speeds(**{"a-relayed": 0.01, "b": 0.01}), in_flight=1, tasks=40)
    assert run.samples["a-relayed"] <= 2 * SIZE  # its probe, a re-test at most
    clock = FakeClock()
    b = StageBalancer(clock=clock)
    b.update_servers(["a-relayed", "b"], relayed=["a-relayed", "gone"])
    assert b.relayed == {"a-relayed"}  # only listed servers count
    run = simulate(b, clock, speeds(**{"a-relayed": 0.005, "b": 0.01}), in_flight=1, tasks=40)
    assert run.share("a-relayed") > 0.9  # twice as fast: the margin does not stand in its way


def test_no_server_and_exclusions():
    b = balancer(FakeClock())
    assert b.choose(1, FORWARD) is None
    b.update_servers(["a"])
    assert b.choose(1, FORWARD, exclude=["a"]) is None
    with pytest.raises(ValueError):
        b.choose(1, "sideways")


# --- what a task costs ----------------------------------------------------------------------------

def test_service_time_of_a_queued_fifo_server_excludes_waiting_behind_our_own_tasks():
    clock = FakeClock()
    b = balancer(clock, "a")
    tickets = [b.charge("a", 1, FORWARD) for _ in range(4)]  # sent at once, answered 1 s apart
    for ticket in tickets:
        clock.now += 1.0
        b.report_success(ticket)
    assert b.expected_seconds_per_sample("a", FORWARD) == pytest.approx(1.0)  # not 2.5, the mean wait


def test_a_task_sent_after_the_previous_answer_is_timed_from_its_sending():
    clock = FakeClock()
    b = balancer(clock, "a")
    first = b.charge("a", 2, FORWARD)
    clock.now += 1.0
    b.report_success(first)
    clock.now += 5.0  # idle
    second = b.charge("a", 2, FORWARD)
    clock.now += 3.0
    b.report_success(second)
    assert b.expected_seconds_per_sample("a", FORWARD) == pytest.approx(0.5 + 0.1 * (1.5 - 0.5))


def test_overlapping_delay_is_not_taken_for_speed():
    # Four tasks wait 5 s side by side, then compute 0.1 s each: answered 5.1, 5.2, 5.3, 5.4 s on.
    clock = FakeClock()
    b = balancer(clock, "far")
    tickets = [b.charge("far", 1, FORWARD) for _ in range(4)]
    for i, ticket in enumerate(tickets):
        clock.now = 1000.0 + 5.0 + 0.1 * (i + 1)
        b.report_success(ticket)
    assert b.expected_finish("far", 1, FORWARD) >= 5.0


def test_outstanding_work_counts_toward_the_finish_and_is_revalued_when_measured():
    clock = FakeClock()
    b = balancer(clock, "a", "new")
    ticket = b.charge("a", SIZE, FORWARD)
    clock.now += SIZE * 0.001
    b.report_success(ticket)
    held = [b.charge("new", SIZE, FORWARD) for _ in range(3)]  # charged as fast as a
    clock.now += 1.0
    b.report_success(held[0])  # new is slow: 1 s for 8 samples
    assert b.outstanding_seconds("new") == pytest.approx(2 * 1.0)  # no longer 2 x 0.008
    assert b.expected_finish("new", SIZE, FORWARD) == pytest.approx(3.0)


def test_each_kind_has_its_own_estimate_and_an_unmeasured_kind_is_scaled_from_the_other():
    clock = FakeClock()
    b = balancer(clock, "a", "b")
    assert b.expected_seconds_per_sample("a", FORWARD) == pytest.approx(0.01)  # the default
    assert b.expected_seconds_per_sample("a", BACKWARD) == pytest.approx(0.01 * BACKWARD_TO_FORWARD)
    ticket = b.charge("a", 10, FORWARD)
    clock.now += 1.0
    b.report_success(ticket)
    assert b.expected_seconds_per_sample("a", FORWARD) == pytest.approx(0.1)
    assert b.expected_seconds_per_sample("a", BACKWARD) == pytest.approx(0.1 * BACKWARD_TO_FORWARD)
    assert b.expected_seconds_per_sample("b", BACKWARD) == pytest.approx(0.1 * BACKWARD_TO_FORWARD)  # as the fastest
    ticket = b.charge("a", 10, BACKWARD)
    clock.now += 2.0
    b.report_success(ticket)
    assert b.expected_seconds_per_sample("a", BACKWARD) == pytest.approx(0.2)
    assert b.expected_seconds_per_sample("a", FORWARD) == pytest.approx(0.1)  # untouched by a backward


def test_a_backward_goes_back_to_the_server_holding_its_graph_unless_another_is_sooner_even_so():
    clock = FakeClock()
    b = balancer(clock, "a", "b")
    measured(b, clock, "a", 0.1)
    measured(b, clock, "b", 0.1)
    busy = b.charge("a", 10, FORWARD)  # a has 1 s of our work ahead; the saving of its kept graph is 1 s
    assert b.choose(10, BACKWARD).peer_id == "b"  # now b has 2 s ahead
    assert b.choose(10, BACKWARD, prefer="a").peer_id == "a"  # 1 s ahead + 2 s - 1 s saved <= 2 s ahead + 2 s
    for _ in range(3):
        b.charge("a", 10, FORWARD)  # 6 s ahead: even without recomputing, b is sooner
    assert b.choose(10, BACKWARD, prefer="a").peer_id == "b"
    b.release(busy)
    assert b.choose(10, BACKWARD, prefer="a", exclude=["a"]).peer_id == "b"  # a retry goes elsewhere
    # pinned (the low-communication mode: replicas differ), the backward goes back whenever the server can take it
    assert b.choose(10, BACKWARD, prefer="a", pin=True).peer_id == "a"
    assert b.choose(10, BACKWARD, prefer="a", pin=True, exclude=["a"]).peer_id == "b"  # gone or failed: elsewhere


def test_one_in_flight_alternating_kinds_still_avoids_the_slow_server():
    clock = FakeClock()
    b = balancer(clock, "a-slow", "b")
    servers = speeds(**{"a-slow": 0.1, "b": 0.01})
    slow_samples = 0
    for _ in range(100):
        for kind in (FORWARD, BACKWARD):
            slow_samples += simulate(b, clock, servers, in_flight=1, tasks=1, kind=kind).samples["a-slow"]
    assert slow_samples <= SIZE  # its forward probe; its backward is then estimated from that
