"""A stage server: hosts one pipeline stage, serves forward/backward, announces itself in the DHT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import hivemind
import torch
from prometheus_client import CollectorRegistry

from swarm.activations import DEFAULT_TTL, ActivationCache, default_cache_bytes
from swarm.averaging import INITIAL_ROUND, ProgressChannel, StageAverager, StateDownloadError, averaging_prefix
from swarm.backend import BackwardResult, Overloaded, StageBackend, autocast
from swarm.checkpoint.keeper import StageKeeper
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, ServerRecord, ServerState, SwarmRecords, peer_id
from swarm.dht.reachability import Reachability, wait_until_reachable
from swarm.model import build_stage
from swarm.model.moe import MoEFeedForward
from swarm.optim import StageOptimizer
from swarm.protocol import (
    BAD_REQUEST,
    DEFAULT_RECEIVE_TIMEOUT,
    INTERNAL,
    NOT_READY,
    WRONG_STAGE,
    RequestRejected,
    StageReply,
    StageRequest,
    StageService,
    register,
    stage_namespace,
    stage_wire_limits,
)
from swarm.routing.experts import ExpertDispatcher, RemoteExperts, expert_call
from swarm.routing.pipeline import PipelineSettings
from swarm.state import StageState

from .handling import CountingHandler
from .placement import choose_stage
from .server_metrics import ServerMetrics

log = logging.getLogger("swarm.server")

LOOP_CALL_TIMEOUT = 30.0  # registering handlers, replicating the DHT's P2P
STEP_LOG_EVERY = 10  # optimizer steps between progress lines in the log
BACKWARD_CACHE_SIZE = 512  # recent backward results kept so a retried request is not counted twice
BACKWARD_CACHE_BYTES = 256 * 2**20  # ... and the most bytes of their result tensors kept
EXPERT_LOOKUP_PERIOD = 2.0  # seconds between lookups of the expert servers, for a stage whose experts live there


@dataclass
class ServerOptions:
    stage: int | None = None  # None: the stage with the least announced throughput
    device: str = "cpu"
    max_queue: int = 64
    inject_delay: float = 0.0  # seconds added to every request (fault injection)
    inject_failure_rate: float = 0.0  # fraction of requests answered with an error (fault injection)
    checkpoint_dir: Path | None = None  # where this server keeps its stage's checkpoints; None: none kept
    fresh: bool = False  # start the stage from fresh weights even though the run has progress elsewhere
    activation_cache_bytes: int | None = None  # forward graphs kept for their backward; None: a share of free memory
    activation_cache_ttl: float = DEFAULT_TTL  # seconds a kept graph waits for its backward
    max_batch: int | None = None  # samples a request may carry; None: the run's optimizer.micro_batch_size
    max_concurrent_requests: int | None = None  # requests taken in at once (more get BUSY); None: 2 x max_queue
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT  # seconds a caller has to send its whole request
    backward_cache_bytes: int = BACKWARD_CACHE_BYTES  # result bytes kept to answer retried backwards
    metrics_addr: str | None = None  # "host:port" of this server's /metrics, announced for Prometheus discovery
    coordinator_peer_id: str | None = None  # the run's coordinator: its checkpoints are trusted as it vetted them
    reachability: Reachability | None = None  # whether others can dial this server, once its check has ended

    def batch_cap(self, config: RunConfig) -> int:
        return self.max_batch if self.max_batch is not None else config.optimizer.micro_batch_size

    def concurrency_cap(self) -> int:
        return self.max_concurrent_requests if self.max_concurrent_requests is not None else 2 * self.max_queue


class StageStateMissing(RuntimeError):
    """The stage has no live server and no checkpoint could be loaded, yet the run has made progress."""


class StageServer:
    """Lifecycle: JOINING -> build the stage, measure speed, register RPCs -> ONLINE -> OFFLINE."""

    def __init__(self, config: RunConfig, dht: hivemind.DHT, records: SwarmRecords, loop: BackgroundLoop,
                 options: ServerOptions | None = None, registry: CollectorRegistry | None = None):
        self.config = config
        self.dht = dht
        self.records = records
        self.loop = loop
        self.options = options or ServerOptions()
        self.peer_id = peer_id(dht)
        self.state = ServerState.JOINING
        self.stage: int | None = None
        self.backend: StageBackend | None = None
        self.stage_state: StageState | None = None  # the replica's parameters, moments, step and round
        self.averager: StageAverager | None = None
        self.keeper: StageKeeper | None = None  # checkpoints on this server's disk (unless turned off)
        self.dispatcher: ExpertDispatcher | None = None  # reaches this stage's experts, if they live on expert servers
        self.throughput = 0.0
        self.stepped_samples = 0  # the samples in the steps this server took since it started (its own and its peers')
        self.registry = registry or CollectorRegistry()
        self.metrics = ServerMetrics(self.registry, self)
        self._stop = threading.Event()
        self._announcer: threading.Thread | None = None
        self._p2p = None
        self._service = None

    def start(self) -> None:
        """Join the stage and go ONLINE; raises if the stage cannot be served."""
        n = self.config.stages.num_stages
        stage = self.options.stage
        if stage is None:
            stage = choose_stage(self.records.lookup_all_servers(n), n)
        if not 0 <= stage < n:
            raise ValueError(f"stage {stage} does not exist: the run has stages 0..{n - 1}")
        self.stage = stage
        self.announce()
        self._p2p = self.loop.run(self.dht.replicate_p2p(), LOOP_CALL_TIMEOUT)
        module = build_stage(self.config, stage)
        optimizer = StageOptimizer(module, self.config.optimizer)
        self.stage_state = StageState(module, optimizer, stage, INITIAL_ROUND)
        self.averager = StageAverager(self.stage_state, self.dht, self.config, owner_key=self.records.local_owner_key,
                                      peer_id=self.peer_id, registry=self.registry)
        self.backend = StageBackend(module, optimizer, self.options.device, self.options.max_queue,
                                    on_step=self._on_step, stepper=self.averager,
                                    stash_weights=self.config.stages.stash_weights,
                                    compute_dtype=self.config.stages.compute_dtype, cache=self._activation_cache())
        if self.options.checkpoint_dir is not None:
            trusted = [self.options.coordinator_peer_id] if self.options.coordinator_peer_id else []
            self.keeper = StageKeeper(self.stage_state, self.config, self.options.checkpoint_dir, self.records,
                                      self.loop, self.peer_id, self.registry, trusted_holders=trusted)
        online = sorted(r.peer_id for r in self.records.lookup_servers(stage)
                        if r.state == ServerState.ONLINE.value and r.peer_id != self.peer_id)
        if online:
            try:
                self.averager.load_state_from_peers()  # never serve fresh weights while the stage has a state
            except StateDownloadError as e:  # the servers announced may be dead (or never were): checkpoints remain
                log.warning("%s; looking for a checkpoint of the stage instead", e)
                self._resume(f"{len(online)} server(s) announce it ONLINE ({', '.join(online[:3])}), but none "
                             f"served a state this server could take ({e})")
        else:
            self._resume()
        self.throughput = measure_throughput(self.backend, self.config)
        self.metrics.throughput.set(self.throughput)
        self._reach_experts(module)
        handler = StageRequestHandler(self)
        namespace = stage_namespace(self.config.run_id, stage)
        self._service = self.loop.run(handler.serve(self._p2p, namespace), LOOP_CALL_TIMEOUT)
        channel = ProgressChannel(self._p2p, self.loop, averaging_prefix(self.config.run_id, stage))
        self.averager.start(self.backend.request_step, channel)
        if self.keeper is not None:
            self.keeper.start(self._p2p)
        wait_until_reachable(self.options.reachability)
        self.state = ServerState.ONLINE
        self.announce()
        self._announcer = threading.Thread(target=self._announce_forever, name="announcer", daemon=True)
        self._announcer.start()
        log.info("serving stage %d of %d (%.1f samples/s measured) as %s", stage, n, self.throughput, self.peer_id)

    def _reach_experts(self, module) -> None:
        """Give the stage's MoE blocks a runner that calls the expert servers, if its experts live there."""
        moe = self.config.model.moe
        if not module.moe_layers or not moe.expert_servers:
            return
        settings = PipelineSettings.from_config(self.config.network)
        limits = stage_wire_limits(self.config.model, self.options.batch_cap(self.config) * moe.top_k)
        self.dispatcher = ExpertDispatcher(self._p2p, self.config.run_id, moe.num_experts, self.config.stages.wire,
                                           settings, limits)
        # The longest one block's expert calls may take: a timeout per host tried, a few hosts in turn.
        runner = RemoteExperts(self.dispatcher, self.loop.run, moe.k_min, 3 * settings.request_timeout)
        for block in module.modules():
            if isinstance(block, MoEFeedForward):
                block.runner = runner
        self.refresh_experts()

    def refresh_experts(self) -> None:
        """Look up the run's ONLINE expert servers and hand them to the dispatcher."""
        if self.dispatcher is None:
            return
        online = ServerState.ONLINE.value
        hosts = {r.peer_id: r.experts for r in self.records.lookup_expert_hosts() if r.state == online}
        self.loop.run(_call_soon(self.dispatcher.update_hosts, hosts), LOOP_CALL_TIMEOUT)

    def _activation_cache(self) -> ActivationCache:
        size = self.options.activation_cache_bytes
        if size is None:
            size = default_cache_bytes(torch.device(self.options.device))
        return ActivationCache(size, self.options.activation_cache_ttl)

    def _resume(self, announced: str | None = None) -> int | None:
        """The stage has no live server that served its state: load its newest checkpoint (its step), or start
        it fresh (None) only if nothing is lost or --fresh says so. `announced`: what says the stage is live."""
        step = self.keeper.restore(self._p2p) if self.keeper is not None else None
        if step is not None:
            self.averager.state_loaded()
            return step
        if self.options.fresh:
            log.warning("stage %d: starting from fresh weights, as --fresh says%s", self.stage,
                        f", although {announced}" if announced else "")
            return None
        progress = announced or self._progress_elsewhere()
        if progress:
            raise StageStateMissing(
                f"stage {self.stage} has no server that served its state and this server could load none of its "
                f"checkpoints, but {progress}: starting it from fresh weights could throw training away. Start "
                "it with the checkpoint directory that holds the stage (--checkpoint-dir), wait until a server or "
                "the coordinator holding a checkpoint of it is online, or pass --fresh to start the stage anew")
        return None

    def _progress_elsewhere(self) -> str | None:
        """What says the run has trained already (checkpoints of this stage, other stages past step 0), if anything."""
        held = [h.step for r in self.records.lookup_checkpoints(self.stage) for h in r.checkpoints]
        if held:
            return f"checkpoints of it up to step {max(held)} are announced in the DHT"
        n = self.config.stages.num_stages
        steps = [r.step for stage, found in self.records.lookup_all_servers(n).items() if stage != self.stage
                 for r in found if r.state == ServerState.ONLINE.value]
        if steps and max(steps) > 0:
            return f"the run's other stages are at step {max(steps)}"
        return None

    def record(self) -> ServerRecord:
        step = self.backend.step if self.backend else 0
        reach = self.options.reachability.state if self.options.reachability else None
        return ServerRecord(peer_id=self.peer_id, stage=self.stage, state=self.state.value,
                            throughput=float(self.throughput), step=step, metrics_addr=self.options.metrics_addr,
                            reach=reach)

    def announce(self) -> bool:
        ok = self.records.announce_server(self.record(), ttl=self.config.network.record_ttl)
        if not ok:
            log.warning("could not store this server's record in the DHT (will retry)")
        return ok

    def _announce_forever(self) -> None:
        # Expert servers come and go: look them up more often than records are renewed.
        period = self.config.network.announce_period
        if self.dispatcher is not None:
            period = min(period, EXPERT_LOOKUP_PERIOD)
        last_announce = time.monotonic()
        while not self._stop.wait(period):
            try:
                self.refresh_experts()
            except Exception as e:
                log.warning("expert server lookup failed: %s", e)
            if time.monotonic() - last_announce < self.config.network.announce_period - period / 2:
                continue
            last_announce = time.monotonic()
            try:
                self.announce()
            except Exception as e:  # a DHT hiccup must not stop the renewals
                log.warning("announce failed: %s", e)
            if self.backend.cache is not None:  # graphs whose backward never came go even when no request does
                with contextlib.suppress(Overloaded, RuntimeError):
                    self.backend.submit(self.backend.cache.expire)

    def _on_step(self, stats: dict) -> None:
        if not stats["skipped"]:
            self.stepped_samples += stats["samples"]
            if self.keeper is not None:
                self.keeper.after_step(stats["step"])
        level = logging.INFO if stats["step"] % STEP_LOG_EVERY == 0 or stats["skipped"] else logging.DEBUG
        own = stats.get("own_samples", stats["samples"])
        log.log(level, "stage %d step %d (lr %.2e, grad norm %.3f, %d samples; of this server's %d, %d one step "
                "late; %d in this server's steps since it started)", self.stage, stats["step"], stats["lr"],
                stats["grad_norm"], stats["samples"], own, stats.get("own_late", 0), self.stepped_samples)

    def shutdown(self) -> None:
        """Announce OFFLINE first, so trainers stop sending work, then stop serving."""
        self._stop.set()
        if self.stage is not None:
            self.state = ServerState.OFFLINE
            try:
                self.announce()
            except Exception as e:
                log.warning("could not announce OFFLINE: %s", e)
        if self._service is not None and self.loop.is_running:
            try:
                self.loop.run(self._service.unregister(self._p2p), LOOP_CALL_TIMEOUT)
            except Exception as e:
                log.debug("unregister failed: %s", e)
        if self.keeper is not None:  # a last checkpoint, read between two requests
            self.keeper.close(lambda: self.backend.call(self.stage_state.state_dict, LOOP_CALL_TIMEOUT))
        if self.averager is not None:
            self.averager.shutdown()  # first: a round in progress on the backend's thread ends at once
        if self.backend is not None:
            self.backend.shutdown()
            cache = self.backend.cache
            if cache is not None and cache.hits + cache.misses:
                log.info("activation cache: %d of %d backwards used the forward's kept graph (%d recomputed), "
                         "%d graphs evicted unused", cache.hits, cache.hits + cache.misses, cache.misses,
                         cache.evictions)


