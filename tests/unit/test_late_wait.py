"""A backward waits for its stage's round when averaging.max_late_share is reached, but never for long."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter

from peer.server import StageRequestHandler

pytestmark = pytest.mark.timeout(30)


class FakeAverager:
    def __init__(self, throttled_for: float | None):
        self.until = None if throttled_for is None else time.perf_counter() + throttled_for

    @property
    def throttled(self) -> bool:
        return self.until is None or time.perf_counter() < self.until


def handler(averager: FakeAverager, timeout_floor: float) -> tuple[StageRequestHandler, CollectorRegistry]:
    registry = CollectorRegistry()
    server = SimpleNamespace(averager=averager, config=SimpleNamespace(network=SimpleNamespace(
        timeout_floor=timeout_floor)), metrics=SimpleNamespace(late_wait=Counter("waited_seconds", "",
                                                                                  registry=registry)))
    return StageRequestHandler(server), registry


def waited(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("waited_seconds_total") or 0.0


def timed_wait(h: StageRequestHandler) -> float:
    started = time.perf_counter()
    asyncio.run(h._wait_for_round())
    return time.perf_counter() - started


def test_a_backward_waits_until_the_round_ends():
    h, registry = handler(FakeAverager(throttled_for=0.3), timeout_floor=5.0)
    assert 0.25 < timed_wait(h) < 2.0
    assert waited(registry) > 0.25


def test_a_round_that_does_not_end_holds_a_backward_at_most_half_the_shortest_call_timeout():
    h, _ = handler(FakeAverager(throttled_for=None), timeout_floor=0.4)
    assert 0.15 < timed_wait(h) < 1.5


def test_no_wait_without_a_limit_reached():
    h, registry = handler(FakeAverager(throttled_for=0.0), timeout_floor=5.0)
    timed_wait(h)
    assert waited(registry) == 0
