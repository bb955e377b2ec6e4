"""Stage RPCs between two real hivemind P2P peers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter

from swarm.protocol import (
    BAD_REQUEST,
    BUSY,
    FORWARD,
    INTERNAL,
    WRONG_STAGE,
    RemoteStageError,
    RequestRejected,
    StageClient,
    StageHandler,
    StageReply,
    StageRequest,
    StageService,
    StageUnavailable,
    WireLimits,
    receive_reply,
    register,
    stage_namespace,
)
from swarm.protocol.framing import encode_metadata
from tests.integration.p2p_pair import server_and_client as two_peers

pytestmark = pytest.mark.timeout(120)

SCENARIO_TIMEOUT = 90.0  # one test's whole scenario, peers included
CALL_TIMEOUT = 20.0  # generous for 2 shared CPU cores; the unavailable test uses its own short one


class DoublingStage(StageHandler):
    """Toy stage: output = 2 * input, grad_input = 2 * grad_output; only 2-d inputs."""

    def __init__(self, stage: int):
        self.stage, self.calls = stage, 0

    def _check(self, request: StageRequest) -> None:
        if request.stage != self.stage:
            raise RequestRejected(WRONG_STAGE, f"this server hosts stage {self.stage}, not {request.stage}")
        if request.inputs.dim() != 2:
            raise ValueError(f"expected a 2-d input, got shape {tuple(request.inputs.shape)}")
        self.calls += 1

    async def forward(self, request: StageRequest) -> StageReply:
        self._check(request)
        return StageReply([request.inputs * 2], server_step=self.calls)

    async def backward(self, request: StageRequest) -> StageReply:
        self._check(request)
        return StageReply([request.grad_outputs * 2], server_step=self.calls)


class StallingStage(DoublingStage):
    """Never answers a forward; records that the server cancelled it once the caller gave up."""

    def __init__(self, stage: int):
        super().__init__(stage)
        self.started, self.cancelled = asyncio.Event(), asyncio.Event()

    async def forward(self, request: StageRequest) -> StageReply:
        self.started.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
        raise AssertionError("unreachable")


class GatedStage(DoublingStage):
    """Holds every forward until `release` is set."""

    def __init__(self, stage: int):
        super().__init__(stage)
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def forward(self, request: StageRequest) -> StageReply:
        self.entered.set()
        await self.release.wait()
        return await super().forward(request)


def run(scenario) -> None:
    asyncio.run(asyncio.wait_for(scenario(), SCENARIO_TIMEOUT))


def test_forward_and_backward_on_two_stages_of_one_peer():
    async def scenario():
        async with two_peers() as (server, client):
            for stage in (0, 1):
                await register(server, DoublingStage(stage), stage_namespace("run", stage))
            stage1 = StageClient(client, server.peer_id, stage_namespace("run", 1), timeout=CALL_TIMEOUT)
            x = torch.randn(4, 8)
            reply = await stage1.forward(1, "mb-1", x)
            assert torch.equal(reply.tensors[0], x * 2) and reply.server_step == 1
            grad = torch.randn(4, 8)
            reply = await stage1.backward(1, "mb-1", x, grad_outputs=grad, wire_dtype="bfloat16")
            assert torch.allclose(reply.tensors[0], grad * 2, rtol=2**-7)

            stage0 = StageClient(client, server.peer_id, stage_namespace("run", 0), timeout=CALL_TIMEOUT)
            with pytest.raises(RemoteStageError) as error:
                await stage0.forward(1, "mb-2", x)  # stage 1's request sent to stage 0's namespace
            assert error.value.code == WRONG_STAGE and "hosts stage 0" in error.value.message

    run(scenario)


def test_tensors_over_4_mib_stream_both_ways():
    async def scenario():
        async with two_peers() as (server, client):
            await register(server, DoublingStage(0), stage_namespace("run", 0))
            stub = StageClient(client, server.peer_id, stage_namespace("run", 0), timeout=CALL_TIMEOUT)
            x = torch.randn(1000, 3000)  # 12 MB as float32, three times hivemind's message cap
            reply = await stub.forward(0, "big", x)
            assert torch.equal(reply.tensors[0], x * 2)

    run(scenario)


def test_handler_failure_and_stall_are_reported_and_the_server_keeps_serving():
    async def scenario():
        async with two_peers() as (server, client):
            await register(server, DoublingStage(0), stage_namespace("run", 0))
            stub = StageClient(client, server.peer_id, stage_namespace("run", 0), timeout=CALL_TIMEOUT)
            with pytest.raises(RemoteStageError) as error:
                await stub.forward(0, "bad-shape", torch.ones(2, 3, 4))
            assert error.value.code == INTERNAL and "expected a 2-d input" in error.value.message
            reply = await stub.forward(0, "good", torch.ones(2, 3))
            assert torch.equal(reply.tensors[0], torch.full((2, 3), 2.0))

            stalling = StallingStage(0)
            await register(server, stalling, "stalling")
            stalled = StageClient(client, server.peer_id, "stalling", timeout=CALL_TIMEOUT)
            with pytest.raises(StageUnavailable, match="did not answer within 0.5s"):
                await stalled.forward(0, "slow", torch.ones(2, 3), timeout=0.5)
            assert stalling.started.is_set()
            # the caller's disconnect reaches the server, which stops working on the request
            await asyncio.wait_for(stalling.cancelled.wait(), CALL_TIMEOUT)

    run(scenario)


def test_garbage_and_oversized_streams_get_error_replies():
    async def scenario():
        async with two_peers() as (server, client):
            await register(server, DoublingStage(0), "open")
            await register(server, DoublingStage(0), "small", limits=WireLimits(max_message_bytes=2**20))

            # a hand-made stream whose only tensor is truncated
            meta = dict(kind=FORWARD, stage=0, request_id="garbage")
            truncated = runtime_pb2.Tensor(buffer=b"\0" * 10, size=[100], dtype="float32")
            frames = [
                runtime_pb2.ExpertRequest(metadata=encode_metadata(meta)),
                runtime_pb2.ExpertRequest(tensors=[truncated]),
            ]
            responses = await StageService.get_stub(client, server.peer_id, namespace="open").rpc_forward(
                iter_as_aiter(frames)
            )
            try:
                with pytest.raises(RemoteStageError) as error:
                    await asyncio.wait_for(receive_reply(responses), CALL_TIMEOUT)
            finally:
                await responses.aclose()
            assert error.value.code == BAD_REQUEST and "needs 400 bytes, got 10" in error.value.message

            # 4 MiB to a server that takes 1 MiB: refused from the header, while the client still sends
            small = StageClient(client, server.peer_id, "small", timeout=CALL_TIMEOUT)
            with pytest.raises(RemoteStageError, match="message limit") as error:
                await small.forward(0, "huge", torch.ones(1024, 1024))
            assert error.value.code == BAD_REQUEST

            for namespace in ("open", "small"):
                stub = StageClient(client, server.peer_id, namespace, timeout=CALL_TIMEOUT)
                assert torch.equal(
                    (await stub.forward(0, "after", torch.ones(2, 2))).tensors[0], torch.full((2, 2), 2.0)
                )

    run(scenario)


def test_gone_or_unregistered_server_is_unavailable_within_the_timeout():
    timeout = 5.0

    async def scenario():
        async with two_peers() as (server, client):
            service = await register(server, DoublingStage(0), "stage")
            stub = StageClient(client, server.peer_id, "stage", timeout=timeout)
            await stub.forward(0, "alive", torch.ones(1, 1))

            await service.unregister(server)
            with pytest.raises(StageUnavailable):
                await stub.forward(0, "unregistered", torch.ones(1, 1))

            await server.shutdown()
            started = time.monotonic()
            with pytest.raises(StageUnavailable):
                await stub.forward(0, "gone", torch.ones(1, 1))
            assert time.monotonic() - started < timeout + 2.0

    run(scenario)


def test_requests_over_the_concurrency_cap_are_refused_at_once_as_busy():
    async def scenario():
        async with two_peers() as (server, client):
            gated = GatedStage(0)
            service = await register(server, gated, "capped", max_concurrent=1)
            stub = StageClient(client, server.peer_id, "capped", timeout=CALL_TIMEOUT)
            first = asyncio.ensure_future(stub.forward(0, "first", torch.ones(2, 2)))
            await asyncio.wait_for(gated.entered.wait(), CALL_TIMEOUT)
            with pytest.raises(RemoteStageError) as error:  # answered while the first is still held
                await stub.forward(0, "second", torch.ones(2, 2))
            assert error.value.code == BUSY and "1 requests, its limit (max_concurrent 1)" in error.value.message
            gated.release.set()
            assert torch.equal((await first).tensors[0], torch.full((2, 2), 2.0))
            assert service.active == 0
            assert torch.equal((await stub.forward(0, "third", torch.ones(2, 2))).tensors[0], torch.full((2, 2), 2.0))

    run(scenario)
