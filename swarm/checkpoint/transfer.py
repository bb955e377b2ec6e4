"""Stage checkpoints between peers: a holder serves the files it has, a fetcher verifies every byte.

Wire format: one streaming RPC, ``CheckpointServer.rpc_read``, under the P2P namespace
``{run_id}_checkpoints``. The request is one ``ExpertRequest`` whose ``metadata`` is a msgpack map
``{"manifest_id": <64 hex>, "file": <"manifest.json" or a name the manifest lists>, "offset": <int>}``
(at most ``MAX_REQUEST_BYTES``). The reply is a stream of ``ExpertResponse`` frames: the first one's
``metadata`` is a msgpack map, ``{"ok": true, "size": <file size>, "offset": <offset>}`` or
``{"ok": false, "code": <code>, "error": <message>}``; after an ok header, every further frame's
``metadata`` holds the next 1 .. ``MAX_CHUNK_BYTES`` raw bytes of the file, up to its end.
Unknown request or header fields are ignored, so newer peers can add some.

The server resolves a manifest id to a directory only through its ``resolve`` callback, and a file
name only through that directory's manifest: nothing in a request is ever used as a path. The
fetcher trusts nothing: the manifest must hash to the id it asked for, every file to its manifest
entry, and a file longer than its entry is cut off at once. What hashes right is genuinely the
announced checkpoint; whether that checkpoint deserves trust is the announcer's, not the bytes', affair.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# hivemind's ServicerBase recognises streaming RPCs only by typing.AsyncIterator annotations
from typing import AsyncIterator, BinaryIO  # noqa: UP035

import msgpack
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter

from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, StageManifest, is_plain_name, manifest_id
from swarm.dht.schemas import CheckpointRecord, HeldCheckpoint

log = logging.getLogger(__name__)

MIB = 2**20
MAX_CHUNK_BYTES = MIB  # one data frame; a server sends at most this, a fetcher refuses more
MAX_REQUEST_BYTES = 1024  # request metadata: an id, a file name of at most 255 characters, an offset
MAX_HEADER_BYTES = 4096  # reply header, error message included
MAX_ERROR_CHARS = 2000
DEFAULT_FETCH_TIMEOUT = 600.0  # one whole checkpoint (manifest and every file) from one holder

# Error codes of a reply header. Peers must treat an unknown code like INTERNAL.
BAD_REQUEST = "bad_request"  # malformed, over a limit, or an offset past the end of the file
NOT_FOUND = "not_found"  # this peer holds no such checkpoint (any more), or the checkpoint no such file
BUSY = "busy"  # every transfer slot stayed taken: try another holder, or later
INTERNAL = "internal"  # our copy is damaged or unreadable

# Why a fetch failed, as CheckpointTransferError.kind; fetch_newest decides what to try next from it.
INVALID = "invalid"  # the holder sent bytes that do not match what it announced: ban it
UNSUITABLE = "unsuitable"  # a genuine checkpoint, but not one we can use (other run, stage, too big...)
MISLABELED = "mislabeled"  # a genuine checkpoint, but of another step than its record said
REFUSED = "refused"  # the holder answered with an error reply
UNAVAILABLE = "unavailable"  # unreachable, no answer in time, or the stream broke off

_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointTransferError(CheckpointError):
    """Fetching a checkpoint from `holder` failed; `kind` says whose fault it was (see the constants above)."""

    def __init__(self, holder: PeerID | str, kind: str, message: str):
        super().__init__(f"checkpoint from {holder}: {message}")
        self.holder, self.kind, self.message = str(holder), kind, message


def checkpoint_namespace(run_id: str) -> str:
    """The P2P namespace a run's checkpoints are served under."""
    return f"{run_id}_checkpoints"


