"""The trainer's in-flight window: grows while round trips leave the stages room, shrinks when they queue."""

from __future__ import annotations

import asyncio

import pytest

from swarm.routing.inflight import GROW_BELOW, SHRINK_ABOVE, InFlightWindow

pytestmark = pytest.mark.timeout(30)


def feed(window: InFlightWindow, trip_of_limit, rounds: int) -> list[int]:
    """Complete `rounds` rounds (2 x limit trips each) whose trip time depends on the limit; the limits seen."""
    seen = []
    for _ in range(rounds):
        for _ in range(2 * window.limit):
            window.record(trip_of_limit(window.limit))
        seen.append(window.limit)
    return seen


def test_long_round_trips_with_idle_stages_grow_the_window_to_its_cap():
    window = InFlightWindow(floor=2, cap=8)
    # a 300 ms network round trip, 5 ms of compute a micro-batch: trips stay flat up to 60 in flight
    assert feed(window, lambda n: 0.3 + 0.005 * n, 10) == [3, 4, 5, 6, 7, 8, 8, 8, 8, 8]


def test_compute_bound_trips_stop_the_growth_where_micro_batches_start_to_queue():
    window = InFlightWindow(floor=1, cap=16)
    # all compute, one stage the bottleneck at 10 ms a micro-batch: beyond 3 in flight the trips lengthen
    limits = feed(window, lambda n: 0.03 + 0.01 * max(0, n - 3), 30)
    assert max(limits) <= 7 and limits[-1] >= 3
    assert 0.03 + 0.01 * max(0, limits[-1] - 3) <= SHRINK_ABOVE * 0.03


def test_queueing_shrinks_the_window_but_never_below_its_floor():
    window = InFlightWindow(floor=2, cap=8)
    feed(window, lambda n: 0.3, 6)
    assert window.limit == 8
    assert feed(window, lambda n: 0.3 * SHRINK_ABOVE * 1.5, 10)[-1] == 2  # a route got slower: trips queue


def test_a_fixed_window_never_moves_and_bad_bounds_are_refused():
    window = InFlightWindow(3, 3, adaptive=False)
    feed(window, lambda n: 1.0, 5)
    assert window.limit == 3 and window.base is None
    for floor, cap in ((0, 4), (5, 4)):
        with pytest.raises(ValueError):
            InFlightWindow(floor, cap)
    assert GROW_BELOW < SHRINK_ABOVE


def test_no_more_than_the_limit_travel_at_once():
    async def run() -> int:
        window = InFlightWindow(2, 2, adaptive=False)
        most, now = 0, 0

        async def worker() -> None:
            nonlocal most, now
            for _ in range(5):
                await window.acquire()
                now += 1
                most = max(most, now)
                await asyncio.sleep(0)  # yield while holding a slot: the others try to take one
                now -= 1
                await window.release(0.001)

        await asyncio.gather(*(worker() for _ in range(6)))
        return most

    assert asyncio.run(run()) == 2
