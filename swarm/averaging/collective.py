"""A sharded round's messages between the servers of a stage, over libp2p (the server's own P2P).

hivemind's all-reduce returns every member the mean gradient; a sharded step needs something else
on the way back (each chunk's update, computed by the members that hold that chunk's moments), so
hivemind's matchmaking still forms each round's group (swarm.averaging.process) and this module
carries what follows, in the communication of one all-reduce:

1. reduce-scatter: every member with samples sends the gradient sum of each chunk to its primary;
2. every member sends every other one its partial sum of squares (the global norm, for clipping);
3. all-gather: each primary steps its chunks and sends each chunk's update to every member, the
   clipped mean gradient to the chunk's co-owners (who step their own copy of its moments) and
   the moments themselves to targets that do not hold them yet (churn).

A round is all-or-nothing for each member: it returns an update for every chunk, or raises
RoundFailed and nothing changes. Every message is checked before it is kept: a known kind, a
chunk of this layout, a member of the round as its (libp2p-authenticated) sender, tensors of the
chunk's size, bounded early buffering for rounds not yet opened here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.averaging.errors import AveragingError
from swarm.dht.loop import BackgroundLoop
from swarm.protocol.codec import encode_tensor
from swarm.protocol.framing import WireLimits, decode_metadata, encode_metadata
from swarm.zero import ChunkMoments, Layout, Plan, adam_chunks, clip_coefficient

log = logging.getLogger(__name__)

GRAD, NORM, UPDATE, MEAN, STATE = "grad", "norm", "update", "mean", "state"
KINDS = (GRAD, NORM, UPDATE, MEAN, STATE)
TENSORS_OF = {GRAD: 1, NORM: 0, UPDATE: 1, MEAN: 1, STATE: 2}
MAX_ROUND_KEY = 96
MAX_CONCURRENT_SENDS = 16
EARLY_ROUNDS = 4  # rounds whose messages may arrive before this server opened them
# One message packs consecutive chunks for one peer: at most this many float32 values in all its tensors
# (1 MiB, well under hivemind's 2 MiB unary cap) and this many chunks (its metadata lists them).
MESSAGE_ELEMENTS = 2**18
MESSAGE_CHUNKS = 2048
LIMITS = WireLimits(max_metadata_bytes=32 * 1024)
# co-owners step the same moments on the same gradient; their updates should be equal
AGREEMENT_ATOL = 1e-6

Key = tuple[str, int, str]  # (kind, chunk, sender)


@dataclass(frozen=True)
class Item:
    """One chunk's part of a message to `peer`: the chunk's slice of each tensor (and its step count for moments)."""

    peer: str
    kind: str
    chunk: int
    tensors: tuple[torch.Tensor, ...]
    steps: int = 0


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
        self.max_early_bytes = 4 * layout.numel * 4 + 2**20  # a bit more than one round can send us
        self.dropped = 0

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
        if kind not in KINDS or not isinstance(chunks, list) or len(chunks) > MESSAGE_CHUNKS:
            raise ValueError(f"bad kind or list of chunks: {kind!r}")
        if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < self.layout.num_chunks for c in chunks) \
                or any(a >= b for a, b in zip(chunks, chunks[1:])):
            raise ValueError("chunks must be increasing ids of this layout")
        if len(request.tensors) != TENSORS_OF[kind]:
            raise ValueError(f"a {kind} message carries {TENSORS_OF[kind]} tensors, got {len(request.tensors)}")
        if kind == NORM:
            value = meta.get("value")
            if chunks or not isinstance(value, float) or value < 0:  # (nan and inf pass: every member then skips)
                raise ValueError("a norm message carries a sum of squares and no chunks")
            return round_key, [((NORM, 0, sender), value)]
        if not chunks:
            raise ValueError(f"a {kind} message without chunks")
        sizes = [self.layout.chunk_numel(c) for c in chunks]
        tensors = [_float32_vector(t, sum(sizes)) for t in request.tensors]
        parts = [t.split(sizes) for t in tensors]
        if kind in (UPDATE, MEAN) and not math.isfinite(float(tensors[0].sum())):  # (grads may: all then skip)
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
    def send(self, round_key: str, items: list[Item], deadline: float, norm: tuple[list[str], float] | None = None
             ) -> int:
        """Send `items` packed into as few messages as the limits allow (and a norm to each of norm's peers),
        concurrently; RoundFailed unless every message was taken. Returns the bytes sent."""
        requests = [(peer, _request({"round": round_key, "kind": NORM, "chunks": [], "value": norm[1]}, []))
                    for peer in (norm[0] if norm is not None else [])]
        for batch in _packed(items):
            first = batch[0]
            meta = {"round": round_key, "kind": first.kind, "chunks": [item.chunk for item in batch]}
            if first.kind == STATE:
                meta["steps"] = [item.steps for item in batch]
            tensors = [torch.cat([item.tensors[i] for item in batch]) for i in range(len(first.tensors))]
            requests.append((first.peer, _request(meta, tensors)))
        if not requests:
            return 0
        sent = sum(sum(len(t.buffer) for t in request.tensors) for _, request in requests)
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


@dataclass
class RoundResult:
    """What a sharded round gives a member: the update of every chunk and its moments after the step."""

    update: torch.Tensor | None  # flat; None when the step is skipped (a non-finite gradient norm)
    moments: dict[int, ChunkMoments]  # the chunks this member owns after the round
    grad_norm: float
    bytes_sent: int = 0
    transfers_in: int = 0  # chunks whose moments came from another member
    transfers_out: int = 0
    fresh: list[int] = field(default_factory=list)  # chunks nobody held: stepped from zero moments
    disagreements: int = 0  # co-owned chunks whose own update differed from the primary's


@dataclass(frozen=True)
class Hyper:
    """The AdamW settings a round needs (the rest is the replica's: lr, weight decay)."""

    beta1: float
    beta2: float
    eps: float
    grad_clip: float


def run_round(mailbox: Mailbox, round_key: str, plan: Plan, me: str, grad_sums: torch.Tensor,
              moments: Mapping[int, ChunkMoments], hyper: Hyper, deadline: float) -> RoundResult:
    """This member's part of one sharded round (on the averaging thread); RoundFailed if it cannot end whole."""
    layout = mailbox.layout
    inbox = mailbox.open_round(round_key, plan.members)
    try:
        return _run(mailbox, inbox, round_key, plan, me, layout, grad_sums, moments, hyper, deadline)
    finally:
        mailbox.close_round(round_key)


def _run(mailbox: Mailbox, inbox: _Inbox, round_key: str, plan: Plan, me: str, layout: Layout,
         grad_sums: torch.Tensor, moments: Mapping[int, ChunkMoments], hyper: Hyper, deadline: float) -> RoundResult:
    def chunk_of(flat: torch.Tensor, c: int) -> torch.Tensor:
        start, end = layout.bounds(c)
        return flat[start:end]

    def wait(keys: list[Key]) -> dict[Key, Any]:
        return inbox.wait(keys, deadline, mailbox.send_timeout)

    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.zeros(0)

    others = [m for m in plan.members if m != me]
    mine = plan.primary_of(me)  # (increasing: every chunk-wise list below follows this order)
    sizes = [layout.chunk_numel(c) for c in mine]
    senders = plan.senders()
    # 1. reduce-scatter: gradient sums to each chunk's primary
    sent = 0
    if plan.samples[me] > 0:
        sent += mailbox.send(round_key, [Item(plan.primary[c], GRAD, c, (chunk_of(grad_sums, c),))
                                         for c in range(layout.num_chunks) if plan.primary[c] != me], deadline)
    got = wait([(GRAD, c, s) for c in mine for s in senders if s != me])
    mean = torch.zeros(sum(sizes))
    for sender in senders:  # (in a fixed order)
        mean += joined([chunk_of(grad_sums, c) if sender == me else got[(GRAD, c, sender)] for c in mine])
    mean.div_(plan.total_samples)
    partial = float(mean.double().square().sum())
    # 2. the global norm
    sent += mailbox.send(round_key, [], deadline, norm=(others, partial))
    norms = wait([(NORM, 0, peer) for peer in others])
    partials = [partial if m == me else norms[(NORM, 0, m)] for m in plan.members]
    grad_norm, scale = clip_coefficient(partials, hyper.grad_clip)
    if not math.isfinite(scale):  # every member sees the same norm: all skip this step
        return RoundResult(None, dict(moments), grad_norm, sent)
    # 3. all-gather: each primary steps its chunks and sends the update
    result = RoundResult(None, {}, grad_norm)
    if scale != 1.0:
        mean.mul_(scale)
    grads = list(mean.split(sizes))
    result.fresh = [c for c in mine if c not in moments]
    before = [moments[c] if c in moments else ChunkMoments.zeros(layout.chunk_numel(c)) for c in mine]
    stepped_mine, updates = adam_chunks(before, grads, hyper.beta1, hyper.beta2, hyper.eps)
    stepped = dict(zip(mine, stepped_mine))
    update_of = dict(zip(mine, updates))
    outgoing = []
    for c, grad, update in zip(mine, grads, updates):
        outgoing += [Item(peer, UPDATE, c, (update,)) for peer in others]
        outgoing += [Item(peer, MEAN, c, (grad,)) for peer in plan.co_owners[c]]
        outgoing += [Item(peer, STATE, c, (stepped[c].exp_avg, stepped[c].exp_avg_sq), stepped[c].steps)
                     for peer in plan.receivers[c]]
        result.transfers_out += len(plan.receivers[c])
    sent += mailbox.send(round_key, outgoing, deadline)
    theirs = [c for c in range(layout.num_chunks) if plan.primary[c] != me]
    co_owned = [c for c in theirs if me in plan.co_owners[c]]
    received = [c for c in theirs if me in plan.receivers[c]]
    got = wait([(UPDATE, c, plan.primary[c]) for c in theirs] + [(MEAN, c, plan.primary[c]) for c in co_owned]
               + [(STATE, c, plan.primary[c]) for c in received])
    update_of.update((c, got[(UPDATE, c, plan.primary[c])]) for c in theirs)
    result.update = torch.cat([update_of[c] for c in range(layout.num_chunks)])
    # co-owners step their own copy of the moments on the primary's gradient, and check they agree
    stepped_co, own = adam_chunks([moments[c] for c in co_owned], [got[(MEAN, c, plan.primary[c])] for c in co_owned],
                                  hyper.beta1, hyper.beta2, hyper.eps)
    stepped.update(zip(co_owned, stepped_co))
    theirs_updates = [got[(UPDATE, c, plan.primary[c])] for c in co_owned]
    if co_owned and not torch.allclose(joined(own), joined(theirs_updates), rtol=0, atol=AGREEMENT_ATOL):
        result.disagreements = sum(not torch.allclose(a, b, rtol=0, atol=AGREEMENT_ATOL)
                                   for a, b in zip(own, theirs_updates))
    for c in received:
        stepped[c] = got[(STATE, c, plan.primary[c])]
    result.transfers_in = len(received)
    if not math.isfinite(float(result.update.sum())):  # (a sum is finite if every element is, and cheap)
        raise RoundFailed("a primary sent a non-finite update")
    result.moments = {c: stepped[c] for c in plan.owned_by(me)}
    result.bytes_sent = sent
    return result


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
                or len(batches[-1]) >= MESSAGE_CHUNKS:
            batches.append([])
            elements = 0
        batches[-1].append(item)
        elements += size
    return batches


def _request(meta: dict, tensors: list[torch.Tensor]) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=encode_metadata(meta), tensors=[encode_tensor(t, "float32")
                                                                              for t in tensors])


def _payload_bytes(payload: Any) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * 4
    if isinstance(payload, ChunkMoments):
        return payload.nbytes
    return 64
