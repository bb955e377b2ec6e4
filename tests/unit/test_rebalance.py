"""The move rule of a stage server (swarm/serving/rebalance.py), on hand-made swarms."""

from __future__ import annotations

import random

import pytest

from swarm.dht import PeerMetricsRecord, ServedWork, ServerRecord
from swarm.serving.rebalance import (
    AVOID_PERIODS,
    MIN_WITNESSES,
    MOVE_GAIN,
    Rebalancer,
    describe,
    plan_move,
    served_on,
    witnessed,
)

pytestmark = pytest.mark.timeout(30)


def rec(peer: str, stage: int, throughput: float, state: str = "ONLINE") -> ServerRecord:
    return ServerRecord(peer_id=peer, stage=stage, state=state, throughput=throughput)


def swarm(*stages: list[tuple[str, float]], state: str = "ONLINE") -> dict[int, list[ServerRecord]]:
    return {k: [rec(peer, k, t, state) for peer, t in servers] for k, servers in enumerate(stages)}


def test_a_server_fills_a_stage_nobody_serves():
    servers = swarm([("a", 10.0), ("b", 10.0)], [])
    move = plan_move(servers, 2, "a")
    assert (move.stage, move.reason, move.before, move.after) == (1, "empty stage", 0.0, 10.0)
    servers[1] = [rec("dead", 1, 10.0, "OFFLINE")]  # an OFFLINE record serves nothing
    assert plan_move(servers, 2, "b").stage == 1


def test_a_server_never_leaves_its_stage_without_a_server():
    assert plan_move(swarm([("a", 10.0)], []), 2, "a") is None
    # a JOINING server on the stage counts as serving it: the other may go
    servers = swarm([("a", 10.0)], [])
    servers[0].append(rec("b", 0, 10.0, "JOINING"))
    assert plan_move(servers, 2, "a").stage == 1
    # ... an OFFLINE one does not
    servers[0][1] = rec("b", 0, 10.0, "OFFLINE")
    assert plan_move(servers, 2, "a") is None


def test_a_move_must_raise_the_bottleneck_by_the_gain():
    # stage 1 has 10; moving a (10) from stage 0 makes it 20, stage 0 then 30: a gain of 2
    servers = swarm([("a", 10.0), ("b", 10.0), ("c", 10.0), ("d", 10.0)], [("e", 10.0)])
    move = plan_move(servers, 2, "a")
    assert (move.stage, move.reason, move.before, move.after) == (1, "bottleneck", 10.0, 20.0)
    # 3 against 2: the bottleneck would go from 20 to 20 (the stage left behind): no move
    assert plan_move(swarm([("a", 10.0), ("b", 10.0), ("c", 10.0)], [("d", 10.0), ("e", 10.0)]), 2, "a") is None
    # five of 10 against one of f (30 <= f < 50): moving one makes the bottleneck 40, 40 / f times what it was
    five = [(peer, 10.0) for peer in "abcde"]
    assert 1.0 < MOVE_GAIN <= 40.0 / 30.0  # the 5 | 3 -> 4 | 4 move of bench/rebalance.py is one it makes
    assert plan_move(swarm(five, [("f", 0.99 * 40.0 / MOVE_GAIN)]), 2, "a").stage == 1
    assert plan_move(swarm(five, [("f", 1.01 * 40.0 / MOVE_GAIN)]), 2, "a") is None  # just short of the gain


def test_the_move_goes_where_the_bottleneck_ends_highest():
    servers = swarm([("a", 10.0), ("b", 10.0), ("c", 10.0)], [("d", 30.0)], [("e", 10.0)])
    assert plan_move(servers, 3, "a").stage == 2  # the weakest stage, not the first


def test_a_liars_claim_counts_capped_and_cannot_pull_a_server_off_a_stage_it_needs():
    # a stranger announces a million samples/s on stage 1 so that stage 0 looks like the bottleneck and
    # honest servers leave stage 1 for it; capped at 4 x the median (10) it would weigh 40, and c would go
    servers = swarm([("a", 10.0), ("b", 10.0)], [("c", 10.0), ("liar", 1e6)])
    assert plan_move(servers, 2, "c") is None  # c counts what it leaves behind by its own measure: 10
    # a slow server counts the fast ones it would leave as slow too: it stays where a move might have helped
    servers = swarm([("slow", 5.0), ("fast", 50.0)], [("x", 10.0)])
    assert plan_move(servers, 2, "slow") is None


