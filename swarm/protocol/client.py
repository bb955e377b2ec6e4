"""Trainer side: call forward/backward of one stage on one server peer, with a timeout on every call.

Three outcomes besides success, so the caller can decide what to do next:
- ProtocolError: the request itself is invalid (raised before anything is sent; a bug on our side);
- RemoteStageError(code, message): the server answered with an error reply;
- StageUnavailable: unreachable, broken connection, timeout, or a malformed/truncated reply (DialHeldOff:
  our daemon did not even try, a recent dial to the server having not completed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.asyncio import iter_as_aiter

from swarm.protocol.errors import DialHeldOff, RemoteStageError, StageUnavailable
from swarm.protocol.framing import DEFAULT_LIMITS, WireLimits
from swarm.protocol.messages import BACKWARD, FORWARD, StageReply, StageRequest, receive_reply, request_frames
from swarm.protocol.service import StageService
from swarm.traffic import counted

log = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT = 60.0  # seconds for one whole call: connect, send, server compute, receive


HANDSHAKE_CUT = "failed to negotiate security protocol"  # a connection made, its handshake cut short


def dial_held_off(error: Exception) -> bool:
    """Whether our own p2p daemon's error (a ControlFailure; a server's error reply, whatever its words, never
    is one) says nothing about the server: for each address, either the daemon tried none (libp2p's dial
    backoff, ``* [address] dial backoff``, held off after a dial that did not complete), or it connected and
    the security handshake was cut short (``failed to negotiate security protocol``: the server is there; at
    100 ms one way, seen once when two peers dialed each other at the same moment). Either way the daemon
    holds the address off for a few seconds, and a call that does reach the server gives the verdict."""
    if not isinstance(error, ControlFailure):
        return False
    text = str(error)
    reasons = [line.split("]", 1)[-1].strip() for line in text.splitlines() if line.lstrip().startswith("* [")]
    return bool(reasons) and all(reason == "dial backoff" or reason.startswith(HANDSHAKE_CUT) for reason in reasons) \
        and "skipping" not in text


class StageClient:
    """Calls one stage (one P2P namespace) served by one peer."""

    def __init__(
        self,
        p2p: P2P,
        peer_id: PeerID,
        namespace: str,
        *,
        limits: WireLimits = DEFAULT_LIMITS,
        timeout: float = DEFAULT_CALL_TIMEOUT,
    ):
        self.p2p, self.peer_id, self.namespace = p2p, peer_id, namespace
        self.limits, self.timeout = limits, timeout

    async def forward(
        self,
        stage: int,
        request_id: str,
        inputs: torch.Tensor,
        *,
        targets: torch.Tensor | None = None,
        wire_dtype: str = "float32",
        backward_follows: bool = False,
        timeout: float | None = None,
    ) -> StageReply:
        """Stage forward: reply.tensors is [outputs], or [loss] when `targets` are given (last stage).

        `backward_follows`: this caller will send the backward under the same request id, so the
        server may keep the forward's graph for it."""
        request = StageRequest(FORWARD, stage, request_id, inputs, targets=targets, wire_dtype=wire_dtype,
                               backward_follows=backward_follows)
        return await self.call(request, timeout)

    async def backward(
        self,
        stage: int,
        request_id: str,
        inputs: torch.Tensor,
        *,
        grad_outputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        wire_dtype: str = "float32",
        timeout: float | None = None,
    ) -> StageReply:
        """Stage backward from the same inputs: give `grad_outputs`, or `targets` on the last stage."""
        request = StageRequest(
            BACKWARD, stage, request_id, inputs, targets=targets, grad_outputs=grad_outputs, wire_dtype=wire_dtype
        )
        return await self.call(request, timeout)

    async def call(self, request: StageRequest, timeout: float | None = None) -> StageReply:
        """Send any StageRequest; `timeout` (default: the client's) bounds the whole exchange."""
        timeout = self.timeout if timeout is None else timeout
        frames = counted(request.kind, request_frames(request, self.limits))  # a bad request fails here, before I/O
        where = f"stage {request.stage} {request.kind} on {self.peer_id}"
        try:
            return await asyncio.wait_for(self._exchange(request.kind, frames), timeout)
        except RemoteStageError:
            raise
        except asyncio.TimeoutError as e:
            raise StageUnavailable(f"{where} did not answer within {timeout:g}s") from e
        except Exception as e:  # daemon errors, resets, truncated or garbled replies: all mean "go elsewhere"
            log.debug("%s failed", where, exc_info=True)
            error = DialHeldOff if dial_held_off(e) else StageUnavailable
            raise error(f"{where} failed: {type(e).__name__}: {e}") from e

    async def _exchange(self, kind: str, frames: Iterator) -> StageReply:
        stub = StageService.get_stub(self.p2p, self.peer_id, namespace=self.namespace)
        rpc = stub.rpc_forward if kind == FORWARD else stub.rpc_backward
        responses = await rpc(iter_as_aiter(frames))
        try:
            return await receive_reply(responses, self.limits)
        finally:
            # Stops our sender task and closes the stream, also when we stop reading early on an error reply.
            await responses.aclose()
