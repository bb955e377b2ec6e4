"""Serving checkpoints to peers: a holder streams the files of the checkpoints it has (wire format: wire.py).

The server resolves a manifest id to a directory only through its ``resolve`` callback, and a file
name only through that directory's manifest: nothing in a request is ever used as a path. Transfers
are bounded: a few at once (``ServingLimits``), shared per caller (one peer id holds at most
``max_per_caller``, peers never served before at most ``max_newcomers`` together), each holding its
slot only while the fetcher keeps taking bytes (``progress_timeout``) and for a limited time in all
(``transfer_timeout``); a transfer past either deadline is cut off, its stream closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# hivemind's ServicerBase recognises streaming RPCs only by typing.AsyncIterator annotations
from typing import Any, AsyncIterator, BinaryIO  # noqa: UP035

import msgpack
from hivemind.p2p import P2P, P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, StageManifest, is_plain_name, manifest_id
from swarm.checkpoint.wire import (
    BAD_REQUEST,
    BUSY,
    INTERNAL,
    MAX_CHUNK_BYTES,
    MAX_ERROR_CHARS,
    MAX_REQUEST_BYTES,
    NOT_FOUND,
    checkpoint_namespace,
    unpack_map,
)
from swarm.protocol.slots import CallerSlots

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ServingLimits:
    """What one CheckpointServer spends on peers."""

    max_transfers: int = 4  # files sent at once; more requests wait for a slot
    # Files sent at once to one peer id (a fetcher reads one file after the other), and to peers this
    # server never served a whole file before, together: None is a quarter and half of max_transfers.
    max_per_caller: int | None = None
    max_newcomers: int | None = None
    chunk_bytes: int = MAX_CHUNK_BYTES
    receive_timeout: float = 10.0  # a request must arrive within this many seconds
    slot_timeout: float = 10.0  # a request waits this long for a slot, then gets a BUSY reply
    # A transfer whose fetcher takes no chunk (the header first) for this long loses its slot and its
    # stream: a peer that stops reading must not keep a slot. One chunk is 1 MiB: 30 s allows 35 KB/s.
    progress_timeout: float = 30.0
    # One file transfer holds a slot at most this long in all; a file of several GB over a slow link needs it.
    transfer_timeout: float = 900.0
    drain_timeout: float = 10.0  # after refusing a request of several frames, discard the rest this long

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES or self.max_transfers < 1:
            raise ValueError(f"need 0 < chunk_bytes <= {MAX_CHUNK_BYTES} and max_transfers >= 1, got {self}")
        if self.progress_timeout <= 0 or self.transfer_timeout <= 0:
            raise ValueError(f"need progress_timeout and transfer_timeout > 0, got {self}")
        self.slots()  # checks the per-caller caps

    def slots(self) -> CallerSlots:
        """A fresh table of this server's transfer slots."""
        return CallerSlots(self.max_transfers, self.max_per_caller, self.max_newcomers, what="transfers",
                           total_name="max_transfers")


