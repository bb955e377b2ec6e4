"""A stage server: hosts one pipeline stage, serves forward/backward, announces itself in the DHT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import hivemind
import torch
from prometheus_client import CollectorRegistry

from swarm.activations import DEFAULT_TTL, ActivationCache, default_cache_bytes
from swarm.averaging import (
    INITIAL_ROUND,
    INNER,
    LocalAverager,
    ProgressChannel,
    StageAverager,
    StateDownloadError,
    averaging_prefix,
)
from swarm.backend import StageBackend
from swarm.checkpoint.keeper import KeeperScope, StageKeeper
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, ServerRecord, ServerState, SwarmRecords, online, online_steps
from swarm.dht.reachability import Reachability
from swarm.drain import wait_for_step
from swarm.model import build_stage
from swarm.model.moe import MoEFeedForward
from swarm.optim import StageOptimizer
from swarm.protocol import (
    BAD_REQUEST,
    DEFAULT_RECEIVE_TIMEOUT,
    FORWARD,
    NOT_READY,
    WRONG_STAGE,
    RequestLimits,
    RequestRejected,
    StageReply,
    StageRequest,
    StageService,
    stage_namespace,
)
from swarm.routing.experts import ExpertDispatcher, RemoteExperts, expert_call
from swarm.routing.pipeline import PipelineSettings
from swarm.state import StageState
from swarm.worker import Overloaded, auto_max_wait, seed_means

from .backwards import BACKWARD_CACHE_BYTES, BACKWARD_CACHE_SIZE, RecentBackwards
from .handler import CountingHandler, InFlight, serve, with_faults
from .lifecycle import LOOP_CALL_TIMEOUT, ServerLifecycle
from .metrics import ServerMetrics
from .placement import choose_stage
from .throughput import stage_throughput

log = logging.getLogger("swarm.server")

STEP_LOG_EVERY = 10  # optimizer steps between progress lines in the log
FORWARDS_REMEMBERED = 8192  # (caller, request id) of the forwards a server in the low-communication mode ran
EXPERT_LOOKUP_PERIOD = 2.0  # seconds between lookups of the expert servers, for a stage whose experts live there


@dataclass
class ServerOptions:
    stage: int | None = None  # None: the stage with the least announced throughput
    choose_delay: float = 0.0  # with stage None, seconds to wait before choosing (joiners of one wave spread)
    device: str = "cpu"
    max_queue: int = 64
    # seconds of queued work past which requests are refused (not_ready), unless their caller has no other server to
    # go to; None: auto_max_wait from the stage's records (inf: never)
    max_wait: float | None = None
    inject_delay: float = 0.0  # seconds added to every request (fault injection)
    inject_slowdown: float = 1.0  # compute held this many times as long, throughput announced that much lower (same)
    # what its JOINING record announces: a moving server's throughput as measured on the stage it left, so
    # that others deciding whether to move count it where it is going (0: a newcomer, not measured yet)
    joining_throughput: float = 0.0
    # what it measures here is multiplied by this: a moving server's first measurement over the same measure of
    # the stage it left, taken just before it left (StageServer.measure_now), so that load on the machine at the
    # moment of the move (its old stage's work, other processes) does not make it announce itself slower
    throughput_scale: float = 1.0
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

    def concurrency_cap(self) -> int:
        return self.max_concurrent_requests if self.max_concurrent_requests is not None else 2 * self.max_queue


class StageStateMissing(RuntimeError):
    """The stage has no live server and no checkpoint could be loaded, yet the run has made progress."""


class StageServer(ServerLifecycle):
    """Lifecycle (ServerLifecycle): JOINING -> build the stage, take its state, measure speed, register RPCs ->
    ONLINE -> OFFLINE."""

    what = "server"

    def __init__(self, config: RunConfig, dht: hivemind.DHT, records: SwarmRecords, loop: BackgroundLoop,
                 options: ServerOptions | None = None, registry: CollectorRegistry | None = None):
        options = options or ServerOptions()
        super().__init__(config, dht, records, loop, options.reachability)
        self.options = options
        self.limits = RequestLimits.of(config, options.max_batch)  # what a request may carry, both ways
        self.stage: int | None = None
        self.backend: StageBackend | None = None
        self.stage_state: StageState | None = None  # the replica's parameters, moments, step and round
        self.averager: StageAverager | None = None
        self.keeper: StageKeeper | None = None  # checkpoints on this server's disk (unless turned off)
        self.dispatcher: ExpertDispatcher | None = None  # reaches this stage's experts, if they live on expert servers
        self.service: StageService | None = None  # the stage RPCs it answers, once registered
        self.throughput = options.joining_throughput
        self.auto_wait: float | None = None  # auto_max_wait while options.max_wait is None (renewed each tick)
        self.stepped_samples = 0  # the samples in the steps this server took since it started (its own and its peers')
        self.served_samples = 0  # the samples of the backwards it answered (swarm_server_samples_total)
        self.registry = registry or CollectorRegistry()
        self.metrics = ServerMetrics(self.registry, backend=lambda: self.backend, dispatcher=lambda: self.dispatcher)

    def start(self) -> None:
        """Join the stage and go ONLINE; raises if the stage cannot be served."""
        n = self.config.stages.num_stages
        stage = self.options.stage
        if stage is None:
            self._stop.wait(self.options.choose_delay)  # records of others joining meanwhile are then seen
            stage = choose_stage(self.records.lookup_all_servers(n), n)
        if not 0 <= stage < n:
            raise ValueError(f"stage {stage} does not exist: the run has stages 0..{n - 1}")
        self.stage = stage
        self.announce()
        self._join_p2p()
        module = build_stage(self.config, stage)
        optimizer = StageOptimizer(module, self.config.optimizer)
        local = self.config.averaging.mode == "local"  # the low-communication mode (swarm.averaging.local)
        self.stage_state = StageState(module, optimizer, stage, INITIAL_ROUND,
                                      local_steps=self.config.averaging.local_steps if local else None)
        averager = LocalAverager if local else StageAverager
        self.averager = averager(self.stage_state, self.dht, self.config.averaging, run_id=self.config.run_id,
                                 owner_key=self.records.local_owner_key, peer_id=self.peer_id, registry=self.registry)
        self.backend = StageBackend(module, optimizer, self.options.device, self.options.max_queue,
                                    on_step=self._on_step, stepper=self.averager,
                                    stash_weights=self.config.stages.stash_weights,
                                    compute_dtype=self.config.stages.compute_dtype, cache=self._activation_cache(),
                                    slowdown=self.options.inject_slowdown)
        if self.options.checkpoint_dir is not None:
            trusted = [self.options.coordinator_peer_id] if self.options.coordinator_peer_id else []
            self.keeper = StageKeeper(self.stage_state, KeeperScope.of(self.config), self.config.checkpoint,
                                      self.options.checkpoint_dir, self.records, self.loop, self.peer_id,
                                      self.registry, trusted_holders=trusted)
        others = sorted(r.peer_id for r in online(self.records.lookup_servers(stage), other_than=self.peer_id))
        if others:
            try:
                self.averager.load_state_from_peers()  # never serve fresh weights while the stage has a state
            except StateDownloadError as e:  # the servers announced may be dead (or never were): checkpoints remain
                log.warning("%s; looking for a checkpoint of the stage instead", e)
                self._resume(f"{len(others)} server(s) announce it ONLINE ({', '.join(others[:3])}), but none "
                             f"served a state this server could take ({e})")
        else:
            self._resume()
        # The state is loaded: from now on only the compute thread changes it (others hand work to it)
        self.backend.hand_over(self.stage_state.owner, LOOP_CALL_TIMEOUT)
        state = self.stage_state
        self.backend.in_look_ahead = lambda: state.lookahead_base is not None
        self.backend.base_params = lambda: state.lookahead_base
        self.throughput = self.measure_now() * self.options.throughput_scale
        self.metrics.throughput.set(self.throughput)
        if self.throughput > 0:  # what --max-wait goes by until requests are timed
            for kind, seconds in seed_means(self.config.optimizer.micro_batch_size / self.throughput,
                                            module.is_last).items():
                self.backend.task_seconds.setdefault(kind, seconds)
        self._reach_experts(module)
        self._renew_auto_wait()
        handler = InFlight(with_faults(StageRequestHandler(self), self.options.inject_delay,
                                       self.options.inject_failure_rate), self.metrics.in_flight)
        self.service = self._serve(serve(self._p2p, handler, stage_namespace(self.config.run_id, stage),
                                         self.limits.stage, self.options.receive_timeout,
                                         self.options.concurrency_cap()))
        channel = ProgressChannel(self._p2p, self.loop, averaging_prefix(self.config.run_id, stage))
        self.averager.start(self.backend.request_step, channel)
        if self.keeper is not None:  # (steps left unsaved when the trainers stop are written, read between requests)
            self.keeper.start(self._p2p, idle_snapshot=lambda: self.backend.call(self.stage_state.state_dict,
                                                                                 LOOP_CALL_TIMEOUT))
        self._go_online()
        log.info("serving stage %d of %d (%.1f samples/s measured) as %s", stage, n, self.throughput, self.peer_id)

    def _reach_experts(self, module) -> None:
        """Give the stage's MoE blocks a runner that calls the expert servers, if its experts live there."""
        moe = self.config.model.moe
        if not module.moe_layers or not moe.expert_servers:
            return
        settings = PipelineSettings.from_config(self.config.network)
        self.dispatcher = ExpertDispatcher(self._p2p, self.config.run_id, moe.num_experts, self.config.stages.wire,
                                           settings, self.limits.expert)
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
        hosts = {r.peer_id: r.experts for r in online(self.records.lookup_expert_hosts())}
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
        servers = self.records.lookup_all_servers(self.config.stages.num_stages)
        steps = online_steps({stage: found for stage, found in servers.items() if stage != self.stage})
        if steps and max(steps) > 0:
            return f"the run's other stages are at step {max(steps)}"
        return None

    @property
    def wait_limit(self) -> float | None:
        """Seconds of queued work past which a caller that could go elsewhere is refused (None: not refused by time)."""
        return self.options.max_wait if self.options.max_wait is not None else self.auto_wait

    def _renew_auto_wait(self) -> None:
        """With no max_wait set: auto_max_wait from this server's forward time and its stage's announced throughputs
        (the median of claims: README, Refusing by time)."""
        if self.options.max_wait is None and self.stage is not None and self.backend is not None:
            try:
                others = online(self.records.lookup_servers(self.stage), other_than=self.peer_id)
            except Exception as e:  # the last limit stays
                log.warning("stage lookup for the wait limit failed: %s", e)
            else:
                claims = [self.throughput, *(r.throughput for r in others)]
                self.auto_wait = auto_max_wait(self.backend.task_seconds.get(FORWARD), self.throughput, claims)
        limit = self.wait_limit
        self.metrics.wait_limit.set(0.0 if limit is None or limit == float("inf") else limit)

    def measure_now(self) -> float:
        """The stage's throughput (samples/s) timed now, on whatever else the machine is doing."""
        return stage_throughput(self.backend, self.config) / self.options.inject_slowdown

    def announce_move(self, stage: int) -> bool:
        """Announce this server JOINING `stage`, with its throughput measured here, before it leaves this stage:
        servers checking whether to move then count it there at once (rather than at 0 until it is ONLINE
        there) and do not follow it to the same stage. A record like any other: anyone can store one."""
        record = ServerRecord(peer_id=self.peer_id, stage=stage, state=ServerState.JOINING.value,
                              throughput=float(self.throughput), metrics_addr=self.options.metrics_addr,
                              reach=self.reach)
        return self._store(record, ttl=self.config.network.record_ttl)

    def record(self) -> ServerRecord:
        step = self.backend.step if self.backend else 0
        averaging: dict = {}
        if self.averager is not None:
            sent, served = self.averager.metrics.sent_bytes, self.served_samples
            averaging["averaging_bytes_per_sample"] = round(sent / served, 1) if served else None
            if isinstance(self.averager, LocalAverager):
                averaging.update(outer_step=self.stage_state.step, drift=round(self.averager.last_drift, 6))
        return ServerRecord(peer_id=self.peer_id, stage=self.stage, state=self.state.value,
                            throughput=float(self.throughput), step=step, metrics_addr=self.options.metrics_addr,
                            reach=self.reach, **averaging)

    def _store(self, record: ServerRecord, ttl: float) -> bool:
        return self.records.announce_server(record, ttl=ttl)

    @property
    def tick_period(self) -> float:
        # Expert servers come and go: look them up more often than records are renewed.
        return EXPERT_LOOKUP_PERIOD if self.dispatcher is not None else self.config.network.announce_period

    def _tick(self) -> None:
        try:
            self.refresh_experts()
        except Exception as e:
            log.warning("expert server lookup failed: %s", e)
        self._renew_auto_wait()
        if self.backend.cache is not None:  # graphs whose backward never came go even when no request does
            with contextlib.suppress(Overloaded, RuntimeError):
                self.backend.submit(self.backend.cache.expire)

    def _on_step(self, stats: dict) -> None:
        if "outer_step" in stats or stats.get("averaging") == INNER:
            self._on_local_step(stats)
            return
        if not stats["skipped"]:
            self.stepped_samples += stats["samples"]
            if self.keeper is not None:
                self.keeper.after_step(stats["step"])
        level = logging.INFO if stats["step"] % STEP_LOG_EVERY == 0 or stats["skipped"] else logging.DEBUG
        own = stats.get("own_samples", stats["samples"])
        log.log(level, "stage %d step %d (lr %.2e, grad norm %.3f, %d samples; of this server's %d, %d one step "
                "late; %d in this server's steps since it started)", self.stage, stats["step"], stats["lr"],
                stats["grad_norm"], stats["samples"], own, stats.get("own_late", 0), self.stepped_samples)

    def _on_local_step(self, stats: dict) -> None:
        """An inner or an outer step of the low-communication mode: what counts (samples, checkpoints) are the outer
        steps, which make the stage's state; inner steps are logged as a lone server's steps are."""
        if "outer_step" not in stats:
            level = logging.INFO if stats["step"] % STEP_LOG_EVERY == 0 or stats["skipped"] else logging.DEBUG
            log.log(level, "stage %d inner step %d (lr %.2e, grad norm %.3f, %d samples)", self.stage, stats["step"],
                    stats["lr"], stats["grad_norm"], stats["samples"])
            return
        if not stats["skipped"]:
            self.stepped_samples += stats["samples"]
            if self.keeper is not None:
                self.keeper.after_step(stats["outer_step"])
        log.info("stage %d outer step %d at inner step %d (%s, %d servers; pseudo-gradient update norm %.4f, "
                 "%d samples; %d in this server's outer steps since it started)", self.stage, stats["outer_step"],
                 stats["step"], stats["averaging"], stats["group_size"], stats["grad_norm"], stats["samples"],
                 self.stepped_samples)

    def _teardown(self) -> None:
        if self.keeper is not None:  # a last checkpoint, read between two requests
            self.keeper.close(lambda: self.backend.call(self.stage_state.state_dict, LOOP_CALL_TIMEOUT))
        if self.averager is not None:
            self.averager.shutdown()  # first: a round in progress on the backend's thread ends at once
        if self.backend is not None:
            self.backend.shutdown()
            log.info("gradient delays: %s", self.backend.delays.summary())
            if self.backend.drain is not None:
                log.info("batch drain: %s", self.backend.drain.summary())
            cache = self.backend.cache
            if cache is not None and cache.hits + cache.misses:
                log.info("activation cache: %d of %d backwards used the forward's kept graph (%d recomputed), "
                         "%d graphs evicted unused", cache.hits, cache.hits + cache.misses, cache.misses,
                         cache.evictions)


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
        # In the low-communication mode replicas differ between outer steps: a backward whose forward another
        # replica ran counts for averaging.recomputed_weight; the forwards this server ran, by (caller, id)
        self._local = server.config.averaging.mode == "local"
        self._forwarded: OrderedDict[tuple, None] = OrderedDict()

    def admit(self, kind: str, meta: dict) -> None:
        """Refuse from the metadata alone, before the request's tensors are read and buffered."""
        stage = meta.get("stage")
        known = isinstance(stage, int) and not isinstance(stage, bool) and stage >= 0  # else parsing refuses it
        self._check_serving(kind, stage if known else None)
        self._check_room(kind, f"stage {self.server.stage}", self.server.wait_limit, meta.get("patient") is True)

    async def forward(self, request: StageRequest) -> StageReply:
        started = time.perf_counter()
        backend = await self._admit(request)
        await self._wait_for_step(backend, ahead=request.backward_follows)
        keep = (request.caller, request.request_id) if request.backward_follows else None
        if keep is not None and self._local:
            self._forwarded[keep] = None
            while len(self._forwarded) > FORWARDS_REMEMBERED:
                self._forwarded.popitem(last=False)
        forwarded, lost = await self._run(request, _in_call(backend.forward_at), request.inputs, request.targets,
                                          keep)
        out, step = forwarded
        self._done(request, started)
        # The experts this forward went without: the trainer sends them back with the backward.
        info = {"moe_lost": sorted(lost.items())} if lost else {}
        if forwarded.ahead:  # on predicted parameters, not step's: spot checks compare it with its like only
            info["ahead"] = True
        return StageReply([out], server_step=step, info=info)

    async def backward(self, request: StageRequest) -> StageReply:
        started = time.perf_counter()
        backend = await self._admit(request)
        # A retry of a request this server already ran (or is running) must not add its gradient
        # twice: the first run's result is shared, shielded from the first caller's cancellation.
        # Keys name the caller too: one peer's request ids cannot collide with, or take, another's.
        key = (request.caller, request.request_id)
        task = self._recent.get(key)
        first = task is None
        if first and backend.module.is_last:  # (its forward: on the parameters of the step, as any forward)
            await self._wait_for_step(backend)
            task = self._recent.get(key)  # (a retry of it may have come meanwhile)
            first = task is None
        if first:
            call = _in_call(backend.backward, request.inputs.shape[0], request.moe_lost, backend)

            def fn(*args):  # the result alone: what lost experts cost is counted by the dispatcher
                return call(*args)[0]

            task = asyncio.ensure_future(self._run(request, fn, request.inputs, request.grad_outputs,
                                                   request.targets, request.forward_step, key, self._weight(key)))
            self._recent.add(key, task)
        result = await asyncio.shield(task)
        if first:
            self.server.metrics.samples.inc(request.inputs.shape[0])
            self.server.served_samples += request.inputs.shape[0]
            if result.staleness is not None:
                self.server.metrics.staleness.observe(result.staleness)
            if result.stashed:
                self.server.metrics.stashed.inc(request.inputs.shape[0])
        self._done(request, started)
        tensors = [] if result.grad_input is None else [result.grad_input]
        info = {} if result.loss is None else {"loss": result.loss}
        if result.ahead:
            info["ahead"] = True
        return StageReply(tensors, server_step=result.step, info=info)

    async def _wait_for_step(self, backend: StageBackend, ahead: bool = False) -> None:
        """A forward waits while its stage's batch is closing, briefly, and (`ahead`: its backward follows) while
        the forwards in flight fill that batch if the stage has other servers (a server alone predicts the step from
        all of the batch so far, a replica from its share: swarm.drain); not in the low-communication mode, whose
        replicas step on their own."""
        optimizer = self.server.config.optimizer
        in_flight = backend.in_flight if ahead and backend.ahead and not backend.module.is_last and \
            _replicated(backend.stepper) else None
        if not self._local and (optimizer.step_wait_seconds > 0 or in_flight is not None):
            await wait_for_step(backend.stepper, optimizer.step_wait_seconds, in_flight=in_flight,
                                ahead_limit=optimizer.ahead_wait_seconds,
                                rounds=getattr(backend.stepper, "round_times", None),
                                round_limit=optimizer.round_wait_seconds)

    def _weight(self, key: tuple) -> float:
        """What a backward's gradient counts for here: in full, unless another replica of a stage in the
        low-communication mode ran its forward (the last stage runs both in one call)."""
        if not self._local or self.server.backend.module.is_last:
            return 1.0
        if key in self._forwarded:
            del self._forwarded[key]
            return 1.0
        self.server.metrics.recomputed_elsewhere.inc()
        return self.server.config.averaging.recomputed_weight

    async def _admit(self, request: StageRequest) -> StageBackend:
        server = self.server
        self._check_serving(request.kind, request.stage)
        cap = server.limits.samples
        if request.inputs.dim() > 0 and request.inputs.shape[0] > cap:
            self._count(request.kind, BAD_REQUEST)
            raise RequestRejected(BAD_REQUEST, f"a request carries at most {cap} samples (the run's micro-batch "
                                               f"size), got a batch of {request.inputs.shape[0]}")
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


def _replicated(stepper: object) -> bool:
    """Whether the stage has other servers at this one's step (as far as its progress view says)."""
    view = getattr(stepper, "view", None)
    try:
        return view is not None and view().group_size > 1
    except Exception:  # noqa: BLE001 - a stepper shutting down: no wait, the request meets that
        return False


def _in_call(fn, samples: int | None = None, lost_in=None, backend: StageBackend | None = None):
    """`fn` run inside an expert_call context (for MoE blocks on expert servers): returns (its result,
    {block: experts lost}). With `backend`, its step when the task runs goes to the experts' backward."""
    def run(*args):
        with expert_call(samples, lost_in, None if backend is None else backend.step) as call:
            return fn(*args), call.lost_out
    return run


async def _call_soon(fn, *args):
    return fn(*args)
