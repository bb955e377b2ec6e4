"""An expert server: hosts experts of a run's MoE blocks, serves their forward and backward, and
announces them in the DHT (`swarm-peer --role expert --experts auto|LIST`)."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter as Tally
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator  # noqa: UP035  (hivemind's ServicerBase reads typing.AsyncIterator annotations)

import hivemind
import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import iter_as_aiter
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from swarm.backend import Overloaded
from swarm.checkpoint.claims import step_bound
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, ExpertHostRecord, ServerState, SwarmRecords, peer_id
from swarm.dht.reachability import Reachability, wait_until_reachable
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
    RequestRejected,
    StageReply,
    StageRequest,
    StageService,
    WireLimits,
    encode_tensor,
    experts_namespace,
    register,
    stage_wire_limits,
)
from swarm.protocol.framing import gather_frames, to_frames
from swarm.protocol.messages import error_frames, raise_if_error
from swarm.protocol.slots import CallerSlots

from .handling import CountingHandler

log = logging.getLogger("swarm.expert")

LOOP_CALL_TIMEOUT = 30.0
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


def choose_experts(hosts: list[ExpertHostRecord], num_experts: int, count: int) -> list[int]:
    """The `count` experts with the fewest ONLINE or JOINING hosts, ties to the lower index."""
    load = Tally(e for record in hosts if record.state != ServerState.OFFLINE.value
                 for e in set(record.experts) if 0 <= e < num_experts)
    return sorted(sorted(range(num_experts), key=lambda e: (load[e], e))[:count])


class ExpertServer:
    """Lifecycle: JOINING -> build the experts, register the RPCs -> ONLINE -> OFFLINE."""

    def __init__(self, config: RunConfig, dht: hivemind.DHT, records: SwarmRecords, loop: BackgroundLoop,
                 options: ExpertOptions | None = None, registry: CollectorRegistry | None = None):
        if config.model.moe is None or not config.model.moe.expert_servers:
            raise ValueError(f"run {config.run_id} has no expert servers (model.moe.expert_servers is not set): "
                             "serve a stage instead (--role server)")
        self.config, self.dht, self.records, self.loop = config, dht, records, loop
        self.options = options or ExpertOptions()
        self.peer_id = peer_id(dht)
        self.state = ServerState.JOINING
        self.host: ExpertHost | None = None
        self.experts: list[int] = []
        self.throughput = 0.0
        self.registry = registry or CollectorRegistry()
        self.metrics = ExpertMetrics(self.registry, self)
        self._stop = threading.Event()
        self._announcer: threading.Thread | None = None
        self._p2p = None
        self._service: StageService | None = None
        self._state_service: ExpertStateService | None = None
        self._saved_step = 0  # the step of the experts' last checkpoint (or of the state they started from)

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
        self._p2p = self.loop.run(self.dht.replicate_p2p(), LOOP_CALL_TIMEOUT)
        self.host = ExpertHost(self.config, self.experts, self.options.device, self.options.max_queue)
        self.throughput = measure_throughput(self.host, self.config)
        self._state_service = ExpertStateService(self)
        self.loop.run(self._state_service.add_p2p_handlers(self._p2p, namespace=self._state_namespace()),
                      LOOP_CALL_TIMEOUT)
        self._download_state(seen)
        self._saved_step = self.host.step
        handler = ExpertRequestHandler(self)
        self._service = self.loop.run(handler.serve(self._p2p), LOOP_CALL_TIMEOUT)
        wait_until_reachable(self.options.reachability)
        self.state = ServerState.ONLINE
        self.announce()
        self._announcer = threading.Thread(target=self._announce_forever, name="announcer", daemon=True)
        self._announcer.start()
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
        hosts = [r for r in found.values() if r.state == ServerState.ONLINE.value and r.peer_id != self.peer_id]
        servers = self.records.lookup_all_servers(self.config.stages.num_stages)
        bound = step_bound([r.step for found in servers.values() for r in found if r.state == ServerState.ONLINE.value]
                           + [r.step for r in hosts])
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
        """Save the hosted experts every checkpoint.every_steps steps (between two tasks on the host's thread)."""
        every, step = self.config.checkpoint.every_steps, self.host.step
        if self.checkpoints is None or step <= self._saved_step or step % every:
            return
        self._saved_step = step
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
        reach = self.options.reachability.state if self.options.reachability else None
        return ExpertHostRecord(peer_id=self.peer_id, experts=self.experts, state=self.state.value,
                                throughput=float(self.throughput), step=self.host.step if self.host else 0,
                                metrics_addr=self.options.metrics_addr, reach=reach)

    def announce(self) -> bool:
        ok = self.records.announce_expert_host(self.record(), ttl=self.config.network.record_ttl)
        if not ok:
            log.warning("could not store this expert server's record in the DHT (will retry)")
        return ok

    def _announce_forever(self) -> None:
        while not self._stop.wait(self.config.network.announce_period):
            try:
                self.announce()
            except Exception as e:  # a DHT hiccup must not stop the renewals
                log.warning("announce failed: %s", e)

    def shutdown(self) -> None:
        """Announce OFFLINE first, so stage servers stop sending tokens, then stop serving."""
        self._stop.set()
        if self.experts:
            self.state = ServerState.OFFLINE
            try:
                self.announce()
            except Exception as e:
                log.warning("could not announce OFFLINE: %s", e)
        if self._service is not None and self.loop.is_running:
            try:
                self.loop.run(self._service.unregister(self._p2p), LOOP_CALL_TIMEOUT)
                self.loop.run(self._state_service.remove_p2p_handlers(self._p2p, namespace=self._state_namespace()),
                              LOOP_CALL_TIMEOUT)
            except Exception as e:
                log.debug("unregister failed: %s", e)
        if self.host is not None:
            if self.checkpoints is not None and self.host.step > self._saved_step:
                try:  # the last state, so a restart here loses nothing the run could not replay
                    self._saved_step = self.host.step
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


class ExpertMetrics:
    def __init__(self, registry: CollectorRegistry, server: ExpertServer):
        self.requests = Counter("swarm_expert_requests_total", "Expert requests by kind and outcome",
                                ["kind", "status"], registry=registry)
        self.latency = Histogram("swarm_expert_request_seconds", "Time to answer an expert request", ["kind"],
                                 registry=registry)
        Gauge("swarm_expert_step", "Optimizer steps of the hosted experts", registry=registry).set_function(
            lambda: server.host.step if server.host else 0)
        Gauge("swarm_expert_queue_depth", "Tasks waiting for or in compute", registry=registry).set_function(
            lambda: server.host.queue_depth if server.host else 0)
        registry.register(_HostedTokens(server))


class _HostedTokens:
    def __init__(self, server: ExpertServer):
        self.server = server

    def collect(self):
        family = CounterMetricFamily("swarm_expert_tokens", "Tokens each hosted expert ran a backward on",
                                     labels=["layer", "expert"])
        host = self.server.host
        if host is not None:
            for (layer, e), count in list(host.tokens.items()):
                family.add_metric([str(layer), str(e)], count)
        yield family


class ExpertRequestHandler(CountingHandler):
    """Checks each request against what is hosted here, then runs it on the expert host's worker."""

    async def serve(self, p2p: hivemind.p2p.P2P) -> StageService:
        config, options = self.server.config, self.server.options
        # A request holds at most top_k slots of each token of a micro-batch, in and (backward) gradient.
        limits = stage_wire_limits(config.model, config.optimizer.micro_batch_size * config.model.moe.top_k)
        return await register(p2p, self, experts_namespace(config.run_id), limits=limits,
                              receive_timeout=options.receive_timeout, admit=self.admit,
                              max_concurrent=2 * options.max_queue)

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
        cap = self.server.config.optimizer.micro_batch_size
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
        options = self.server.options
        if options.inject_delay > 0:
            await asyncio.sleep(options.inject_delay)
        if options.inject_failure_rate > 0 and random.random() < options.inject_failure_rate:
            self._count(request.kind, "injected")
            raise RequestRejected(INTERNAL, "injected failure (--inject-failure-rate)")
        return self.server.host

    def _check_serving(self, kind: str) -> None:
        server = self.server
        if server.state != ServerState.ONLINE or server.host is None:
            self._count(kind, NOT_READY)
            raise RequestRejected(NOT_READY, f"expert server is {server.state.value}, not ONLINE")

    @property
    def worker(self) -> ExpertHost:
        return self.server.host


def measure_throughput(host: ExpertHost, config: RunConfig, repeats: int = 3) -> float:
    """Tokens per second one hosted expert runs forward and backward on (a copy, so nothing accumulates)."""
    import copy

    moe = config.model.moe
    rows = max(1, config.optimizer.micro_batch_size * config.model.seq_len * moe.top_k // moe.num_experts)
    module = copy.deepcopy(next(iter(host.modules.values())))
    x = torch.randn(rows, config.model.d_model, device=host.device)
    timings = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        leaf = x.detach().requires_grad_(True)
        module(leaf).sum().backward()
        timings.append(time.perf_counter() - started)
    return rows / min(timings[1:])
