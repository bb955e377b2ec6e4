"""Fetching checkpoints from peers: every byte verified, holders that lie banned (wire format: wire.py).

The fetcher trusts nothing: the manifest must hash to the id it asked for, every file to its manifest
entry, and a file longer than its entry is cut off at once. What hashes right is genuinely the
announced checkpoint; whether that checkpoint deserves trust is the announcer's, not the bytes', affair.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgpack
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter

from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, StageManifest, manifest_id
from swarm.checkpoint.serving import CheckpointServer  # for its RPC stub only
from swarm.checkpoint.wire import (
    BUSY,
    MAX_CHUNK_BYTES,
    MAX_ERROR_CHARS,
    MAX_HEADER_BYTES,
    checkpoint_namespace,
    unpack_map,
)
from swarm.dht.schemas import CheckpointRecord, HeldCheckpoint

log = logging.getLogger(__name__)

DEFAULT_FETCH_TIMEOUT = 600.0  # one whole checkpoint (manifest and every file) from one holder
# The longest a holder may leave us waiting for its next frame (the header, or the next chunk of at most
# 1 MiB; a holder may first wait up to 10 s for a free transfer slot). One that sends a header and then
# nothing is given up on after this, not after the whole fetch timeout, and the next holder is tried.
DEFAULT_IDLE_TIMEOUT = 30.0

# Why a fetch failed, as CheckpointTransferError.kind; fetch_newest decides what to try next from it.
INVALID = "invalid"  # the holder sent bytes that do not match what it announced: ban it
UNSUITABLE = "unsuitable"  # a genuine checkpoint, but not one we can use (other run, stage, too big...)
MISLABELED = "mislabeled"  # a genuine checkpoint, but of another step than its record said
REFUSED = "refused"  # the holder answered with an error reply
UNAVAILABLE = "unavailable"  # unreachable, no answer in time, or the stream broke off


class CheckpointTransferError(CheckpointError):
    """Fetching a checkpoint from `holder` failed; `kind` says whose fault it was (see the constants above)."""

    def __init__(self, holder: PeerID | str, kind: str, message: str):
        super().__init__(f"checkpoint from {holder}: {message}")
        self.holder, self.kind, self.message = str(holder), kind, message


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
    expect_part: str = "stage",
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
) -> Path:
    """Fetch checkpoint `manifest_id_` of run `run_id` from `holder` into `staging_dir`, verifying every byte.

    `staging_dir` must be empty or absent (e.g. ``StageCheckpoints.new_temp_dir()``); on success it is a
    complete checkpoint directory for ``StageCheckpoints.install``, on failure it is removed.
    The manifest must be for `expect_run_id` (default: `run_id`), `expect_part` `expect_stage` and `expect_state_hash`
    (and `expect_step` if given), its files at most `max_bytes` in all. Raises CheckpointTransferError
    (its `kind` says what went wrong) after at most `timeout` seconds, or as soon as the holder sends
    nothing for `idle_timeout` seconds; CheckpointError or OSError for trouble with our own disk.
    """
    staging_dir = Path(staging_dir)
    expected = _Expected(expect_run_id or run_id, expect_stage, expect_state_hash, expect_step, max_bytes, expect_part)
    fetch = _Fetch(p2p, holder, checkpoint_namespace(run_id), manifest_id_, staging_dir, expected, idle_timeout)
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
    expect_part: str = "stage",
    timeout: float = DEFAULT_FETCH_TIMEOUT,
    total_timeout: float | None = None,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
) -> tuple[Path, HeldCheckpoint, str] | None:
    """The newest checkpoint any of `records`' holders serves correctly: (staging dir, checkpoint, holder).

    Holders are tried newest checkpoint first. One that sends bytes its checkpoint does not hash to is
    banned for the rest of this call, one that cannot be reached, or stops sending for `idle_timeout`
    seconds, is not asked again; either way the next holder of the same or an older checkpoint is
    tried. `timeout` bounds each attempt, `total_timeout` the whole call (default: `timeout`, so that
    slow holders, however many, cost a caller no more than one would). None if no holder served one.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (timeout if total_timeout is None else total_timeout)
    candidates = checkpoint_candidates(records, stage=expect_stage, state_hash=expect_state_hash,
                                       min_step=min_step, max_bytes=max_bytes, exclude={str(p2p.peer_id)},
                                       part=expect_part)
    banned: set[str] = set()  # sent wrong bytes, or could not be reached
    unusable: set[str] = set()  # manifest ids of checkpoints that are not for us
    for held, holder in candidates:
        if holder in banned or held.manifest_id in unusable:
            continue
        left = min(timeout, deadline - loop.time())
        if left <= 0:
            log.info("gave up fetching a checkpoint of %s %d: no time left of the %gs allowed", expect_part,
                     expect_stage, timeout if total_timeout is None else total_timeout)
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
                expect_step=held.step, expect_part=expect_part, timeout=left, idle_timeout=idle_timeout,
            )
        except CheckpointTransferError as e:
            if e.kind == INVALID:
                log.warning("banning checkpoint holder %s for the rest of this fetch: %s", holder, e.message)
            else:
                log.info("could not use step %d of %s %d: %s", held.step, expect_part, expect_stage, e)
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
    part: str = "stage",
) -> list[tuple[HeldCheckpoint, str]]:
    """(checkpoint, holder peer id) pairs worth trying, newest step first; holders in `exclude` left out."""
    seen: set[tuple[str, str]] = set()
    candidates = []
    for record in records:
        if (record.part, record.stage) != (part, stage) or record.state_hash != state_hash or record.peer_id in exclude:
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
    part: str = "stage"


class _Mismatch(Exception):
    """The holder sent more, or other, bytes than it announced."""


class _Fetch:
    """One checkpoint from one holder: the manifest, checked, then each file it lists, verified."""

    def __init__(self, p2p: P2P, holder: PeerID, namespace: str, manifest_id_: str, staging_dir: Path,
                 expected: _Expected, idle_timeout: float = DEFAULT_IDLE_TIMEOUT):
        self.p2p, self.holder, self.namespace = p2p, holder, namespace
        self.manifest_id, self.staging_dir, self.expected = manifest_id_, staging_dir, expected
        self.idle_timeout = idle_timeout

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
        found = (manifest.run_id, manifest.part, manifest.stage, manifest.state_hash)
        if found != (expected.run_id, expected.part, expected.stage, expected.state_hash):
            raise self.error(UNSUITABLE, f"it is of run {manifest.run_id!r}, {manifest.part} {manifest.stage}, state "
                                         f"hash {manifest.state_hash[:12]}; wanted run {expected.run_id!r}, "
                                         f"{expected.part} {expected.stage}, state hash {expected.state_hash[:12]}")
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
            return await asyncio.wait_for(anext(responses, None), self.idle_timeout)
        except asyncio.TimeoutError:  # a holder that stalls is given up on now, not at the end of the fetch
            raise self.error(UNAVAILABLE, f"sent nothing of {name} for {self.idle_timeout:g}s") from None
        except Exception as e:  # a broken connection or hivemind's own error reply
            raise self.error(UNAVAILABLE, f"receiving {name} failed: {_describe(e)}") from None

    def _parse_header(self, name: str, frame: runtime_pb2.ExpertResponse | None) -> int:
        if frame is None:
            raise self.error(UNAVAILABLE, f"the stream ended before the reply to the request for {name}")
        meta = unpack_map(frame.metadata) if len(frame.metadata) <= MAX_HEADER_BYTES and not frame.tensors else None
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
