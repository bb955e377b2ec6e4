"""A server that moves announces itself JOINING where it goes, with its throughput, before it leaves (peer/cli.py
serve_until, StageServer.announce_move): other servers' plans count it there and do not follow it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from peer.cli import serve_until
from swarm.dht import PeerMetricsRecord, ServedWork, ServerState
from swarm.serving.rebalance import Move
from swarm.serving.stage import StageServer

pytestmark = pytest.mark.timeout(30)


class FakeServer:
    def __init__(self, announced: bool = True):
        self.calls: list = []
        self.announced = announced
        self.config = SimpleNamespace(stages=SimpleNamespace(num_stages=3))
        self.peer_id, self.stage = "me", 1
        trainer = PeerMetricsRecord(peer_id="t", role="trainer", step=0, samples_per_second=1.0, samples=1, time=0.0,
                                    served=[ServedWork(peer_id="me", stage=1, work=5.0),
                                            ServedWork(peer_id="other", stage=0, work=9.0)])
        self.records = SimpleNamespace(lookup_all_servers=lambda n: {}, lookup_metrics=lambda: [trainer])

    def start(self) -> None:
        self.calls.append("start")

    throughput = 30.0  # as measured when it started

    def announce_move(self, stage: int) -> bool:
        self.calls.append(("announce_move", stage))
        return self.announced

    def measure_now(self) -> float:  # timed again as it leaves, on a busier machine
        self.calls.append("measure_now")
        return 10.0

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class MoveAtOnce:
    """A rebalancer whose first check plans a move to stage 0 and whose last check confirms it."""

    def next_wait(self) -> float:
        return 0.0

    def settle_wait(self) -> float:
        return 0.0

    def __init__(self):
        self.served = []  # what each check was given of the trainers' served work
        self.view = {}  # what the last check's plan was made of: nothing, here

    def check(self, servers, num_stages, me, served):
        self.served.append(served)
        return Move(0, "bottleneck", 1.0, 2.0)

    def settle(self, move, servers, num_stages, me, served) -> bool:
        self.served.append(served)
        return True


@pytest.mark.parametrize("announced", [True, False])
def test_a_move_is_announced_where_it_goes_before_the_server_leaves(announced):
    server = FakeServer(announced)  # a failed announcement does not stop the move
    rebalancer = MoveAtOnce()
    move = serve_until(server, threading.Event(), rebalancer)
    assert move.stage == 0
    assert rebalancer.served == [[{"me": 5.0}]] * 2  # each check read the trainers' work on its own stage (1)
    # the load of the moment makes it time itself 3x slower: the next stage's measure is scaled back by that
    assert move.scale == 3.0
    assert server.calls == ["start", ("announce_move", 0), "measure_now", "shutdown"]


def test_the_announcement_is_a_joining_record_with_the_throughput_measured_here():
    stored = []
    me = SimpleNamespace(peer_id="me", throughput=12.5, reach="direct", options=SimpleNamespace(metrics_addr=None),
                         config=SimpleNamespace(network=SimpleNamespace(record_ttl=30.0)),
                         _store=lambda record, ttl: stored.append((record, ttl)) or True)
    assert StageServer.announce_move(me, 2)
    (record, ttl), = stored
    assert (record.peer_id, record.stage, record.state, record.throughput, ttl) == (
        "me", 2, ServerState.JOINING, 12.5, 30.0)
