"""The work a trainer's balancer says each server answered lately (StageBalancer.served), which trainers
publish and stage servers weigh their stage-mates by when deciding whether to leave."""

from __future__ import annotations

import pytest

from swarm.protocol import BACKWARD, FORWARD
from swarm.routing.balancer import BACKWARD_TO_FORWARD, SERVED_WINDOW, StageBalancer

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def answer(b: StageBalancer, clock: FakeClock, peer: str, kind: str = FORWARD, size: int = 8,
           vouch: bool = True) -> None:
    ticket = b.charge(peer, size, kind)
    clock.now += 0.1
    b.report_success(ticket, vouch=vouch)


def test_served_counts_answered_work_a_backward_as_two_forwards_within_the_window():
    clock = FakeClock()
    b = StageBalancer(clock=clock)
    b.update_servers(["a", "b", "c"])
    assert b.served() == {}
    answer(b, clock, "a")
    answer(b, clock, "a", BACKWARD)
    answer(b, clock, "b", size=4)
    failed = b.charge("c", 8, FORWARD)
    b.report_failure(failed)  # a failure serves nothing
    assert b.served() == {"a": 8 + 8 * BACKWARD_TO_FORWARD, "b": 4}
    clock.now += SERVED_WINDOW - 0.15  # a's forward (answered first) leaves the window, the rest stays
    assert b.served() == {"a": 8 * BACKWARD_TO_FORWARD, "b": 4}
    clock.now += 1.0
    assert b.served() == {}


def test_a_witness_answer_and_a_caught_servers_past_work_do_not_count():
    clock = FakeClock()
    b = StageBalancer(clock=clock)
    b.update_servers(["a", "liar"])
    answer(b, clock, "a", vouch=False)  # a witness's answer: nothing checked it, and it was not used
    assert b.served() == {}
    answer(b, clock, "liar")
    answer(b, clock, "liar")
    sent_before = b.charge("liar", 8, FORWARD)
    b.ban("liar", 60.0)  # caught answering wrongly: what it answered before counts for nothing
    b.report_success(sent_before)  # nor does an answer to a call sent before it was caught
    assert b.served() == {}
