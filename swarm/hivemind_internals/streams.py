"""Protobuf streams whose caller closes first, so that a handler's last replies are never reset away.

hivemind's p2pd pipes each stream between the libp2p stream and a unix connection to our process. When a
handler returns, hivemind closes its connection; p2pd then closes the libp2p stream, which closes its read
side too, and the goroutine still reading it (the caller never half-closes) wakes with "stream reset" and
resets the stream. If that reset goes out before the close (the daemon's two goroutines race), the caller's
daemon drops every reply it holds but has not yet handed to the caller: go-yamux answers a read on a reset
stream with an error before its buffered data. The caller then sees its stream end early: a join request
with no answer at all (hivemind: StopAsyncIteration), an all-reduce with its last parts missing ("sent 13
parts, but we expected 14"). In 2 x 2 swarms of tiny.yaml, a few such rounds every 150 steps.

A stream is only safe to close from the caller's side, once it has read what it wanted. So here:
- a caller ends its requests with an end-of-stream marker that says it will close first (hivemind's own
  marker is an RPCError with no message; ours carries CALLER_CLOSES, which hivemind's handlers take as
  the end of stream all the same), and stops reading, and closes, when the handler's marker comes back;
- a handler that has answered reads its caller's requests to their end (at most DRAIN_MESSAGES within
  DRAIN_SECONDS: a caller trickling messages holds a finished handler that long at most), then, if the
  caller said it closes first, sends the marker and waits (at most LINGER_SECONDS) for the caller to close.
A caller or handler of plain hivemind still gets plain hivemind's behaviour from ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from hivemind.p2p import P2P, P2PContext, P2PHandlerError
from hivemind.proto.p2pd_pb2 import RPCError

logger = logging.getLogger(__name__)

CALLER_CLOSES = "swarm: the caller closes"  # the message of both ends' end-of-stream markers
DRAIN_SECONDS = 2.0
DRAIN_MESSAGES = 64
LINGER_SECONDS = 10.0  # a handler's wait, after its marker, for the caller to close (it reads a backlog first)

# plain hivemind's, kept for tests of either end talking with a plain one (taken before anything replaces them)
HIVEMIND_ADD_STREAM_HANDLER = P2P._add_protobuf_stream_handler
HIVEMIND_CALL_STREAM_HANDLER = P2P._iterate_protobuf_stream_handler


def callers_close_first() -> None:
    """From now on, in this process (and the processes it forks), protobuf stream handlers and calls follow the
    module's rule: the caller closes first. Idempotent."""
    if getattr(P2P._add_protobuf_stream_handler, "_callers_close_first", False):
        return
    _add_stream_handler._callers_close_first = True
    P2P._add_protobuf_stream_handler = _add_stream_handler
    P2P._iterate_protobuf_stream_handler = _call_stream_handler


async def _add_stream_handler(self: P2P, name: str, handler: Any, input_protobuf_type: Any, max_prefetch: int = 5,
                              balanced: bool = False) -> None:
    async def serve(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=self.peer_id, remote_id=stream_info.peer_id)
        with contextlib.closing(writer):
            await _Served(handler, context, input_protobuf_type, max_prefetch, reader, writer).run()

    await self.add_binary_stream_handler(name, serve, balanced=balanced)


