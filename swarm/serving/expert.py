"""An expert server: hosts experts of a run's MoE blocks, serves their forward and backward, and
announces them in the DHT (`swarm-peer --role expert --experts auto|LIST`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator  # noqa: UP035  (hivemind's ServicerBase reads typing.AsyncIterator annotations)

import hivemind
import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter
from prometheus_client import CollectorRegistry

from swarm.backend import Overloaded
from swarm.checkpoint.claims import step_bound
from swarm.checkpoint.schedule import CheckpointSchedule
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, ExpertHostRecord, ServerState, SwarmRecords, online, online_steps
from swarm.dht.reachability import Reachability
from swarm.experts import ExpertHost, expert_checkpoints, load_experts, save_experts
from swarm.protocol import (
    BAD_REQUEST,
    BUSY,
    DEFAULT_FIRST_BYTE_TIMEOUT,
    DEFAULT_LIMITS,
    DEFAULT_RECEIVE_TIMEOUT,
    INTERNAL,
    NOT_READY,
    WRONG_STAGE,
    ProtocolError,
    RequestLimits,
    RequestRejected,
    StageReply,
    StageRequest,
    WireLimits,
    encode_tensor,
    experts_namespace,
)
from swarm.protocol.framing import gather_frames, to_frames
from swarm.protocol.messages import error_frames, raise_if_error
from swarm.protocol.slots import CallerSlots

from .handler import CountingHandler, serve, with_faults
from .lifecycle import LOOP_CALL_TIMEOUT, ServerLifecycle
from .metrics import ExpertMetrics
from .placement import choose_experts
from .throughput import expert_throughput

log = logging.getLogger("swarm.expert")

STATE_TIMEOUT = 60.0  # for one expert's state to arrive from a host that has it
DONOR_LOOKUPS = 3  # reads of the experts' hosts, an announce period apart, while one is beyond the bound
STATE_SLOTS = 4  # expert state requests answered at once (each holds a copy of one expert's state)


@dataclass
class ExpertOptions:
    experts: list[int] | None = None  # None: auto, the `count` experts with the fewest hosts
    count: int | None = None  # auto: how many experts to host; None: half the experts of a block, at least 1
    device: str = "cpu"
    max_queue: int = 64
    inject_delay: float = 0.0  # seconds added to every request (fault injection)
    inject_failure_rate: float = 0.0  # fraction of requests answered with an error (fault injection)
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT
    metrics_addr: str | None = None
    reachability: Reachability | None = None  # whether others can dial this host, once its check has ended
    checkpoint_dir: Path | None = None  # where the hosted experts are saved every checkpoint.every_steps; None: not


class ExpertServer(ServerLifecycle):
    """Lifecycle (ServerLifecycle): JOINING -> build the experts, take their state, register the RPCs -> ONLINE
    -> OFFLINE."""

    what = "expert server"

    def __init__(self, config: RunConfig, dht: hivemind.DHT, records: SwarmRecords, loop: BackgroundLoop,
                 options: ExpertOptions | None = None, registry: CollectorRegistry | None = None):
        if config.model.moe is None or not config.model.moe.expert_servers:
            raise ValueError(f"run {config.run_id} has no expert servers (model.moe.expert_servers is not set): "
                             "serve a stage instead (--role server)")
        options = options or ExpertOptions()
        super().__init__(config, dht, records, loop, options.reachability)
        self.options = options
        self.limits = RequestLimits.of(config)  # what a request may carry, both ways
        self.host: ExpertHost | None = None
        self.experts: list[int] = []
        self.throughput = 0.0
        self.registry = registry or CollectorRegistry()
        self.metrics = ExpertMetrics(self.registry, host=lambda: self.host)
        # when the experts' next checkpoint is due; restored() with the step they start from
        self.schedule = CheckpointSchedule(config.checkpoint)

    @property
    def checkpoints(self) -> Path | None:
        """Where this server keeps its experts' checkpoints (None: it keeps none)."""
        root = self.options.checkpoint_dir
        return None if root is None else Path(root) / self.config.run_id / "experts"

    def start(self) -> None:
        moe = self.config.model.moe
        experts, seen = self.options.experts, []
        if experts is None:
            count = self.options.count or max(1, moe.num_experts // 2)
            seen = self.records.lookup_expert_hosts()
            experts = choose_experts(seen, moe.num_experts, count)
        bad = [e for e in experts if not 0 <= e < moe.num_experts]
        if bad or not experts:
            raise ValueError(f"--experts must name experts in 0..{moe.num_experts - 1}, got {sorted(experts)}")
        self.experts = sorted(set(experts))
        self.announce()
        self._join_p2p()
        self.host = ExpertHost(self.config, self.experts, self.options.device, self.options.max_queue)
        self.host.hand_over(self.host.owner, LOOP_CALL_TIMEOUT)  # only its worker thread changes the experts
        self.throughput = expert_throughput(self.host, self.config)
        self._serve_servicer(ExpertStateService(self), self._state_namespace())
        self._download_state(seen)
        self.schedule.restored(self.host.step)
        self.schedule.restart_clock()
        handler = with_faults(ExpertRequestHandler(self), self.options.inject_delay, self.options.inject_failure_rate)
        self._serve(serve(self._p2p, handler, experts_namespace(self.config.run_id), self.limits.expert,
                          self.options.receive_timeout, 2 * self.options.max_queue))
        self._go_online()
        log.info("hosting experts %s of MoE blocks %s as %s (%.0f tokens/s measured)", self.experts,
                 self.config.model.moe_layers(), self.peer_id, self.throughput)

    def _state_namespace(self) -> str:
        return experts_namespace(self.config.run_id) + "/state"

    def _download_state(self, seen: list[ExpertHostRecord] = ()) -> None:
        """Take each hosted expert's state from an ONLINE host of it, so replicas start equal; an expert
        that no live host has starts from its initial weights (said loudly once the run has trained).

        `seen`: the hosts looked up when choosing the experts. A later lookup can miss one (a DHT get that
        reached no holder of the key; seen once in CI, where the joiner then started an expert afresh beside
        its live host), so those records stay candidates too: asking a host for its state needs no DHT.
        """
        hosts = self._donors_within_bound(seen)
        fresh = []
        for e in self.experts:
            donors = sorted((r for r in hosts if e in r.experts), key=lambda r: -r.step)
            for donor in donors:
                try:
                    for layer in self.host.layers:
                        meta, tensors = self.loop.run(self._fetch(donor.peer_id, layer, e), STATE_TIMEOUT + 5)
                        self.host.submit(self.host.import_expert, layer, e, meta, tensors).result(LOOP_CALL_TIMEOUT)
                    log.info("expert %d: state of step %d taken from %s", e, meta["step_count"], donor.peer_id)
                    break
                except Exception as err:  # a donor that left, or sent something unusable: try the next
                    log.warning("expert %d: could not take its state from %s (%s)", e, donor.peer_id, err)
            else:
                fresh.append(e)
        fresh = self._restore(fresh)
        steps = [r.step for r in self.records.lookup_all_servers(self.config.stages.num_stages).get(0, [])]
        steps += [r.step for r in hosts]
        if fresh and steps and max(steps) > 0:
            log.warning("experts %s have no live host to take their state from: they start from their initial "
                        "weights although the run is at step %d", fresh, max(steps))

    def _donors_within_bound(self, seen: list[ExpertHostRecord] = ()) -> list:
        """The hosts that may give their state (_donors), read again an announce period later while one is
        beyond the bound, DONOR_LOOKUPS times at most; each one refused in the end is logged."""
        for lookup in range(1, DONOR_LOOKUPS + 1):
            hosts, refused = self._donors(seen)
            if not refused or lookup == DONOR_LOOKUPS or self._stop.wait(self.config.network.announce_period):
                break
        for r, bound in refused:
            log.warning("not taking expert states from %s: its step %d is beyond step %d, the furthest the run's "
                        "servers make believable", r.peer_id, r.step, bound)
        return hosts

    def _donors(self, seen: list[ExpertHostRecord] = ()) -> tuple[list, list]:
        """The ONLINE hosts of experts that may give their state, and those refused (with the bound).

        A host's step is its own claim: one far ahead of what most of the run's servers announce is no donor
        (the lower median of every ONLINE stage server's and expert host's step, plus MAX_STEP_LEAD). Records
        are a moment old, each its own: in a run of several steps a second an honest host's can be a few steps
        past the others' (seen in a test: 72 against 71), hence a few lookups a period apart.
        """
        found = {r.peer_id: r for r in seen}
        found.update((r.peer_id, r) for r in self.records.lookup_expert_hosts())  # a fresh record wins
        hosts = online(found.values(), other_than=self.peer_id)
        servers = self.records.lookup_all_servers(self.config.stages.num_stages)
        bound = step_bound(online_steps(servers) + [r.step for r in hosts])
        if bound is None:
            return hosts, []
        return [r for r in hosts if r.step <= bound], [(r, bound) for r in hosts if r.step > bound]

    def _restore(self, experts: list[int]) -> list[int]:
        """Load `experts` from the newest of this server's checkpoints that holds them; those it cannot."""
        left = list(experts)
        for path in reversed(expert_checkpoints(self.checkpoints) if self.checkpoints and left else []):
            try:
                states = load_experts(path, self.config.state_hash())
            except ValueError as err:
                log.warning("skipping checkpoint %s: %s", path, err)
                continue
            for e in list(left):
                if all((layer, e) in states for layer in self.host.layers):
                    try:
                        for layer in self.host.layers:
                            meta, tensors = states[layer, e]
                            self.host.submit(self.host.import_expert, layer, e, meta, tensors).result(LOOP_CALL_TIMEOUT)
                    except ValueError as err:
                        log.warning("expert %d: checkpoint %s does not fit (%s)", e, path, err)
                        continue
                    log.info("expert %d: restored from %s (step %d)", e, path.name, meta["step_count"])
                    left.remove(e)
        return left

    def after_steps(self) -> None:
        """Save the hosted experts when the checkpoint schedule says (checkpoint.every_steps steps or
        every_seconds seconds; 0 turns either off), between two tasks on the host's thread."""
        step = self.host.step
        if self.checkpoints is None or not self.schedule.due(step):
            return
        self.schedule.done(step)
        self.host.submit(self._save).add_done_callback(_log_failure)

    def _save(self) -> Path:
        host = self.host
        states = {key: host.export_expert(*key) for key in host.modules}
        return save_experts(states, self.checkpoints, host.step, self.config.state_hash(), self.config.checkpoint.keep)

    async def _fetch(self, peer: str, layer: int, expert: int) -> tuple[dict, list[torch.Tensor]]:
        stub = ExpertStateService.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self._state_namespace())
        frames = to_frames({"layer": layer, "expert": expert}, [], runtime_pb2.ExpertRequest)
        responses = await stub.rpc_state(iter_as_aiter(frames))
        try:
            return await asyncio.wait_for(gather_frames(responses, state_limits(self.host), raise_if_error),
                                          STATE_TIMEOUT)
        finally:
            await responses.aclose()

    def record(self) -> ExpertHostRecord:
        return ExpertHostRecord(peer_id=self.peer_id, experts=self.experts, state=self.state.value,
                                throughput=float(self.throughput), step=self.host.step if self.host else 0,
                                metrics_addr=self.options.metrics_addr, reach=self.reach)

    def _store(self, record: ExpertHostRecord, ttl: float) -> bool:
        return self.records.announce_expert_host(record, ttl=ttl)

    def _teardown(self) -> None:
        if self.host is not None:
            if self.checkpoints is not None and self.host.step > self.schedule.last_step:
                try:  # the last state, so a restart here loses nothing the run could not replay
                    self.schedule.done(self.host.step)
                    log.info("saved the experts to %s", self.host.submit(self._save).result(LOOP_CALL_TIMEOUT))
                except Exception as e:
                    log.warning("could not save the experts at shutdown: %s", e)
            self.host.shutdown()


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("saving the experts failed: %s", future.exception())


