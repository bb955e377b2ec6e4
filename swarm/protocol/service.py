"""Server side: the P2P endpoints of one stage, delegating the work to an injected StageHandler.

Every failure, whether in the bytes that arrive or in the handler, becomes an error reply
(`ok: false` with a code and a message) on the same stream: a caller never sees a silently dropped
connection, and the server keeps serving.

Memory a caller can make the service hold is bounded: at most `max_concurrent` requests are taken
in at once (more are refused as BUSY before anything is read), each under `limits`; an `admit`
callback can refuse a request from its metadata, before its tensors are read.

Slots are shared per caller (swarm.protocol.slots): one peer id holds at most `max_per_caller` of
them, and callers this service has not answered yet hold at most `max_newcomers` together, so
neither one stranger nor a crowd of fresh peer ids can take the slots of the callers it serves.
A slot has a deadline for its request's first frame (`first_byte_timeout`), for each frame after
it (`idle_timeout`) and for the last (`receive_timeout`): a silent stream gives its slot back in
seconds, not at the end of the whole receive timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

# hivemind's ServicerBase recognises streaming RPCs only by typing.AsyncIterator annotations
from typing import AsyncIterator  # noqa: UP035

from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.protocol.errors import BAD_REQUEST, BUSY, INTERNAL, ProtocolError, RequestRejected
from swarm.protocol.framing import DEFAULT_LIMITS, WireLimits
from swarm.protocol.messages import (
    BACKWARD,
    FORWARD,
    StageReply,
    StageRequest,
    error_frames,
    receive_request,
    reply_frames,
)
from swarm.protocol.slots import CallerSlots
from swarm.traffic import counted

log = logging.getLogger(__name__)

DEFAULT_RECEIVE_TIMEOUT = 60.0  # a caller must finish sending its request within this many seconds
# ... send its first frame (the metadata) within this many seconds of opening the call: an honest caller
# sends it at once, so a stream that stays silent longer is a stall, and its slot goes back early.
DEFAULT_FIRST_BYTE_TIMEOUT = 5.0
# ... and each later frame (a tensor part of at most 2 MiB) within this many seconds of the one before.
DEFAULT_IDLE_TIMEOUT = 10.0
# After refusing a half-read request we keep reading (and discarding) the rest for at most this long:
# hivemind's stream handler blocks on its full prefetch queue if nobody reads, and never closes.
DEFAULT_DRAIN_TIMEOUT = 10.0
# Requests taken in at once (being received, run or answered): twice a stage server's default queue,
# so a full queue is reached before this cap, which only stops a flood of requests still arriving.
DEFAULT_MAX_CONCURRENT = 128

Admission = Callable[[str, dict], None]
"""Called with (endpoint kind, request metadata) before any tensor is read; raises RequestRejected to refuse."""


class StageHandler(ABC):
    """What a stage server plugs into StageService. Implementations check `request.stage` themselves.

    Raise RequestRejected(code, message) to refuse with a specific code (e.g. NOT_READY,
    WRONG_STAGE); any other exception becomes an INTERNAL error reply.
    """

    @abstractmethod
    async def forward(self, request: StageRequest) -> StageReply:
        """Run the stage forward; the last stage (targets given) returns the scalar loss."""

    @abstractmethod
    async def backward(self, request: StageRequest) -> StageReply:
        """Accumulate parameter grads, return grad of the inputs (none for stage 0)."""


class StageService(ServicerBase):
    """Streaming `rpc_forward` / `rpc_backward` endpoints for one stage, under one P2P namespace."""

    def __init__(
        self,
        handler: StageHandler,
        *,
        limits: WireLimits = DEFAULT_LIMITS,
        receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        admit: Admission | None = None,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        max_per_caller: int | None = None,
        max_newcomers: int | None = None,
        first_byte_timeout: float = DEFAULT_FIRST_BYTE_TIMEOUT,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
    ):
        """`max_per_caller` (default: a quarter of `max_concurrent`) and `max_newcomers` (default: half)
        share the slots per caller, see swarm.protocol.slots."""
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self.handler, self.limits, self.admit = handler, limits, admit
        self.receive_timeout, self.drain_timeout = receive_timeout, drain_timeout
        self.first_byte_timeout, self.idle_timeout = first_byte_timeout, idle_timeout
        self.max_concurrent = max_concurrent
        # requests taken in and not answered yet, per caller (all on the P2P's event loop)
        self.slots = CallerSlots(max_concurrent, max_per_caller, max_newcomers)
        self.namespace: str | None = None

    @property
    def active(self) -> int:
        """Requests taken in and not answered yet, from every caller."""
        return self.slots.active

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for frame in self._serve(FORWARD, requests, context):
            yield frame

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        async for frame in self._serve(BACKWARD, requests, context):
            yield frame

    async def unregister(self, p2p: P2P) -> None:
        """Stop serving on `p2p` (the namespace given to `register`)."""
        await self.remove_p2p_handlers(p2p, namespace=self.namespace)

    async def _serve(self, kind: str, requests: AsyncIterator, context: P2PContext) -> AsyncIterator:
        caller = str(context.remote_id)  # what libp2p authenticated
        refusal = self.slots.try_take(caller)
        if refusal is not None:  # refused at once, before reading anything: a flood must not queue up here
            for frame in self._refuse(context, kind, BUSY, f"{refusal}; try another server or later"):
                yield frame
            await self._drain(requests)
            return
        try:  # the slot is held until the reply is sent: the request's tensors live until then
            frames, fully_read = await self._respond(kind, self._paced(requests), context)
            for frame in frames:
                yield frame
        finally:
            self.slots.give_back(caller)
        if not fully_read:
            await self._drain(requests)

    async def _paced(self, requests: AsyncIterator) -> AsyncIterator:
        """The request's frames, each within its deadline: the first within `first_byte_timeout` of the
        call's start, every later one within `idle_timeout` of the one before (ProtocolError if not)."""
        timeout, which = self.first_byte_timeout, "the first frame"
        while True:
            try:
                frame = await asyncio.wait_for(anext(requests, None), timeout)
            except asyncio.TimeoutError:
                raise ProtocolError(f"{which} of the request did not arrive within {timeout:g}s") from None
            if frame is None:
                return
            yield frame
            timeout, which = self.idle_timeout, "a frame after the first"

    async def _respond(self, kind: str, requests: AsyncIterator, context: P2PContext) -> tuple[Iterable, bool]:
        """The reply frames, and whether the request stream was read to its end."""
        admit = None if self.admit is None else functools.partial(self.admit, kind)
        try:
            request = await asyncio.wait_for(receive_request(requests, self.limits, admit), self.receive_timeout)
        except RequestRejected as e:  # refused from its metadata: its tensors were never read
            return self._refuse(context, kind, e.code, e.message), False
        except ProtocolError as e:
            return self._refuse(context, kind, BAD_REQUEST, str(e)), False
        except asyncio.TimeoutError:
            message = f"request not received within {self.receive_timeout:g}s"
            return self._refuse(context, kind, BAD_REQUEST, message), False
        except Exception as e:  # a decoding bug on our side must still produce an answer
            message = f"could not read the request: {type(e).__name__}: {e}"
            return self._refuse(context, kind, INTERNAL, message, exc_info=True), False
        if request.kind != kind:
            message = f"a {request.kind} request was sent to the {kind} endpoint"
            return self._refuse(context, kind, BAD_REQUEST, message), True
        request.caller = str(context.remote_id)  # what libp2p authenticated, not what the request claims
        try:
            work = self.handler.forward if kind == FORWARD else self.handler.backward
            reply = await work(request)
        except RequestRejected as e:
            return self._refuse(context, kind, e.code, e.message), True
        except ProtocolError as e:  # the handler found the request's content unusable
            return self._refuse(context, kind, BAD_REQUEST, str(e)), True
        except Exception as e:  # whatever the handler does wrong, the caller gets an answer
            return self._refuse(context, kind, INTERNAL, f"{type(e).__name__}: {e}", exc_info=True), True
        try:
            frames = counted(kind, reply_frames(reply, request.wire_dtype, self.limits))
            self.slots.vouch(request.caller)  # served: from now on a known caller, not a newcomer
            return frames, True
        except Exception as e:  # a reply we cannot send (over the limits, bad metadata) is our fault
            message = f"could not encode the reply: {type(e).__name__}: {e}"
            return self._refuse(context, kind, INTERNAL, message, exc_info=True), True

    @staticmethod
    def _refuse(context: P2PContext, kind: str, code: str, message: str, exc_info: bool = False) -> list:
        log.warning("refused a %s request from %s: [%s] %s", kind, context.remote_id, code, message, exc_info=exc_info)
        return error_frames(code, message)

    async def _drain(self, requests: AsyncIterator) -> None:
        async def discard() -> None:
            async for _ in requests:
                pass

        # An honest caller closes the stream when it sees the error; only a misbehaving one lingers.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(discard(), self.drain_timeout)


async def register(
    p2p: P2P,
    handler: StageHandler,
    namespace: str,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    admit: Admission | None = None,
    max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    max_per_caller: int | None = None,
    max_newcomers: int | None = None,
    first_byte_timeout: float = DEFAULT_FIRST_BYTE_TIMEOUT,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
) -> StageService:
    """Serve `handler` on `p2p` under `namespace` (see `stage_namespace`); returns the service."""
    service = StageService(handler, limits=limits, receive_timeout=receive_timeout, drain_timeout=drain_timeout,
                           admit=admit, max_concurrent=max_concurrent, max_per_caller=max_per_caller,
                           max_newcomers=max_newcomers, first_byte_timeout=first_byte_timeout,
                           idle_timeout=idle_timeout)
    service.namespace = namespace
    await service.add_p2p_handlers(p2p, namespace=namespace)
    return service
