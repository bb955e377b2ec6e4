"""A swarm of simulated peers driven by the project's own routing, placement and rebalancing code.

What is the project's own, imported and run on the simulated clock:
- routing: each trainer has one swarm.routing.StageBalancer per stage (expected finish, probation, bans,
  the backward preferring its forward's server), told the stage's ONLINE servers every lookup period, their
  claims, and (with `pings`) the round trip to each, as a ping (twice the one-way latency) measures it;
- placement: a joining server takes swarm.serving.placement.choose_stage of the records it sees, after a
  random pause (as swarm-peer does);
- rebalancing: a server placed by the swarm runs a swarm.serving.rebalance.Rebalancer (its random
  periods, two checks in a row, the last check after a pause) and moves as swarm-peer does (OFFLINE,
  its queued work failed back to the trainers, a state download, ONLINE on the new stage).

What is modelled, not run (the constants are the Scenario's):
- compute: a server does one task at a time, first come first served; a task of n samples takes
  n x seconds_per_sample x (1 forward, 2 for a backward from the kept graph, 3 for the last stage's
  forward and backward in one call or a backward that recomputes its forward) / the server's speed; with
  `max_queue` or `max_wait` a server refuses a call as busy when its queue is that long, or when the work ahead
  of the call, as a real server estimates it (swarm.worker.wait_ahead, seed_means), is longer than that;
- the network: a message waits for its sender's uplink (each uplink sends one message at a time, first
  come first served: busy whenever it has bytes, as a fair share is), moves at the lesser of that uplink
  and the receiver's downlink (downlinks are not shared), a STREAM_WINDOW at a time (each window past the
  first waits for the receiver's update, a round trip, where its bytes went out sooner), and arrives one
  region-to-region latency later; a relayed server (behind NAT, not hole-punched) adds a relay detour to
  each of its messages; a call carries token ids into stage 0 and hidden states elsewhere, and costs
  `call_overhead` besides (serializing, the p2p daemons' hops);
- records: what a peer reads of the others' records is what they are at that moment (no DHT delay);
- churn: server sessions are exponential (mean Scenario.session); for each server that leaves a newcomer
  arrives an exponential delay later (mean Scenario.arrival_delay), so the population stays near its
  size; a server that leaves fails its queued and running tasks at once (the trainer learns after one
  latency) and its trainers' balancers ban it as usual;
- an oracle's placement, with `oracle_placement`: servers placed and moved, free of cost, by one who knows every
  speed (Swarm._oracle_place), instead of by choose_stage and Rebalancer;
- routing against an oracle: at each call, the finish the chosen server would give it (its queue, what its
  running task has left, its speed and links as they are then) against the best of the stage's ONLINE servers
  (Window.routing, a ratio of sums); and what the trainer got: how long each call took to be answered, from
  its first choice through any refusals, failures and retries, against the oracle's best finish at that first
  choice among the servers that would take it (Window.answered);
- a trainer gives a call up (and bans the server, as its balancer does) after the timeout RemotePipeline
  sets, from the same balancer; the server drops a forward given up before it started, and computes
  anything else (a backward is shared by its retries, as StageRequestHandler does).
A trainer keeps `in_flight` micro-batches going (or, with `in_flight_cap`, as many as the project's own
swarm.routing.inflight.InFlightWindow allows from the trips it measures, between the two, as `--in-flight
auto` does): forward through stages 0..S-2, the last stage's
forward and backward in one call, then backward S-2..0, every call from the trainer and back.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.sim.engine import Sim
from bench.sim.network import ONE_WAY_MS, REGIONS, Endpoint, Network  # noqa: F401 - ONE_WAY_MS: tests and validate.py set it here
from bench.sim.oracle import finish_on, oracle_ticket
from bench.sim.servers import Server, Task
from swarm.dht import ServerRecord
from swarm.dht.schemas import MAX_SERVED_LISTED, PeerMetricsRecord, ServedWork
from swarm.protocol import BACKWARD, FORWARD
from swarm.routing.balancer import StageBalancer, most_served
from swarm.routing.inflight import InFlightWindow
from swarm.routing.pings import RoundTrips
from swarm.serving.placement import choose_stage
from swarm.serving.rebalance import Move, Rebalancer, served_on
from swarm.worker import TASK_SECONDS_ALPHA, auto_max_wait, seed_means, wait_ahead

AUTO = "auto"  # Scenario.max_wait: what a stage server does with no max_wait set

METRICS_PERIOD = 5.0  # seconds between a trainer's metrics records (swarm.trainer's default)


@dataclass
class Scenario:
    """What the simulated swarm is made of. Speeds are relative to `seconds_per_sample` at 1.0."""

    stages: int = 8
    servers: int = 900
    trainers: int = 100
    micro_batch: int = 64
    in_flight: int = 4  # micro-batches a trainer keeps going
    in_flight_cap: int | None = None  # set: the trainer's InFlightWindow adapts from in_flight up to this
    seconds_per_sample: float = 0.01  # one forward of one sample of a stage on a speed-1.0 server
    wire_bytes_per_sample: int = 128 * 512 * 2  # hidden states of one sample (seq 128, d 512, bfloat16)
    token_bytes_per_sample: int = 128 * 8  # stage 0's inputs and the last stage's targets: token ids (int64)
    # seconds a call takes beyond compute and the network: serializing, the p2p daemons' hops, the trainer's own
    # handling (configs/tiny.yaml on loopback at one micro-batch in flight, 2026-12-06: a trip took 79 ms where
    # compute and the network made 61 ms, three calls)
    call_overhead: float = 0.006
    stage_state_bytes: int = 400 * 2**20  # what a server downloads to join a stage
    join_overhead: float = 10.0  # seconds a join takes besides the download
    choose_spread: float = 5.0  # a joiner's random pause before choosing (swarm-peer's JOIN_SPREAD)
    session: float = 3600.0  # mean server session, seconds (exponential); 0: no churn
    arrival_delay: float = 120.0  # mean seconds after a server leaves until a newcomer arrives
    rebalance: bool = True
    rebalance_period: float = 60.0
    lookup_period: float = 5.0  # how often a trainer reads the stages' servers
    # (relative speed, share of servers): from a fast datacenter GPU down to a CPU
    speeds: Sequence[tuple[float, float]] = ((1.0, 0.15), (0.5, 0.35), (0.25, 0.35), (0.1, 0.15))
    # (uplink, downlink) in Mbit/s, share of servers; trainers get the first
    links: Sequence[tuple[tuple[float, float], float]] = (((1000, 1000), 0.2), ((100, 500), 0.4),
                                                           ((50, 300), 0.3), ((20, 100), 0.1))
    nat_share: float = 0.4  # servers behind NAT
    punched_share: float = 0.7  # of those, reached directly after hole punching; the rest relayed
    relay_detour: float = 0.04  # seconds a relayed message takes beyond the direct latency
    regions: Sequence[str] = REGIONS  # where peers are, drawn uniformly
    seed: int = 0
    max_queue: int | None = None  # tasks a server queues; it refuses more as busy (NOT_READY), None: no limit
    # seconds of work queued ahead past which a server refuses a call as busy (swarm-peer --max-wait), None: no limit,
    # AUTO: as a server with none set (swarm.worker.auto_max_wait); either way a caller with nowhere else to go waits
    max_wait: float | str | None = None
    claims: bool = True  # trainers take a server's announced throughput for it until they measure it
    pings: bool = True  # trainers time a round trip to each server and count it in an untried server's calls
    # servers placed by an oracle instead (Swarm._oracle_place): joiners to the stage weakest by every server's
    # true speed, and whenever one joins, comes ONLINE or leaves, servers moved free of cost while that helps
    oracle_placement: bool = False
    # trainers routed by an oracle instead of their StageBalancers: each call to the ONLINE server that would answer
    # it first, knowing every queue, what each server has on its way to it, every speed and link (Trainer.call)
    oracle_routing: bool = False


# a trainer's call timeout, as swarm.config.NetworkConfig's defaults: 5 x its expected finish, within [5 s, 60 s]
TIMEOUT_MULTIPLIER, TIMEOUT_FLOOR, REQUEST_TIMEOUT = 5.0, 5.0, 60.0


class Swarm:
    def __init__(self, scenario: Scenario):
        self.s = scenario
        self.sim = Sim()
        self.net = Network(self.sim, scenario.relay_detour)
        self.rng = random.Random(scenario.seed)
        self._rebalance_rng = random.Random(scenario.seed + 1)  # (the peers drawn are the same either way)
        self.servers: dict[str, Server] = {}
        self.trainers: list[Trainer] = []
        self._served: tuple[int, list] = (-1, [])  # (period, what each trainer published then): served_on
        self.samples = 0  # samples whose micro-batch finished, all trainers
        self.failed_calls = 0  # calls a server failed (it left, or was not serving)
        self.timed_out_calls = 0  # calls the trainer gave up on (the server computes them anyway)
        self.trips: list[float] = []  # seconds each finished micro-batch took, first forward to last backward
        self.measure_routing = False  # then each call adds (its expected finish, the oracle's best) to routing
        self.routing: list[tuple[float, float]] = []
        # ... and each call answered (how long it took, from its first choice through any refusals, failures and
        # retries, the oracle's best expected finish at that first choice) to `answered`
        self.answered: list[tuple[float, float]] = []
        self._ids = 0
        self._records: tuple[int, dict] | None = None  # (version, records) while no server changes state
        self._version = 0  # bumped whenever a server's stage or state changes
        self._auto: tuple[int, dict[str, float | None]] = (-1, {})  # (version, each server's auto max_wait)

    # --- peers --------------------------------------------------------------------------------------
    def _pick(self, table):
        x, acc = self.rng.random(), 0.0
        for value, share in table:
            acc += share
            if x < acc:
                return value
        return table[-1][0]

    def _endpoint(self, trainer: bool = False) -> Endpoint:
        up, down = self.s.links[0][0] if trainer else self._pick(self.s.links)
        nat = not trainer and self.rng.random() < self.s.nat_share
        relayed = nat and self.rng.random() >= self.s.punched_share
        return Endpoint(self.rng.choice(self.s.regions), up * 1e6 / 8, down * 1e6 / 8, relayed)

    def add_server(self, stage: int | None = None, speed: float | None = None) -> Server:
        self._ids += 1
        speed = self._pick(self.s.speeds) if speed is None else speed
        server = Server(f"s{self._ids}", speed, self._endpoint(), pinned=stage is not None)
        self.servers[server.peer_id] = server
        if stage is None:
            self.sim.after(self.rng.uniform(0, self.s.choose_spread), self._choose, server)
        else:
            self._join(server, stage)
        if self.s.session > 0:
            self.sim.after(self.rng.expovariate(1 / self.s.session), self.leave, server)
        return server

    def _choose(self, server: Server) -> None:
        if not server.alive:
            return
        if self.s.oracle_placement:
            totals = self._true_totals()
            self._join(server, totals.index(min(totals)))
            self._oracle_place()
        else:
            self._join(server, choose_stage(self.records(), self.s.stages))

    def _join(self, server: Server, stage: int) -> None:
        self._version += 1
        server.stage, server.state = stage, "JOINING"
        # (a new worker: swarm-peer starts the stage's server anew, and seeds its means from what it measured there)
        server.task_seconds = seed_means(self.s.micro_batch / server.throughput(self.s), stage == self.s.stages - 1)
        download = self.s.stage_state_bytes / server.link.down + self.s.join_overhead
        self.sim.after(download, self._online, server, stage)

    def _online(self, server: Server, stage: int) -> None:
        if not server.alive or server.stage != stage:
            return
        self._version += 1
        server.state = "ONLINE"
        if self.s.oracle_placement:  # (it could not move the server while it joined)
            self._oracle_place()
        if self.s.rebalance and not self.s.oracle_placement and not server.pinned and server.rebalancer is None:
            server.rebalancer = Rebalancer(self.s.rebalance_period, random.Random(self._rebalance_rng.random()),
                                           clock=self.sim.clock)
            self.sim.after(server.rebalancer.next_wait(), self._check, server)

    def leave(self, server: Server) -> None:
        if not server.alive:
            return
        self._version += 1
        server.alive, server.state = False, "OFFLINE"
        self._fail_tasks(server)
        if self.s.oracle_placement:
            self._oracle_place()
        if self.s.session > 0:  # a newcomer arrives in its place, an exponential delay later
            self.sim.after(self.rng.expovariate(1 / self.s.arrival_delay), self.add_server)

    def servers_alive(self) -> list[Server]:
        return [s for s in self.servers.values() if s.alive]

    def _fail_tasks(self, server: Server) -> None:
        failed = [*([server.current] if server.current else []), *server.queue]
        server.queue.clear()
        server.current = None
        for task in failed:
            task.fail()

    # --- the oracle's placement ---------------------------------------------------------------------
    def _true_totals(self) -> list[float]:
        """Each stage's samples/s by every alive server's true speed, joining ones counted where they go."""
        totals = [0.0] * self.s.stages
        for server in self.servers.values():
            if server.alive and server.stage is not None:
                totals[server.stage] += server.throughput(self.s)
        return totals

    def _oracle_place(self) -> None:
        """Move ONLINE servers to the weakest stage while that raises it and leaves the stage the server comes
        from above what the weakest was: each time the move that leaves the weaker of the two strongest. The
        moves are free (no download, ONLINE at once; a moved server's queued work fails back to its trainers,
        as on a real move): an upper bound on what moving servers can do."""
        totals = self._true_totals()
        for _ in range(4 * self.s.stages):
            low = totals.index(min(totals))
            movable = [s for s in self.servers.values()  # (a joining one goes on to where it chose)
                       if s.state == "ONLINE" and s.stage != low and not s.pinned
                       and s.throughput(self.s) < totals[s.stage] - totals[low]]
            if not movable:
                return
            server = max(movable, key=lambda s: (min(totals[low] + s.throughput(self.s),
                                                     totals[s.stage] - s.throughput(self.s)), s.peer_id))
            speed = server.throughput(self.s)
            totals[server.stage] -= speed
            totals[low] += speed
            self._version += 1
            server.moves += 1
            self._fail_tasks(server)
            server.stage = low

    # --- rebalancing --------------------------------------------------------------------------------
    def _check(self, server: Server) -> None:
        if not server.alive:
            return
        if server.state != "ONLINE":  # (joining a stage it moved to: it checks again once there)
            self.sim.after(server.rebalancer.next_wait(), self._check, server)
            return
        move = server.rebalancer.check(self.records(), self.s.stages, server.peer_id, self.served_on(server.stage))
        if move is not None:
            self.sim.after(server.rebalancer.settle_wait(), self._settle, server, move)
        else:
            self.sim.after(server.rebalancer.next_wait(), self._check, server)

    def served_on(self, stage: int) -> list[dict[str, float]]:
        """What each trainer published of the work `stage`'s servers answered it (a metrics record with the servers
        it used most, as swarm.trainer does once every METRICS_PERIOD simulated seconds), read as a stage server
        reads it (swarm.serving.rebalance.served_on)."""
        period = int(self.sim.clock() // METRICS_PERIOD)
        if self._served[0] != period:
            published = [PeerMetricsRecord(peer_id=trainer.name, role="trainer", step=0, samples_per_second=0.0,
                                           samples=0, time=self.sim.clock(),
                                           served=[ServedWork(peer_id=peer, stage=k, work=float(work)) for peer, k, work
                                                   in most_served(trainer.balancers, MAX_SERVED_LISTED)])
                         for trainer in self.trainers]
            self._served = (period, published)
        return served_on(self._served[1], stage)

    def _settle(self, server: Server, move: Move) -> None:
        if not server.alive:
            return
        if server.state == "ONLINE" and server.rebalancer.settle(move, self.records(), self.s.stages, server.peer_id,
                                                                 self.served_on(server.stage)):
            server.moves += 1
            server.state = "OFFLINE"  # leaving: its queued work fails back to the trainers
            self._fail_tasks(server)
            self._join(server, move.stage)
        self.sim.after(server.rebalancer.next_wait(), self._check, server)

    # --- what peers read ----------------------------------------------------------------------------
    def records(self) -> dict[int, list[ServerRecord]]:
        if self._records is not None and self._records[0] == self._version:
            return self._records[1]
        found: dict[int, list[ServerRecord]] = {k: [] for k in range(self.s.stages)}
        for server in self.servers.values():
            if server.alive and server.stage is not None:
                found[server.stage].append(ServerRecord(peer_id=server.peer_id, stage=server.stage,
                                                        state=server.state,
                                                        throughput=server.throughput(self.s)))
        self._records = (self._version, found)
        return found

    def online(self, stage: int) -> list[Server]:
        return [s for s in self.servers.values() if s.alive and s.stage == stage and s.state == "ONLINE"]

    def oracle(self) -> tuple[float, float]:
        """The bottleneck (samples/s) of the alive servers placed by one who knows every speed: greedy
        (fastest first, each to the weakest stage so far), and the bound no placement passes (total / S)."""
        speeds = sorted((s.throughput(self.s) for s in self.servers_alive()), reverse=True)
        totals = [0.0] * self.s.stages
        for speed in speeds:
            totals[totals.index(min(totals))] += speed
        return min(totals), sum(speeds) / self.s.stages

    def bottleneck(self) -> float:
        """The bottleneck (samples/s) of the ONLINE servers where they are."""
        return min(sum(s.throughput(self.s) for s in self.online(k)) for k in range(self.s.stages))

    # --- compute --------------------------------------------------------------------------------------
    def full(self, server: Server, patient: bool = False) -> bool:
        """Whether the server refuses a call now as busy: its queue at max_queue, or, unless the caller is `patient`
        (it has no other server to go to), more than max_wait seconds of work ahead, as a real server estimates it
        (swarm.worker.wait_ahead: its tasks at their mean time; with AUTO, swarm.worker.auto_max_wait)."""
        s = self.s
        if s.max_queue is not None and len(server.queue) >= s.max_queue:
            return True
        limit = self._auto_wait(server) if s.max_wait == AUTO else s.max_wait
        if limit is None or patient:
            return False
        waiting = Counter(t.kind for t in server.queue if not t.cancelled)
        task = server.current
        running = None if task is None else (task.kind, self.sim.now - (task.ends - task.seconds))
        return wait_ahead(waiting, server.task_seconds, running) > limit

    def _auto_wait(self, server: Server) -> float | None:
        """The server's auto_max_wait from its stage's records (as a real server reads them), cached while no
        server changes state."""
        if self._auto[0] != self._version:
            self._auto = (self._version, {})
        known = self._auto[1]
        if server.peer_id not in known:
            claims = [r.throughput for r in self.records().get(server.stage, ())]
            known[server.peer_id] = auto_max_wait(server.task_seconds.get(FORWARD), server.throughput(self.s), claims)
        return known[server.peer_id]

    def submit(self, server: Server, seconds: float, done: Callable[[], None], fail: Callable[[], None],
               kind: str = FORWARD, patient: bool = False) -> Task | None:
        if not server.alive or server.state != "ONLINE":
            self.sim.after(0.0, fail)
            return None
        if self.full(server, patient):
            self.sim.after(0.0, fail, True)
            return None
        task = Task(seconds, done, fail, kind=kind)
        server.queue.append(task)
        if server.current is None:
            self._next_task(server)
        return task

    def _next_task(self, server: Server) -> None:
        while server.queue:
            task = server.queue.popleft()
            if not task.cancelled:
                server.current = task
                task.ends = self.sim.now + task.seconds
                self.sim.after(task.seconds, self._finish, server, task)
                return
        server.current = None

    def _finish(self, server: Server, task: Task) -> None:
        if server.current is not task:  # it left (or moved) meanwhile: the task was failed then
            return
        server.current = None
        mean = server.task_seconds.get(task.kind)
        server.task_seconds[task.kind] = task.seconds if mean is None else \
            mean + TASK_SECONDS_ALPHA * (task.seconds - mean)
        task.done()
        self._next_task(server)


class Trainer:
    """Keeps `in_flight` micro-batches going through the stages, choosing servers with StageBalancers."""

    def __init__(self, swarm: Swarm, name: str):
        self.swarm, self.name = swarm, name
        self.link = swarm._endpoint(trainer=True)
        # as swarm.trainer.Trainer's: ties broken by a hash of the trainer's id (its peer id there)
        self.balancers = [StageBalancer(clock=swarm.sim.clock, tie_salt=name, wire_bytes=self._wire_bytes(stage))
                          for stage in range(swarm.s.stages)]
        self.samples = 0
        self.round_trips = RoundTrips(swarm.sim.clock, random.Random(name))
        s = swarm.s
        self.window = InFlightWindow(s.in_flight, s.in_flight_cap or s.in_flight, adaptive=s.in_flight_cap is not None)
        self.active = 0  # micro-batches going

    def start(self) -> None:
        self.refresh()
        for _ in range(self.window.limit):
            self.active += 1
            self.swarm.sim.after(self.swarm.rng.uniform(0, 1.0), self.micro_batch)

    def _wire_bytes(self, stage: int) -> dict[str, tuple[float, float]] | None:
        """What a call to `stage` carries per sample each way, by kind (as `call` sends it)."""
        if not self.swarm.s.pings:
            return None
        kinds = (BACKWARD,) if stage == self.swarm.s.stages - 1 else (FORWARD, BACKWARD)
        return {kind: self._message_bytes(stage, kind, 1) for kind in kinds}

    def _message_bytes(self, stage: int, kind: str, n: int) -> tuple[float, float]:
        """(bytes a call of `n` samples sends, bytes its reply brings): its inputs (token ids into stage 0), a
        backward's gradients too, the last stage's targets; back, a forward's outputs or the inputs' gradients
        (none for token ids)."""
        s = self.swarm.s
        last = stage == s.stages - 1
        payload, tokens = n * s.wire_bytes_per_sample, n * s.token_bytes_per_sample
        up = (tokens if stage == 0 else payload) + (payload if kind == BACKWARD and not last else 0)
        up += tokens if last else 0
        return up, payload if stage > 0 or kind == FORWARD else 0

    def refresh(self) -> None:
        for stage, balancer in enumerate(self.balancers):
            online = self.swarm.online(stage)
            balancer.update_servers([s.peer_id for s in online], [s.peer_id for s in online if s.link.relayed],
                                    {s.peer_id: s.throughput(self.swarm.s) for s in online} if self.swarm.s.claims
                                    else None)
        if self.swarm.s.pings:  # pings of the servers due one (RoundTrips, as swarm.trainer's): a round trip each
            listed = {s.peer_id: s for stage in range(self.swarm.s.stages) for s in self.swarm.online(stage)}
            self.round_trips.forget(listed)
            for peer in self.round_trips.due(listed):
                for balancer in self.balancers:
                    balancer.measured_round_trip(peer, 2 * self.swarm.net.latency(self.link, listed[peer].link))
        self.swarm.sim.after(self.swarm.s.lookup_period, self.refresh)

    def micro_batch(self) -> None:
        self.call(0, FORWARD, forwards=[], began=self.swarm.sim.now)

    def call(self, stage: int, kind: str, forwards: list[str], tries: int = 0, exclude: tuple = (),
             began: float = 0.0, first: tuple[float, float] | None = None) -> None:
        """One call of the micro-batch: a forward of `stage`, or its backward (after the forwards to the last
        stage, whose single call is forward and backward); `forwards`: the servers that ran its forwards;
        `first`: when the call was first chosen and the oracle's best expected finish then (measure_routing)."""
        s, sim = self.swarm.s, self.swarm.sim
        n = s.micro_batch
        last = stage == s.stages - 1
        prefer = forwards[stage] if kind == BACKWARD and not last and stage < len(forwards) else None
        up, down = self._message_bytes(stage, kind, n)
        if s.oracle_routing:
            ticket, patient = oracle_ticket(self, stage, kind, exclude, prefer, up, down)
        else:
            ticket = self.balancers[stage].choose(n, kind, exclude=exclude, prefer=prefer)
            # as RemotePipeline: a call to the stage's only server asks it to take the call however long it waits (a
            # server refusing by time would only send it back to wait here)
            patient = ticket is not None and self.balancers[stage].listed() == [ticket.peer_id]
        if ticket is None:  # nobody serves the stage now: look again shortly
            sim.after(1.0, self.call, stage, kind, forwards, tries, (), began, first)
            return
        server = self.swarm.servers[ticket.peer_id]

        def work(peer: str) -> float:
            if kind == FORWARD:
                return 1.0
            return 3.0 if last or peer != prefer else 2.0  # (3: one call of both, or recomputing its forward)

        def finish(candidate: Server) -> float:
            return finish_on(self, candidate, up, down, work(candidate.peer_id))

        if self.swarm.measure_routing:  # the oracle's choice among the stage's ONLINE servers, beside ours
            chosen = finish(server)
            finishes = {c: finish(c) for c in self.swarm.online(stage)}
            self.swarm.routing.append((chosen - sim.now, min([chosen, *finishes.values()]) - sim.now))
            if first is None:  # the oracle sends it where it would be answered first, to a server that takes it
                room = [f for c, f in finishes.items() if not self.swarm.full(c)]
                # (with no server ONLINE, the one chosen: the trainer's last lookup still lists it)
                first = (sim.now, min(room or [*finishes.values()] or [chosen]))
        seconds = n * s.seconds_per_sample * work(ticket.peer_id) / server.speed

        over = [False]  # answered, failed or timed out: whatever comes later is ignored

        def fail(brief: bool = False) -> None:
            if over[0]:
                return
            over[0] = True
            self.swarm.failed_calls += 1
            latency = self.swarm.net.latency(server.link, self.link)
            sim.after(latency, self._failed, ticket, stage, kind, forwards, tries, exclude, began, first, brief)

        def timed_out() -> None:  # as RemotePipeline: 5 x the expected finish, within [5 s, 60 s]
            if not over[0]:
                over[0] = True
                if kind == FORWARD and task[0] is not None:  # a cancelled forward that has not started is
                    task[0].cancelled = True  # dropped; a backward is shielded (retries share it) and runs
                self.swarm.timed_out_calls += 1
                self._failed(ticket, stage, kind, forwards, tries, exclude, began, first)

        def answered() -> None:
            if over[0]:
                return
            over[0] = True
            self.balancers[stage].report_success(ticket)
            if first is not None and self.swarm.measure_routing:
                self.swarm.answered.append((sim.now - first[0], first[1] - first[0]))
            self._next(stage, kind, forwards + [ticket.peer_id] if kind == FORWARD else forwards, began)

        def computed() -> None:
            self.swarm.net.send(server.link, self.link, down, answered)

        sim.after(self.balancers[stage].timeout(ticket, TIMEOUT_MULTIPLIER, TIMEOUT_FLOOR, REQUEST_TIMEOUT),
                  timed_out)
        task: list[Task | None] = [None]

        def arrived() -> None:
            server.incoming -= seconds
            task[0] = self.swarm.submit(server, seconds, computed, fail, kind, patient)

        server.incoming += seconds
        sim.after(s.call_overhead, self.swarm.net.send, self.link, server.link, up, arrived)

    def _failed(self, ticket, stage, kind, forwards, tries, exclude, began, first, brief=False) -> None:
        self.balancers[stage].report_failure(ticket, brief=brief)
        self.call(stage, kind, forwards, tries + 1, (*exclude, ticket.peer_id), began, first)

    def _next(self, stage: int, kind: str, forwards: list[str], began: float) -> None:
        last = self.swarm.s.stages - 1
        if kind == FORWARD:
            self.call(stage + 1, BACKWARD if stage + 1 == last else FORWARD, forwards, began=began)
        elif stage > 0:
            self.call(stage - 1, BACKWARD, forwards, began=began)
        else:
            self.samples += self.swarm.s.micro_batch
            self.swarm.samples += self.swarm.s.micro_batch
            self.window.record(self.swarm.sim.now - began)
            self.swarm.trips.append(self.swarm.sim.now - began)
            self.active -= 1
            while self.active < self.window.limit:  # as the trainer's workers wait on InFlightWindow.acquire
                self.active += 1
                self.micro_batch()