def state_limits(host: ExpertHost) -> WireLimits:
    """The largest honest state message of one expert: 4 flat float32 tensors of its parameter count."""
    params = sum(p.numel() for p in next(iter(host.optimizers.values())).params)
    return WireLimits(max_message_bytes=4 * 4 * params + DEFAULT_LIMITS.max_metadata_bytes, max_tensor_elements=params,
                      max_tensors=4)


class ExpertStateService(ServicerBase):
    """`rpc_state`: one hosted expert's state (ExpertHost.export_expert), for a host joining it.

    The request is metadata only, {"layer": L, "expert": e}; the reply is the state's numbers and
    its 4 tensors, or an error reply. Read between two tasks on the host's worker thread."""

    def __init__(self, server: ExpertServer):
        self.server = server
        # each reply holds a copy of one expert's state until it is sent: a few at once, one per caller
        self.slots = CallerSlots(STATE_SLOTS, per_caller=1, what="state requests", total_name="state slots")

    async def rpc_state(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                        ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        caller = str(context.remote_id)
        refused = self.slots.try_take(caller)
        if refused is not None:
            for frame in error_frames(BUSY, refused):
                yield frame
            return
        try:
            for frame in await self._answer(requests):
                yield frame
        finally:
            self.slots.give_back(caller)

    async def _answer(self, requests: AsyncIterator) -> list:
        limits = WireLimits(max_message_bytes=DEFAULT_LIMITS.max_metadata_bytes, max_tensors=0)
        try:
            # a joiner asks at once: a silent stream gets its slot back within the first-byte deadline
            meta, _ = await asyncio.wait_for(gather_frames(requests, limits), DEFAULT_FIRST_BYTE_TIMEOUT)
            host = self.server.host
            if self.server.state != ServerState.ONLINE or host is None:
                return error_frames(NOT_READY, "not ONLINE")
            layer, expert = meta.get("layer"), meta.get("expert")
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (layer, expert)) \
                    or (layer, expert) not in host.modules:
                return error_frames(BAD_REQUEST, f"expert {expert!r} of block {layer!r} is not hosted here")
            state, tensors = await asyncio.wrap_future(host.submit(host.export_expert, layer, expert))
            encoded = [encode_tensor(t, "float32") for t in tensors]
            return list(to_frames({**state, "ok": True}, encoded, runtime_pb2.ExpertResponse, state_limits(host)))
        except (ProtocolError, asyncio.TimeoutError) as e:
            return error_frames(BAD_REQUEST, f"could not read the request: {e}")
        except Overloaded as e:
            return error_frames(NOT_READY, str(e))
        except Exception as e:  # whatever goes wrong, the caller gets an answer
            log.warning("state request failed", exc_info=True)
            return error_frames(INTERNAL, f"{type(e).__name__}: {e}")


