"""The handler's side of swarm/hivemind_internals/streams.py, on frames fed by hand: a caller that says it
closes first gets the handler's marker after the last reply and is waited for; a plain hivemind caller
gets hivemind's behaviour; a finished handler reads its caller's stream to its end; a caller that leaves
stops the handler."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import averaging_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from swarm.hivemind_internals import streams
from swarm.hivemind_internals.streams import CALLER_CLOSES, _Served

pytestmark = pytest.mark.timeout(30)

WAIT = 10.0  # seconds any condition below may take to come true on a loaded machine


class Sink:
    """A StreamWriter stand-in that keeps what is written."""

    def __init__(self):
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        pass


async def frames(*messages) -> bytes:
    sink = Sink()
    for message in messages:
        await P2P.send_protobuf(message, sink)
    return bytes(sink.data)


async def parsed(data: bytes) -> list:
    """What a caller reads from `data`: replies, and ("marker", text) for an RPCError."""
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    out = []
    while True:
        try:
            reply, error = await P2P.receive_protobuf(averaging_pb2.AveragingData, reader)
        except asyncio.IncompleteReadError:
            return out
        out.append(reply.group_id if error is None else ("marker", error.message))


async def until(condition) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.001)


def served(handler, reader: asyncio.StreamReader, sink: Sink) -> _Served:
    return _Served(handler, P2PContext(handle_name="h", local_id=None, remote_id=None), averaging_pb2.AveragingData,
                   5, reader, sink)


def request(name: bytes):
    return averaging_pb2.AveragingData(group_id=name)


async def two_replies(requests, _context):
    async for _ in requests:
        break
    yield request(b"r1")
    yield request(b"r2")


def test_a_caller_that_closes_first_gets_the_marker_after_the_last_reply_and_is_waited_for():
    async def main():
        reader, sink = asyncio.StreamReader(), Sink()
        reader.feed_data(await frames(request(b"q"), RPCError(message=CALLER_CLOSES)))
        task = asyncio.create_task(served(two_replies, reader, sink).run())
        await until(lambda: CALLER_CLOSES.encode() in sink.data)
        assert await parsed(bytes(sink.data)) == [b"r1", b"r2", ("marker", CALLER_CLOSES)]
        for _ in range(50):  # loop turns, not time: everything here is in this process, so an early close
            await asyncio.sleep(0)  # would have happened within them
        assert not task.done(), "the handler closed before its caller did"
        reader.feed_eof()  # the caller closes
        await asyncio.wait_for(task, WAIT)

    asyncio.run(main())


def test_a_plain_hivemind_caller_gets_the_replies_and_the_close_without_a_marker():
    async def main():
        reader, sink = asyncio.StreamReader(), Sink()
        reader.feed_data(await frames(request(b"q"), P2P.END_OF_STREAM))  # the caller never closes
        await asyncio.wait_for(served(two_replies, reader, sink).run(), WAIT)
        assert await parsed(bytes(sink.data)) == [b"r1", b"r2"]

    asyncio.run(main())


def test_a_finished_handler_reads_its_caller_s_stream_to_its_end_before_the_marker():
    async def main():
        reader, sink = asyncio.StreamReader(), Sink()
        reader.feed_data(await frames(request(b"q"), *(request(b"more") for _ in range(20))))
        task = asyncio.create_task(served(two_replies, reader, sink).run())
        await until(lambda: len(sink.data) > 0 and not reader._buffer)  # replies out, the extra requests read
        assert CALLER_CLOSES.encode() not in sink.data  # no marker before the caller's own
        reader.feed_data(await frames(RPCError(message=CALLER_CLOSES)))
        await until(lambda: CALLER_CLOSES.encode() in sink.data)
        reader.feed_eof()
        await asyncio.wait_for(task, WAIT)
        assert await parsed(bytes(sink.data)) == [b"r1", b"r2", ("marker", CALLER_CLOSES)]

    asyncio.run(main())


def test_a_caller_that_leaves_mid_answer_stops_the_handler():
    stopped = []

    async def endless(requests, _context):
        try:
            async for _ in requests:
                yield request(b"r")
            await asyncio.Event().wait()  # answers nothing more, for ever
        finally:
            stopped.append(True)

    async def main():
        reader, sink = asyncio.StreamReader(), Sink()
        reader.feed_data(await frames(request(b"q"), RPCError(message=CALLER_CLOSES)))
        task = asyncio.create_task(served(endless, reader, sink).run())
        await until(lambda: len(sink.data) > 0)
        reader.feed_eof()
        await asyncio.wait_for(task, WAIT)
        await until(lambda: stopped)

    asyncio.run(main())


def test_a_failing_handler_tells_the_caller_its_error():
    async def failing(requests, _context):
        async for _ in requests:
            raise ValueError("no such part")
        yield request(b"never")

    async def main():
        reader, sink = asyncio.StreamReader(), Sink()
        reader.feed_data(await frames(request(b"q"), RPCError(message=CALLER_CLOSES)))
        task = asyncio.create_task(served(failing, reader, sink).run())
        await until(lambda: b"no such part" in sink.data)
        reader.feed_eof()
        await asyncio.wait_for(task, WAIT)
        assert await parsed(bytes(sink.data)) == [("marker", "no such part")]

    asyncio.run(main())


def test_a_stranger_that_says_it_closes_first_and_never_does_is_let_go_after_the_linger(monkeypatch):
    monkeypatch.setattr(streams, "LINGER_SECONDS", 0.2)

    async def main():
        reader, sink = asyncio.StreamReader(), Sink()
        reader.feed_data(await frames(request(b"q"), RPCError(message=CALLER_CLOSES)))  # and never closes
        await asyncio.wait_for(served(two_replies, reader, sink).run(), WAIT)
        assert await parsed(bytes(sink.data)) == [b"r1", b"r2", ("marker", CALLER_CLOSES)]

    asyncio.run(main())


def test_a_stranger_that_sends_after_its_marker_is_not_waited_for(monkeypatch):
    monkeypatch.setattr(streams, "LINGER_SECONDS", 10 * WAIT)  # waiting for it would outlast the wait below

    async def main():
        reader, sink = asyncio.StreamReader(), Sink()
        reader.feed_data(await frames(request(b"q"), RPCError(message=CALLER_CLOSES), request(b"more")))
        await asyncio.wait_for(served(two_replies, reader, sink).run(), WAIT)
        assert CALLER_CLOSES.encode() not in sink.data

    asyncio.run(main())


def test_a_malformed_frame_ends_the_stream_and_stops_the_handler():
    stopped = []

    async def waits(requests, _context):
        try:
            async for _ in requests:
                pass
            yield request(b"never")
        finally:
            stopped.append(True)

    async def main():
        reader, sink = asyncio.StreamReader(), Sink()
        reader.feed_data(b"\x07garbage")  # neither a message nor an error frame
        await asyncio.wait_for(served(waits, reader, sink).run(), WAIT)
        await until(lambda: stopped)
        assert not sink.data

    asyncio.run(main())
