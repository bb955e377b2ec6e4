"""A 10x-slow server joins a stage of 2 normal servers: trainer throughput with it / without it.

One stage, served by two normal servers; the trainer runs in this process so that its routing can
be swapped. A calibration phase (one micro-batch in flight, so no queueing) measures a normal
server's time per request; a third server then joins, slowed by --inject-delay to ~10x that. Each
round then times, for every in-flight count (1, 2, 4 and 8 by default), a pair of phases, each a
fresh trainer (fresh routing estimates) over the same running swarm:

    balancer with the 2 normal servers | balancer with all 3

plus the same pair with round-robin routing at the smallest in-flight count, for contrast (with one
in flight it is where a slow server hurts most). Every other round runs the phases in reverse order.
("with 2": the trainer's routing ignores the slow server, so the same programs run in every phase
and machine-load drift shows up between rounds instead of between the figures compared). The
figures of merit are speed with the slow server / speed without it, for the balancer at each
in-flight count (goal >= 0.95). A phase times its window only once the fresh trainer has measured
every server it uses (so a newcomer's probe, paid once per trainer, is left out) and after
`warmup` more. The batch is larger than any phase trains, so no averaging round (which pauses every
server of the stage alike) blurs the routing.

    .venv/bin/python bench/slow_peer.py            # 3 rounds of 12 s phases (about 9 minutes)
    .venv/bin/python bench/slow_peer.py --quick    # 2 rounds of 5 s phases (about 4 minutes)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from coordinator.launcher import Child, end_all
from coordinator.local_swarm import free_port
from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, SwarmRecords, join_run, load_identity
from swarm.logs import FORMAT
from swarm.routing import StageBalancer, Ticket
from swarm.trainer import Trainer, TrainerOptions

LOCAL = "/ip4/127.0.0.1/tcp/0"
START_TIMEOUT = 180.0  # a program's start, and servers showing up ONLINE (2 shared cores, torch imports)
HTTP_TIMEOUT = 5.0
POLL = 0.2


class RoundRobinBalancer(StageBalancer):
    """StageBalancer choosing servers in turn, whatever their speed (bans and timeouts unchanged)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._turn = 0

    def choose(self, task_size: int, kind: str, exclude: Iterable[str] = ()) -> Ticket | None:
        candidates = sorted(self.available(exclude))
        if not candidates:
            return None
        self._turn += 1
        return self.charge(candidates[self._turn % len(candidates)], task_size, kind)


ROUTINGS: dict[str, type[StageBalancer]] = {"balancer": StageBalancer, "round-robin": RoundRobinBalancer}