def test_a_move_for_the_bottleneck_needs_two_checks_in_a_row_naming_the_same_stage():
    five = [(peer, 10.0) for peer in "abcde"]
    weak_1 = swarm(five, [("f", 10.0)], [("g", 30.0), ("h", 30.0)])
    weak_2 = swarm(five, [("f", 30.0), ("g", 30.0)], [("h", 10.0)])
    rebalancer = Rebalancer(60.0, random.Random(0))
    assert rebalancer.check(weak_1, 3, "a") is None  # the first check only plans
    move = rebalancer.check(weak_1, 3, "a")  # the second confirms
    assert (move.stage, move.reason) == (1, "bottleneck")
    # a plan that flips between checks confirms nothing
    rebalancer = Rebalancer(60.0)
    assert rebalancer.check(weak_1, 3, "a") is None
    assert rebalancer.check(weak_2, 3, "a") is None
    assert rebalancer.check(weak_1, 3, "a") is None
    # one check in between that plans nothing starts the count again
    assert rebalancer.check(swarm(five, [("f", 50.0)], [("g", 50.0)]), 3, "a") is None
    assert rebalancer.check(weak_2, 3, "a") is None
    assert rebalancer.check(weak_2, 3, "a").stage == 2


def test_a_stage_nobody_serves_is_filled_after_one_check_and_the_last_one():
    rebalancer = Rebalancer(60.0, random.Random(0))
    empty_1 = swarm([("a", 10.0), ("b", 10.0)], [])
    move = rebalancer.check(empty_1, 2, "a")  # urgent: no second period to wait
    assert (move.stage, move.reason) == (1, "empty stage")
    assert rebalancer.settle(move, empty_1, 2, "a")  # the last check reads the records again
    assert not rebalancer.settle(move, swarm([("a", 10.0), ("b", 10.0)], [("c", 10.0)]), 2, "a")


def test_a_stage_whose_state_could_not_be_had_is_avoided_for_a_while():
    now = [0.0]
    rebalancer = Rebalancer(60.0, clock=lambda: now[0])
    empty_1 = swarm([("a", 10.0), ("b", 10.0)], [])
    rebalancer.avoid(1)
    for _ in range(3):
        assert rebalancer.check(empty_1, 2, "a") is None
    now[0] += AVOID_PERIODS * 60.0 + 1
    assert rebalancer.check(empty_1, 2, "a").stage == 1


def test_the_last_check_before_leaving_reads_the_swarm_again():
    rebalancer = Rebalancer(60.0, random.Random(1))
    empty_1 = swarm([("a", 10.0), ("b", 10.0)], [])
    move = rebalancer.check(empty_1, 2, "a")
    assert 0 <= rebalancer.settle_wait() <= 10.0
    assert rebalancer.settle(move, empty_1, 2, "a")
    # b left for stage 1 meanwhile (OFFLINE here, JOINING there): a stays
    b_moved = {0: [rec("a", 0, 10.0), rec("b", 0, 10.0, "OFFLINE")], 1: [rec("b", 1, 10.0, "JOINING")]}
    assert not rebalancer.settle(move, b_moved, 2, "a")


def test_a_server_counted_where_it_is_moving_is_not_followed_there():
    # two slow servers on stage 0, two fast on each other stage; "c" of stage 1 moves to stage 0 first
    slow_start = swarm([("a", 1.0), ("b", 1.0)], [("c", 3.0), ("d", 3.0)], [("e", 3.0), ("f", 3.0)])
    assert plan_move(slow_start, 3, "c").stage == 0 and plan_move(slow_start, 3, "e").stage == 0
    moving = swarm([("a", 1.0), ("b", 1.0)], [("d", 3.0)], [("e", 3.0), ("f", 3.0)])
    moving[1].append(rec("c", 1, 3.0, "OFFLINE"))
    # announced JOINING stage 0 at 0 (unmeasured there), "e" would follow it: stage 0 looks as weak as before
    moving[0].append(rec("c", 0, 0.0, "JOINING"))
    assert plan_move(moving, 3, "e").stage == 0
    # announced with the throughput it measured where it was (StageServer.announce_move), "e" stays
    moving[0][-1] = rec("c", 0, 3.0, "JOINING")
    assert plan_move(moving, 3, "e") is None


# the bench/rebalance.py case: two slow servers and a three times faster one on stage 0, one fast on stage 1
SLOW_HERE = swarm([("s1", 1.0), ("s2", 1.0), ("f0", 3.0)], [("f1", 3.0)], [("f2", 3.0), ("f3", 3.0)])


def test_trainers_served_work_lets_a_slow_server_count_a_faster_stage_mate_and_leave():
    # by its own measure, s1 counts f0 as slow as itself: 3 | 3 | 6, and leaving makes stage 0 2: it stays
    assert plan_move(SLOW_HERE, 3, "s1") is None
    # two trainers got three times as much from f0 as from s1: 5 | 3 | 6 -> 4 | 4 | 6 by moving to stage 1
    served = [{"s1": 10.0, "s2": 10.0, "f0": 30.0}, {"s1": 10.0, "s2": 11.0, "f0": 32.0}]
    move = plan_move(SLOW_HERE, 3, "s1", served)
    assert (move.stage, move.reason, move.before, move.after) == (1, "bottleneck", 3.0, 4.0)
    # never above a mate's (capped) claim: f0 served 10x as much, it still counts 3
    assert plan_move(SLOW_HERE, 3, "s1", [{"s1": 1.0, "s2": 1.0, "f0": 10.0}] * 2).after == 4.0
    # the trainers' word counts only for the stage-mates: f0's own view of where it is does not change
    assert plan_move(SLOW_HERE, 3, "f0", served) is None


