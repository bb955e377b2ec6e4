"""A sharded round's messages between the servers of a stage, over libp2p (the server's own P2P).

hivemind's all-reduce returns every member the mean gradient; a sharded step needs something else
on the way back (each chunk's update, computed by the members that hold that chunk's moments), so
hivemind's matchmaking still forms each round's group (swarm.averaging.process), and the round's
messages (swarm.averaging.zero_round says what each carries and when) go through the Mailbox here:
gradients, each owner's sums of squares, updates, co-owners' digests of theirs, and moments.

Every message is checked before it is kept: a known kind, a chunk of this layout, a member of the
round as its (libp2p-authenticated) sender, tensors of the chunk's size, finite updates and moments,
bounded early buffering for rounds not yet opened here. A message packs many chunks for one peer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.averaging.crosscheck import DIGEST_BYTES
from swarm.averaging.errors import AveragingError
from swarm.dht.loop import BackgroundLoop
from swarm.protocol.codec import encode_tensor
from swarm.protocol.framing import WireLimits, decode_metadata, encode_metadata
from swarm.zero import ChunkMoments, Layout

log = logging.getLogger(__name__)

GRAD, NORM, UPDATE, CHECK, STATE = "grad", "norm", "update", "check", "state"
KINDS = (GRAD, NORM, UPDATE, CHECK, STATE)
TENSORS_OF = {GRAD: 1, NORM: 0, UPDATE: 1, CHECK: 0, STATE: 2}
MAX_ROUND_KEY = 96
MAX_CONCURRENT_SENDS = 16
EARLY_ROUNDS = 4  # rounds whose messages may arrive before this server opened them
# One message packs consecutive chunks for one peer: at most this many float32 values in all its tensors
# (1 MiB, well under hivemind's 2 MiB unary cap) and this many chunks (its metadata lists them).
MESSAGE_ELEMENTS = 2**18
MESSAGE_CHUNKS = 2048
CHECK_CHUNKS = 1024  # a check message lists one or two digests a chunk in its metadata
LIMITS = WireLimits(max_metadata_bytes=32 * 1024)

Key = tuple[str, int, str]  # (kind, chunk, sender)


@dataclass(frozen=True)
class Item:
    """One chunk's part of a message to `peer`: the chunk's slice of each tensor (and its step count for
    moments, its sum of squares for a norm, its digests for a check)."""

    peer: str
    kind: str
    chunk: int
    tensors: tuple[torch.Tensor, ...] = ()
    steps: int = 0
    value: float = 0.0
    digest: bytes = b""


class RoundFailed(AveragingError):
    """A sharded round ended without an update for every chunk (a member gone, a timeout, bad data)."""


def handler_name(prefix: str) -> str:
    return f"{prefix}.zero"


class _Inbox:
    """What arrived for one round, for the averaging thread to wait on."""

    def __init__(self, members: frozenset[str]):
        self.members = members
        self.messages: dict[Key, Any] = {}
        self.ready = threading.Condition()
        self.arrived = time.monotonic()  # when the last message came

    def put(self, messages: list[tuple[Key, Any]]) -> None:
        with self.ready:
            for key, payload in messages:
                self.messages.setdefault(key, payload)  # a repeat never replaces what came first
            self.arrived = time.monotonic()
            self.ready.notify_all()

    def wait(self, keys: Iterable[Key], deadline: float, silence: float = math.inf) -> dict[Key, Any]:
        """Every message of `keys`; RoundFailed at `deadline`, or once nothing has come for `silence` seconds."""
        wanted = set(keys)
        started = time.monotonic()
        with self.ready:
            while True:
                missing = wanted - self.messages.keys()
                if not missing:
                    return {key: self.messages[key] for key in wanted}
                now = time.monotonic()
                quiet_until = max(started, self.arrived) + silence
                if now >= min(deadline, quiet_until):
                    kinds = sorted({f"{kind} from {sender[-8:]}" for kind, _, sender in missing})
                    why = "in time" if now >= deadline else f"and nothing came for {silence:g}s"
                    raise RoundFailed(f"{len(missing)} messages did not come {why} ({', '.join(kinds[:4])})")
                self.ready.wait(min(deadline, quiet_until) - now)


class Mailbox:
    """The stage's sharded-round handler on this server: takes messages, sends ours."""

    def __init__(self, p2p: P2P, loop: BackgroundLoop, prefix: str, layout: Layout, send_timeout: float):
        self.p2p, self.loop, self.name, self.layout = p2p, loop, handler_name(prefix), layout
        self.send_timeout = send_timeout
        self._lock = threading.Lock()
        self._rounds: dict[str, _Inbox] = {}
        # messages of rounds not opened here yet: a peer may begin a moment before us
        self._early: dict[str, list[tuple[Key, Any]]] = {}
        self._early_bytes = 0
        # a bit more than one round can send us: r gradients' and one update's worth, and its norms and checks
        self.max_early_bytes = 4 * layout.numel * 4 + 256 * layout.num_chunks + 2**20
        self.dropped = 0
        # a seam for tests: what this server sends passes through it (a test's liar rewrites its updates)
        self.outbound: Callable[[list[Item]], list[Item]] | None = None

    async def open(self) -> None:
        await self.p2p.add_protobuf_handler(self.name, self._handle, runtime_pb2.ExpertRequest)

    async def close(self) -> None:
        await self.p2p.remove_protobuf_handler(self.name)

    def open_round(self, key: str, members: Iterable[str]) -> _Inbox:
        inbox = _Inbox(frozenset(members))
        with self._lock:
            self._rounds[key] = inbox
            early = self._early.pop(key, [])
            self._early_bytes -= sum(_payload_bytes(p) for _, p in early)
        inbox.put([(key, payload) for key, payload in early if key[2] in inbox.members])
        return inbox

    def close_round(self, key: str) -> None:
        with self._lock:
            self._rounds.pop(key, None)

    # receiving (on the loop)
    async def _handle(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:
            round_key, messages = self._parse(request, context.remote_id.to_base58())
            self._deliver(round_key, messages)
            return runtime_pb2.ExpertResponse(metadata=encode_metadata({"ok": True}))
        except Exception as e:  # noqa: BLE001 - a malformed message is refused; the handler keeps serving
            self.dropped += 1
            log.debug("refused a sharded-round message from %s: %s", context.remote_id, e)
            return runtime_pb2.ExpertResponse(metadata=encode_metadata({"error": str(e)[:200]}))

    def _parse(self, request: runtime_pb2.ExpertRequest, sender: str) -> tuple[str, list[tuple[Key, Any]]]:
        """(round key, [((kind, chunk, sender), payload), ...]) of one message; ValueError if anything is off."""
        meta = decode_metadata(request.metadata, LIMITS)
        round_key, kind, chunks = meta.get("round"), meta.get("kind"), meta.get("chunks")
        if not isinstance(round_key, str) or not 0 < len(round_key) <= MAX_ROUND_KEY:
            raise ValueError("bad round key")
        if kind not in KINDS or not isinstance(chunks, list) or \
                len(chunks) > (CHECK_CHUNKS if kind == CHECK else MESSAGE_CHUNKS):
            raise ValueError(f"bad kind or list of chunks: {kind!r}")
        if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < self.layout.num_chunks for c in chunks) \
                or any(a >= b for a, b in zip(chunks, chunks[1:])):
            raise ValueError("chunks must be increasing ids of this layout")
        if len(request.tensors) != TENSORS_OF[kind]:
            raise ValueError(f"a {kind} message carries {TENSORS_OF[kind]} tensors, got {len(request.tensors)}")
        if not chunks:
            raise ValueError(f"a {kind} message without chunks")
        if kind == NORM:
            values = meta.get("values")
            # (nan and inf pass: a chunk whose owners all say so makes every member skip the step)
            if not isinstance(values, list) or len(values) != len(chunks) or \
                    not all(isinstance(v, float) and not v < 0 for v in values):
                raise ValueError("a norm message carries a sum of squares (a float, not negative) per chunk")
            return round_key, [((NORM, c, sender), v) for c, v in zip(chunks, values)]
        if kind == CHECK:
            digests = meta.get("digests")
            if not isinstance(digests, list) or len(digests) != len(chunks) or \
                    not all(isinstance(d, bytes) and len(d) in (DIGEST_BYTES, 2 * DIGEST_BYTES) for d in digests):
                raise ValueError("a check message carries one or two digests per chunk")
            return round_key, [((CHECK, c, sender), (d[:DIGEST_BYTES], d[DIGEST_BYTES:] or None))
                               for c, d in zip(chunks, digests)]
        sizes = [self.layout.chunk_numel(c) for c in chunks]
        tensors = [_float32_vector(t, sum(sizes)) for t in request.tensors]
        parts = [t.split(sizes) for t in tensors]
        if kind == UPDATE and not math.isfinite(float(tensors[0].sum())):  # (grads may: all then skip)
            raise ValueError(f"a non-finite {kind}")
        if kind != STATE:
            return round_key, [((kind, c, sender), part) for c, part in zip(chunks, parts[0])]
        steps = meta.get("steps")
        if not isinstance(steps, list) or len(steps) != len(chunks) or \
                not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in steps):
            raise ValueError("moments without their step counts")
        if not all(bool(torch.isfinite(t).all()) for t in tensors) or bool((tensors[1] < 0).any()):
            raise ValueError("moments with non-finite or negative second moments")
        return round_key, [((STATE, c, sender), ChunkMoments(m, v, n))
                           for c, m, v, n in zip(chunks, parts[0], parts[1], steps)]

    def _deliver(self, round_key: str, messages: list[tuple[Key, Any]]) -> None:
        with self._lock:
            inbox = self._rounds.get(round_key)
            if inbox is None:
                size = sum(_payload_bytes(payload) for _, payload in messages)
                if self._early_bytes + size > self.max_early_bytes or \
                        (round_key not in self._early and len(self._early) >= EARLY_ROUNDS):
                    raise ValueError("too much for rounds not opened here")
                self._early.setdefault(round_key, []).extend(messages)
                self._early_bytes += size
                return
        if any(key[2] not in inbox.members for key, _ in messages):
            raise ValueError("the sender is not a member of this round")
        inbox.put(messages)

    def forget_early(self, keep: Iterable[str] = ()) -> None:
        """Drop early messages of rounds other than `keep` (those rounds are over or never came)."""
        kept = set(keep)
        with self._lock:
            for round_key in [k for k in self._early if k not in kept]:
                self._early_bytes -= sum(_payload_bytes(p) for _, p in self._early.pop(round_key))

    # sending (from the averaging thread)
    def send(self, round_key: str, items: list[Item], deadline: float) -> int:
        """Send `items` packed into as few messages as the limits allow, concurrently; RoundFailed unless
        every message was taken. Returns the bytes sent (tensors and metadata)."""
        if self.outbound is not None:
            items = self.outbound(items)
        requests = _requests(round_key, items)
        if not requests:
            return 0
        sent = sum(sum(len(t.buffer) for t in request.tensors) + len(request.metadata) for _, request in requests)
        timeout = max(0.0, deadline - time.monotonic())
        try:
            self.loop.run(self._send_all(requests), timeout)
        except TimeoutError:
            raise RoundFailed(f"sending {len(requests)} messages took over {timeout:.1f}s") from None
        return sent

    async def _send_all(self, requests: list[tuple[str, runtime_pb2.ExpertRequest]]) -> None:
        slots = asyncio.Semaphore(MAX_CONCURRENT_SENDS)

        async def one(peer: str, request: runtime_pb2.ExpertRequest) -> None:
            async with slots:
                reply = await asyncio.wait_for(self.p2p.call_protobuf_handler(
                    PeerID.from_base58(peer), self.name, request, runtime_pb2.ExpertResponse), self.send_timeout)
            answer = decode_metadata(reply.metadata, LIMITS)
            if not answer.get("ok"):
                raise RoundFailed(f"{peer[-8:]} refused a message: {answer.get('error')}")

        results = await asyncio.gather(*(one(p, r) for p, r in requests), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RoundFailed(f"{len(errors)} of {len(requests)} messages were not delivered: "
                              f"{type(errors[0]).__name__}: {errors[0]}")


@dataclass(frozen=True)
class Hyper:
    """The AdamW settings a round needs (the rest is the replica's: lr, weight decay)."""

    beta1: float
    beta2: float
    eps: float
    grad_clip: float


def _float32_vector(serialized: runtime_pb2.Tensor, numel: int) -> torch.Tensor:
    """A float32 vector of `numel` elements as sent (uncompressed), read in place: no copy of the bytes
    (hivemind's decoder copies them twice). Read-only: what keeps it copies it first."""
    if serialized.compression != runtime_pb2.CompressionType.NONE or serialized.dtype != "float32" or \
            list(serialized.size) != [numel] or len(serialized.buffer) != 4 * numel:
        raise ValueError(f"expected {numel} uncompressed float32 elements, got {list(serialized.size)} "
                         f"{serialized.dtype} in {len(serialized.buffer)} bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch warns that the bytes are not writable)
        return torch.frombuffer(serialized.buffer, dtype=torch.float32) if numel else torch.zeros(0)


def _packed(items: list[Item]) -> list[list[Item]]:
    """Items grouped into messages: one peer and kind each, chunks increasing, within the message limits."""
    batches: list[list[Item]] = []
    elements = 0
    for item in sorted(items, key=lambda i: (i.peer, i.kind, i.chunk)):
        size = sum(t.numel() for t in item.tensors)
        last = batches[-1][-1] if batches else None
        if last is None or (last.peer, last.kind) != (item.peer, item.kind) or elements + size > MESSAGE_ELEMENTS \
                or len(batches[-1]) >= (CHECK_CHUNKS if item.kind == CHECK else MESSAGE_CHUNKS):
            batches.append([])
            elements = 0
        batches[-1].append(item)
        elements += size
    return batches


def _requests(round_key: str, items: list[Item]) -> list[tuple[str, runtime_pb2.ExpertRequest]]:
    """The messages that carry `items`, each with the peer it goes to."""
    requests = []
    for batch in _packed(items):
        first = batch[0]
        meta: dict[str, Any] = {"round": round_key, "kind": first.kind, "chunks": [item.chunk for item in batch]}
        if first.kind == STATE:
            meta["steps"] = [item.steps for item in batch]
        elif first.kind == NORM:
            meta["values"] = [float(item.value) for item in batch]
        elif first.kind == CHECK:
            meta["digests"] = [item.digest for item in batch]
        tensors = [torch.cat([item.tensors[i] for item in batch]) for i in range(len(first.tensors))]
        requests.append((first.peer, _request(meta, tensors)))
    return requests


def _request(meta: dict, tensors: list[torch.Tensor]) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=encode_metadata(meta), tensors=[encode_tensor(t, "float32")
                                                                              for t in tensors])


def _payload_bytes(payload: Any) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * 4
    if isinstance(payload, ChunkMoments):
        return payload.nbytes
    return 64