@dataclass(frozen=True)
class ServingLimits:
    """What one CheckpointServer spends on peers."""

    max_transfers: int = 4  # files sent at once; more requests wait for a slot
    chunk_bytes: int = MAX_CHUNK_BYTES
    receive_timeout: float = 10.0  # a request must arrive within this many seconds
    slot_timeout: float = 10.0  # a request waits this long for a slot, then gets a BUSY reply
    # One file transfer holds a slot at most this long (a peer that stops reading must not keep it);
    # a checkpoint file of several GB over a slow link needs all of it.
    transfer_timeout: float = 900.0
    drain_timeout: float = 10.0  # after refusing a request of several frames, discard the rest this long

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES or self.max_transfers < 1:
            raise ValueError(f"need 0 < chunk_bytes <= {MAX_CHUNK_BYTES} and max_transfers >= 1, got {self}")


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
        self._slots = asyncio.Semaphore(limits.max_transfers)

    async def rpc_read(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            request = await self._receive(requests)
        except _Refusal as e:
            yield self._refuse(context, None, e)
            await self._drain(requests)
            return
        try:
            await asyncio.wait_for(self._slots.acquire(), self.limits.slot_timeout)
        except asyncio.TimeoutError:
            busy = _Refusal(BUSY, f"all {self.limits.max_transfers} transfer slots stayed taken")
            yield self._refuse(context, request, busy)
            return
        lease = _Lease(self._slots, self.limits.transfer_timeout)
        try:
            async for frame in self._send(request, context, lease):
                yield frame
        finally:
            lease.release()

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
                    log.warning("cut off sending %s of checkpoint %s to %s: it took over %gs", request.file,
                                request.manifest_id, context.remote_id, self.limits.transfer_timeout)
                    return
                left -= len(chunk)
                yield runtime_pb2.ExpertResponse(metadata=chunk)
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
    """A transfer slot, given back when the transfer ends or its time is up, whichever comes first."""

    def __init__(self, slots: asyncio.Semaphore, duration: float):
        self._slots, self._released = slots, False
        self._timer = asyncio.get_running_loop().call_later(duration, self.release)

    @property
    def expired(self) -> bool:
        return self._released

    def release(self) -> None:
        self._timer.cancel()
        if not self._released:
            self._released = True
            self._slots.release()


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
    meta = _unpack(frame.metadata)
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


def _unpack(data: bytes) -> dict | None:
    try:
        meta = msgpack.unpackb(data, raw=False)
    except Exception:  # msgpack raises a zoo of types on garbage; all mean the same to us
        return None
    return meta if isinstance(meta, dict) else None


def _header_frame(meta: dict) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=msgpack.packb(meta, use_bin_type=True))


async def fetch_checkpoint(
    p2p: P2P,
    holder: PeerID,
    run_id: str,
    manifest_id_: str,
    staging_dir: Path,
    *,
    expect_stage: int,
    expect_state_hash: str,
    max_bytes: int,
    expect_run_id: str | None = None,
    expect_step: int | None = None,
    timeout: float = DEFAULT_FETCH_TIMEOUT,
) -> Path:
    """Fetch checkpoint `manifest_id_` of run `run_id` from `holder` into `staging_dir`, verifying every byte.

    `staging_dir` must be empty or absent (e.g. ``StageCheckpoints.new_temp_dir()``); on success it is a
    complete checkpoint directory for ``StageCheckpoints.install``, on failure it is removed.
    The manifest must be for `expect_run_id` (default: `run_id`), `expect_stage` and `expect_state_hash`
    (and `expect_step` if given), its files at most `max_bytes` in all. Raises CheckpointTransferError
    (its `kind` says what went wrong) after at most `timeout` seconds; CheckpointError or OSError for
    trouble with our own disk.
    """
    staging_dir = Path(staging_dir)
    expected = _Expected(expect_run_id or run_id, expect_stage, expect_state_hash, expect_step, max_bytes)
    fetch = _Fetch(p2p, holder, checkpoint_namespace(run_id), manifest_id_, staging_dir, expected)
    await asyncio.to_thread(_make_empty_dir, staging_dir)
    try:
        await asyncio.wait_for(fetch.run(), timeout)
    except BaseException as e:
        shutil.rmtree(staging_dir, ignore_errors=True)
        if isinstance(e, asyncio.TimeoutError):
            raise fetch.error(UNAVAILABLE, f"not complete within {timeout:g}s") from None
        raise
    return staging_dir


async def fetch_newest(
    p2p: P2P,
    records: list[CheckpointRecord],
    run_id: str,
    staging_dir: Path,
    *,
    expect_stage: int,
    expect_state_hash: str,
    max_bytes: int,
    expect_run_id: str | None = None,
    min_step: int = 0,
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    total_timeout: float | None = None,
) -> tuple[Path, HeldCheckpoint, str] | None:
    """The newest checkpoint any of `records`' holders serves correctly: (staging dir, checkpoint, holder).

    Holders are tried newest checkpoint first. One that sends bytes its checkpoint does not hash to is
    banned for the rest of this call, one that cannot be reached is not asked again; either way the
    next holder of the same or an older checkpoint is tried. `timeout` bounds each attempt,
    `total_timeout` (if given) the whole call. None if no holder served one.
    """
    loop = asyncio.get_running_loop()
    deadline = None if total_timeout is None else loop.time() + total_timeout
    candidates = checkpoint_candidates(records, stage=expect_stage, state_hash=expect_state_hash,
                                       min_step=min_step, max_bytes=max_bytes, exclude={str(p2p.peer_id)})
    banned: set[str] = set()  # sent wrong bytes, or could not be reached
    unusable: set[str] = set()  # manifest ids of checkpoints that are not for us
    for held, holder in candidates:
        if holder in banned or held.manifest_id in unusable:
            continue
        left = timeout if deadline is None else min(timeout, deadline - loop.time())
        if left <= 0:
            log.info("gave up fetching a checkpoint of stage %d after %gs", expect_stage, total_timeout)
            break
        try:
            holder_id = PeerID.from_base58(holder)
        except Exception:  # a record's peer id is just a string a peer wrote
            log.debug("skipping checkpoint holder with a malformed peer id %r", holder)
            banned.add(holder)
            continue
        try:
            path = await fetch_checkpoint(
                p2p, holder_id, run_id, held.manifest_id, staging_dir, expect_stage=expect_stage,
                expect_state_hash=expect_state_hash, max_bytes=max_bytes, expect_run_id=expect_run_id,
                expect_step=held.step, timeout=left,
            )
        except CheckpointTransferError as e:
            if e.kind == INVALID:
                log.warning("banning checkpoint holder %s for the rest of this fetch: %s", holder, e.message)
            else:
                log.info("could not use step %d of stage %d: %s", held.step, expect_stage, e)
            if e.kind in (INVALID, UNAVAILABLE):
                banned.add(holder)
            elif e.kind == UNSUITABLE:
                unusable.add(held.manifest_id)
            continue
        return path, held, holder
    return None


