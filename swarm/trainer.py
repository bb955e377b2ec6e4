"""A trainer: reads its share of the data and keeps micro-batches in flight through the stages."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import hivemind
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from swarm.config import RunConfig
from swarm.data import BatchSampler, load_tokenizer, load_tokens, sampler_seed
from swarm.dht import BackgroundLoop, PeerMetricsRecord, SwarmRecords, online, online_steps, peer_id
from swarm.dht.schemas import MAX_PEER_ID, MAX_SERVED_LISTED, RELAYED, ServedWork
from swarm.protocol import RequestLimits
from swarm.routing import PipelineError, PipelineSettings, RemotePipeline, StageBalancer
from swarm.routing.balancer import most_served
from swarm.routing.inflight import AUTO_IN_FLIGHT, InFlightWindow
from swarm.routing.pings import PING_TIMEOUT, RoundTrips, ping, stage_wire_bytes
from swarm.routing.spot_checks import SPOT_CHECK_RATE

log = logging.getLogger("swarm.trainer")

LOOP_CALL_TIMEOUT = 30.0


@dataclass
class TrainerOptions:
    trainer_index: int | None = None  # which share of the data; None: derived from the peer id
    data: str | None = None  # corpus path or glob overriding the run config's
    in_flight: int | str | None = None  # micro-batches travelling through the pipeline at once (None:
    # default_in_flight; "auto": from that up to a batch's worth as measured round trips demand, inflight.py)
    max_samples: int | None = None  # stop after this many samples (None: until stopped)
    refresh_period: float = 2.0  # how often the server list is read from the DHT
    metrics_period: float = 5.0  # how often loss and speed are published (at least every network.announce_period)
    metrics_addr: str | None = None  # "host:port" of this trainer's /metrics, announced for Prometheus discovery


REQUEST_ID_TOKEN_BYTES = 8  # random bytes in every micro-batch's request id (16 hex characters)


def micro_batch_id(peer: str, worker: int, count: int) -> str:
    """The request id of a micro-batch: readable in logs, unique, and unpredictable to other peers.

    Servers key kept graphs and backward results by (caller, request id). Without the random token
    a trainer restarted under the same identity would count from 1 again and be answered with the
    results of its previous life's micro-batches; with it, no one can guess an id ahead of time.
    """
    return f"{peer}:{worker}:{count}:{secrets.token_hex(REQUEST_ID_TOKEN_BYTES)}"


MAX_DEFAULT_IN_FLIGHT = 8
MAX_ADAPTIVE_IN_FLIGHT = 32  # however long the round trips, a trainer never keeps more in flight
STALE_SHARE = 16  # by default a trainer keeps at most 1/STALE_SHARE of a batch in flight


def in_flight_cap(config: RunConfig) -> int:
    """The most micro-batches a trainer lets the round trips it measures put in flight: a batch's worth
    (more would mean samples of two steps ahead in flight at once, only staler gradients)."""
    opt = config.optimizer
    return max(default_in_flight(config), min(MAX_ADAPTIVE_IN_FLIGHT, opt.batch_size // opt.micro_batch_size))


STREAM_WINDOW = 256 * 1024  # bytes a libp2p stream over TCP may carry before its first yamux window update
MESSAGE_HEADROOM = 8 * 1024  # a message's metadata and framing beside its hidden states


def max_split(config: RunConfig) -> int:
    """Pieces an adaptive window may split each micro-batch into at its cap (InFlightWindow): the fewest (a power
    of two, none smaller than a sample) whose hidden states cross the wire within a stream's first window;
    1 where a whole micro-batch's do already, and with MoE blocks (an expert's capacity is a share of the
    tokens of a request: pieces would drop other tokens than the whole)."""
    if config.model.moe is not None:
        return 1
    per_sample = config.model.seq_len * config.model.d_model * getattr(torch, config.stages.wire).itemsize
    micro, split = config.optimizer.micro_batch_size, 1
    while split < micro and -(-micro // split) * per_sample > STREAM_WINDOW - MESSAGE_HEADROOM:
        split *= 2
    return split


def default_in_flight(config: RunConfig) -> int:
    """Micro-batches a trainer keeps in flight unless told otherwise: at most a sixteenth of a batch.

    More in flight keeps more stages busy at once, but a micro-batch whose stage steps between its
    forward and its backward gets a stale gradient (the recomputed forward sees the new parameters,
    the gradient from the next stage was computed from the old ones), and every trainer's share adds
    up. Measured on configs/tiny.yaml (batch 16, micro-batch 8): with every other micro-batch one step
    stale, the validation loss after 65 steps is 11% worse than exact training. At batch 128 in a
    2 x 2 swarm with two trainers (bench/convergence.py, 2026-12-06), a quarter of a batch each (4)
    ended the schedule 1.16-1.18 x the reference, one each 1.00-1.04 x, at the same samples/s on this
    machine; with one trainer and one micro-batch in flight the swarm trains as the reference does.
    Across links with latency, `--in-flight auto` grows the count from here as the trips demand.
    """
    opt = config.optimizer
    return max(1, min(MAX_DEFAULT_IN_FLIGHT, opt.batch_size // (STALE_SHARE * opt.micro_batch_size)))


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.samples = Counter("swarm_trainer_samples_total", "Samples trained", registry=registry)
        self.failed = Counter("swarm_trainer_failed_micro_batches_total", "Micro-batches that could not complete",
                              registry=registry)
        self.loss = Gauge("swarm_trainer_loss", "Mean loss of recent micro-batches", registry=registry)
        self.speed = Gauge("swarm_trainer_samples_per_second", "Recent training speed", registry=registry)
        self.waiting = Gauge("swarm_trainer_waiting_stages", "Stages with no usable server right now",
                             registry=registry)
        self.in_flight = Gauge("swarm_trainer_in_flight", "Micro-batches this trainer lets travel at once "
                               "(grows while the measured round trips leave the stages room)", registry=registry)
        self.pieces = Gauge("swarm_trainer_micro_batch_pieces", "Pieces each micro-batch travels in at once (more than "
                            "1 once a window at its cap is bound by latency)", registry=registry)
        self.pipeline: RemotePipeline | None = None
        registry.register(self)  # the per-stage figures below are read from the pipeline at each scrape

    def describe(self) -> list:
        return []  # no fixed families at registration: collect() is only called at scrape time

    def collect(self):
        """Per stage: calls that failed (each retried elsewhere), replies that did not fit, servers banned now."""
        failures = CounterMetricFamily("swarm_trainer_call_failures", "Calls to a stage's server that failed "
                                       "(each is retried elsewhere)", labels=["stage"])
        bad = CounterMetricFamily("swarm_trainer_bad_replies", "Replies that did not fit the request "
                                  "(shape, dtype, non-finite values)", labels=["stage"])
        held = CounterMetricFamily("swarm_trainer_held_off_calls", "Calls not sent because this trainer's p2p "
                                   "daemon held off dialing the server after a dial that did not complete (each "
                                   "is retried elsewhere; not the server's failure)", labels=["stage"])
        banned = GaugeMetricFamily("swarm_trainer_banned_servers", "A stage's servers this trainer bans now "
                                   "(or holds off, see swarm_trainer_held_off_calls)", labels=["stage"])
        caught = CounterMetricFamily("swarm_trainer_caught_servers", "Servers banned because witnesses of their "
                                     "stage disagreed with their reply (spot checks)", labels=["stage"])
        errors = CounterMetricFamily("swarm_trainer_error_replies", "Error replies from servers, by code (each is "
                                     "that server's failure)", labels=["code"])
        checks = CounterMetricFamily("swarm_trainer_spot_checks", "Replies checked against a witness, and of them "
                                     "those a witness disagreed with", labels=["outcome"])
        pipeline = self.pipeline
        if pipeline is not None:
            stats = pipeline.stats
            for stage, balancer in enumerate(pipeline.balancers):
                label = [str(stage)]
                failures.add_metric(label, stats.stage_failures.get(stage, 0))
                bad.add_metric(label, stats.stage_bad_replies.get(stage, 0))
                held.add_metric(label, stats.held_off.get(stage, 0))
                banned.add_metric(label, len(balancer.listed()) - len(balancer.available()))
                caught.add_metric(label, stats.caught.get(stage, 0))
            for code, count in sorted(stats.error_replies.items()):
                errors.add_metric([code], count)
            checks.add_metric(["agreed"], stats.spot_checks - stats.disputes)
            checks.add_metric(["disputed"], stats.disputes)
        yield from (failures, bad, held, banned, caught, errors, checks)


class Trainer:
    """Drives micro-batches through the remote pipeline until stopped (or `max_samples`)."""

    def __init__(self, config: RunConfig, dht: hivemind.DHT, records: SwarmRecords, loop: BackgroundLoop,
                 options: TrainerOptions | None = None, registry: CollectorRegistry | None = None,
                 balancer_factory: Callable[[], StageBalancer] | None = None):
        self.config = config
        # How each stage picks its servers (benchmarks swap it); by default with the run's ban times.
        self.balancer_factory = balancer_factory or functools.partial(
            StageBalancer, ban_base=config.network.ban_seconds, ban_max=config.network.max_ban_seconds,
            tie_salt=peer_id(dht))  # (trainers starting together spread their first calls)
        self.dht = dht
        self.records = records
        self.loop = loop
        self.options = options or TrainerOptions()
        wanted = self.options.in_flight
        if wanted == AUTO_IN_FLIGHT:
            self.window = InFlightWindow(default_in_flight(config), in_flight_cap(config), max_split=max_split(config))
        else:
            fixed = default_in_flight(config) if wanted is None else wanted
            if not isinstance(fixed, int) or fixed < 1:
                raise ValueError(f"in_flight must be a whole number of at least 1 or {AUTO_IN_FLIGHT!r}, got {fixed!r}")
            self.window = InFlightWindow(fixed, fixed, adaptive=False)
        self.peer_id = peer_id(dht)
        self.metrics = TrainerMetrics(registry or CollectorRegistry())
        index = self.options.trainer_index
        if index is None:
            index = int.from_bytes(hashlib.sha256(self.peer_id.encode()).digest()[:4], "big")
        data_cfg = config.data
        if self.options.data:
            data_cfg = type(data_cfg)(**{**vars(data_cfg), "corpus": self.options.data})
        tokens = load_tokens(data_cfg, "train", load_tokenizer(data_cfg))
        run_step = self._run_step()
        if run_step:
            # windows are drawn at random (with replacement): there is no position in the data to go back to
            log.info("the run is at step %d: this trainer draws its random windows with a new seed (it does not "
                     "replay those it may have drawn before a restart)", run_step)
        self.sampler = BatchSampler(tokens, config.model.seq_len, config.optimizer.micro_batch_size,
                                    seed=sampler_seed(data_cfg.seed, index, run_step))
        self.samples = 0  # claimed by workers, in flight included (the budget of max_samples)
        self.samples_done = 0  # completed forward and backward
        self.initial_loss: float | None = None  # mean loss of the first batch_size samples trained
        self._first: list[tuple[float, int]] = []
        self.recent: deque[tuple[float, float, int]] = deque(maxlen=256)  # (time, loss, samples)
        self.pipeline: RemotePipeline | None = None
        self.round_trips = RoundTrips()  # which servers to ping next
        self._pinging: asyncio.Task | None = None

    def _run_step(self) -> int:
        """The furthest step any ONLINE server of the run announces (0 for a new run, or if none is found)."""
        try:
            servers = self.records.lookup_all_servers(self.config.stages.num_stages)
        except Exception as e:  # noqa: BLE001 - the data order is all this is for
            log.debug("server lookup for the run's step failed: %s", e)
            return 0
        return max(online_steps(servers), default=0)

    def run(self, stop: threading.Event) -> None:
        """Train until `stop` is set or `max_samples` are done."""
        p2p = self.loop.run(self.dht.replicate_p2p(), LOOP_CALL_TIMEOUT)
        settings = PipelineSettings.from_config(self.config.network)
        settings.pin_backward = self.config.averaging.mode == "local"  # (replicas differ between outer steps)
        config = self.config
        self.pipeline = RemotePipeline(p2p, config.run_id, config.stages.num_stages, config.stages.wire, settings,
                                       self.balancer_factory, hidden_size=config.model.d_model,
                                       limits=RequestLimits.of(config).stage,
                                       # with dropout two honest replicas' forwards differ: no witness can judge
                                       spot_check_rate=0.0 if config.model.dropout > 0 else SPOT_CHECK_RATE)
        for stage, balancer in enumerate(self.pipeline.balancers):  # (untried servers' calls: swarm.routing.pings)
            balancer.wire_bytes = stage_wire_bytes(config, stage)
        self.metrics.pipeline = self.pipeline
        future = asyncio.run_coroutine_threadsafe(self._main(), self.loop.loop)
        try:
            while not future.done():
                if stop.wait(0.2):
                    future.cancel()
                    break
            if not future.cancelled():
                future.result()
        finally:
            self._publish_metrics(self._served_work_from_loop())

    async def _main(self) -> None:
        refresher = asyncio.create_task(self._refresh_servers())
        reporter = asyncio.create_task(self._report())
        try:
            await self._refresh_once()
            await asyncio.gather(*(self._worker(i) for i in range(self.window.cap)))
        finally:
            refresher.cancel()
            reporter.cancel()
            if self._pinging is not None:
                self._pinging.cancel()

    async def _worker(self, worker: int) -> None:
        budget = self.options.max_samples
        count = 0
        while budget is None or self.samples < budget:
            await self.window.acquire()  # as many workers as the window may ever allow; it lets some wait
            trip = None
            try:
                if budget is not None and self.samples >= budget:
                    return
                x, y = self.sampler.next_batch()
                if budget is not None:
                    x, y = x[: budget - self.samples], y[: budget - self.samples]
                n = x.shape[0]
                self.samples += n  # claimed before the trip, so workers never overshoot the budget
                started = time.monotonic()
                split = min(self.window.split, n)
                done, failure = await self._travel(x, y, split, worker, count)
                count += split
                trained = sum(k for _, k in done)
                if failure is not None:
                    self.samples -= n - trained
                    self.metrics.failed.inc()
                    log.warning("micro-batch failed and is dropped%s: %s",
                                f" ({n - trained} of its {n} samples)" if done else "", failure)
                if not done:
                    continue
                n = trained
                loss = sum(value * k for value, k in done) / n
                if failure is None:  # (a trip cut short by a failure says nothing of the round trips)
                    trip = time.monotonic() - started
            finally:
                await self.window.release(trip)
            self.metrics.in_flight.set(self.window.limit)
            self.metrics.pieces.set(self.window.split)
            self.recent.append((time.monotonic(), loss, n))
            self.samples_done += n
            self.metrics.samples.inc(n)
            self._note_initial_loss(loss, n)

    async def _travel(self, x, y, split: int, worker: int, count: int,
                      ) -> tuple[list[tuple[float, int]], PipelineError | None]:
        """Train the micro-batch (x, y) in `split` pieces at once (InFlightWindow.split); (loss, samples) of each
        piece that completed, and the failure of one that did not (None if all did)."""
        pieces = list(zip(x.tensor_split(split), y.tensor_split(split)))
        results = await asyncio.gather(*(
            self.pipeline.train(px, py, request_id=micro_batch_id(self.peer_id, worker, count + i + 1))
            for i, (px, py) in enumerate(pieces)), return_exceptions=True)
        done, failure = [], None
        for result, (px, _) in zip(results, pieces):
            if isinstance(result, PipelineError):
                failure = result
            elif isinstance(result, BaseException):  # a bug, or the trainer stopping: as before the pieces
                raise result
            else:
                done.append((result, px.shape[0]))
        return done, failure

    def _note_initial_loss(self, loss: float, n: int) -> None:
        if self.initial_loss is not None:
            return
        self._first.append((loss, n))
        seen = sum(k for _, k in self._first)
        if seen >= self.config.optimizer.batch_size:
            self.initial_loss = sum(x * k for x, k in self._first) / seen
            asyncio.get_running_loop().run_in_executor(None, self._publish_metrics)

    async def _refresh_once(self) -> None:
        n = self.config.stages.num_stages
        servers = await asyncio.to_thread(self.records.lookup_all_servers, n)
        self.pipeline.update_servers(
            {stage: [r.peer_id for r in online(records)] for stage, records in servers.items()},
            relayed=[r.peer_id for records in servers.values() for r in records if r.reach == RELAYED],
            claims={r.peer_id: r.throughput for records in servers.values() for r in online(records)})
        self.metrics.waiting.set(len(self.pipeline.stats.waiting_stages))
        if self._pinging is None or self._pinging.done():  # (beside the lookups: a ping round takes its time)
            self._pinging = asyncio.create_task(
                self._ping_servers([r.peer_id for records in servers.values() for r in online(records)]))

    async def _ping_servers(self, listed: list[str]) -> None:
        """Time a round trip to the listed servers not timed lately (swarm.routing.pings), for the balancers."""
        self.round_trips.forget(listed)
        due = self.round_trips.due(listed)
        try:
            measured = await asyncio.to_thread(ping, self.dht, due, PING_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - untimed servers are estimated as before
            log.debug("pinging %d servers failed: %s", len(due), e)
            return
        for peer, seconds in measured.items():
            for balancer in self.pipeline.balancers:
                balancer.measured_round_trip(peer, seconds)
        if due:
            trips = sorted(measured.values())
            log.info("pinged %d servers: %d answered%s", len(due), len(trips),
                     f", round trips {trips[0] * 1000:.0f}-{trips[-1] * 1000:.0f} ms" if trips else "")

    async def _refresh_servers(self) -> None:
        while True:
            await asyncio.sleep(self.options.refresh_period)
            try:
                await self._refresh_once()
            except Exception as e:  # a failed lookup keeps the previous list
                log.warning("server lookup failed: %s", e)

    async def _report(self) -> None:
        while True:
            # Renewed like every record, so it never expires between two reports (record_ttl may be short):
            # the coordinator's /status and Prometheus discovery would lose the trainer meanwhile.
            await asyncio.sleep(min(self.options.metrics_period, self.config.network.announce_period))
            # read on the loop, which is where the balancers change; the DHT store then runs off it
            await asyncio.to_thread(self._publish_metrics, self._served_work())

    def recent_stats(self, window: float = 10.0) -> tuple[float | None, float]:
        """Mean loss and samples per second over the last `window` seconds."""
        now = time.monotonic()
        recent = [(t, loss, n) for t, loss, n in list(self.recent) if now - t <= window]
        if not recent:
            return None, 0.0
        loss = sum(loss * n for _, loss, n in recent) / sum(n for *_, n in recent)
        span = max(now - recent[0][0], 1e-3) if len(recent) > 1 else window
        return loss, sum(n for *_, n in recent) / span

    def _served_work(self) -> list[ServedWork] | None:
        """What the servers this trainer used answered lately (StageBalancer.served), the most worked first."""
        pipeline = self.pipeline
        if pipeline is None:
            return None
        return [ServedWork(peer_id=peer_id, stage=stage, work=float(work))
                for peer_id, stage, work in most_served(pipeline.balancers, MAX_SERVED_LISTED)
                if len(peer_id) <= MAX_PEER_ID]

    def _served_work_from_loop(self) -> list[ServedWork] | None:
        """_served_work read on the loop (where the balancers change), from another thread; None if it cannot."""
        async def read() -> list[ServedWork] | None:
            return self._served_work()

        try:
            return self.loop.run(read(), timeout=5.0)
        except Exception as e:
            log.debug("served work not read: %s", e)
            return None

    def _publish_metrics(self, served: list[ServedWork] | None = None) -> None:
        loss, speed = self.recent_stats()
        if loss is not None:
            self.metrics.loss.set(loss)
        self.metrics.speed.set(speed)
        record = PeerMetricsRecord(peer_id=self.peer_id, role="trainer", step=0, samples_per_second=float(speed),
                                   samples=int(self.samples_done), time=time.time(), loss=loss,
                                   initial_loss=self.initial_loss, metrics_addr=self.options.metrics_addr,
                                   served=served)
        try:
            self.records.publish_metrics(record, ttl=self.config.network.record_ttl)
        except Exception as e:
            log.warning("could not publish metrics: %s", e)
