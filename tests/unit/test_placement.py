"""A new server takes the stage with the least announced throughput; a new expert server, the experts served least."""

import random

import pytest

from swarm.dht import ExpertHostRecord, ServerRecord
from swarm.serving.placement import choose_experts, choose_stage

pytestmark = pytest.mark.timeout(30)


def rec(stage, throughput, state="ONLINE", peer="p"):
    return ServerRecord(peer_id=f"{peer}{stage}{throughput}", stage=stage, state=state, throughput=throughput)


def test_empty_swarm_fills_stages_in_order():
    assert choose_stage({}, 3) == 0
    assert choose_stage({0: [rec(0, 10.0)]}, 3) == 1


def test_weakest_stage_wins_and_offline_servers_do_not_count():
    servers = {0: [rec(0, 50.0)], 1: [rec(1, 20.0), rec(1, 20.0, peer="q")], 2: [rec(2, 100.0, "OFFLINE")]}
    assert choose_stage(servers, 3) == 2
    servers[2] = [rec(2, 100.0)]
    assert choose_stage(servers, 3) == 1


def test_joining_servers_count_so_simultaneous_joiners_spread():
    servers = {0: [rec(0, 10.0, "JOINING")], 1: []}
    assert choose_stage(servers, 2) == 1


def test_a_stranger_claiming_a_huge_throughput_weighs_as_one_fast_server():
    # stage 0's honest server is slow; a stranger announces a million samples/s there, so that no joiner
    # would ever come to stage 0 on its word
    servers = {0: [rec(0, 10.0), rec(0, 1e6, peer="liar")], 1: [rec(1, 50.0, peer=p) for p in "qrstu"]}
    # counted: 10 + 4 x 50 (the lower median claim) = 210, against stage 1's 250
    assert choose_stage(servers, 2) == 0
    # a claim within the cap counts in full: a fast honest server is not mistaken for a liar
    servers = {0: [rec(0, 10.0), rec(0, 35.0, peer="fast")], 1: [rec(1, 20.0), rec(1, 20.0, peer="q")]}
    assert choose_stage(servers, 2) == 1


def host(peer, experts, throughput, state="ONLINE"):
    return ExpertHostRecord(peer_id=peer, experts=experts, state=state, throughput=throughput)


def test_a_joining_expert_server_takes_the_experts_served_least_by_throughput():
    # a host's throughput is shared among the experts it hosts: 0 and 1 get 30 each from "a", 2 gets 20 from "b"
    # and 3 gets 25 from "c": by count every expert has one host, by throughput 2 and 3 are served least
    hosts = [host("a", [0, 1], 60.0), host("b", [2], 20.0), host("c", [3], 25.0),
             host("gone", [2, 3], 500.0, "OFFLINE")]
    assert choose_experts(hosts, 4, 2) == [2, 3]
    assert choose_experts(hosts, 4, 1) == [2]
    # an expert nobody hosts comes first, then one whose only host is JOINING (its throughput not measured yet: 0,
    # as a stage's joiner), its host counted in the tie
    hosts.append(host("new", [4], 0.0, "JOINING"))
    assert choose_experts(hosts, 6, 1) == [5]
    assert choose_experts(hosts, 6, 2) == [4, 5]


def test_a_stranger_claiming_a_huge_throughput_for_its_experts_weighs_as_one_fast_host():
    hosts = [host("liar", [0], 1e6), *(host(f"h{e}", [e], 10.0) for e in range(1, 4)), host("h0", [0], 10.0)]
    # expert 0 counts 10 + 4 x 10 (the lower median claim), not a million: still served most, but by its cap
    assert choose_experts(hosts, 4, 3) == [1, 2, 3]
    hosts += [host(f"m{e}", [e], 40.0) for e in (1, 2, 3)] + [host(f"n{e}", [e], 5.0) for e in (1, 2, 3)]
    assert choose_experts(hosts, 4, 1) == [0]  # the others 55 each, within the cap, against expert 0's 50


def test_ties_between_experts_go_at_random_so_joiners_spread():
    chosen = {tuple(choose_experts([], 8, 2, random.Random(seed))) for seed in range(20)}
    assert len(chosen) > 5  # an empty run: every pair as likely
    assert all(len(set(c)) == 2 and all(0 <= e < 8 for e in c) for c in chosen)