class _Refusal(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class _FileRequest:
    manifest_id: str
    file: str
    offset: int


class CheckpointServer(ServicerBase):
    """Serves the files of the checkpoints `resolve(manifest_id)` finds (a held checkpoint directory, or None).

    `resolve` runs on a worker thread (it may read the disk), e.g. ``StageCheckpoints.path_for``.
    """

    def __init__(self, resolve: Callable[[str], Path | None], limits: ServingLimits = ServingLimits()):
        self.resolve, self.limits = resolve, limits
        self.namespace: str | None = None
        self.slots = limits.slots()  # per caller (its libp2p-authenticated peer id); on the P2P's loop

    async def rpc_read(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            request = await self._receive(requests)
        except _Refusal as e:
            yield self._refuse(context, None, e)
            await self._drain(requests)
            return
        caller = str(context.remote_id)
        refusal = await self.slots.wait_take(caller, self.limits.slot_timeout)
        if refusal is not None:
            yield self._refuse(context, request, _Refusal(BUSY, f"{refusal}, for {self.limits.slot_timeout:g}s"))
            return
        what = f"{request.file} of checkpoint {request.manifest_id} to {caller}"
        lease = _Lease(_CallerSlot(self.slots, caller), self.limits.transfer_timeout,
                       progress_timeout=self.limits.progress_timeout, task=asyncio.current_task(), what=what)
        try:
            async for frame in self._send(request, context, lease):
                yield frame
                lease.progress()  # the transport took the frame: the fetcher is reading
        finally:
            lease.release()
        if lease.completed:
            self.slots.vouch(caller)  # took a whole file: from now on a known caller

    async def unregister(self, p2p: P2P) -> None:
        """Stop serving on `p2p`."""
        await self.remove_p2p_handlers(p2p, namespace=self.namespace)

    async def _receive(self, requests: AsyncIterator) -> _FileRequest:
        """The one request frame of a call, checked; the end of the stream must follow it."""
        try:
            frame = await asyncio.wait_for(anext(requests, None), self.limits.receive_timeout)
            if frame is None:
                raise _Refusal(BAD_REQUEST, "the stream ended before a request arrived")
            if await asyncio.wait_for(anext(requests, None), self.limits.receive_timeout) is not None:
                raise _Refusal(BAD_REQUEST, "a call carries exactly one request frame")
        except asyncio.TimeoutError:
            raise _Refusal(BAD_REQUEST, f"request not received within {self.limits.receive_timeout:g}s") from None
        return _parse_request(frame)

    async def _send(self, request: _FileRequest, context: P2PContext, lease: _Lease) -> AsyncIterator:
        try:
            source, size = await asyncio.to_thread(self._open, request)
        except _Refusal as e:
            yield self._refuse(context, request, e)
            return
        except Exception as e:  # a bug in `resolve` or here: the caller still gets an answer
            log.warning("serving %s of checkpoint %s failed", request.file, request.manifest_id, exc_info=True)
            yield self._refuse(context, request, _Refusal(INTERNAL, f"{type(e).__name__}: {e}"))
            return
        try:
            yield _header_frame({"ok": True, "size": size, "offset": request.offset})
            left = size - request.offset
            while left > 0:
                chunk = await asyncio.to_thread(source.read, min(left, self.limits.chunk_bytes))
                if not chunk:
                    break  # cannot happen for an immutable checkpoint: the fetcher sees the truncation
                if lease.expired:
                    return  # cut off (and logged) by the lease
                left -= len(chunk)
                yield runtime_pb2.ExpertResponse(metadata=chunk)
            lease.completed = left == 0
        except OSError as e:  # the header is out: ending the stream early is all we can still say
            log.warning("reading %s of checkpoint %s failed: %s", request.file, request.manifest_id, e)
        finally:
            source.close()

    def _open(self, request: _FileRequest) -> tuple[BinaryIO, int]:
        """The requested file, positioned at the offset, and its size; on a worker thread."""
        directory = self.resolve(request.manifest_id)
        if directory is None:
            raise _Refusal(NOT_FOUND, f"no checkpoint {request.manifest_id} is held here")
        try:
            with open(directory / MANIFEST_NAME, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
            if manifest_id(data) != request.manifest_id:
                raise _Refusal(INTERNAL, f"our copy of checkpoint {request.manifest_id} is damaged (manifest)")
            if request.file == MANIFEST_NAME:
                source, size = io.BytesIO(data), len(data)
            else:
                entry = StageManifest.from_bytes(data).files.get(request.file)
                if entry is None:
                    raise _Refusal(NOT_FOUND, f"checkpoint {request.manifest_id} has no file {request.file!r}")
                source = open(directory / request.file, "rb")  # noqa: SIM115 (closed by _send)
                size = os.fstat(source.fileno()).st_size
                if size != entry.size:
                    source.close()
                    raise _Refusal(INTERNAL, f"our copy of {request.file} of checkpoint {request.manifest_id} "
                                             f"is damaged ({size} bytes, not {entry.size})")
        except (OSError, CheckpointError) as e:  # pruned meanwhile, or unreadable
            raise _Refusal(NOT_FOUND, f"checkpoint {request.manifest_id} cannot be read here: {e}") from None
        if request.offset > size:
            source.close()
            raise _Refusal(BAD_REQUEST, f"offset {request.offset} is past the end of {request.file} ({size} bytes)")
        source.seek(request.offset)
        return source, size

    @staticmethod
    def _refuse(context: P2PContext, request: _FileRequest | None, refusal: _Refusal) -> runtime_pb2.ExpertResponse:
        what = f"{request.file} of {request.manifest_id}" if request else "a request"
        log.info("refused %s from %s: [%s] %s", what, context.remote_id, refusal.code, refusal.message)
        return _header_frame({"ok": False, "code": refusal.code, "error": refusal.message[:MAX_ERROR_CHARS]})

    async def _drain(self, requests: AsyncIterator) -> None:
        # hivemind's stream handler blocks on its full prefetch queue if nobody reads, and never closes
        async def discard() -> None:
            async for _ in requests:
                pass

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(discard(), self.limits.drain_timeout)


class _Lease:
    """A transfer slot (anything with a `release()`), given back once: when the transfer ends, when it has
    run `duration` seconds, or when the fetcher took no frame for `progress_timeout` seconds (if given).

    On either deadline the lease also cancels `task`, the one running the transfer (hivemind's, for
    this one stream): a fetcher that stopped reading leaves that task blocked on sending to it, where
    no check of ours could run, holding a chunk and a stream. Cancelled, hivemind closes the stream.
    """

    def __init__(self, slot: Any, duration: float, *, progress_timeout: float | None = None,
                 task: asyncio.Task | None = None, what: str = "a transfer"):
        self._slot, self._task, self._what = slot, task, what
        self._loop = asyncio.get_running_loop()
        self._released, self.completed = False, False
        self._total = self._loop.call_later(duration, self._cut, f"it took over {duration:g}s")
        self._progress_timeout = progress_timeout
        self._idle: asyncio.TimerHandle | None = None
        self.progress()

    @property
    def expired(self) -> bool:
        return self._released

    def progress(self) -> None:
        """A frame left: the fetcher has the full `progress_timeout` again for the next one."""
        if self._idle is not None:
            self._idle.cancel()
        if self._progress_timeout is not None and not self._released:
            self._idle = self._loop.call_later(self._progress_timeout, self._cut,
                                               f"the fetcher took nothing for {self._progress_timeout:g}s")

    def _cut(self, why: str) -> None:
        if self._released:
            return
        log.warning("cut off sending %s: %s", self._what, why)
        self.release()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def release(self) -> None:
        self._total.cancel()
        if self._idle is not None:
            self._idle.cancel()
        if not self._released:
            self._released = True
            self._slot.release()


@dataclass(frozen=True)
class _CallerSlot:
    """One slot `caller` took from `slots`, as a lease gives it back."""

    slots: CallerSlots
    caller: str

    def release(self) -> None:
        self.slots.give_back(self.caller)


async def serve_checkpoints(
    p2p: P2P, run_id: str, resolve: Callable[[str], Path | None], limits: ServingLimits = ServingLimits()
) -> CheckpointServer:
    """Serve the checkpoints `resolve` finds on `p2p` (run on the loop that owns `p2p`)."""
    server = CheckpointServer(resolve, limits)
    server.namespace = checkpoint_namespace(run_id)
    await server.add_p2p_handlers(p2p, namespace=server.namespace)
    return server


def _parse_request(frame: runtime_pb2.ExpertRequest) -> _FileRequest:
    if frame.tensors or len(frame.metadata) > MAX_REQUEST_BYTES:
        raise _Refusal(BAD_REQUEST, f"a request is a msgpack map of at most {MAX_REQUEST_BYTES} bytes, no tensors")
    meta = unpack_map(frame.metadata)
    if meta is None:
        raise _Refusal(BAD_REQUEST, "the request metadata is not a msgpack map")
    mid, file, offset = meta.get("manifest_id"), meta.get("file"), meta.get("offset")
    if type(mid) is not str or not _SHA256.fullmatch(mid):
        raise _Refusal(BAD_REQUEST, "manifest_id must be 64 lowercase hex digits")
    if not (file == MANIFEST_NAME or is_plain_name(file)):
        raise _Refusal(NOT_FOUND, f"no file {file!r:.300} is served: only {MANIFEST_NAME} and the files it lists")
    if type(offset) is not int or offset < 0:
        raise _Refusal(BAD_REQUEST, f"offset must be an integer >= 0, got {offset!r:.80}")
    return _FileRequest(mid, file, offset)


def _header_frame(meta: dict) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=msgpack.packb(meta, use_bin_type=True))

