"""Every use of hivemind's private names, in one package (written against hivemind 1.1.12): here, and in
streams.py (P2P's protobuf streams, replaced so that the caller closes first).

hivemind offers no public way to do these things, and each one matters (see where they are used).
Nothing else in swarm touches a name of hivemind's that starts with an underscore (the RPC gate of
a private swarm replaces P2P's methods through :func:`wrap_p2p_rpc_methods`, by role).
The unit tests test_hivemind_internals (and, for the gate's four methods, test_rpc_gate) fail if
hivemind renames or reshapes any of them, so an upgrade breaks a named test instead of a running swarm.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import hivemind.averaging.averager as hivemind_averager
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.partition import TensorPartReducer
from hivemind.compression import serialize_torch_tensor
from hivemind.dht.schema import SchemaValidator
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.mpfuture import MPFuture, SharedBytes
from hivemind.utils.multiaddr import Multiaddr

from swarm.hivemind_internals.streams import callers_close_first

log = logging.getLogger(__name__)

UNKNOWN_GROUP_WAIT = 3.0  # seconds a part for a group not registered here waits for it (AveragerInternals)
UNKNOWN_GROUP_POLL = 0.02


class RoundRefused(RuntimeError):
    """Raised by our hooks in the averaging process to fail a round that hivemind would count a success.

    It reaches the round's caller through the round's future, where hivemind's step sets it; hivemind then
    raises it again out of its step task, which nobody awaits ("Task exception was never retrieved", an
    ERROR with a traceback for a failure the round's own WARN already reports): AveragerInternals stops it
    there."""


class AveragerInternals(DecentralizedAverager):
    """A DecentralizedAverager whose private parts are reached through named methods, and whose
    private hooks call public ones a subclass overrides."""

    all_reduce_bytes: Any = None  # a shared counter of the bytes its all-reduce rounds send (PolicyAllReduceRunner)

    # --- hooks hivemind calls in the averaging process, routed to ours ----------------------------

    def run(self) -> None:
        # The averaging process's entry point: from here on, every all-reduce it runs reduces its
        # part with the policy `reducer_policy` names (hivemind builds its runner by this module name).
        policy = self.reducer_policy()
        if policy is not None:
            hivemind_averager.AllReduceRunner = functools.partial(PolicyAllReduceRunner, policy=policy,
                                                                  sent=self.all_reduce_bytes,
                                                                  canonical=self.canonical_grid())
        super().run()

    async def _declare_for_download_periodically(self) -> None:
        await self.declare_for_download()

    async def _trigger_declare_load_state(self) -> None:
        self.on_sharing_changed()

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any) -> Any:
        if not self.runs_all_reduce():
            return self._group_only(group_info)
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        # the round's runner is still registered under its group id until this returns
        registered = self._running_groups.get(group_info.group_id)
        runner = registered.result() if registered is not None and registered.done() else None
        container = getattr(runner, "tensor_part_container", None)
        self.after_all_reduce(getattr(container, "failed_size", 0), getattr(container, "total_size", 0))
        reducer = getattr(runner, "tensor_part_reducer", None)
        weights = getattr(reducer, "sender_weights", None) or ()
        counted = {peer: weight for peer, weight in zip(getattr(runner, "sender_peer_ids", ()), weights)
                   if weight is not None}
        return self.with_counted_weights(gathered, counted)

    async def _step(self, **kwargs: Any) -> None:
        try:
            await super()._step(**kwargs)
        except RoundRefused:
            pass  # hivemind has set it on the round's future, where the caller reads it

    async def rpc_aggregate_part(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        # A part for a group this member does not run: hivemind waits for the next group it registers. A member
        # whose leader's word that the group formed never reached it (the join stream ended empty, 2 x 2 swarms:
        # ~1 round in 200) still looks for a group, so that wait lasted its whole matchmaking window, and the
        # leader's round waited as long (next_chunk_timeout), 10 s and more a stall. Bounded here: a group that
        # has not registered within unknown_group_wait() is refused, and the sender's round fails at once.
        first = await anext(stream)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.unknown_group_wait()
        while first.group_id not in self._running_groups and loop.time() < deadline:
            await asyncio.sleep(UNKNOWN_GROUP_POLL)
        if first.group_id not in self._running_groups:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        async for message in super().rpc_aggregate_part(_first_then(first, stream), context):
            yield message

    def unknown_group_wait(self) -> float:
        """In the child: how long a part for a group not (yet) registered here waits for it (the leader's word
        that the group formed may come after a member's part)."""
        return UNKNOWN_GROUP_WAIT

    def _group_only(self, group_info: Any) -> dict[Any, Any]:
        """Each member's gather data, each with the round's group id, and no all-reduce (a sharded round
        carries its own data): the group's membership is all the caller wants."""
        gathered = {}
        for peer, raw in zip(group_info.peer_ids, group_info.gathered):
            _, _, user_bytes = self.serializer.loads(raw)
            data = self.serializer.loads(user_bytes)
            if isinstance(data, dict):
                data["group_id"] = group_info.group_id.hex()
            gathered[peer] = data
        registered = self._running_groups.get(group_info.group_id)
        if registered is not None and not registered.done():
            registered.set_result(None)  # (hivemind warns about a registered group that never ran)
        return gathered

    def reducer_policy(self) -> ReducerPolicy | None:
        """In the child: how this member reduces its part of each all-reduce (None: hivemind's weighted mean)."""
        return None

    def canonical_grid(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """In the child: with a reducer policy, a function that rounds each averaged part onto the codec's grid, for
        all-reduce rounds whose members must all end with the same values (PolicyAllReduceRunner); None: hivemind's
        replies, each member's difference from the mean."""
        return None

    def runs_all_reduce(self) -> bool:
        """In the child: whether a formed group runs hivemind's all-reduce (else the round only forms the group)."""
        return True

    async def declare_for_download(self) -> None:
        """In the child: keep this replica declared as a state source (hivemind's own way by default)."""
        await super()._declare_for_download_periodically()

    def on_sharing_changed(self) -> None:
        """In the child: the parent changed allow_state_sharing or state_sharing_priority."""

    def after_all_reduce(self, failed_size: int, total_size: int) -> None:
        """In the child, after a round's all-reduce: `failed_size` of `total_size` elements came back
        unaveraged (a member failed partway). Raise to fail the round."""

    def with_counted_weights(self, gathered: dict[Any, Any], counted: dict[Any, float]) -> dict[Any, Any]:
        """In the child, after a round's all-reduce: the round's result, given the weight this member's
        reducer counted each sender's contribution with (by peer id; a weight can be set after the group
        formed, so the gather data cannot carry it). Returns `gathered` unchanged by default."""
        return gathered

    # --- private parts, by name --------------------------------------------------------------------

    def state_sources_key(self) -> str:
        """The DHT key under which replicas offer their state for download (in the child)."""
        return f"{self._matchmaking.group_key_manager.prefix}.all_averagers"

    def set_group(self, group_bits: str, group_size: int) -> None:
        """In the child, between rounds: the group key's bits and the group size the next round waits for."""
        matchmaking = self._matchmaking
        matchmaking.group_key_manager.group_bits = group_bits
        matchmaking.target_group_size = matchmaking.group_key_manager.target_group_size = group_size

    def key_manager(self) -> GroupKeyManager:
        """In the child: the matchmaking's group key manager (which declares and finds averagers)."""
        return self._matchmaking.group_key_manager

    def use_key_manager(self, manager: GroupKeyManager) -> None:
        """In the child, between rounds: have matchmaking declare and find averagers through `manager`."""
        self._matchmaking.group_key_manager = manager

    def averaged_tensors(self) -> Sequence[torch.Tensor]:
        """The shared-memory buffers the all-reduce averages (hold lock_averaged_tensors)."""
        return self._averaged_tensors

    def send_to_child(self, method: str, future: MPFuture, **kwargs: Any) -> None:
        """Have the averaging process run `await self.<method>(**kwargs, future=future)`."""
        self._outer_pipe.send((method, [], dict(kwargs, future=future)))

    def child_p2p(self) -> P2P:
        """The averaging process's own P2P replica (in the child)."""
        return self._p2p


class ReducerPolicy:
    """How a reducer turns the contributions to its part into the averaged part: `aggregate(parts, weights)`
    returns the result, `sanitize(part, weight)` the contribution as counted (both pure, see averaging/robust)."""

    def sanitize(self, part: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
        raise NotImplementedError

    def counted_weight(self, weight: float) -> float:
        """The weight a contribution claiming `weight` counts with, whatever its values."""
        raise NotImplementedError

    def aggregate(self, parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        raise NotImplementedError


class _Contributions:
    """Stands in for a TensorPartReducer's accumulator (hivemind calls add_ per contribution, then div_
    once all have come): keeps the contributions, and aggregates them by the policy instead of summing;
    `finish` (if any) turns the aggregate into the part's result."""

    def __init__(self, policy: ReducerPolicy, finish: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.policy = policy
        self.finish = finish
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, part: torch.Tensor, *, alpha: float = 1.0) -> _Contributions:
        part, weight = self.policy.sanitize(part, alpha)
        self.parts.append(part)
        self.weights.append(weight)
        return self

    def div_(self, _denominator: float) -> torch.Tensor:  # hivemind's sum of the claimed weights: not used
        result = self.policy.aggregate(self.parts, self.weights)
        return result if self.finish is None else self.finish(result)


class PolicyPartReducer(TensorPartReducer):
    """hivemind's reducer (its ordering, waiting and failure handling), aggregating each part by a policy;
    with `canonical`, each part's result is rounded by it and kept in `results` (by part index)."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, policy: ReducerPolicy,
                 canonical: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.policy = policy
        self.canonical = canonical
        self.results: dict[int, torch.Tensor] = {}
        # what each sender's weight counted as, from its first part (hivemind sends one weight with each)
        self.sender_weights: list[float | None] = [None] * num_senders
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        if 0 <= sender_index < len(self.sender_weights) and self.sender_weights[sender_index] is None:
            self.sender_weights[sender_index] = self.policy.counted_weight(weight)
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():  # the last part done: hivemind finalized and dropped its accumulator
            self.accumulator = _Contributions(self.policy, None if self.canonical is None else self._rounded)

    def _rounded(self, result: torch.Tensor) -> torch.Tensor:
        rounded = self.canonical(result).to(result.dtype)
        self.results[self.current_part_index] = rounded
        return rounded


class PolicyAllReduceRunner(AllReduceRunner):
    """hivemind's all-reduce runner whose reducer aggregates by `policy`, and which adds the bytes of the
    messages it sends (parts to their reducers, averaged parts back to their senders) to `sent`, a
    shared counter (swarm.traffic.shared_counter) that the process which forked this one reads.

    With `canonical` (a function that rounds a tensor onto the round's codec grid, exactly as the codec
    sends it), every member ends with the same values: a reducer rounds its averaged part, keeps that for
    itself and sends it (not each sender's difference from it, hivemind's way) to every sender, whose own
    part of the vector becomes it. hivemind's differences, each rounded by a lossy codec on its way, leave each
    member its own rounding (with 8-bit codecs, a few percent of the difference).
    """

    def __init__(self, *args: Any, policy: ReducerPolicy, sent: Any = None,
                 canonical: Callable[[torch.Tensor], torch.Tensor] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        plain = self.tensor_part_reducer
        plain.finished.set()  # replaced before any part arrived: it must not report what it never received
        self.tensor_part_reducer = PolicyPartReducer(plain.part_shapes, plain.num_senders, policy, canonical)
        self._sent = sent
        self._canonical = canonical
        if canonical is not None:
            self._take_results_as_values()

    def _take_results_as_values(self) -> None:
        """Make the container read a reducer's reply as the part's value (the sender's difference to it is then
        this member's update), except for its own part (hivemind registers that one's difference itself) and a
        reducer that failed (hivemind registers no change)."""
        container = self.tensor_part_container
        own = self.ordered_peer_ids.index(self.peer_id)
        register, fail = container.register_processed_part, container.register_failed_reducer
        failed: set[int] = set()

        def register_processed_part(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            if peer_index != own and peer_index not in failed:
                local = container._input_parts_by_peer[peer_index][part_index][0]
                if part.shape != local.shape:  # (a difference would broadcast: fail this reducer's part instead)
                    raise ValueError(f"reducer {peer_index} sent part {part_index} of shape {list(part.shape)}, "
                                     f"expected {list(local.shape)}")
                part = part.to(local.dtype) - local
            register(peer_index, part_index, part)

        def register_failed_reducer(peer_index: int) -> None:
            failed.add(peer_index)
            fail(peer_index)

        container.register_processed_part = register_processed_part
        container.register_failed_reducer = register_failed_reducer

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        try:
            await super()._communicate_with_peer(peer_id)
        except Exception:
            # Its part of the vector is lost, so the round is partial whatever else the peer sends: stop waiting
            # for its parts of ours too (hivemind waits next_chunk_timeout for them; a member that was never in
            # the group sends none). Both ends then fail alike, where one could step while the other retried.
            if peer_id in self.sender_peer_ids:
                await self._ban_sender(peer_id)
            raise

    def _count(self, message: Any) -> Any:
        if self._sent is not None:
            self._sent.value += message.ByteSize()  # one event loop: no other writer in this process
        return message

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        async for message in super()._generate_input_for_peer(peer_index):
            yield self._count(message)

    async def rpc_aggregate_part(self, stream: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        part_index = 0
        async for message in super().rpc_aggregate_part(stream, context):
            if self._canonical is not None and message.code == averaging_pb2.AVERAGED_PART:
                # the part's rounded value, the same for every sender, instead of this sender's difference to it
                value = self.tensor_part_reducer.results[part_index]
                message.tensor_part.CopyFrom(serialize_torch_tensor(value, message.tensor_part.compression))
                part_index += 1
            yield self._count(message)


# Every RPC of hivemind 1.1.12's P2P goes through these four methods, by role: stream handlers (protobuf
# stream handlers are built on them) and unary ones, which go through the daemon client directly.
P2P_RPC_METHODS = {"add_stream": "add_binary_stream_handler", "call_stream": "call_binary_stream_handler",
                   "add_unary": "_add_protobuf_unary_handler", "call_unary": "_call_unary_protobuf_handler"}


def wrap_p2p_rpc_methods(replacements: dict[str, Any]) -> dict[str, Any]:
    """Put `replacements` (by role, as P2P_RPC_METHODS names them) in place of P2P's methods; hivemind's own,
    by role, for the replacements to call."""
    originals = {role: getattr(P2P, P2P_RPC_METHODS[role]) for role in replacements}
    for role, method in replacements.items():
        setattr(P2P, P2P_RPC_METHODS[role], method)
    return originals


def mend_p2p() -> None:
    """hivemind's P2P with our two mends, in this process and the processes it forks (call before forking
    them and before handlers are added): a stream is closed by its caller, once the handler's last reply has
    come (streams.py), and the unary calls' reader survives a reply to a call cancelled in the same instant."""
    callers_close_first()
    keep_reading_after_a_late_reply()


def keep_reading_after_a_late_reply() -> None:
    """From now on, in this process (and the processes it forks), a reply from p2pd to a unary call that was
    cancelled in the same instant no longer stops this process's unary calls for good.

    hivemind's client reads every reply to a unary call (and every unary request to our handlers) from one
    persistent connection to p2pd, in one task. A call cancelled (its timeout, or its caller cancelled)
    cancels the future its reply resolves; when that reply is already waiting to be read in the same
    event-loop turn, the reader sets a result on the cancelled future, raises InvalidStateError and ends:
    from then on no reply and no request on that connection is read, so every unary call from and to the
    process times out. Seen in 2 x 2 swarms (1 run in 3 to 5): a stage's matchmaking declarations (sent
    straight, averaging.direct_matchmaking) all timed out from partway through the run, its every round
    formed only through the DHT after averaging.request_timeout, steps grew to 128 samples and the two
    stages parted by hundreds of steps. The DHT's own calls are unary too. Here the reader picks up with
    the next message instead: the late reply is dropped, as it would have been a moment later.
    """
    read = ControlClient._read_from_persistent_conn
    if getattr(read, "_keeps_reading", False):
        return

    async def keep_reading(self, reader):
        while True:
            try:
                return await read(self, reader)
            except asyncio.InvalidStateError:  # (the message that raised it was read whole: the next one is next)
                log.debug("p2pd answered a unary call cancelled in the same instant; reading on")

    keep_reading._keeps_reading = True
    ControlClient._read_from_persistent_conn = keep_reading


async def _first_then(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def add_p2pd_flags(flags: dict[str, Any], with_trusted_relays: dict[str, Any] | None = None) -> None:
    """From now on, in this process, start every p2pd with `flags` (name -> value) beside hivemind's, and
    `with_trusted_relays` too where hivemind passes ``trustedRelays``.

    hivemind's P2P.create passes only some of p2pd's flags; the relay ones we need (``relayDiscovery``,
    ``relayService``) go through its private argument builder. Called in the DHT process, before
    hivemind creates its P2P there; a flag hivemind also sets is left as hivemind sets it. Not every
    daemon of the process is ours: hivemind starts a throwaway one, with auto-relay but no relays, to
    check that a persistent identity is free, and p2pd refuses to start with auto-relay, no relays
    and no relay discovery; hence the second set.
    """
    build = P2P.__dict__["_make_process_args"].__func__
    relayed = with_trusted_relays or {}

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        extra = {**flags, **relayed} if kwargs.get("trustedRelays") else flags
        return build(*args, **{**extra, **kwargs})

    P2P._make_process_args = staticmethod(with_flags)


def forget_inherited_p2p_socket(dht: Any) -> None:
    """In a forked child: make the parent's P2P replica, inherited through `dht`, unable to unlink the
    parent's client socket when it is collected (P2P.__del__ would), or the parent's handlers go deaf."""
    inherited = getattr(dht, "_p2p_replica", None)
    if inherited is not None:
        inherited._client_listen_maddr = None


def public_key_der(public_key: RSAPublicKey) -> bytes:
    """The DER (SubjectPublicKeyInfo) bytes of hivemind's RSAPublicKey, which keeps its key privately."""
    return public_key._public_key.public_bytes(encoding=serialization.Encoding.DER,
                                               format=serialization.PublicFormat.SubjectPublicKeyInfo)


def private_key_from(loaded: rsa.RSAPrivateKey) -> RSAPrivateKey:
    """hivemind's RSAPrivateKey around an already loaded key. Its constructor would generate a key
    to throw away (slow); fill an empty instance instead, as hivemind's own unpickling does."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = loaded
    return key


def schema_count(validator: SchemaValidator) -> int:
    """How many schemas a SchemaValidator checks (more than one once merged with another)."""
    return len(validator._schemas)


class DeathReleasedLock:
    """A lock a process shares with every process it forks, which the kernel releases when a holder dies.

    hivemind orders the writes of a whole family of processes to an update pipe (results of futures
    made in another process) with one multiprocessing lock created at import, MPFuture._update_lock.
    A process killed while it held that lock left it held for good: every other process of the family
    then waited forever on its next result for another process (a volunteer's DHT and averaging
    processes, and the server itself through them). A crash or a SIGKILL can come at any time; the
    lock is held for each result sent.

    This lock is an flock on an unlinked file. The kernel releases an flock when the last descriptor
    of its open file closes, which it does when the holder dies. flock excludes open files, not
    processes or threads: so each forked process opens the file anew (:meth:`reopen_in_child`, from
    the fork hook) and closes what it inherited, and a thread lock orders the threads of one process.
    """

    def __init__(self) -> None:
        fd, path = tempfile.mkstemp(prefix="swarm-update-lock-")
        os.unlink(path)  # the descriptors keep the file; nothing is left on disk
        self._fd = fd
        self._threads = threading.Lock()

    def reopen_in_child(self) -> None:
        """In a forked child: an open file of its own (the inherited one is its parent's), a new thread lock."""
        inherited = self._fd
        self._fd = os.open(f"/proc/self/fd/{inherited}", os.O_RDWR | os.O_CLOEXEC)
        os.close(inherited)
        self._threads = threading.Lock()

    def acquire(self, blocking: bool = True) -> bool:
        if not self._threads.acquire(blocking):
            return False
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # (not blocking: another process holds it)
            self._threads.release()
            return False
        except BaseException:
            self._threads.release()
            raise
        return True

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _own_mpfuture_locks() -> None:
    """In a forked child: new locks for the MPFuture state that is each process's own.

    hivemind guards its per-process allocator of future states (SharedBytes) and its per-process
    backend start with locks created at import, so every forked child shares its parent's. A child
    killed while it held one (the averaging process makes two futures a round; a crash or a SIGKILL
    can come at any time) left it held for good, and the parent's next future, of any DHT call, then
    waited forever (seen: a test run hung in SharedBytes.next after a child was killed). The state
    these locks guard is re-made in each process anyway (both check the pid), so a child's own lock
    loses nothing. hivemind's lock for writes to another process's pipe (MPFuture._update_lock) does
    guard state the family shares: it stays one lock for the family, one a dead holder cannot keep
    (DeathReleasedLock).
    """
    SharedBytes._lock = mp.Lock()
    MPFuture._initialization_lock = mp.Lock()
    if isinstance(MPFuture._update_lock, DeathReleasedLock):
        MPFuture._update_lock.reopen_in_child()


if sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd"):  # (flock; reopened through /proc)
    MPFuture._update_lock = DeathReleasedLock()
os.register_at_fork(after_in_child=_own_mpfuture_locks)


async def connect(p2p: P2P, peer: PeerID, maddrs: Sequence[str]) -> None:
    """Have `p2p`'s daemon connect to `peer` at `maddrs` (hivemind's P2P has no public call for this). The
    /p2p/ part is cut off: p2pd cannot decode hivemind's encoding of it."""
    await p2p._client.connect(peer, [Multiaddr(maddr.split("/p2p/", 1)[0]) for maddr in maddrs])


async def open_stream(p2p: P2P, peer: PeerID, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw libp2p stream to `peer` on `protocol`, not one of hivemind's handlers (a relay's hop protocol)."""
    _info, reader, writer = await p2p._client.stream_open(peer, (protocol,))
    return reader, writer

