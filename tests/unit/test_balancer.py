"""StageBalancer: work in proportion to speed, prompt trials of newcomers, bans with backoff."""

from collections import Counter

import pytest

from swarm.routing.balancer import StageBalancer

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def simulate(balancer, speeds, tasks, size=8):
    counts = Counter()
    for _ in range(tasks):
        peer = balancer.choose(size)
        counts[peer] += 1
        balancer.report_success(peer, size, size * speeds[peer])
    return counts


def test_work_goes_in_proportion_to_speed():
    b = StageBalancer(clock=FakeClock())
    b.update_servers(["fast", "slow"])
    counts = simulate(b, {"fast": 0.01, "slow": 0.1}, 1100)
    assert 9 <= counts["fast"] / counts["slow"] <= 11


def test_newcomer_is_tried_promptly_and_enters_at_the_minimum():
    b = StageBalancer(clock=FakeClock())
    b.update_servers(["a"])
    simulate(b, {"a": 0.01}, 50)
    b.update_servers(["a", "new"])
    assert b.servers["new"].load == pytest.approx(b.servers["a"].load)
    assert "new" in {b.choose(8) for _ in range(2)}


def test_failures_ban_with_exponential_backoff_reset_on_success():
    clock = FakeClock()
    b = StageBalancer(ban_base=15, ban_max=60, clock=clock)
    b.update_servers(["a", "b"])
    assert [b.report_failure("a") for _ in range(4)] == [15, 30, 60, 60]
    assert {b.choose(1) for _ in range(5)} == {"b"}
    clock.now += 61
    assert "a" in b.available()
    b.report_success("a", 1, 0.01)
    assert b.report_failure("a") == 15


def test_returning_server_does_not_get_a_flood():
    clock = FakeClock()
    b = StageBalancer(clock=clock)
    b.update_servers(["a", "b"])
    b.report_failure("a")
    simulate(b, {"a": 0.01, "b": 0.01}, 100)
    clock.now += 16
    counts = simulate(b, {"a": 0.01, "b": 0.01}, 20)
    assert counts["a"] <= 11


def test_no_server_and_exclusions():
    b = StageBalancer(clock=FakeClock())
    assert b.choose(1) is None
    b.update_servers(["a"])
    assert b.choose(1, exclude=["a"]) is None
    b.update_servers([])
    assert b.servers == {}


def test_timeouts_adapt_to_measured_speed_within_floor_and_ceiling():
    b = StageBalancer(clock=FakeClock())
    b.update_servers(["a", "b"])
    assert b.timeout("a", 8, multiplier=5, floor=1, ceiling=60) == 60  # never timed: the ceiling
    b.report_success("a", 8, 8 * 0.5)
    assert b.timeout("a", 8, multiplier=5, floor=1, ceiling=60) == pytest.approx(20.0)
    b.report_success("b", 8, 8 * 0.001)
    assert b.timeout("b", 8, multiplier=5, floor=1, ceiling=60) == 1
    b.report_success("a", 8, 8 * 100.0)
    assert b.timeout("a", 8, multiplier=5, floor=1, ceiling=60) == 60
