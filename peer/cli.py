"""`swarm-peer`: join a run through its initial peers and serve a stage or train."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import random
import signal
import sys
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from swarm.averaging import AveragingError
from swarm.config import ConfigError, RunConfig
from swarm.data import DataError, volunteer_data
from swarm.dht import (
    BackgroundLoop,
    SwarmDHTError,
    SwarmRecords,
    gate,
    join_run,
    load_identity,
    load_swarm_key,
    read_initial_peers,
    serve_run_info,
    visible_maddrs,
)
from swarm.dht.node import REACHABILITY_CHOICES, NatOptions
from swarm.dht.reachability import Reachability, behind_nat, serve_dial_back, start_check
from swarm.envflags import apply_env_defaults, positive_int
from swarm.logs import setup_logging, stop_on_signals
from swarm.metrics import MetricsServer, metrics_address
from swarm.routing.inflight import AUTO_IN_FLIGHT
from swarm.traffic import TrafficCollector

log = logging.getLogger("swarm.peer")

DEFAULT_REBALANCE_PERIOD = 60.0
JOIN_SPREAD = 5.0  # seconds: a server choosing its stage waits a uniform random part of this first


def stage_arg(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        stage = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a stage number, got {value!r}") from None
    if stage < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {stage}")
    return stage


def experts_arg(value: str) -> list[int] | None:
    if value == "auto":
        return None
    try:
        experts = [int(part) for part in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a comma-separated list of expert indices, got {value!r}"
                                         ) from None
    if any(e < 0 for e in experts) or len(set(experts)) != len(experts):
        raise argparse.ArgumentTypeError(f"expert indices must be distinct and not negative, got {value!r}")
    return experts


def fraction(value: str) -> float:
    x = float(value)
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return x


def non_negative(value: str) -> float:
    x = float(value)
    if not 0 <= x < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return x


def at_least_one(value: str) -> float:
    x = float(value)
    if not 1 <= x < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1, got {value}")
    return x


def positive_float(value: str) -> float:
    x = float(value)
    if not 0 < x < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return x


def wait_seconds(value: str) -> float:
    x = float(value)
    if not 0 < x <= math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (inf: never), got {value}")
    return x


def dht_problem(dht) -> str | None:
    """Why this peer cannot do its job right now (for /healthz), or None."""
    return None if dht.is_alive() else "its DHT process has exited"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swarm-peer", description="Join a swarm training run.")
    p.add_argument("--initial-peers", nargs="+", required=True,
                   help="multiaddrs of peers already in the run, or @FILE: a file listing them (as swarm-coordinator "
                   "--initial-peers-file writes it; waited for up to --join-timeout)")
    p.add_argument("--role", choices=["auto", "server", "trainer", "expert"], default="auto",
                   help="server: host a stage; trainer: drive data through the stages; expert: host experts of the "
                   "run's mixture-of-experts blocks (runs with model.moe.expert_servers); auto: server with a GPU")
    p.add_argument("--experts", type=experts_arg, default=None, metavar="auto|LIST",
                   help="expert: which experts to host, in every MoE block, e.g. 0,1,2 (default auto: the "
                   "--expert-count experts that the hosts' announced throughput serves least)")
    p.add_argument("--expert-count", type=positive_int, default=None, metavar="N",
                   help="expert, with --experts auto: how many experts to host (default: half of a block's)")
    p.add_argument("--stage", type=stage_arg, default=None, metavar="auto|K",
                   help="stage to serve (default auto: the one with the least throughput, and the server moves "
                   "to another stage when that raises the swarm's bottleneck; K pins it to stage K)")
    p.add_argument("--movable", action="store_true",
                   help="server with --stage K: start on stage K, and move later as a server with --stage auto does")
    p.add_argument("--no-rebalance", action="store_true",
                   help="server with --stage auto: stay on the stage chosen at joining")
    p.add_argument("--rebalance-period", type=positive_float, default=DEFAULT_REBALANCE_PERIOD, metavar="S",
                   help="server with --stage auto: mean seconds between checks of whether to move (a move needs "
                   "two checks in a row)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where a server computes")
    p.add_argument("--identity", help="identity file (created if missing) for a stable peer id")
    p.add_argument("--swarm-key", metavar="FILE", help="join a private swarm: a copy of its coordinator's swarm key")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], help="multiaddrs to listen on")
    p.add_argument("--announce-maddrs", nargs="+", default=[], help="multiaddrs others should dial")
    p.add_argument("--reachability", choices=REACHABILITY_CHOICES, default="auto",
                   help="whether other peers can dial this one: auto (libp2p's AutoNAT finds out from peers that "
                   "dial back), public, or private (behind NAT: a server takes a relay slot at once)")
    p.add_argument("--relays", nargs="+", default=[], metavar="MADDR",
                   help="server, expert: relays to be reached through when behind NAT (default: the initial peers)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics (and /healthz) on this port")
    p.add_argument("--metrics-host", help="the host or IP address at which Prometheus reaches this peer's metrics "
                   "port, announced so the coordinator's discovery lists it (default: from --announce-maddrs, "
                   "else this peer's first non-loopback address)")
    p.add_argument("--data", help="trainer: the data this peer may read: a directory the run config's data.corpus "
                   "is resolved under, or your own corpus (file, glob, or a directory when the run uses the "
                   "embedded one). Without it only the embedded corpus is read")
    p.add_argument("--trainer-index", type=int, help="trainer: which share of the data (default: from peer id)")
    p.add_argument("--max-samples", type=int, help="trainer: stop after this many samples")
    p.add_argument("--in-flight", type=in_flight_arg, metavar="N|auto",
                   help="trainer: micro-batches in flight at once (default: a sixteenth of a batch, at least 1; "
                   "more keeps stages busier but makes gradients staler). auto: from that up to a whole batch "
                   "while the round trips it measures leave the stages idle (for links with latency); at a "
                   "whole batch, each micro-batch then travels in pieces small enough for a stream's first window")
    p.add_argument("--max-queue", type=positive_int, default=None, metavar="N",
                   help="server, expert: tasks queued for compute before more are refused as busy, so callers go "
                   "to another server (default: 64). In a large swarm whose trainers keep many micro-batches in "
                   "flight, 1-2 spread the load (bench/sim: README, A simulator of a large swarm)")
    p.add_argument("--max-wait", type=wait_seconds, default=None, metavar="SECONDS",
                   help="server, expert: refuse a request as busy while the work queued ahead of it would hold it "
                   "longer than this, unless its caller has no other server to go to, so callers go to a server "
                   "that starts it sooner; inf: never (default: the run config's network.max_wait, else for a stage "
                   "server of a stage of three or more 0.3 of a forward of its stage's median server, at least 0.5 s, "
                   "and for an expert host "
                   "never; README, Refusing by time)")
    p.add_argument("--inject-delay", type=non_negative, default=0.0, metavar="SECONDS",
                   help="fault injection (tests, demos): a server delays every request by this much")
    p.add_argument("--inject-slowdown", type=at_least_one, default=1.0, metavar="FACTOR",
                   help="fault injection (tests, benches): a server computes FACTOR times as long and announces "
                   "FACTOR times less throughput, as on hardware that much slower (--inject-delay only adds latency)")
    p.add_argument("--inject-failure-rate", type=fraction, default=0.0, metavar="P",
                   help="fault injection (tests, demos): a server fails this fraction of requests")
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="server, expert: keep this stage's (these experts') checkpoints here and resume from them "
                   "(default: $XDG_CACHE_HOME/swarm/checkpoints, or ~/.cache/swarm/checkpoints)")
    p.add_argument("--no-checkpoints", action="store_true",
                   help="server, expert: keep no checkpoints on this machine (the run's other holders still do)")
    p.add_argument("--fresh", action="store_true",
                   help="server: start a stage that has no live server from fresh weights even though the run "
                   "has checkpoints or progress (a new run under an old run id)")
    p.add_argument("--activation-cache-mb", type=non_negative, default=None, metavar="MB",
                   help="server: memory for forward graphs kept until their backward, so it need not recompute "
                   "the forward (default: a quarter of the device's free memory; 0 turns it off)")
    p.add_argument("--activation-cache-ttl", type=positive_float, default=None, metavar="SECONDS",
                   help="server: how long a kept forward graph waits for its backward (default: 120)")
    p.add_argument("--join-timeout", type=float, default=60.0, help="seconds to find the run and its config")
    p.add_argument("--check", action="store_true", help="join, print the run config, and exit")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    apply_env_defaults(p)
    return p


def resolve_role(role: str, device: str) -> tuple[str, str]:
    import torch

    has_gpu = torch.cuda.is_available()
    if device == "cuda" and not has_gpu:
        raise ConfigError("--device cuda was asked for but no CUDA device is available")
    if device == "auto":
        device = "cuda" if has_gpu else "cpu"
    if role == "auto":
        role = "server" if device == "cuda" else "trainer"
    return role, device


def describe(config: RunConfig) -> str:
    m, o = config.model, config.optimizer
    return (f"run {config.run_id}: GPT {m.n_layer} layers x {m.d_model} in {config.stages.num_stages} stages, "
            f"batch {o.batch_size} (micro-batch {o.micro_batch_size}), lr {o.lr:g}, corpus {config.data.corpus}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    stop = threading.Event()
    stop_on_signals(stop)
    # The DHT process is forked: with these handlers it would ignore DHT.shutdown()'s SIGTERM fallback (hang at exit).
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    if args.no_checkpoints and args.checkpoint_dir is not None:
        sys.exit("swarm-peer: error: --checkpoint-dir and --no-checkpoints contradict each other: give one")
    if args.movable and args.no_rebalance:
        sys.exit("swarm-peer: error: --movable and --no-rebalance contradict each other: give one")
    from swarm.checkpoint.errors import CheckpointError
    from swarm.serving import StageStateMissing

    try:
        run(args, stop)
    except (ConfigError, DataError, SwarmDHTError, AveragingError, CheckpointError, StageStateMissing, OSError,
            ValueError) as e:
        sys.exit(f"swarm-peer: error: {e}")


def run(args: argparse.Namespace, stop: threading.Event) -> None:
    role, device = resolve_role(args.role, args.device)
    identity = load_identity(args.identity)
    loop = BackgroundLoop("peer-loop").start()
    dht = None
    try:
        swarm_key = load_swarm_key(args.swarm_key) if args.swarm_key else None
        if swarm_key is not None:  # before any P2P starts: the DHT and averaging processes fork from this one
            gate.install(swarm_key)
        initial_peers = read_initial_peers(args.initial_peers, args.join_timeout, stop.wait)
        serves = role in ("server", "expert")  # a trainer only dials out: behind NAT it needs no relay
        reachability = args.reachability
        if serves and reachability == "auto" and behind_nat(initial_peers, args.host_maddrs, args.announce_maddrs):
            log.info("no peer could dial this machine: telling libp2p it is behind NAT, so that it takes a relay "
                     "slot at once and opens direct connections by hole punching where the NAT allows")
            reachability = "private"
        nat = NatOptions(reachability=reachability, relay_client=serves, relay_service=serves,
                         relays=tuple(args.relays))
        dht, info, config = join_run(initial_peers, identity, loop, host_maddrs=args.host_maddrs,
                                     announce_maddrs=args.announce_maddrs, timeout=args.join_timeout,
                                     swarm_key=swarm_key, nat=nat)
        log.info("joined %s (coordinator %s)", describe(config), info.coordinator_peer_id)
        if args.check:
            print(describe(config), flush=True)
            print(config.to_yaml(), end="", flush=True)
            return
        serve_run_info(dht, loop, info, swarm_key=swarm_key)  # so newcomers can use this peer as an initial peer too
        serve_dial_back(dht, loop, visible_maddrs(dht))  # so newcomers can learn whether they can be dialed
        reachability = Reachability()
        if serves:
            start_check(dht, loop, initial_peers, reachability)
        records = SwarmRecords(dht, config.run_id, identity, swarm_key=swarm_key)
        registry = CollectorRegistry()
        registry.register(TrafficCollector(dht))
        metrics, metrics_addr = None, None
        if args.metrics_port is not None:
            metrics = MetricsServer(registry, args.metrics_port, health=lambda: dht_problem(dht))
            maddrs = [*args.announce_maddrs, *visible_maddrs(dht)]
            metrics_addr = metrics_address(metrics.port, args.metrics_host, maddrs)
            log.info("metrics: http://%s/metrics", metrics_addr)
        try:
            if role == "server":
                run_server(args, config, dht, records, loop, device, registry, stop, metrics_addr,
                           coordinator=info.coordinator_peer_id, reachability=reachability)
            elif role == "expert":
                run_expert(args, config, dht, records, loop, device, registry, stop, metrics_addr, reachability,
                           coordinator=info.coordinator_peer_id)
            else:
                run_trainer(args, config, dht, records, loop, registry, stop, metrics_addr)
        finally:
            if metrics is not None:
                metrics.close()
    finally:
        if dht is not None:
            dht.shutdown()
        loop.stop()


def checkpoint_root(args: argparse.Namespace) -> Path | None:
    """Where a server keeps its checkpoints: --checkpoint-dir, the user's cache, or nowhere (--no-checkpoints)."""
    from swarm.checkpoint.store import default_root

    return None if args.no_checkpoints else (args.checkpoint_dir or default_root())


