"""Request slots are shared per caller, and a silent or stalled stream gives its slot back within seconds."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import P2PContext
from hivemind.utils.asyncio import iter_as_aiter

from swarm.protocol import (
    BAD_REQUEST,
    BUSY,
    FORWARD,
    CallerSlots,
    RemoteStageError,
    StageHandler,
    StageReply,
    StageRequest,
    StageService,
    receive_reply,
    request_frames,
)

pytestmark = pytest.mark.timeout(30)

SCENARIO_TIMEOUT = 20.0


def test_one_caller_holds_at_most_its_share():
    slots = CallerSlots(total=8, per_caller=3, newcomers=8)
    assert [slots.try_take("a") for _ in range(3)] == [None] * 3
    refusal = slots.try_take("a")
    assert refusal is not None and "already has 3 requests in" in refusal and "per caller 3" in refusal
    assert slots.try_take("b") is None and (slots.active, slots.held("a"), slots.held("b")) == (4, 3, 1)
    slots.give_back("a")
    assert slots.try_take("a") is None  # a slot given back is the caller's to take again
    with pytest.raises(RuntimeError):
        slots.give_back("nobody")


def test_defaults_are_a_quarter_per_caller_and_half_for_newcomers():
    slots = CallerSlots(128)
    assert (slots.per_caller, slots.newcomers) == (32, 64)
    assert (CallerSlots(1).per_caller, CallerSlots(1).newcomers) == (1, 1)  # one slot is still usable
    with pytest.raises(ValueError):
        CallerSlots(4, per_caller=5)


def test_a_crowd_of_new_callers_leaves_the_rest_to_callers_served_before():
    slots = CallerSlots(total=8, per_caller=2, newcomers=4)
    slots.vouch("trainer")
    taken = [slots.try_take(f"sybil-{i}") for i in range(100)]  # a hundred fresh peer ids, one slot each
    assert taken.count(None) == 4 and slots.newcomers_active == 4
    assert "newcomers 4 of max_concurrent 8" in taken[-1]
    assert slots.try_take("trainer") is None and slots.try_take("trainer") is None  # the known caller gets in
    assert slots.try_take("another-new-one") is not None
    slots.give_back("sybil-0")
    assert slots.try_take("another-new-one") is None  # a newcomer's slot came back: one newcomer more


def test_a_caller_vouched_while_holding_newcomer_slots_frees_them_as_a_newcomer():
    slots = CallerSlots(total=4, per_caller=4, newcomers=2)
    assert slots.try_take("x") is None
    slots.vouch("x")  # its first request was answered while it still held the slot
    assert slots.try_take("x") is None and slots.newcomers_active == 1
    slots.give_back("x")
    slots.give_back("x")
    assert (slots.active, slots.newcomers_active) == (0, 0)


def test_known_callers_are_remembered_most_recent_last_and_bounded():
    slots = CallerSlots(total=4, max_known=3)
    for caller in ("a", "b", "c"):
        slots.vouch(caller)
    slots.vouch("a")  # served again: the most recent now
    slots.vouch("d")
    assert [slots.is_known(c) for c in "abcd"] == [True, False, True, True]


def test_wait_take_waits_for_a_slot_and_gives_up_with_the_reason():
    async def scenario():
        slots = CallerSlots(total=2, per_caller=1, newcomers=2)
        assert slots.try_take("a") is None
        started = time.monotonic()
        refusal = await slots.wait_take("a", 0.2)  # its own share is full, and stays so
        assert "per caller 1" in refusal and time.monotonic() - started >= 0.2
        waiting = asyncio.ensure_future(slots.wait_take("a", SCENARIO_TIMEOUT))
        await asyncio.sleep(0)
        assert not waiting.done()
        slots.give_back("a")
        assert await asyncio.wait_for(waiting, SCENARIO_TIMEOUT) is None and slots.held("a") == 1

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT))


class _Echo(StageHandler):
    async def forward(self, request):
        return StageReply([request.inputs])

    backward = forward


def _context(caller: str) -> P2PContext:
    return P2PContext(handle_name="test", local_id=None, remote_id=caller)


async def _call(service: StageService, caller: str, frames) -> StageReply | RemoteStageError:
    responses = [frame async for frame in service.rpc_forward(frames, _context(caller))]
    try:
        return await receive_reply(iter_as_aiter(responses))
    except RemoteStageError as e:
        return e


def _good_frames():
    return iter_as_aiter(list(request_frames(StageRequest(FORWARD, 0, "r", torch.ones(2)))))


async def _silent(after=(), stop: asyncio.Event | None = None):
    """A request stream that sends `after` and then nothing, until `stop` (never, by default)."""
    for frame in after:
        yield frame
    await (stop or asyncio.Event()).wait()


async def _until(condition, timeout: float = SCENARIO_TIMEOUT / 2) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for a condition"
        await asyncio.sleep(0.01)


def test_a_silent_stream_is_refused_after_the_first_byte_deadline_and_gives_its_slot_back():
    async def scenario():
        service = StageService(_Echo(), max_concurrent=1, first_byte_timeout=0.2, receive_timeout=30.0,
                               drain_timeout=0.1)
        started = time.monotonic()
        reply = await _call(service, "staller", _silent())
        assert isinstance(reply, RemoteStageError) and reply.code == BAD_REQUEST
        assert "the first frame of the request did not arrive within 0.2s" in reply.message
        assert time.monotonic() - started < 5.0 and service.active == 0  # not the 30 s receive timeout
        assert isinstance(await _call(service, "honest", _good_frames()), StageReply)

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT))


def test_a_stream_that_stops_after_its_metadata_is_refused_after_the_idle_deadline():
    async def scenario():
        service = StageService(_Echo(), first_byte_timeout=0.2, idle_timeout=0.3, receive_timeout=30.0,
                               drain_timeout=0.1)
        first = list(request_frames(StageRequest(FORWARD, 0, "r", torch.ones(2))))[:1]
        reply = await _call(service, "staller", _silent(first))
        assert isinstance(reply, RemoteStageError) and reply.code == BAD_REQUEST
        assert "a frame after the first of the request did not arrive within 0.3s" in reply.message
        assert service.active == 0

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT))


def test_one_caller_with_many_silent_streams_leaves_slots_to_others():
    """A stranger's silent streams take at most its share; the rest are refused BUSY at once."""
    async def scenario():
        service = StageService(_Echo(), max_concurrent=8, first_byte_timeout=SCENARIO_TIMEOUT, drain_timeout=0.1)
        stop = asyncio.Event()
        stalls = [asyncio.ensure_future(_call(service, "stranger", _silent(stop=stop))) for _ in range(20)]
        await _until(lambda: sum(stall.done() for stall in stalls) == 18)  # answered, then drained 0.1 s
        busy = [stall.result() for stall in stalls if stall.done()]
        assert service.slots.held("stranger") == 2  # a quarter of 8
        assert all(e.code == BUSY and "per caller 2 of max_concurrent 8" in e.message for e in busy)
        for i in range(5):
            assert isinstance(await _call(service, f"honest-{i}", _good_frames()), StageReply)
        stop.set()
        await asyncio.gather(*stalls)
        assert service.active == 0

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT))


