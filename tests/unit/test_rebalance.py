"""The move rule of a stage server (swarm/serving/rebalance.py), on hand-made swarms."""

from __future__ import annotations

import random

import pytest

from swarm.dht import ServerRecord
from swarm.serving.rebalance import AVOID_PERIODS, MOVE_GAIN, Rebalancer, plan_move

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
    # five of 10 against one of 30: moving one makes the bottleneck 40, 1.333 x 30: enough (MOVE_GAIN 1.33)
    five = [(peer, 10.0) for peer in "abcde"]
    assert MOVE_GAIN <= 40.0 / 30.0
    assert plan_move(swarm(five, [("f", 30.0)]), 2, "a").stage == 1
    # against one of 31: 40 is 1.29 x 31, not enough
    assert plan_move(swarm(five, [("f", 31.0)]), 2, "a") is None


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