class ExpertRequestHandler(CountingHandler):
    """Checks each request against what is hosted here, then runs it on the expert host's worker."""

    def admit(self, kind: str, meta: dict) -> None:
        self._check_serving(kind)
        host = self.server.host
        if host.queue_depth >= host.max_queue:
            self._count(kind, NOT_READY)
            raise RequestRejected(NOT_READY, f"the expert server has {host.queue_depth} tasks queued; try later")

    async def forward(self, request: StageRequest) -> StageReply:
        started = time.perf_counter()
        host = await self._admit(request)
        out = await self._run(request, host.forward, request.stage, request.experts, request.inputs)
        self._done(request, started)
        return StageReply([out], server_step=host.step)

    async def backward(self, request: StageRequest) -> StageReply:
        started = time.perf_counter()
        host = await self._admit(request)
        if request.samples is None:
            self._count(request.kind, BAD_REQUEST)
            raise RequestRejected(BAD_REQUEST, "an expert backward must say how many samples its micro-batch has")
        cap = self.server.limits.samples
        if request.samples > cap:
            self._count(request.kind, BAD_REQUEST)
            raise RequestRejected(BAD_REQUEST, f"a micro-batch has at most {cap} samples, got {request.samples}")
        grad, stats = await self._run(request, host.backward, request.stage, request.experts, request.inputs,
                                      request.grad_outputs, request.samples, request.stage_step)
        for step in stats:
            if step["skipped"]:
                log.warning("an expert skipped a step: non-finite gradient norm")
        if stats:
            log.info("experts stepped: step %d (lr %.2e)", host.step, stats[0]["lr"])
            self.server.after_steps()
        self._done(request, started)
        return StageReply([grad], server_step=host.step)

    async def _admit(self, request: StageRequest) -> ExpertHost:
        self._check_serving(request.kind)
        if request.experts is None or request.grad_outputs is None and request.kind == "backward":
            self._count(request.kind, BAD_REQUEST)
            raise RequestRejected(BAD_REQUEST, "an expert request must name its experts (and a backward carry "
                                               "grad_outputs)")
        layers = self.server.host.layers
        if request.stage not in layers:
            self._count(request.kind, WRONG_STAGE)
            raise RequestRejected(WRONG_STAGE, f"block {request.stage} is not a mixture of experts (MoE blocks: "
                                               f"{layers})")
        return self.server.host

    def _check_serving(self, kind: str) -> None:
        server = self.server
        if server.state != ServerState.ONLINE or server.host is None:
            self._count(kind, NOT_READY)
            raise RequestRejected(NOT_READY, f"expert server is {server.state.value}, not ONLINE")

    @property
    def worker(self) -> ExpertHost:
        return self.server.host