def run_server(args, config, dht, records, loop, device, registry, stop, metrics_addr, coordinator=None,
               reachability=None) -> None:
    """Serve a stage until `stop`; with --stage auto, move to another stage whenever the rebalancing rule says
    (swarm.serving.rebalance): leave cleanly, then join the new stage as a new server would."""
    from swarm.averaging import StateDownloadError
    from swarm.serving import ServerOptions, StageServer, StageStateMissing
    from swarm.serving.rebalance import Rebalancer

    movable = (args.stage is None or args.movable) and not args.no_rebalance
    rebalancer = Rebalancer(args.rebalance_period) if movable else None
    current = CurrentRegistry()
    registry.register(current)
    moves = Counter("swarm_server_moves_total", "Moves of this server to another stage, by why",
                    ["reason"], registry=registry)
    stage, back_to, joining, scale = args.stage, None, 0.0, 1.0
    while not stop.is_set():
        options = ServerOptions(stage=stage, device=device, inject_delay=args.inject_delay,
                                inject_slowdown=args.inject_slowdown, joining_throughput=joining,
                                throughput_scale=scale, inject_failure_rate=args.inject_failure_rate,
                                checkpoint_dir=checkpoint_root(args),
                                fresh=args.fresh and back_to is None, metrics_addr=metrics_addr,
                                coordinator_peer_id=coordinator, reachability=reachability,
                                choose_delay=random.uniform(0, JOIN_SPREAD))
        if args.max_queue is not None:
            options.max_queue = args.max_queue
        options.max_wait = max_wait(args, config)
        if args.activation_cache_mb is not None:
            options.activation_cache_bytes = int(args.activation_cache_mb * 2**20)
        if args.activation_cache_ttl is not None:
            options.activation_cache_ttl = args.activation_cache_ttl
        current.registry = CollectorRegistry()  # each stage served has metrics of its own
        server = StageServer(config, dht, records, loop, options, current.registry)
        try:
            move = serve_until(server, stop, rebalancer)
        except (StageStateMissing, StateDownloadError) as e:
            if back_to is None:
                raise
            log.error("could not take the state of stage %s (%s): going back to stage %d", stage, e, back_to)
            rebalancer.avoid(stage)
            stage, back_to, joining = back_to, None, server.throughput
            continue
        if move is None:
            return
        moves.labels(reason=move.reason).inc()
        stage, back_to, joining, scale = move.stage, server.stage, server.throughput, move.scale