@dataclass
class Window:
    start: float
    seconds: float
    samples_per_second: float
    bottleneck: float  # mean over the window, samples/s, of the ONLINE servers where they are
    oracle: float  # ... of the same alive servers placed greedily knowing every speed
    bound: float  # ... the bound no placement passes (total / stages)
    moves: int  # moves made in the window
    routing: float  # the calls' finish as chosen / the oracle's best finish for them, summed over the window
    answered: float  # how long calls took to be answered, refusals and retries included / the oracle's best finish
    trip: float  # mean seconds a micro-batch finished in the window took, its first forward to its last backward


def simulate(scenario: Scenario, duration: float, window: float = 60.0, warmup: float = 120.0,
             pinned: Sequence[tuple[int, float]] | None = None, progress: Callable[[Window], None] | None = None
             ) -> tuple[Swarm, list[Window]]:
    """Run the scenario for `duration` simulated seconds after `warmup`; one Window per `window` seconds.
    `pinned`: (stage, speed) of each initial server (as --stage K), instead of speeds drawn and the swarm
    placing them."""
    swarm = Swarm(scenario)
    for i in range(scenario.servers):
        stage, speed = (None, None) if pinned is None else pinned[i]
        swarm.add_server(stage, speed)
    for i in range(scenario.trainers):
        trainer = Trainer(swarm, f"t{i}")
        swarm.trainers.append(trainer)
        swarm.sim.after(scenario.join_overhead + scenario.choose_spread, trainer.start)
    swarm.sim.run(warmup)
    swarm.measure_routing = True
    windows = []
    for _ in range(int(duration // window)):
        began, samples = swarm.sim.now, swarm.samples
        moves = sum(s.moves for s in swarm.servers.values())
        swarm.routing.clear()
        swarm.answered.clear()
        swarm.trips.clear()
        readings, step = [], window / 10
        for _ in range(10):
            swarm.sim.run(swarm.sim.now + step)
            readings.append((swarm.bottleneck(), *swarm.oracle()))
        done = Window(began, window, (swarm.samples - samples) / window,
                      *(math.fsum(r[i] for r in readings) / len(readings) for i in range(3)),
                      sum(s.moves for s in swarm.servers.values()) - moves,
                      math.fsum(c for c, _ in swarm.routing) / max(math.fsum(b for _, b in swarm.routing), 1e-9),
                      math.fsum(c for c, _ in swarm.answered) / max(math.fsum(b for _, b in swarm.answered), 1e-9),
                      math.fsum(swarm.trips) / max(len(swarm.trips), 1))
        windows.append(done)
        if progress is not None:
            progress(done)
    return swarm, windows