def routing(kind: str, ignore: frozenset[str] = frozenset()) -> Callable[[], StageBalancer]:
    """A balancer factory of this kind that never sees the servers in `ignore`."""

    class Routing(ROUTINGS[kind]):
        def update_servers(self, peer_ids: Iterable[str]) -> None:
            super().update_servers(p for p in peer_ids if p not in ignore)

    return Routing


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """A program's /metrics: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=HTTP_TIMEOUT) as reply:
        body = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def total(metrics: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in metrics.items() if n == name and want <= lab)


class Server:
    """A swarm-peer serving stage 0, with its /metrics port."""

    def __init__(self, name: str, maddr: str, log_dir: Path, *extra: str):
        self.port = free_port()
        self.child = Child(name, "peer.cli", ["--initial-peers", maddr, "--host-maddrs", LOCAL, "--role", "server",
                                              "--stage", "0", "--device", "cpu", "--metrics-port", str(self.port),
                                              *extra], log_dir)

    def peer_id(self, timeout: float = START_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(r"serving stage \d+ of \d+ .* as (\S+)", self.child.log_path.read_text(errors="replace"))
            if found:
                return found.group(1)
            if not self.child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.child.name} did not start serving: {self.child.last_error()}")
            time.sleep(POLL)

    def requests(self) -> tuple[float, float]:
        """(ok requests, seconds spent answering requests) so far."""
        m = scrape(self.port)
        return total(m, "swarm_server_requests_total", status="ok"), total(m, "swarm_server_request_seconds_sum")


class Bench:
    def __init__(self, config: RunConfig, config_path: Path, log_dir: Path):
        self.config, self.config_path, self.log_dir = config, config_path, log_dir
        self.children: list[Child] = []
        self.loop = BackgroundLoop("bench-loop")
        self.dht = None

    def start(self, normal_servers: int) -> list[Server]:
        coordinator = Child("coordinator", "coordinator.cli", ["--config", str(self.config_path), "--host-maddrs",
                                                                LOCAL], self.log_dir)
        self.children.append(coordinator)
        self.maddr = coordinator.wait_for_output(r"initial peers: (\S+)", START_TIMEOUT, threading.Event()).group(1)
        servers = [self.add_server(f"server-{i}") for i in range(normal_servers)]
        self.loop.start()
        identity = load_identity(None)
        self.dht, _, _ = join_run([self.maddr], identity, self.loop, host_maddrs=[LOCAL])
        self.records = SwarmRecords(self.dht, self.config.run_id, identity)
        return servers

    def add_server(self, name: str, *extra: str) -> Server:
        server = Server(name, self.maddr, self.log_dir, *extra)
        self.children.append(server.child)
        return server

    def wait_online(self, peer_ids: set[str]) -> None:
        """Until stage 0's ONLINE servers are exactly `peer_ids`."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            records = self.records.lookup_all_servers(1).get(0, [])
            if {r.peer_id for r in records if r.state == "ONLINE"} == peer_ids:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage 0 did not get exactly the servers {sorted(peer_ids)} ONLINE")
            time.sleep(POLL)

    def phase(self, balancer: Callable[[], StageBalancer], servers: list[Server], in_flight: int, warmup: float,
              seconds: float) -> dict:
        """A fresh trainer with this routing: samples/s over `seconds` once it has measured every server
        and `warmup` more, and each server's calls."""
        options = TrainerOptions(trainer_index=0, in_flight=in_flight)
        trainer = Trainer(self.config, self.dht, self.records, self.loop, options, CollectorRegistry(),
                          balancer_factory=balancer)
        stop, errors = threading.Event(), []

        def run() -> None:
            try:
                trainer.run(stop)
            except BaseException as e:  # reported below; a crash must not pass for a slow phase
                errors.append(e)

        thread = threading.Thread(target=run, name="trainer")
        thread.start()
        try:
            self.wait_measured(trainer, errors)
            time.sleep(warmup)
            before, counts_before, started = trainer.samples_done, [s.requests() for s in servers], time.monotonic()
            time.sleep(seconds)
            after, counts_after, elapsed = trainer.samples_done, [s.requests() for s in servers], \
                time.monotonic() - started
        finally:
            stop.set()
            thread.join(60)
        if errors:
            raise RuntimeError(f"the trainer crashed: {errors[0]!r}")
        calls = [a[0] - b[0] for a, b in zip(counts_after, counts_before)]
        busy = [a[1] - b[1] for a, b in zip(counts_after, counts_before)]
        return {"speed": (after - before) / elapsed, "calls": calls, "busy": busy,
                "failed_calls": trainer.pipeline.stats.failures}

    def wait_measured(self, trainer: Trainer, errors: list) -> None:
        """Until the trainer's routing has timed every server it uses: its probes of newcomers are past."""

        async def unmeasured() -> list[str] | None:  # on the loop that owns the balancer, not beside it
            if trainer.pipeline is None or not trainer.pipeline.balancers[0].listed():
                return None  # not started, or no lookup yet
            balancer = trainer.pipeline.balancers[0]
            return [p for p in balancer.listed() if not balancer.servers[p].measured]

        deadline = time.monotonic() + START_TIMEOUT
        while (left := self.loop.run(unmeasured(), HTTP_TIMEOUT)) is None or left:
            if errors:
                raise RuntimeError(f"the trainer crashed: {errors[0]!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not time every server within {START_TIMEOUT:g}s "
                                   f"(untimed: {left})")
            time.sleep(POLL)

    def close(self) -> None:
        # Servers before the coordinator, so they can still announce OFFLINE through the DHT.
        end_all(self.children[1:])
        end_all(self.children[:1])
        if self.dht is not None:
            self.dht.shutdown()
        self.loop.stop()