class CurrentRegistry:
    """A collector that reads the registry of the stage server serving now (a server that moves starts anew)."""

    def __init__(self):
        self.registry: CollectorRegistry | None = None

    def collect(self):
        if self.registry is not None:
            yield from self.registry.collect()


def run_expert(args, config, dht, records, loop, device, registry, stop, metrics_addr, reachability=None,
               coordinator: str | None = None) -> None:
    from swarm.serving import ExpertOptions, ExpertServer

    checkpoint_dir = checkpoint_root(args)
    options = ExpertOptions(experts=args.experts, count=args.expert_count, device=device,
                            inject_delay=args.inject_delay, inject_slowdown=args.inject_slowdown,
                            inject_failure_rate=args.inject_failure_rate,
                            metrics_addr=metrics_addr, checkpoint_dir=checkpoint_dir, reachability=reachability,
                            coordinator_peer_id=coordinator)
    if args.max_queue is not None:
        options.max_queue = args.max_queue
    options.max_wait = max_wait(args, config)
    serve_until(ExpertServer(config, dht, records, loop, options, registry), stop)


def max_wait(args, config) -> float | None:
    """The seconds of queued work past which this server refuses a request: --max-wait, else the run's setting."""
    return args.max_wait if args.max_wait is not None else config.network.max_wait


