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


def test_at_its_cap_a_latency_bound_window_splits_its_micro_batches_and_joins_them_when_trips_queue():
    window = InFlightWindow(floor=2, cap=8, max_split=2)
    # a 300 ms round trip and little compute: the window reaches its cap, then splits (once: max_split)
    limits = feed(window, lambda n: 0.3 + 0.005 * n, 12)
    assert limits[-1] == 8 and window.split == 2
    # a piece's trips are measured anew: the whole micro-batches' shortest no longer counts
    assert window.base == 0.3 + 0.005 * 8
    feed(window, lambda n: 0.3, 4)
    assert window.split == 2  # never beyond max_split
    # trips queue (compute, not latency, bounds it now): the window shrinks to its floor and joins the pieces
    assert feed(window, lambda n: 0.3 * SHRINK_ABOVE * 1.5, 6) == [7, 6, 5, 4, 3, 2]
    assert window.split == 1 and window.base is None  # (whole micro-batches' trips are measured anew)


def test_a_window_that_may_not_split_stays_whole_and_bad_splits_are_refused():
    window = InFlightWindow(floor=2, cap=8)
    feed(window, lambda n: 0.3, 12)
    assert window.limit == 8 and window.split == 1
    for split in (0, 3):
        with pytest.raises(ValueError):
            InFlightWindow(2, 8, max_split=split)


def test_micro_batches_split_only_where_their_hidden_states_exceed_a_stream_s_first_window():
    from swarm.config import MoEConfig, RunConfig
    from swarm.trainer import STREAM_WINDOW, max_split

    config = RunConfig.load("configs/tiny.yaml")
    config.optimizer.micro_batch_size = 8  # 8 x 64 x 128 float32: 256 KiB, over the window with its headers
    assert config.model.seq_len * config.model.d_model * 4 * 8 >= STREAM_WINDOW
    assert max_split(config) == 2
    config.stages.wire_dtype = "bfloat16"  # half the bytes: within it
    assert max_split(config) == 1
    config.stages.wire_dtype, config.optimizer.micro_batch_size = "float32", 1  # never below a sample
    assert max_split(config) == 1
    config.optimizer.micro_batch_size, config.model.moe = 8, MoEConfig(every=2, num_experts=4)
    assert max_split(config) == 1  # an expert's capacity is per request: pieces would route differently