class _Served:
    """One stream at a handler: the caller's requests in, the handler's replies out, and the close."""

    def __init__(self, handler: Any, context: P2PContext, input_type: Any, max_prefetch: int,
                 reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.handler, self.context, self.input_type = handler, context, input_type
        self.reader, self.writer = reader, writer
        self.inbox: asyncio.Queue = asyncio.Queue(max(max_prefetch, 0))  # (0: unbounded, as hivemind takes it)
        self.ended = False  # the caller's end-of-stream marker came
        self.caller_closes = False  # ... and said the caller closes first
        self.failed = False  # the handler raised (the caller was told, and closes on that)

    async def run(self) -> None:
        receiving = asyncio.create_task(self._receive())
        answering = asyncio.create_task(self._answer())
        try:
            await asyncio.wait({receiving, answering}, return_when=asyncio.FIRST_COMPLETED)
            if answering.done():
                await self._close_after(receiving)
            # else the caller went away (or broke the protocol) first: nobody to answer
        finally:
            answering.cancel()
            receiving.cancel()

    async def _requests(self) -> AsyncIterator[Any]:
        while (request := await self.inbox.get()) is not None:
            yield request

    async def _receive(self) -> None:
        """Until the caller closes: its requests into the inbox (waiting while it is full), then its marker."""
        try:
            while True:
                request, error = await P2P.receive_protobuf(self.input_type, self.reader)
                if request is not None:
                    await self.inbox.put(request)
                    continue
                self.ended, self.caller_closes = True, error is not None and error.message == CALLER_CLOSES
                await self.inbox.put(None)
                await self.reader.read(1)  # nothing is due after the marker but the close (or a protocol breach)
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # the caller closed or broke the connection
        except Exception:  # noqa: BLE001 - a malformed frame: the stream ends here
            logger.debug("stream %s from %s: a bad frame", self.context.handle_name, self.context.remote_id,
                         exc_info=True)

    async def _answer(self) -> None:
        try:
            async for reply in self.handler(self._requests(), self.context):
                try:
                    await P2P.send_protobuf(reply, self.writer)
                except Exception:  # noqa: BLE001 - the caller closed or broke the connection
                    logger.debug("stream %s: could not send a reply", self.context.handle_name, exc_info=True)
                    return
        except Exception as e:  # noqa: BLE001 - the handler failed: the caller is told (as hivemind does)
            logger.warning("stream handler %s failed", self.context.handle_name, exc_info=True)
            self.failed = True
            with contextlib.suppress(Exception):
                await P2P.send_protobuf(RPCError(message=str(e)), self.writer)

    async def _close_after(self, receiving: asyncio.Task) -> None:
        """The handler is done: read the caller's requests to their end marker, then let it close first if it
        said it would (after our marker), else close at once (hivemind's way)."""
        if not self.ended:
            draining = asyncio.create_task(self._drain())
            try:
                await asyncio.wait({draining, receiving}, timeout=DRAIN_SECONDS, return_when=asyncio.FIRST_COMPLETED)
            finally:
                draining.cancel()
        if self.caller_closes and not receiving.done():
            with contextlib.suppress(Exception):
                if not self.failed:  # (after an error the caller stops reading and closes anyway)
                    await P2P.send_protobuf(RPCError(message=CALLER_CLOSES), self.writer)
                await asyncio.wait({receiving}, timeout=LINGER_SECONDS)

    async def _drain(self) -> None:
        """What the finished handler left unread, up to the marker (at most DRAIN_MESSAGES requests)."""
        for _ in range(DRAIN_MESSAGES + 1):
            if await self.inbox.get() is None:
                return


async def _call_stream_handler(self: P2P, peer_id: Any, name: str, requests: AsyncIterator[Any],
                               output_protobuf_type: Any) -> AsyncIterator[Any]:
    _, reader, writer = await self.call_binary_stream_handler(peer_id, name)

    async def send_all() -> None:
        async for request in requests:
            await P2P.send_protobuf(request, writer)
        await P2P.send_protobuf(RPCError(message=CALLER_CLOSES), writer)

    sending = asyncio.create_task(send_all())

    async def replies() -> AsyncIterator[Any]:
        with contextlib.closing(writer):
            try:
                while True:
                    try:
                        reply, error = await P2P.receive_protobuf(output_protobuf_type, reader)
                    except asyncio.IncompleteReadError:  # the handler closed (plain hivemind's way)
                        break
                    if error is not None:
                        if error.message == CALLER_CLOSES:  # the handler's last reply came: we close first
                            break
                        raise P2PHandlerError(f"Failed to call handler `{name}` at {peer_id}: {error.message}")
                    yield reply
                await sending
            finally:
                sending.cancel()

    return replies()
