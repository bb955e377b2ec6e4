"""A new server takes the stage with the least announced throughput."""

import pytest

from swarm.dht import ServerRecord
from swarm.serving.placement import choose_stage

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