def serve_until(server, stop: threading.Event, rebalancer=None):
    """Start a stage or expert server and serve until `stop` (None) or, with a rebalancer, until it says to move
    (the Move); then leave (OFFLINE first) whatever happened."""
    try:
        server.start()
        while not stop.wait(rebalancer.next_wait() if rebalancer is not None else None):
            move = planned_move(server, rebalancer, stop)
            if move is not None:
                log.info("moving from stage %d to stage %d (%s): the swarm's bottleneck would go from %.1f to %.1f "
                         "samples/s", server.stage, move.stage, move.reason, move.before, move.after)
                if not server.announce_move(move.stage):  # before OFFLINE here: it is always counted somewhere
                    log.warning("could not announce joining stage %d before leaving (moving anyway)", move.stage)
                return dataclasses.replace(move, scale=load_scale(server))
        log.info("stopping: announcing OFFLINE")
        return None
    finally:
        server.shutdown()


def load_scale(server) -> float:
    """What the stage it moves to should multiply its measurements by (ServerOptions.throughput_scale): its
    announced throughput over the same measure taken now, on the load of the moment (bounded to 1/4..4; 1 if
    the measure fails)."""
    try:
        now = server.measure_now()
    except Exception as e:
        log.warning("could not time this stage before leaving it (%s): the next stage's measure counts as it is", e)
        return 1.0
    if not (now > 0 and math.isfinite(now) and server.throughput > 0):
        return 1.0
    return min(max(server.throughput / now, 0.25), 4.0)


