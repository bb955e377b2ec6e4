"""An expert server: hosts experts of a run's MoE blocks, serves their forward and backward, and
announces them in the DHT (`swarm-peer --role expert --experts auto|LIST`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import hivemind
import torch
from prometheus_client import CollectorRegistry

from swarm.checkpoint.claims import step_bound
from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.keeper import KeeperMetrics, KeeperScope, StageKeeper
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, ExpertHostRecord, ServerState, SwarmRecords, online, online_steps
from swarm.dht.reachability import Reachability
from swarm.experts import ExpertHost, ExpertState
from swarm.protocol import (
    BAD_REQUEST,
    DEFAULT_RECEIVE_TIMEOUT,
    NOT_READY,
    WRONG_STAGE,
    RequestLimits,
    RequestRejected,
    StageReply,
    StageRequest,
    experts_namespace,
)

from .handler import CountingHandler, serve, with_faults
from .lifecycle import LOOP_CALL_TIMEOUT, ServerLifecycle
from .metrics import ExpertMetrics
from .placement import choose_experts
from .replicas import ExpertReplicas
from .throughput import expert_throughput

log = logging.getLogger("swarm.expert")

STATE_TIMEOUT = 60.0  # for every hosted expert's state to arrive from live hosts of it
DONOR_LOOKUPS = 3  # reads of the experts' hosts, an announce period apart, while one is beyond the bound


@dataclass
class ExpertOptions:
    experts: list[int] | None = None  # None: auto, the `count` experts served least (placement.choose_experts)
    count: int | None = None  # auto: how many experts to host; None: half the experts of a block, at least 1
    device: str = "cpu"
    max_queue: int = 64
    max_wait: float | None = None  # as ServerOptions.max_wait
    inject_delay: float = 0.0  # seconds added to every request (fault injection)
    inject_slowdown: float = 1.0  # compute held this many times as long, throughput announced that much lower (same)
    inject_failure_rate: float = 0.0  # fraction of requests answered with an error (fault injection)
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT
    metrics_addr: str | None = None
    reachability: Reachability | None = None  # whether others can dial this host, once its check has ended
    checkpoint_dir: Path | None = None  # checkpoint root (swarm.checkpoint: <root>/<run_id>/expert<e>/); None: none
    coordinator_peer_id: str | None = None  # the run's coordinator: its checkpoints are trusted as it vetted them


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
        self.states: dict[int, ExpertState] = {}  # each hosted expert, in every MoE block
        self.replicas: dict[int, ExpertReplicas] = {}  # each one's averaging with its other hosts
        self.keepers: dict[int, StageKeeper] = {}  # each one's checkpoints (none with no checkpoint_dir)
        self._renewed = 0.0  # monotonic time the keepers' records were last renewed

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
        self.host = ExpertHost(self.config, self.experts, self.options.device, self.options.max_queue,
                               slowdown=self.options.inject_slowdown)
        self.states = {e: ExpertState(self.host, e) for e in self.experts}
        for e, state in self.states.items():
            self.replicas[e] = ExpertReplicas(state, self.dht, self.records, self.config.averaging,
                                              run_id=self.config.run_id,
                                              announce_period=self.config.network.announce_period,
                                              peer_id=self.peer_id, counter=self.metrics.replica_rounds)
        for replicas in self.replicas.values():  # forked side by side, waited for together
            replicas.wait_started(self.config.averaging.state_download_timeout)
        if self.options.checkpoint_dir is not None:
            metrics = KeeperMetrics(self.registry)
            trusted = [self.options.coordinator_peer_id] if self.options.coordinator_peer_id else []
            scope = KeeperScope.of(self.config, "expert")
            self.keepers = {e: StageKeeper(state, scope, self.config.checkpoint, self.options.checkpoint_dir,
                                           self.records, self.loop, self.peer_id, trusted_holders=trusted,
                                           metrics=metrics)
                            for e, state in self.states.items()}
        self._take_states(seen)
        self.host.hand_over(self.host.owner, LOOP_CALL_TIMEOUT)  # only its worker thread changes the experts
        self.throughput = expert_throughput(self.host, self.config) / self.options.inject_slowdown
        handler = with_faults(ExpertRequestHandler(self), self.options.inject_delay, self.options.inject_failure_rate)
        self._serve(serve(self._p2p, handler, experts_namespace(self.config.run_id), self.limits.expert,
                          self.options.receive_timeout, 2 * self.options.max_queue))
        self._go_online()
        for replicas in self.replicas.values():
            replicas.start()
        for i, keeper in enumerate(self.keepers.values()):  # one service answers for all, _tick renews them
            keeper.start(self._p2p, serve=self._checkpoint_path if i == 0 else False, renew=False)
        log.info("hosting experts %s of MoE blocks %s as %s (%.0f tokens/s measured)", self.experts,
                 self.config.model.moe_layers(), self.peer_id, self.throughput)

    def _tick(self) -> None:
        """Renew the experts' checkpoint records, at half their lifetime: a host of many experts renews that
        many records, and a record changes only when a checkpoint is written (announced then, at once)."""
        now = time.monotonic()
        if self.keepers and now - self._renewed >= self.config.network.record_ttl / 2:
            self._renewed = now
            for e, keeper in self.keepers.items():
                try:  # steps left unsaved when the stage servers stop calling are written, as a stage's are (not
                    if self.host.queue_depth == 0:  # behind queued work: this thread also renews the records)
                        keeper.save_idle(lambda state=self.states[e]: self.host.submit(state.state_dict).result(
                            LOOP_CALL_TIMEOUT))
                    keeper.announce()
                except Exception as err:  # noqa: BLE001 - a DHT hiccup: the next tick tries again
                    log.warning("expert %d: writing or announcing its checkpoints failed: %s", e, err)

    def _checkpoint_path(self, manifest_id: str) -> Path | None:
        """The checkpoint directory of any hosted expert whose manifest has this id (what the service serves)."""
        for keeper in self.keepers.values():
            path = keeper.store.path_for(manifest_id)
            if path is not None:
                return path
        return None

    def _take_states(self, seen: list[ExpertHostRecord] = ()) -> None:
        """Each hosted expert's state: from a live host of it (so replicas start equal), else from the newest
        checkpoint of it on this disk or announced in the DHT (swarm.checkpoint, as a stage's); an expert with
        neither starts from its initial weights (said loudly once the run has trained).

        `seen`: the hosts looked up when choosing the experts. A later lookup can miss one (a DHT get that
        reached no holder of the key; seen once in CI, where the joiner then started an expert afresh beside
        its live host), so those records stay candidates too: asking a host for its state needs no DHT.
        """
        hosts = self._donors_within_bound(seen)
        fresh, deadline = [], time.monotonic() + STATE_TIMEOUT  # for every expert's state from live hosts
        for e in self.states:
            donors = [r.peer_id for r in sorted((r for r in hosts if e in r.experts), key=lambda r: -r.step)]
            left = deadline - time.monotonic()
            step = self.replicas[e].download(donors, left) if donors and left > 0 else None
            if step is not None:
                if e in self.keepers:  # the next checkpoint is due counting from the state taken
                    self.keepers[e].schedule.restored(step)
                continue
            keeper = self.keepers.get(e)
            try:
                if keeper is not None and keeper.restore(self._p2p) is not None:
                    continue
            except CheckpointError as err:
                log.warning("expert %d: %s", e, err)
            fresh.append(e)
        steps = [r.step for r in self.records.lookup_all_servers(self.config.stages.num_stages).get(0, [])]
        steps += [r.step for r in hosts]
        if fresh and steps and max(steps) > 0:
            log.warning("experts %s have no live host nor checkpoint to take their state from: they start from "
                        "their initial weights although the run is at step %d", fresh, max(steps))

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

    def backward(self, *args) -> tuple[torch.Tensor, list[dict]]:
        """ExpertHost.backward, on the host's worker thread; after a step, each expert's keeper gets its step
        (it copies the state there and writes it beside compute when checkpoint.every_steps / every_seconds
        say), as a stage server's does on its compute thread."""
        grad, stats = self.host.backward(*args)
        for e, keeper in self.keepers.items() if stats else ():
            try:
                keeper.after_step(self.states[e].step)
            except Exception as err:  # noqa: BLE001 - the backward took effect: its reply must still go out
                log.warning("expert %d: copying its state for a checkpoint failed: %s", e, err)
        return grad, stats

    def record(self) -> ExpertHostRecord:
        return ExpertHostRecord(peer_id=self.peer_id, experts=self.experts, state=self.state.value,
                                throughput=float(self.throughput), step=self.host.step if self.host else 0,
                                metrics_addr=self.options.metrics_addr, reach=self.reach)

    def _store(self, record: ExpertHostRecord, ttl: float) -> bool:
        return self.records.announce_expert_host(record, ttl=ttl)

    def _teardown(self) -> None:
        for replicas in self.replicas.values():  # first: a round hands its update to the host's worker
            replicas.stop()
        for e, keeper in self.keepers.items():  # a last checkpoint, so a restart here loses nothing
            keeper.close(lambda state=self.states[e]: self.host.submit(state.state_dict).result(LOOP_CALL_TIMEOUT))
        for e, replicas in self.replicas.items():
            try:
                replicas.close()
            except Exception as err:  # noqa: BLE001 - stopping anyway; the others still close
                log.warning("expert %d: closing its averaging failed: %s", e, err)
        if self.host is not None:
            self.host.shutdown()


class ExpertRequestHandler(CountingHandler):
    """Checks each request against what is hosted here, then runs it on the expert host's worker."""

    def admit(self, kind: str, meta: dict) -> None:
        self._check_serving(kind)
        self._check_room(kind, "the expert server", self.server.options.max_wait)

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
        grad, stats = await self._run(request, self.server.backward, request.stage, request.experts,
                                      request.inputs, request.grad_outputs, request.samples, request.stage_step)
        for step in stats:
            if step["skipped"]:
                log.warning("an expert skipped a step: non-finite gradient norm")
        if stats:
            log.info("experts stepped: step %d (lr %.2e)", host.step, stats[0]["lr"])
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