class RecentBackwards:
    """Backward tasks of recent requests, so a retried one is answered from the first run and its
    gradient is not accumulated twice; bounded in entries and in the bytes of the results held.

    Keyed by (caller peer id, request id). A result's bytes count once its task is done (a running
    task holds none yet; the backend's queue bounds how many run). The oldest entries go first;
    the newest is kept even if its result alone is over `max_bytes`. A failed task is forgotten at
    once: nothing was accumulated, so a retry must run again.
    """

    def __init__(self, max_entries: int = BACKWARD_CACHE_SIZE, max_bytes: int = BACKWARD_CACHE_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._tasks: OrderedDict[tuple, asyncio.Future[BackwardResult]] = OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self.bytes_held = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def get(self, key: tuple) -> asyncio.Future[BackwardResult] | None:
        return self._tasks.get(key)

    def add(self, key: tuple, task: asyncio.Future[BackwardResult]) -> None:
        self._tasks[key] = task
        task.add_done_callback(lambda done: self._settle(key, done))
        self._trim()

    def _settle(self, key: tuple, task: asyncio.Future[BackwardResult]) -> None:
        if self._tasks.get(key) is not task:  # already evicted
            return
        if task.cancelled() or task.exception() is not None:
            del self._tasks[key]
            return
        size = result_bytes(task.result())
        self._sizes[key] = size
        self.bytes_held += size
        self._trim()

    def _trim(self) -> None:
        while len(self._tasks) > self.max_entries or (self.bytes_held > self.max_bytes and len(self._tasks) > 1):
            key, _ = self._tasks.popitem(last=False)
            self.bytes_held -= self._sizes.pop(key, 0)


def result_bytes(result: BackwardResult) -> int:
    """Bytes a kept backward result holds: its gradient of the input (the rest is a few numbers)."""
    return 0 if result.grad_input is None else result.grad_input.untyped_storage().nbytes()


class StageRequestHandler(CountingHandler):
    """Checks each request against the server's state, then runs it on the stage backend.

    What a caller can make it hold is bounded: requests over the size of the run's micro-batch are
    refused before buffering (`stage_wire_limits`) or before compute (`_admit`); a request that
    arrives while the backend's queue is full is refused from its metadata (`admit`); recent
    backward results are bounded in bytes (`RecentBackwards`).
    """

    def __init__(self, server: StageServer):
        super().__init__(server)
        self._recent = RecentBackwards(BACKWARD_CACHE_SIZE, server.options.backward_cache_bytes)

    async def serve(self, p2p: hivemind.p2p.P2P, namespace: str) -> StageService:
        """Register this handler on `p2p` under the limits the server's run and options set."""
        config, options = self.server.config, self.server.options
        return await register(p2p, self, namespace, limits=stage_wire_limits(config.model, options.batch_cap(config)),
                              receive_timeout=options.receive_timeout, admit=self.admit,
                              max_concurrent=options.concurrency_cap())

    def admit(self, kind: str, meta: dict) -> None:
        """Refuse from the metadata alone, before the request's tensors are read and buffered."""
        stage = meta.get("stage")
        known = isinstance(stage, int) and not isinstance(stage, bool) and stage >= 0  # else parsing refuses it
        self._check_serving(kind, stage if known else None)
        backend = self.server.backend
        if backend.queue_depth >= backend.max_queue:  # the backend would refuse it (Overloaded) once read
            self._count(kind, NOT_READY)
            raise RequestRejected(NOT_READY, f"stage {self.server.stage} has {backend.queue_depth} tasks queued, "
                                             f"its limit (max_queue {backend.max_queue}); try again later")

    async def forward(self, request: StageRequest) -> StageReply:
        with self.server.metrics.in_flight.labels(kind=request.kind).track_inprogress():
            return await self._forward(request)

    async def backward(self, request: StageRequest) -> StageReply:
        with self.server.metrics.in_flight.labels(kind=request.kind).track_inprogress():
            return await self._backward(request)

    async def _forward(self, request: StageRequest) -> StageReply:
        started = time.perf_counter()
        backend = await self._admit(request)
        keep = (request.caller, request.request_id) if request.backward_follows else None
        (out, step), lost = await self._run(request, _in_call(backend.forward_at), request.inputs, request.targets,
                                            keep)
        self._done(request, started)
        # The experts this forward went without: the trainer sends them back with the backward.
        info = {"moe_lost": sorted(lost.items())} if lost else {}
        return StageReply([out], server_step=step, info=info)

    async def _backward(self, request: StageRequest) -> StageReply:
        started = time.perf_counter()
        backend = await self._admit(request)
        # A retry of a request this server already ran (or is running) must not add its gradient
        # twice: the first run's result is shared, shielded from the first caller's cancellation.
        # Keys name the caller too: one peer's request ids cannot collide with, or take, another's.
        key = (request.caller, request.request_id)
        task = self._recent.get(key)
        first = task is None
        if first:
            call = _in_call(backend.backward, request.inputs.shape[0], request.moe_lost, backend)

            def fn(*args):  # the result alone: what lost experts cost is counted by the dispatcher
                return call(*args)[0]

            task = asyncio.ensure_future(self._run(request, fn, request.inputs, request.grad_outputs,
                                                   request.targets, request.forward_step, key))
            self._recent.add(key, task)
        result = await asyncio.shield(task)
        if first:
            self.server.metrics.samples.inc(request.inputs.shape[0])
            if result.staleness is not None:
                self.server.metrics.staleness.observe(result.staleness)
            if result.stashed:
                self.server.metrics.stashed.inc(request.inputs.shape[0])
        self._done(request, started)
        tensors = [] if result.grad_input is None else [result.grad_input]
        info = {} if result.loss is None else {"loss": result.loss}
        return StageReply(tensors, server_step=result.step, info=info)

    async def _admit(self, request: StageRequest) -> StageBackend:
        server, options = self.server, self.server.options
        self._check_serving(request.kind, request.stage)
        cap = options.batch_cap(server.config)
        if request.inputs.dim() > 0 and request.inputs.shape[0] > cap:
            self._count(request.kind, BAD_REQUEST)
            raise RequestRejected(BAD_REQUEST, f"a request carries at most {cap} samples (the run's micro-batch "
                                               f"size), got a batch of {request.inputs.shape[0]}")
        if options.inject_delay > 0:
            await asyncio.sleep(options.inject_delay)
        if options.inject_failure_rate > 0 and random.random() < options.inject_failure_rate:
            self._count(request.kind, "injected")
            raise RequestRejected(INTERNAL, "injected failure (--inject-failure-rate)")
        return server.backend

    def _check_serving(self, kind: str, stage: int | None) -> None:
        """Refuse unless the server is ONLINE and hosts `stage` (None: not known yet)."""
        server = self.server
        if server.state != ServerState.ONLINE or server.backend is None:
            self._count(kind, NOT_READY)
            raise RequestRejected(NOT_READY, f"server is {server.state.value}, not ONLINE")
        if stage is not None and stage != server.stage:
            self._count(kind, WRONG_STAGE)
            raise RequestRejected(WRONG_STAGE, f"this server hosts stage {server.stage}, not {stage}")

    @property
    def worker(self) -> StageBackend:
        return self.server.backend


def _in_call(fn, samples: int | None = None, lost_in=None, backend: StageBackend | None = None):
    """`fn` run inside an expert_call context (for MoE blocks on expert servers): returns (its result,
    {block: experts lost}). With `backend`, its step when the task runs goes to the experts' backward."""
    def run(*args):
        with expert_call(samples, lost_in, None if backend is None else backend.step) as call:
            return fn(*args), call.lost_out
    return run


async def _call_soon(fn, *args):
    return fn(*args)


def _no_experts(layer: int, u: torch.Tensor, plan):
    """A stand-in for expert servers while timing the stage alone: outputs 0 (the stage's own compute)."""
    return u.new_zeros(*plan.experts.shape, u.shape[-1]) * u.sum(), plan


def measure_throughput(backend: StageBackend, config: RunConfig, repeats: int = 3) -> float:
    """Samples per second of forward + backward on one micro-batch, on a copy of the stage.

    A copy, so the measurement leaves no gradient behind in the real stage. It times what a request
    costs: in the backend's compute dtype, and with the forward run once (graph kept for the
    backward) when the backend keeps graphs, twice (recomputed) when it does not.
    """
    import copy

    module = copy.deepcopy(backend.module)
    for block in module.modules():  # experts on expert servers are not this stage's compute
        if isinstance(block, MoEFeedForward) and block.experts is None:
            block.runner = _no_experts
    n, t = config.optimizer.micro_batch_size, config.model.seq_len
    if module.is_first:
        x = torch.randint(0, config.model.vocab_size, (n, t), device=backend.device)
    else:
        x = torch.randn(n, t, config.model.d_model, device=backend.device)
    targets = torch.randint(0, config.model.vocab_size, (n, t), device=backend.device) if module.is_last else None
    recompute = backend.cache is None and not module.is_last
    timings = []
    for _ in range(repeats + 1):  # the first run warms up allocators and kernels
        started = time.perf_counter()
        with autocast(backend.device, backend.compute_dtype):
            if recompute:
                with torch.no_grad():
                    module(x, targets)
            x_grad = x.float().requires_grad_(True) if not module.is_first else x
            out = module(x_grad, targets)
        out.sum().backward() if out.dim() == 0 else out.backward(torch.ones_like(out))
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        timings.append(time.perf_counter() - started)
    return n / min(timings[1:])