def planned_move(server, rebalancer, stop: threading.Event):
    """One check of the rebalancer on records read now and, for a move it confirms, its last check after a
    pause on records read again: the Move to make, or None."""
    from swarm.serving.rebalance import describe, served_on

    num_stages = server.config.stages.num_stages

    def read():
        try:
            servers = server.records.lookup_all_servers(num_stages)
        except Exception as e:  # a DHT hiccup: no move this time
            log.warning("could not read the stages' servers to check whether to move: %s", e)
            return None, ()
        try:  # what trainers got from this stage's servers: without it, stage-mates count at most as this one
            served = served_on(server.records.lookup_metrics(), server.stage)
        except Exception as e:
            log.warning("could not read the trainers' served work: %s", e)
            served = ()
        return servers, served

    servers, served = read()
    move = None if servers is None else rebalancer.check(servers, num_stages, server.peer_id, served)
    if servers is not None:
        log.info("rebalancing check: %s", describe(rebalancer.view))
    if move is None or stop.wait(rebalancer.settle_wait()):
        return None
    servers, served = read()
    if servers is None:
        return None
    if not rebalancer.settle(move, servers, num_stages, server.peer_id, served):
        log.info("not moving to stage %d after all: the swarm changed meanwhile", move.stage)
        return None
    return move


def in_flight_arg(value: str) -> int | str:
    """argparse type of --in-flight: a whole number of at least 1, or auto."""
    return value if value == AUTO_IN_FLIGHT else positive_int(value)


def run_trainer(args, config, dht, records, loop, registry, stop, metrics_addr) -> None:
    from swarm.trainer import Trainer, TrainerOptions

    config.data = volunteer_data(config.data, args.data)  # the run config's paths stay under --data
    options = TrainerOptions(trainer_index=args.trainer_index, in_flight=args.in_flight, max_samples=args.max_samples,
                             metrics_addr=metrics_addr)
    trainer = Trainer(config, dht, records, loop, options, registry)
    window = trainer.window
    log.info("training on stages 0..%d with %s", config.stages.num_stages - 1,
             f"{window.limit} micro-batches in flight" if not window.adaptive else
             f"{window.floor} to {window.cap} micro-batches in flight, as the round trips it measures demand")
    trainer.run(stop)
    log.info("trainer done: %d samples", trainer.samples_done)


if __name__ == "__main__":
    main()