def checkpoint_candidates(
    records: list[CheckpointRecord],
    *,
    stage: int,
    state_hash: str,
    max_bytes: int,
    min_step: int = 0,
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[tuple[HeldCheckpoint, str]]:
    """(checkpoint, holder peer id) pairs worth trying, newest step first; holders in `exclude` left out."""
    seen: set[tuple[str, str]] = set()
    candidates = []
    for record in records:
        if record.stage != stage or record.state_hash != state_hash or record.peer_id in exclude:
            continue
        for held in record.checkpoints:
            key = (record.peer_id, held.manifest_id)
            if held.step >= min_step and held.size <= max_bytes and key not in seen:
                seen.add(key)
                candidates.append((held, record.peer_id))
    candidates.sort(key=lambda candidate: candidate[0].step, reverse=True)  # stable: ties keep record order
    return candidates


@dataclass(frozen=True)
class _Expected:
    run_id: str
    stage: int
    state_hash: str
    step: int | None
    max_bytes: int


class _Mismatch(Exception):
    """The holder sent more, or other, bytes than it announced."""


class _Fetch:
    """One checkpoint from one holder: the manifest, checked, then each file it lists, verified."""

    def __init__(self, p2p: P2P, holder: PeerID, namespace: str, manifest_id_: str, staging_dir: Path,
                 expected: _Expected):
        self.p2p, self.holder, self.namespace = p2p, holder, namespace
        self.manifest_id, self.staging_dir, self.expected = manifest_id_, staging_dir, expected

    def error(self, kind: str, message: str) -> CheckpointTransferError:
        return CheckpointTransferError(self.holder, kind, f"checkpoint {self.manifest_id[:12]}: {message}")

    async def run(self) -> None:
        manifest_sink = _Sink(MANIFEST_NAME)
        await self._read_file(MANIFEST_NAME, manifest_sink, max_size=MAX_MANIFEST_BYTES)
        data = manifest_sink.data()
        if manifest_id(data) != self.manifest_id:
            raise self.error(INVALID, f"its manifest.json hashes to {manifest_id(data)[:12]}, not to its id")
        manifest = self._check_manifest(data)
        await asyncio.to_thread(_write_new, self.staging_dir / MANIFEST_NAME, data)
        for name, entry in sorted(manifest.files.items()):
            sink = _Sink(name, self.staging_dir / name)
            try:
                await self._read_file(name, sink, exact_size=entry.size)
            finally:
                await asyncio.to_thread(sink.close)
            if sink.sha256() != entry.sha256:
                raise self.error(INVALID, f"{name} has sha256 {sink.sha256()[:12]}, its manifest says "
                                          f"{entry.sha256[:12]}")

    def _check_manifest(self, data: bytes) -> StageManifest:
        expected = self.expected
        try:
            manifest = StageManifest.from_bytes(data)
        except CheckpointError as e:  # it hashes right, so the announcer, not the sender, is to blame
            raise self.error(UNSUITABLE, f"not a stage manifest this version reads: {e}") from None
        found = (manifest.run_id, manifest.stage, manifest.state_hash)
        if found != (expected.run_id, expected.stage, expected.state_hash):
            raise self.error(UNSUITABLE, f"it is of run {manifest.run_id!r}, stage {manifest.stage}, state hash "
                                         f"{manifest.state_hash[:12]}; wanted run {expected.run_id!r}, stage "
                                         f"{expected.stage}, state hash {expected.state_hash[:12]}")
        total = sum(entry.size for entry in manifest.files.values())
        if total > expected.max_bytes:
            raise self.error(UNSUITABLE, f"its files hold {total} bytes, more than the {expected.max_bytes} allowed")
        if expected.step is not None and manifest.step != expected.step:
            raise self.error(MISLABELED, f"it is of step {manifest.step}, announced as step {expected.step}")
        return manifest

    async def _read_file(self, name: str, sink: _Sink, *, max_size: int | None = None,
                         exact_size: int | None = None) -> None:
        """Stream file `name` into `sink`; its size must be `exact_size`, or at most `max_size`."""
        stub = CheckpointServer.get_stub(self.p2p, self.holder, namespace=self.namespace)
        meta = {"manifest_id": self.manifest_id, "file": name, "offset": 0}
        request = runtime_pb2.ExpertRequest(metadata=msgpack.packb(meta, use_bin_type=True))
        try:
            responses = await stub.rpc_read(iter_as_aiter([request]))
        except Exception as e:  # unreachable, no such protocol, daemon trouble
            raise self.error(UNAVAILABLE, f"cannot ask for {name}: {_describe(e)}") from None
        try:
            size = self._parse_header(name, await self._next_frame(responses, name))
            if (exact_size is not None and size != exact_size) or (max_size is not None and size > max_size):
                wanted = f"its manifest says {exact_size}" if exact_size is not None else f"at most {max_size}"
                raise self.error(INVALID, f"{name} is {size} bytes, {wanted}")
            await asyncio.to_thread(sink.start, size)
            # Reading stops at the announced size: whatever follows (or how the stream ends) is ignored.
            while sink.received < size:
                frame = await self._next_frame(responses, name)
                if frame is None:
                    raise self.error(UNAVAILABLE, f"the stream of {name} ended after {sink.received} of {size} bytes")
                if frame.tensors or not 0 < len(frame.metadata) <= MAX_CHUNK_BYTES:
                    raise self.error(INVALID, f"a data frame of {name} is not 1..{MAX_CHUNK_BYTES} bytes of data")
                try:
                    await asyncio.to_thread(sink.write, frame.metadata)
                except _Mismatch as e:
                    raise self.error(INVALID, str(e)) from None
        finally:
            await responses.aclose()  # stops our sender task and closes the stream, also on early exits

    async def _next_frame(self, responses: AsyncIterator, name: str) -> runtime_pb2.ExpertResponse | None:
        try:
            return await anext(responses, None)
        except Exception as e:  # a broken connection or hivemind's own error reply
            raise self.error(UNAVAILABLE, f"receiving {name} failed: {_describe(e)}") from None

    def _parse_header(self, name: str, frame: runtime_pb2.ExpertResponse | None) -> int:
        if frame is None:
            raise self.error(UNAVAILABLE, f"the stream ended before the reply to the request for {name}")
        meta = _unpack(frame.metadata) if len(frame.metadata) <= MAX_HEADER_BYTES and not frame.tensors else None
        if meta is None:
            raise self.error(INVALID, f"the reply to the request for {name} is not a header")
        if meta.get("ok") is not True:
            code, message = meta.get("code"), meta.get("error")
            kind = UNAVAILABLE if code == BUSY else REFUSED  # a busy holder is not asked again in this fetch
            raise self.error(kind, f"refused {name}: [{code!s:.40}] {message!s:.{MAX_ERROR_CHARS}}")
        size, offset = meta.get("size"), meta.get("offset")
        if type(size) is not int or size < 0 or offset != 0:
            raise self.error(INVALID, f"the header for {name} has size {size!r:.40} and offset {offset!r:.40}")
        return size


class _Sink:
    """Takes one file's bytes as they arrive, never more than announced, hashing them; to a file or to memory."""

    def __init__(self, name: str, path: Path | None = None):
        self.name, self.path = name, path
        self.size = self.received = 0
        self._digest = hashlib.sha256()
        self._parts: list[bytes] = []
        self._file: BinaryIO | None = None

    def start(self, size: int) -> None:
        self.size = size
        if self.path is not None:
            self._file = open(self.path, "xb")  # noqa: SIM115 (closed by close())

    def write(self, data: bytes) -> None:
        if self.received + len(data) > self.size:
            raise _Mismatch(f"sent more of {self.name} than the {self.size} bytes announced")
        self.received += len(data)
        self._digest.update(data)
        if self._file is None:
            self._parts.append(data)
        else:
            self._file.write(data)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

    def data(self) -> bytes:
        return b"".join(self._parts)

    def sha256(self) -> str:
        return self._digest.hexdigest()


def _make_empty_dir(path: Path) -> None:
    if path.exists() and any(path.iterdir()):
        raise CheckpointError(f"staging directory {path} is not empty: give a fresh one for each fetch")
    path.mkdir(parents=True, exist_ok=True)


def _write_new(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)


def _describe(error: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