def run(args: argparse.Namespace) -> dict:
    config = RunConfig.load(args.config)
    config.stages.num_stages = 1
    config.optimizer.batch_size = 1_000_000  # never filled here: no averaging round during a phase
    config.network.announce_period, config.network.record_ttl = 1.0, 5.0  # joins and leaves seen within seconds
    config.validate()
    os.environ["OMP_NUM_THREADS"] = "1"  # the servers share this machine's cores; children inherit it
    rounds, warmup, seconds = (2, 1.0, 5.0) if args.quick else (3, 3.0, 12.0)
    with tempfile.TemporaryDirectory(prefix="bench-slow-peer-") as tmp:
        logs = Path(args.log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        # the in-process trainer's log (each failed call is a warning) goes beside the programs' logs
        logging.basicConfig(filename=logs / "trainer.log", level=logging.INFO, format=FORMAT, datefmt="%H:%M:%S")
        path = logs / "run.yaml"
        config.save(path)
        bench = Bench(config, path, logs)
        try:
            normal = bench.start(normal_servers=2)
            normal_ids = {s.peer_id() for s in normal}
            bench.wait_online(normal_ids)
            calibration = bench.phase(routing("balancer"), normal, 1, warmup, seconds)
            per_call = sum(calibration["busy"]) / max(sum(calibration["calls"]), 1)
            delay = max(args.slowdown - 1.0, 0.0) * per_call
            print(f"a normal server answers a request in {per_call * 1000:.0f} ms (one in flight); "
                  f"the slow server adds {delay * 1000:.0f} ms to each (~{args.slowdown:g}x)", flush=True)
            slow = bench.add_server("server-slow", "--inject-delay", f"{delay:.4f}")
            slow_id = slow.peer_id()
            bench.wait_online(normal_ids | {slow_id})
            servers = [*normal, slow]
            results: dict[tuple[str, int, str], list[dict]] = {}
            phases = [(kind, in_flight, with_slow, ignore) for kind, in_flight in cases(args.in_flight)
                      for with_slow, ignore in (("2 normal", frozenset({slow_id})), ("+ slow", frozenset()))]
            for i in range(rounds):
                # every other round in reverse order, so a steady drift in the machine's load favours no phase
                for kind, in_flight, with_slow, ignore in phases if i % 2 == 0 else phases[::-1]:
                    result = bench.phase(routing(kind, ignore), servers, in_flight, warmup, seconds)
                    results.setdefault((kind, in_flight, with_slow), []).append(result)
                    print(f"round {i + 1}: {kind:<11} {in_flight} in flight, {with_slow:<8} "
                          f"{result['speed']:6.1f} samples/s, micro-batches per server "
                          f"{[round(c) for c in result['calls']]}, failed calls {result['failed_calls']}", flush=True)
        finally:
            bench.close()
    return results


def cases(in_flights: list[int]) -> list[tuple[str, int]]:
    """(routing, in flight) pairs to time: the balancer at each count, round-robin at the smallest."""
    return [("balancer", n) for n in sorted(set(in_flights))] + [("round-robin", min(in_flights))]


def report(results: dict, args: argparse.Namespace) -> None:
    rounds = len(next(iter(results.values())))
    print(f"\nsamples/s of one trainer, stage of 2 normal servers + one {args.slowdown:g}x slower "
          f"(mean of {rounds} rounds):")
    print(f"{'routing':<12} {'in flight':>9} {'2 normal':>9} {'+ slow':>8} {'ratio':>6} {'per round':>18}  "
          f"slow server's share  failed calls")
    for kind, in_flight in cases(args.in_flight):
        alone, slow = results[kind, in_flight, "2 normal"], results[kind, in_flight, "+ slow"]
        base = sum(r["speed"] for r in alone) / len(alone)
        speed = sum(r["speed"] for r in slow) / len(slow)
        per_round = ", ".join(f"{s['speed'] / a['speed']:.2f}" for a, s in zip(alone, slow))
        calls = [sum(r["calls"][i] for r in slow) for i in range(3)]
        share = calls[2] / max(sum(calls), 1)
        failed = sum(r["failed_calls"] for r in alone + slow)
        print(f"{kind:<12} {in_flight:>9} {base:>9.1f} {speed:>8.1f} {speed / base:>6.2f} {per_round:>18}  "
              f"{share:>19.0%}  {failed:>12}")
    print("goal: balancer ratio >= 0.95 at every in-flight count")


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml", help="model and data (run with 1 stage here)")
    p.add_argument("--quick", action="store_true", help="fewer, shorter phases (about 4 minutes in all)")
    p.add_argument("--slowdown", type=float, default=10.0, help="how many times slower the slow server is")
    p.add_argument("--in-flight", type=positive, nargs="+", default=[1, 2, 4, 8],
                   help="micro-batches the trainer keeps in flight, one pair of phases per count "
                        "(round-robin runs at the smallest)")
    p.add_argument("--log-dir", help="keep the programs' logs here (default: a temporary directory, removed)")
    args = p.parse_args()
    report(run(args), args)


if __name__ == "__main__":
    main()
