"""A stream handler that has answered reads its caller's stream to the end before it is closed
(swarm.hivemind_internals.read_to_end_before_close), so the caller gets every reply.

Without it (measured 2026-12-06, hivemind 1.1.12's p2pd on loopback): a handler that reads one request,
answers 1 MB and returns, while its caller sends three more small messages, lost the reply 16 times in
100 (BrokenPipeError, ConnectionResetError on the caller's side); with the caller sending nothing after
its request but the end of stream, 1 in 100. Here 40 calls: without the fix all 40 come whole about one
time in a thousand.
"""

from __future__ import annotations

import asyncio

import pytest
from hivemind.proto import averaging_pb2

from swarm.hivemind_internals import read_to_end_before_close
from tests.integration.p2p_pair import run_held, server_and_client

pytestmark = pytest.mark.timeout(120)

CALLS = 40
REPLY = 1_000_000
EXTRA = 3  # messages the caller sends after the one the handler reads


def test_every_reply_arrives_when_the_caller_sends_after_the_handler_is_done():
    read_to_end_before_close()
    read_to_end_before_close()  # (once is enough: not wrapped twice)

    async def main() -> tuple[int, list[str]]:
        async with server_and_client() as (server, client):
            async def answer_the_first(stream, _context):
                await stream.__anext__()
                reply = averaging_pb2.AveragingData(code=averaging_pb2.ACCEPTED)
                reply.tensor_part.buffer = b"r" * REPLY
                yield reply

            await server.add_protobuf_handler("first", answer_the_first, averaging_pb2.AveragingData,
                                              stream_input=True, stream_output=True)
            whole, errors = 0, []
            for _ in range(CALLS):
                async def requests():
                    for _ in range(1 + EXTRA):
                        message = averaging_pb2.AveragingData()
                        message.tensor_part.buffer = b"q" * 1000
                        yield message
                        await asyncio.sleep(0.001)

                received = 0
                try:
                    async for reply in await client.iterate_protobuf_handler(server.peer_id, "first", requests(),
                                                                             averaging_pb2.AveragingData):
                        received += len(reply.tensor_part.buffer)
                except Exception as e:  # noqa: BLE001 - what the caller saw is the finding
                    errors.append(type(e).__name__)
                whole += received == REPLY
            return whole, errors

    whole, errors = run_held(main)
    assert (whole, errors) == (CALLS, []), f"{whole} of {CALLS} replies whole; the caller saw {errors}"
