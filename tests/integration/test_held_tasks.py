"""A stream call from a task nobody keeps, as hivemind's averaging process starts each round, survives the
garbage collector once the loop holds its tasks (swarm.tasks).

Without it (reproduced on 2026-12-06 with hivemind 1.1.12, uvloop 0.23, Python 3.11): while the handler
took its time, a collection destroyed the calling task ("Task was destroyed but it is pending!"), the
handler got one message of four and the caller none of its replies. In training swarms that was the
"stream ended early" failure of averaging rounds (a member waiting out next_chunk_timeout, a stage
stalled for 20 s while the other kept stepping).
"""

from __future__ import annotations

import asyncio
import gc

import pytest
from hivemind.proto import averaging_pb2

from swarm.tasks import keep_tasks_alive
from tests.integration.p2p_pair import run_held, server_and_client

pytestmark = pytest.mark.timeout(60)

MESSAGES = 4
PART = 600 * 1024  # larger than a stream reader's buffer limit


def test_a_detached_stream_call_finishes_under_collection():
    keep_tasks_alive()

    async def main() -> tuple[list[int], int]:
        async with server_and_client() as (server, client):
            received: list[int] = []

            async def slow_handler(stream, _context):
                async for message in stream:
                    received.append(len(message.tensor_part.buffer))
                    await asyncio.sleep(0.3)  # the caller waits on its stream meanwhile, and only on it
                    yield averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)

            await server.add_protobuf_handler("slow", slow_handler, averaging_pb2.AveragingData,
                                              stream_input=True, stream_output=True)
            replies = [0]
            finished = asyncio.Event()

            async def requests():
                for _ in range(MESSAGES):
                    message = averaging_pb2.AveragingData()
                    message.tensor_part.buffer = b"x" * PART
                    yield message

            async def call():
                try:
                    async for _ in await client.iterate_protobuf_handler(server.peer_id, "slow", requests(),
                                                                         averaging_pb2.AveragingData):
                        replies[0] += 1
                finally:
                    finished.set()

            asyncio.get_running_loop().create_task(call())  # kept by nobody, as hivemind's rounds are
            for _ in range(40):
                gc.collect()
                if finished.is_set():
                    break
                await asyncio.sleep(0.05)
            await asyncio.wait_for(finished.wait(), timeout=20)
            return received, replies[0]

    received, replies = run_held(main)
    assert received == [PART] * MESSAGES
    assert replies == MESSAGES