def test_one_trainers_word_is_not_enough_and_a_liar_among_several_cannot_raise_a_mate():
    assert MIN_WITNESSES == 2
    honest = {"s1": 10.0, "s2": 10.0, "f0": 30.0}
    assert plan_move(SLOW_HERE, 3, "s1", [honest]) is None  # one trainer alone: mates count as s1 at most
    assert witnessed("f0", "s1", [honest]) is None
    # a lying trainer (f0's friend) says f0 served everything: the lower median of the two is the honest 3
    liar = {"s1": 0.001, "f0": 1e9}
    assert witnessed("f0", "s1", [honest, liar]) == 3.0
    # one saying f0 served nothing: the lower median is 0, and f0 counts as s1 at most, as with no trainers
    assert witnessed("f0", "s1", [honest, {"s1": 10.0}]) == 0.0
    assert plan_move(SLOW_HERE, 3, "s1", [honest, {"s1": 10.0, "s2": 10.0}]) is None
    # a trainer that got work from the mate only: as much as the mate claims (inf, then capped by the claim)
    assert witnessed("f0", "s1", [{"f0": 5.0}, {"f0": 6.0}]) == float("inf")
    assert witnessed("f0", "s1", [{"s2": 5.0}, {"s2": 6.0}]) is None  # neither got work from either


def test_a_mate_that_served_less_counts_as_this_server_not_less():
    # stage 1 has room to spare: trainers gave f1 nearly everything and its equal f2 next to nothing
    # (bench/rebalance.py saw 50x). Counted by that, f2 would be worth 0.1 and f1 would never move to stage 0,
    # which needs it; a ratio below 1 says who is faster, not by how much less the other is
    servers = swarm([("s1", 1.0), ("s2", 1.0)], [("f1", 3.0), ("f2", 3.0)])
    served = [{"f1": 100.0, "f2": 2.0}, {"f1": 90.0, "f2": 3.0}]
    move = plan_move(servers, 2, "f1", served)
    assert (move.stage, move.before, move.after) == (0, 2.0, 3.0)


def test_served_work_is_read_from_trainers_records_of_the_stage():
    def metrics(peer, role, served):
        return PeerMetricsRecord(peer_id=peer, role=role, step=0, samples_per_second=1.0, samples=1, time=0.0,
                                 served=[ServedWork(peer_id=p, stage=k, work=w) for p, k, w in served])

    records = [metrics("t1", "trainer", [("a", 0, 5.0), ("b", 0, 0.0), ("c", 1, 7.0)]),
               metrics("t2", "trainer", [("c", 1, 3.0)]),  # nothing on stage 0: not a witness there
               metrics("srv", "server", [("a", 0, 99.0)]),  # only trainers' records count
               PeerMetricsRecord(peer_id="t3", role="trainer", step=0, samples_per_second=1.0, samples=1, time=0.0)]
    assert served_on(records, 0) == [{"a": 5.0}]
    assert served_on(records, 1) == [{"c": 7.0}, {"c": 3.0}]
    with pytest.raises(ValueError):  # a record lists at most MAX_SERVED_LISTED servers
        metrics("t4", "trainer", [(f"p{i}", 0, 1.0) for i in range(33)])
    with pytest.raises(ValueError):
        ServedWork(peer_id="a", stage=0, work=float("inf"))


def test_each_check_says_in_a_line_what_its_plan_was_made_of():
    rebalancer = Rebalancer(60.0)
    assert rebalancer.check(SLOW_HERE, 3, "s1", [{"s1": 10.0, "s2": 10.0, "f0": 30.0}]) is None
    line = describe(rebalancer.view)
    assert "stages at 3.0 | 3.0 | 6.0 samples/s" in line and "capped at its own" in line  # one trainer: not enough
    assert "to stage 1, makes the bottleneck 2.0 from 3.0" in line
    rebalancer.check(SLOW_HERE, 3, "s1", [{"s1": 10.0, "s2": 10.0, "f0": 30.0}] * 2)
    assert "stages at 5.0 | 3.0 | 6.0" in describe(rebalancer.view) and "3.0 (x3.00)" in describe(rebalancer.view)
    rebalancer.check(swarm([("s1", 1.0)], [("f1", 3.0)]), 2, "s1")
    assert describe(rebalancer.view).startswith("nothing to plan")
