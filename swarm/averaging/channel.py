"""Progress sent straight to the other servers of a stage, so they learn of a full batch at once.

The DHT holds each server's signed progress record and is the source of truth about who serves
the stage, but reading it takes a round trip and is done at most a few times a second. Between
reads, each server also pushes its record to the stage's other servers over libp2p whenever its
samples or step change (milliseconds on a LAN). A receiver believes a pushed record only from a
server it already knows from the DHT, only about that server itself (libp2p authenticates the
sender's peer id), and only if it is newer than what it has; anything else is dropped, and the
DHT's copy still counts.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.averaging.progress import ProgressRecord
from swarm.dht.loop import BackgroundLoop
from swarm.protocol.framing import DEFAULT_LIMITS, answered_ok, decode_metadata, encode_metadata

log = logging.getLogger(__name__)

PUSH_TIMEOUT = 5.0  # a push that takes longer is dropped: the next one or the DHT says the same
MAX_PENDING_PUSHES = 64  # more in flight are dropped rather than queued without bound

# (record, sender's peer id as base58) -> whether it was taken
Receive = Callable[[ProgressRecord, str], bool]


def handler_name(prefix: str) -> str:
    return f"{prefix}.push_progress"


class ProgressChannel:
    """Sends this server's progress records to peers of the stage, and takes theirs."""

    def __init__(self, p2p: P2P, loop: BackgroundLoop, prefix: str):
        self.p2p, self.loop, self.name = p2p, loop, handler_name(prefix)
        self._receive: Receive | None = None
        self._slots = threading.BoundedSemaphore(MAX_PENDING_PUSHES)  # pushes in flight
        self.sent = self.received = self.dropped = 0  # for tests and debugging
        self._missed = threading.Event()  # a push since the last clear_missed() did not reach, or was not taken
        self.on_missed: Callable[[], None] | None = None  # called when a push misses (the tracker wakes up)

    def missed(self) -> bool:
        """Whether some push since the last clear_missed() was dropped, failed or refused: only the DHT carries it."""
        return self._missed.is_set()

    def clear_missed(self) -> None:
        self._missed.clear()

    def _miss(self) -> None:
        self._missed.set()
        if self.on_missed is not None:
            self.on_missed()

    async def open(self, receive: Receive) -> None:
        """Start taking pushed records (on the loop)."""
        self._receive = receive
        await self.p2p.add_protobuf_handler(self.name, self._handle, runtime_pb2.ExpertRequest)

    async def close(self) -> None:
        self._receive = None
        await self.p2p.remove_protobuf_handler(self.name)

    def push(self, record: ProgressRecord, peers: Iterable[str]) -> None:
        """Send `record` to each of `peers` (base58 ids) without waiting; failures only cost freshness."""
        request = runtime_pb2.ExpertRequest(metadata=encode_metadata(record.to_wire()))
        for peer in peers:
            if not self._slots.acquire(blocking=False):
                self.dropped += 1
                self._miss()
                continue
            try:
                asyncio.run_coroutine_threadsafe(self._send(PeerID.from_base58(peer), request), self.loop.loop)
            except Exception as e:  # a bad id in a record, or the loop is gone: the DHT still works
                self._slots.release()
                self._miss()
                log.debug("could not push progress to %s: %s", peer, e)

    async def _send(self, peer: PeerID, request: runtime_pb2.ExpertRequest) -> None:
        try:
            reply = await asyncio.wait_for(
                self.p2p.call_protobuf_handler(peer, self.name, request, runtime_pb2.ExpertResponse), PUSH_TIMEOUT)
            self.sent += 1
            if not answered_ok(reply.metadata):  # unknown to it yet, or an old record: only the DHT reaches it
                self._miss()
        except Exception as e:  # noqa: BLE001 - a peer gone or slow: the DHT still carries our record
            self._miss()
            log.debug("pushing progress to %s failed: %s", peer, e)
        finally:
            self._slots.release()

    async def _handle(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        taken = False
        try:
            record = ProgressRecord.from_wire(_decode(request.metadata))
            sender = context.remote_id.to_base58()
            if record is not None and record.peer_id == sender and self._receive is not None:
                taken = self._receive(record, sender)
        except Exception as e:  # noqa: BLE001 - a malformed push is dropped; the handler keeps serving
            log.debug("dropped a progress push from %s: %s", context.remote_id, e)
        if taken:
            self.received += 1
        return runtime_pb2.ExpertResponse(metadata=encode_metadata({"ok": taken}))


def _decode(data: bytes) -> Any:
    return decode_metadata(data, DEFAULT_LIMITS)
