"""What a stage server takes in is bounded by its run: wire limits, batch cap, kept backward results."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.utils.asyncio import iter_as_aiter

from swarm.backend import BackwardResult
from swarm.config import ModelConfig, OptimizerConfig, RunConfig
from swarm.protocol import (
    BACKWARD,
    DEFAULT_LIMITS,
    FORWARD,
    ProtocolError,
    RequestLimits,
    StageRequest,
    receive_request,
    request_frames,
    stage_wire_limits,
)
from swarm.serving import ServerOptions
from swarm.serving.backwards import RecentBackwards, result_bytes

pytestmark = pytest.mark.timeout(30)

MODEL = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=32)
CAP = 4
T, D = MODEL.seq_len, MODEL.d_model


def received(request: StageRequest, limits) -> StageRequest:
    """`request` sent as its sender would, read back under `limits` (the sender is held to no limit)."""
    frames = list(request_frames(request))
    return asyncio.run(receive_request(iter_as_aiter(frames), limits))


def test_stage_wire_limits_follow_the_model_and_the_batch_cap():
    limits = stage_wire_limits(MODEL, CAP)
    tensor_bytes = CAP * T * D * 4  # hidden states in float32
    assert limits.max_message_bytes == 2 * tensor_bytes + DEFAULT_LIMITS.max_metadata_bytes
    assert limits.max_tensor_elements == CAP * T * D
    assert limits.max_tensors == 2
    assert limits.max_message_bytes < DEFAULT_LIMITS.max_message_bytes / 1000  # 80 KiB, not 256 MiB
    assert stage_wire_limits(MODEL, 2 * CAP).max_message_bytes == 4 * tensor_bytes + DEFAULT_LIMITS.max_metadata_bytes
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        stage_wire_limits(MODEL, 0)


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_the_largest_honest_requests_fit(wire_dtype):
    limits = stage_wire_limits(MODEL, CAP)
    hidden, grad = torch.randn(CAP, T, D), torch.randn(CAP, T, D)
    targets = torch.full((CAP, T), 2**40)  # out of int32 range: travels as int64, the widest encoding
    last = received(StageRequest(BACKWARD, 1, "r" * 256, hidden, targets=targets, wire_dtype=wire_dtype), limits)
    assert torch.equal(last.targets, targets)
    first = received(StageRequest(BACKWARD, 0, "r", targets, grad_outputs=grad, wire_dtype=wire_dtype), limits)
    assert first.grad_outputs.shape == (CAP, T, D)


def test_token_ids_fit_even_when_hidden_states_are_narrower():
    narrow = ModelConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=1, d_model=1)
    ids = torch.full((CAP, T), 2**40)
    request = received(StageRequest(FORWARD, 0, "r", ids, targets=ids), stage_wire_limits(narrow, CAP))
    assert torch.equal(request.inputs, ids)


@pytest.mark.parametrize("shape", [(CAP + 1, T, D), (CAP, T + 1, D), (CAP, T, D + 1)])
def test_one_value_more_is_refused_from_the_header(shape):
    with pytest.raises(ProtocolError, match=f"over the limit of {CAP * T * D}"):
        received(StageRequest(FORWARD, 1, "r", torch.randn(shape)), stage_wire_limits(MODEL, CAP))


def test_request_limits_default_to_the_runs_micro_batch_and_servers_to_twice_the_queue():
    config = RunConfig(model=MODEL, optimizer=OptimizerConfig(batch_size=8, micro_batch_size=4)).validate()
    assert RequestLimits.of(config).samples == 4
    assert RequestLimits.of(config, max_batch=2).samples == 2
    assert RequestLimits.of(config).stage == stage_wire_limits(MODEL, 4)  # what callers and servers both use
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        _ = RequestLimits.of(config).expert
    assert ServerOptions(max_queue=10).concurrency_cap() == 20
    assert ServerOptions(max_queue=10, max_concurrent_requests=3).concurrency_cap() == 3


def result(nbytes: int) -> BackwardResult:
    return BackwardResult(grad_input=torch.zeros(nbytes, dtype=torch.uint8), loss=None, step=0, step_stats=None)


def run_with_futures(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 10))


async def settled() -> None:
    await asyncio.sleep(0)  # done callbacks run on the next turn of the loop


async def done_future(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def test_recent_backwards_are_bounded_in_bytes_oldest_first():
    async def scenario():
        recent = RecentBackwards(max_entries=100, max_bytes=250)
        for i in range(3):
            recent.add(("peer", f"r{i}"), await done_future(result(100)))
            await settled()
        assert recent.get(("peer", "r0")) is None and recent.get(("peer", "r2")) is not None
        assert (len(recent), recent.bytes_held) == (2, 200)

        recent.add(("peer", "huge"), await done_future(result(1000)))
        await settled()
        # the newest is kept, alone, even over the bound: its retry must still find it
        assert (len(recent), recent.bytes_held) == (1, 1000) and recent.get(("peer", "huge")) is not None

    run_with_futures(scenario)


def test_recent_backwards_count_running_tasks_by_entries_and_forget_failed_ones():
    async def scenario():
        recent = RecentBackwards(max_entries=2, max_bytes=10**9)
        loop = asyncio.get_running_loop()
        running, failing = loop.create_future(), loop.create_future()
        recent.add(("a", "1"), running)
        recent.add(("a", "2"), failing)
        assert recent.bytes_held == 0  # no result yet
        failing.set_exception(ValueError("bad input"))
        await settled()
        assert recent.get(("a", "2")) is None  # nothing was accumulated: a retry must run again
        running.set_result(result(64))
        await settled()
        assert recent.bytes_held == 64
        for i in range(3):
            recent.add(("b", str(i)), await done_future(result(0)))
        await settled()
        assert len(recent) == 2 and recent.get(("a", "1")) is None and recent.bytes_held == 0

    run_with_futures(scenario)


def test_an_evicted_task_that_finishes_later_is_not_counted():
    async def scenario():
        recent = RecentBackwards(max_entries=1, max_bytes=10**9)
        slow = asyncio.get_running_loop().create_future()
        recent.add(("a", "slow"), slow)
        recent.add(("a", "next"), await done_future(result(8)))
        await settled()
        slow.set_result(result(1000))
        await settled()
        assert (len(recent), recent.bytes_held) == (1, 8)

    run_with_futures(scenario)


def test_result_bytes_count_the_gradient_held():
    assert result_bytes(result(123)) == 123
    assert result_bytes(BackwardResult(grad_input=None, loss=1.0, step=0, step_stats=None)) == 0