def test_a_crowd_of_fresh_peer_ids_cannot_take_the_slots_of_a_caller_served_before():
    async def scenario():
        service = StageService(_Echo(), max_concurrent=8, first_byte_timeout=SCENARIO_TIMEOUT, drain_timeout=0.1)
        assert isinstance(await _call(service, "trainer", _good_frames()), StageReply)  # served once: known
        stop = asyncio.Event()
        stalls = [asyncio.ensure_future(_call(service, f"sybil-{i}", _silent(stop=stop))) for i in range(50)]
        await _until(lambda: sum(stall.done() for stall in stalls) == 46)
        assert service.slots.newcomers_active == 4 and service.active == 4  # half of 8, whatever the keys
        assert isinstance(await _call(service, "trainer", _good_frames()), StageReply)
        refused = await _call(service, "newcomer", _good_frames())
        assert isinstance(refused, RemoteStageError) and refused.code == BUSY and "newcomers 4" in refused.message
        stop.set()
        await asyncio.gather(*stalls)

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT))


def test_a_transfer_lease_is_cut_off_when_the_fetcher_stops_taking_frames():
    """Checkpoint serving: progress (frames taken) keeps a transfer's slot; none for a while cuts it off."""
    from swarm.checkpoint.serving import _CallerSlot, _Lease

    PROGRESS_TIMEOUT = 2.0

    async def scenario():
        slots = CallerSlots(total=2, per_caller=1, newcomers=2)

        async def transfer(frames: int, gap: float) -> None:
            assert slots.try_take("fetcher") is None
            lease = _Lease(_CallerSlot(slots, "fetcher"), 60.0, progress_timeout=PROGRESS_TIMEOUT,
                           task=asyncio.current_task())
            try:
                for _ in range(frames):
                    await asyncio.sleep(gap)
                    lease.progress()
            finally:
                lease.release()

        # (the gaps are the fetcher's scripted pace: a tenth of the deadline, so a loaded loop cannot
        # stretch one past it)
        await asyncio.wait_for(transfer(frames=10, gap=PROGRESS_TIMEOUT / 10), SCENARIO_TIMEOUT)
        assert slots.active == 0
        stalled = asyncio.ensure_future(transfer(frames=1, gap=SCENARIO_TIMEOUT))
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await stalled
        assert time.monotonic() - started < SCENARIO_TIMEOUT / 2 and slots.active == 0

    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT))
