"""hivemind's DecentralizedAverager behind a small sync API where every wait is bounded.

The averager is a child process (forked) that owns a set of shared-memory buffers: matchmaking
forms a group in the DHT, then a butterfly all-reduce replaces every member's buffers with the
weighted mean of the group's. The same process serves this replica's state to peers that download
it. What this wrapper adds:

- every hivemind timeout set from the config, and every call here bounded (hivemind's own
  ``step``/``set_group_bits``/``run_in_background`` can wait forever);
- ``prepare_round``: the group key carries the step, so only servers at the same step ever meet,
  and the target group size is the number of servers expected, so a round starts as soon as all
  of them have joined instead of waiting out ``min_matchmaking_time``;
- ``arm`` / ``run_round``: a round's group forms ahead, while the batch fills, and its all-reduce
  waits for the batch (hivemind's require_trigger); each member's weight (its samples) is set when
  it closes its batch, and what the round averaged over is read from the weights the reducers
  counted, since the gather data has left before then;
- signals: hivemind ignores SIGINT in the parent for good when it starts its child; we keep the
  parent's handler, and the child dies with its parent (no orphaned averagers).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming

from swarm.averaging.codecs import Float8Codec, float8_grid
from swarm.averaging.direct import Declarations, DirectKeyManager
from swarm.averaging.errors import AveragingError
from swarm.averaging.robust import RobustPolicy
from swarm.config import AveragingConfig
from swarm.dht.node import collect_before_fork
from swarm.hivemind_internals import AveragerInternals, RoundRefused, forget_inherited_p2p_socket, mend_p2p
from swarm.protocol.framing import DEFAULT_LIMITS, answered_ok, decode_metadata, encode_metadata
from swarm.tasks import keep_tasks_alive
from swarm.traffic import shared_counter

logger = logging.getLogger(__name__)

STEP_KEY_BITS = 16  # the group key holds the step modulo 2**16
PR_SET_PDEATHSIG = 1  # linux/prctl.h

StateSource = Callable[[], tuple[Any, Sequence[torch.Tensor]]]


class RoundFailed(AveragingError):
    """An averaging round ended without a result (no group, a timeout, a broken all-reduce)."""


class PartialRound(RoundRefused):
    """An all-reduce that lost part of the averaged vector (a member failed partway).

    hivemind keeps the member's own values for the missing part and reports success, so the
    survivors' buffers would differ; raised instead, in the averaging process, and not retried by
    hivemind (it is none of the errors it retries on).
    """


def total_samples(gathered: dict[Any, Any], step: int, max_samples: int | None = None) -> tuple[int, int]:
    """Samples behind a round's mean gradient, and how many of them came late, from what each member sent.

    A member's claim counts for at most `max_samples` (what its reducers weigh it by at most, too).
    """
    total = late = 0
    for info in gathered.values():
        if not isinstance(info, dict) or info.get("step") != step or not isinstance(info.get("samples"), int) \
                or not isinstance(info.get("late", 0), int) or info["samples"] < 0 or info.get("late", 0) < 0:
            raise RoundFailed(f"a member of the group sent {info!r}, expected step {step} and its samples")
        samples = info["samples"] if max_samples is None else min(info["samples"], max_samples)
        total += samples
        late += min(info.get("late", 0), samples)
    if total <= 0:
        raise RoundFailed("nobody in the group had samples")
    return total, late


class AveragingProcess(AveragerInternals):
    """Averages ``buffers`` with the servers of one stage; serves ``state_source()`` to downloaders."""

    def __init__(self, buffers: Sequence[torch.Tensor], dht: Any, *, prefix: str, config: AveragingConfig,
                 compression: CompressionBase, state_source: StateSource, declare_period: float,
                 all_reduce: bool = True, max_weight: float = float("inf")):
        self._state_source = state_source
        self.config = config
        self._policy = RobustPolicy(max_weight, config.aggregation, config.clip_factor)
        self._all_reduce = all_reduce  # False: sharded rounds, where a round only forms the group
        self.round_compression = compression
        # declarations sent straight to this member (used in the child)
        self._declarations = Declarations(prefix, config.matchmaking_timeout + config.min_matchmaking_time)
        self.all_reduce_bytes = shared_counter()  # added to in the averaging process, read in this one
        keep_tasks_alive()  # before the averaging process is forked: its loop holds its rounds' tasks
        mend_p2p()  # and its reducers deliver their last parts, its declarations' replies are read
        super().__init__(
            buffers,
            dht,
            start=False,
            prefix=prefix,
            target_group_size=config.target_group_size,
            min_group_size=2,
            initial_group_bits=step_bits(0),
            min_matchmaking_time=config.min_matchmaking_time,
            request_timeout=config.request_timeout,
            allreduce_timeout=config.allreduce_timeout,
            next_chunk_timeout=config.next_chunk_timeout,
            sender_timeout=config.next_chunk_timeout,
            reducer_timeout=2 * config.next_chunk_timeout,
            compression=compression,
            allow_state_sharing=False,  # not before this replica holds the stage's state
            declare_state_period=declare_period,  # how long a "download my state here" entry lives
            client_mode=False,
            shutdown_timeout=config.shutdown_timeout,
        )

    def canonical_grid(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        # float8: every member takes the reducers' rounded means as they are (PolicyAllReduceRunner), not each its
        # own rounding of its difference from them (a few percent of it at 8 bits: the replicas would part)
        return float8_grid if isinstance(self.round_compression, Float8Codec) else None

    def reducer_policy(self) -> RobustPolicy:
        return self._policy

    def start_process(self, timeout: float) -> None:
        """Fork the averaging process and wait until it serves (launch, then wait_started).

        The process ignores the SIGINT a terminal sends to the whole process group (this process
        stops it, after leaving cleanly), and dies with this process. This process keeps its own
        SIGINT handler (hivemind would ignore SIGINT here for good).
        """
        self.launch()
        self.wait_started(timeout)

    def launch(self) -> None:
        """Fork the averaging process (start_process says how), without waiting for it."""
        collect_before_fork()
        self._forked_by_main_thread = threading.current_thread() is threading.main_thread()
        self._owner_pid = os.getpid()
        if self._forked_by_main_thread:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                self.start()  # the child inherits "ignore"
            finally:
                signal.signal(signal.SIGINT, previous)
        else:
            self.start()  # signal handlers can only change on the main thread; the child keeps ours

    def wait_started(self, timeout: float) -> None:
        """Wait until a launched process serves (several can be launched first, then waited for together)."""
        try:
            self.wait_until_ready(timeout)
        except Exception as e:
            self.close()
            if isinstance(e, TimeoutError):
                raise AveragingError(f"the averaging process did not start within {timeout:g}s") from None
            raise AveragingError(f"the averaging process failed to start: {type(e).__name__}: {e}") from e

    def run(self) -> None:
        # in the child. The death signal comes when the thread that forked us ends: only the main one
        # lives as long as its process.
        if self._forked_by_main_thread:
            _die_with_parent(self._owner_pid)
        # The DHT object still holds the parent's P2P replica, and hivemind replicates anew here
        # (another pid). Once the inherited copy is collected, P2P.__del__ would unlink the parent's
        # listen socket, and the parent's stage handlers would never receive a request again. With
        # no path, the copy's cleanup removes nothing (its TypeError is suppressed).
        forget_inherited_p2p_socket(self.dht)
        super().run()

    async def declare_for_download(self) -> None:
        # In the child. hivemind's own version re-declares this replica in the DHT whenever its
        # tensors change, which during an all-reduce is once per averaged tensor: dozens of DHT
        # stores competing with the round for CPU (measured: rounds 40% slower). This one declares
        # when sharing is switched on or off, and to renew the entry each declare period.
        key = self.state_sources_key()
        changed = self._sharing_changed()
        was_allowed = False
        while True:
            expiration = get_dht_time() + self.declare_state_period
            allowed = self.allow_state_sharing
            if allowed or was_allowed:  # None overwrites the entry once sharing is switched off
                value = self.state_sharing_priority if allowed else None
                asyncio.create_task(self._declare(key, value, expiration))
            was_allowed = allowed
            changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=max(0.0, expiration - get_dht_time()))

    def on_sharing_changed(self) -> None:
        self._sharing_changed().set()

    def _sharing_changed(self) -> asyncio.Event:
        if getattr(self, "_sharing_event", None) is None:
            self._sharing_event = asyncio.Event()  # created in the child, on its event loop
        return self._sharing_event

    async def _declare(self, key: str, value: float | None, expiration: float) -> None:
        try:
            await asyncio.wait_for(self.dht.store(key, subkey=self.peer_id.to_bytes(), value=value,
                                                  expiration_time=expiration, return_future=True),
                                   timeout=max(0.0, expiration - get_dht_time()))
        except Exception as e:  # noqa: BLE001 - a peer downloading our state will try another one
            logger.debug("declaring the state for download failed: %s", e)

    @contextlib.contextmanager
    def buffers(self) -> Iterator[Sequence[torch.Tensor]]:
        """The averaging buffers, while no all-reduce touches them (hivemind's get_tensors, bounded)."""
        if not self.is_alive():
            raise RoundFailed("the averaging process is not running")
        # a process killed amid an all-reduce would hold this lock forever
        timeout = self.config.allreduce_timeout + self.config.request_timeout
        if not self.lock_averaged_tensors.acquire(timeout=timeout):
            raise RoundFailed(f"the averaging buffers stayed locked for {timeout:g}s")
        try:
            yield self.averaged_tensors()
        finally:
            self.lock_averaged_tensors.release()

    @property
    def process_id(self) -> int | None:
        """The averaging process's pid (for operators, and tests that kill it)."""
        return self.pid

    def unknown_group_wait(self) -> float:
        return self.config.request_timeout  # (as long as a member waits for a leader's word at matchmaking)

    def runs_all_reduce(self) -> bool:
        return self._all_reduce

    def after_all_reduce(self, failed_size: int, total_size: int) -> None:
        if failed_size:
            raise PartialRound(f"the all-reduce returned {100 * (1 - failed_size / max(total_size, 1)):.1f}% of the "
                               f"averaged vector: a member failed partway")

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo]]:
        # hivemind calls this on a thread of the parent process when a peer downloads our state
        metadata, tensors = self._state_source()
        return metadata, tensors, [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]

    def prepare_round(self, step: int, group_size: int, members: Sequence[str] = ()) -> None:
        """Meet only servers at `step`; start the all-reduce as soon as `group_size` have joined. `members`
        (peer ids) are the others expected: matchmaking declarations go straight to them (direct.py)."""
        size = max(2, min(group_size, self.config.target_group_size))
        self._call("_set_round", self.config.request_timeout, group_bits=step_bits(step), group_size=size,
                   members=list(members))

    async def _set_round(self, group_bits: str, group_size: int, members: list[str], future: MPFuture) -> None:
        # runs in the child, between rounds (the parent waits for each round before the next)
        try:
            if self.config.direct_matchmaking:
                self._declarations.expect(_peer_ids(members))
                manager = self.key_manager()
                if not isinstance(manager, DirectKeyManager):
                    self.use_key_manager(DirectKeyManager(manager, self._declarations, self._send_declaration,
                                                          self.config.request_timeout))
            self.set_group(group_bits, group_size)
            future.set_result(None)
        except Exception as e:  # the caller gets it
            future.set_exception(e)

    async def add_p2p_handlers(self, p2p: Any, wrapper: Any = None, *, namespace: str | None = None) -> None:
        # in the child, as it starts: hivemind's handlers, and ours for declarations sent straight to us
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace)
        if self.config.direct_matchmaking:
            await p2p.add_protobuf_handler(declarations_handler(self.prefix), self._take_declaration,
                                           runtime_pb2.ExpertRequest)

    async def _take_declaration(self, request: runtime_pb2.ExpertRequest,
                                context: P2PContext) -> runtime_pb2.ExpertResponse:
        taken = False
        try:
            meta = decode_metadata(request.metadata, DEFAULT_LIMITS)
            taken = self._declarations.take(context.remote_id, meta.get("key"), meta.get("expiration"),
                                            meta.get("looking"))
        except Exception as e:  # noqa: BLE001 - a malformed declaration is dropped; the handler keeps serving
            logger.debug("dropped a matchmaking declaration from %s: %s", context.remote_id, e)
        return runtime_pb2.ExpertResponse(metadata=encode_metadata({"ok": taken}))

    async def _send_declaration(self, peers: Iterable[PeerID], key: str, expiration: float, looking: bool) -> bool:
        request = runtime_pb2.ExpertRequest(
            metadata=encode_metadata({"key": key, "expiration": expiration, "looking": looking}))
        return all(await asyncio.gather(*(self._declare_to(peer, request) for peer in peers)))

    async def _declare_to(self, peer: PeerID, request: runtime_pb2.ExpertRequest) -> bool:
        """Whether `peer` took the declaration."""
        try:
            reply = await asyncio.wait_for(self.child_p2p().call_protobuf_handler(
                peer, declarations_handler(self.prefix), request, runtime_pb2.ExpertResponse),
                self.config.request_timeout)
            return answered_ok(reply.metadata)
        except Exception as e:  # noqa: BLE001 - a server gone or slow: the DHT carries the declaration
            logger.debug("sending a matchmaking declaration to %s failed: %r", peer, e)
            return False

    def arm(self, step: int, group_size: int, gather: dict, members: Sequence[str] = (),
            matchmaking_timeout: float | None = None) -> StepControl:
        """Begin forming the round for `step` with `group_size` servers (`members`: the others expected), in
        the background: the group forms while the batch fills, and the all-reduce waits for :meth:`run_round`.
        Every member's `gather` travels at matchmaking, so it can only say what is known now (the step).
        `matchmaking_timeout`: how long the group may take to form (averaging.matchmaking_timeout by default)."""
        self.prepare_round(step, group_size, members)
        if not self.is_alive():
            raise RoundFailed("the averaging process is not running")
        # No retries: hivemind's child learns of a cancel through a pipe, and a cancelled round it retries
        # (it has not heard yet) lives on until its deadline, holding the matchmaking lock and joining the
        # peers' groups as a member that never takes part; seen to fail a stage's rounds for minutes. A
        # failed round is handled by StageAverager instead (a new round for the same batch, armed afresh).
        timeout, scheduled = self.config.matchmaking_timeout, None  # (None: hivemind's, min_matchmaking_time on)
        if matchmaking_timeout is not None:  # a shorter window: a group still missing members gives up sooner too
            timeout = matchmaking_timeout
            scheduled = get_dht_time() + min(self.config.min_matchmaking_time, timeout / 2)
        return self.step(gather=gather, weight=0.0, timeout=timeout, scheduled_time=scheduled, require_trigger=True,
                         allow_retries=False, wait=False)

    def run_round(self, control: StepControl, weight: float, stop: threading.Event,
                  nobody_left: Callable[[], bool]) -> tuple[dict[Any, Any], float]:
        """Let an armed round (:meth:`arm`) average the buffers, weighted by `weight`, and wait for it.

        Returns each member's gather data and the seconds from this call until this member's
        all-reduce began (its group formed, if it had not yet). Raises RoundFailed after at most the
        matchmaking and all-reduce timeouts (plus a request_timeout), soon after `stop` is set, or when
        `nobody_left()` while still matchmaking.
        """
        config = self.config
        started = time.monotonic()
        limit = config.matchmaking_timeout + config.allreduce_timeout + config.request_timeout
        deadline = started + limit

        def give_up() -> bool:
            return stop.is_set() or (control.stage == AveragingStage.LOOKING_FOR_GROUP and nobody_left())

        try:
            control.weight = weight
            control.allow_allreduce()
            formed = _wait_until_formed(control, deadline, give_up) - started
            gathered = _wait(control, deadline - time.monotonic(), give_up)
        except GaveUp:
            control.cancel()
            reason = "left before the group formed" if stop.is_set() else "nobody left to average with"
            raise RoundFailed(reason) from None
        except TimeoutError:
            control.cancel()
            raise RoundFailed(f"no result within {limit:g}s") from None
        except (Exception, asyncio.CancelledError) as e:  # hivemind's matchmaking and all-reduce errors
            raise RoundFailed(f"{type(e).__name__}: {e}") from None
        if not gathered:
            raise RoundFailed("no group formed")
        return gathered, formed

    def with_counted_weights(self, gathered: dict[Any, Any], counted: dict[Any, float]) -> dict[Any, Any]:
        # in the child: a member's samples are the weight its contribution counted with (the gather data,
        # sent before the batch was closed, cannot say); one this reducer never heard from counts 0
        for peer, info in gathered.items():
            if isinstance(info, dict) and "samples" not in info:
                info["samples"] = int(round(counted.get(peer, 0.0)))
        return gathered

    def download_state(self, timeout: float, stop: threading.Event, exclude: Sequence[str] = (), max_bytes: int = 0,
                       only: Sequence[str] | None = None) -> tuple[Any, list[torch.Tensor], str] | None:
        """The state of the first peer that shares one and is not in `exclude` (peer ids), and that peer; with
        `only`, peers of `only` alone, asked in its order (the caller ranks them by their signed progress
        records); without, in random order. None if none came within `timeout`. A peer that sends more than
        `max_bytes` of tensors (0: no limit) is cut off and the next one tried."""
        if not self.is_alive():
            raise AveragingError("the averaging process is not running")
        future = MPFuture()
        self.send_to_child("_download_state", future, exclude=list(exclude), max_bytes=max_bytes,
                           only=None if only is None else list(only))
        try:
            return _wait(future, timeout, stop.is_set)
        except TimeoutError:  # GaveUp included
            future.cancel()
            return None

    async def _download_state(self, exclude: list[str], max_bytes: int, future: MPFuture,
                              only: list[str] | None = None) -> None:
        # In the child: like hivemind's _load_state_from_peers, but it skips peers the caller refused
        # (a state that failed its checks), bounds what a peer may send, and says who sent the state.
        try:
            key = self.state_sources_key()
            found = await self.dht.get(key, latest=True, return_future=True)
            offers = found.value if found is not None and isinstance(found.value, dict) else {}
            offered = [PeerID(peer) for peer, item in offers.items()
                       if isinstance(peer, bytes) and getattr(item, "value", None) is not None]
            rank = {peer: i for i, peer in enumerate(only)} if only is not None else {}
            ranked = sorted((rank.get(peer.to_base58(), len(rank)), random.random(), peer) for peer in offered)
            for _, _, peer in ranked:
                if peer == self.peer_id or peer.to_base58() in exclude or (only is not None
                                                                          and peer.to_base58() not in rank):
                    continue
                try:
                    loaded = await self._download_from(peer, max_bytes)
                except Exception as e:  # noqa: BLE001 - a broken or slow peer: try the next one
                    logger.info("downloading the state from %s failed: %s", peer, e)
                    continue
                if loaded is not None:
                    future.set_result((*loaded, peer.to_base58()))
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_from(self, peer: PeerID, max_bytes: int) -> tuple[Any, list[torch.Tensor]] | None:
        stub = self.get_stub(self.child_p2p(), peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, tensors, parts, received = None, [], [], 0
        async for message in aiter_with_timeout(stream, timeout=self.config.next_chunk_timeout):
            received += len(message.tensor_part.buffer) + len(message.metadata)
            if max_bytes and received > max_bytes:
                raise AveragingError(f"it sent more than {max_bytes} bytes")
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a new tensor begins
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return None if metadata is None else (metadata, tensors)

    def share_state(self, allowed: bool) -> None:
        """Let peers download this replica's state (or not). The DHT entry says only that it is offered: a
        downloader ranks the offers by the stage's signed progress records, so the entry is not stored anew
        at every step (it was: most of a server's DHT stores, bench/scaling.py)."""
        if self.is_alive():
            self.allow_state_sharing = allowed

    def close(self) -> None:
        """Stop the process (at most shutdown_timeout, then it is terminated)."""
        if self.is_alive():
            self.shutdown()

    def _call(self, method: str, timeout: float, **kwargs: Any) -> Any:
        if not self.is_alive():
            raise AveragingError("the averaging process is not running")
        future = MPFuture()
        self.send_to_child(method, future, **kwargs)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            raise AveragingError(f"the averaging process did not answer {method} within {timeout:g}s") from None


def _die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel kill this process when its parent dies (no orphaned averagers)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's shutdown stops us, as in hivemind
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class GaveUp(TimeoutError):
    """A wait ended early because there was no point waiting on."""


def _wait(future: MPFuture, timeout: float, give_up: Callable[[], bool], poll: float = 0.2) -> Any:
    """future.result(timeout), but GaveUp as soon as `give_up()` (checked every `poll` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        if give_up():
            raise GaveUp
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            return future.result(timeout=min(poll, remaining))
        except TimeoutError:
            if future.done():  # the future's own error is a timeout (asyncio's is the builtin one)
                raise AveragingError(f"timed out: {future.exception()}") from None


FORMING = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP, AveragingStage.AWAITING_TRIGGER)
FORMED_POLL = 0.005  # how often the round's stage is read while its group forms: the start latency's resolution


def _wait_until_formed(control: Any, deadline: float, give_up: Callable[[], bool]) -> float:
    """Wait until a round's group has formed (or the round ended); the monotonic time it was seen."""
    while control.stage in FORMING and not control.done():
        if give_up():
            raise GaveUp
        if time.monotonic() >= deadline:
            raise TimeoutError
        time.sleep(FORMED_POLL)
    return time.monotonic()


def _peer_ids(members: Sequence[str]) -> Iterator[PeerID]:
    for member in members:
        try:
            yield PeerID.from_base58(member)
        except Exception as e:  # noqa: BLE001 - the records were checked; a bad id only loses the shortcut
            logger.debug("not a peer id: %r (%s)", member, e)


def declarations_handler(prefix: str) -> str:
    return f"{prefix}.declare_direct"


def step_bits(step: int) -> str:
    """The group key suffix of a step."""
    return format(step % 2**STEP_KEY_BITS, f"0{STEP_KEY_BITS}b")
