"""Choosing a server of one stage by expected finish time; temporary bans. Pure logic, no I/O.

Each task (one forward or backward of a micro-batch on this stage) goes to the available server
where it should be answered first: the work this trainer still has outstanding there, plus the
task's own expected service time. With many tasks in flight that spreads work in proportion to
speed; with one or two in flight it is the fastest idle server, and a server several times slower
than the others gets nothing once it has been measured (bar a rare re-test, below).

- Service time: an EMA of seconds per sample, per server and request kind (a backward recomputes
  the forward, so it costs ~2.5x). Servers compute one task at a time, first in first out, so a
  call's duration includes waiting behind this trainer's earlier tasks there, which the outstanding
  term already counts: a task's service is taken to start when it was sent or when this trainer's
  previous task on that server completed, whichever is later. Other trainers' load shows as slowness.
- Latency: waits that are not first-in-first-out (the network, several tasks at once) would make
  that estimate too low when tasks overlap, so a task is never expected back sooner than the server
  answered a task that had nothing of ours ahead of it.
- A server not yet measured for a kind: its own estimate of the other kind scaled by the backward /
  forward ratio; else, if its record claims a throughput, that claim calibrated by what this trainer
  measured of the other servers that claim one (the median of measured over claimed seconds: a
  server's claim times its compute alone, a call also waits on the network and on other trainers);
  CLAIM_OPTIMISM faster than that, so a claim that came out low on a busy machine does not keep a
  newcomer untried; else as fast as the fastest known server; else a default. It wins ties, so a newcomer is tried at
  once. Without claims every newcomer is taken to be as fast as the fastest, and with 20 servers a
  stage and speeds a tenfold apart a trainer spent most of its calls probing slow ones one by one
  (bench/sim: 80% of what its choices lost against an oracle). A claim only sets where a server
  stands until it is measured: a liar claiming speed is tried sooner (as every newcomer was before),
  on probation, and then judged by its answers; one claiming slowness only loses work; the
  calibration is a median, which a minority of claims does not move.
- Probation: a server that has never answered us, or has failed since its last answer, takes one task
  at a time (its probe) while another server can take the task. Assumed as fast as the fastest (or
  as fast as it claims), it would otherwise win every choice however it answers: a server that refuses or fails
  everything costs one call per ban, not the trainer's throughput.
- An idle server whose estimates no answer has refreshed for `reprobe_after` seconds (and for 50
  times its last answer's duration, so re-testing a slow one costs at most ~2% of the time) is
  treated as untried for one task, whose answer restarts its estimates: an unlucky first answer, or
  load that has since gone, does not shut a server out for good.
- Every choice returns a `Ticket`; `report_success`, `report_failure` or `release` (a cancelled call)
  closes it, and only the first of these counts, so outstanding work cannot leak.
- A server caught answering wrongly (`ban`, from a spot check) loses its estimates and is banned; an
  answer of a call sent before that lifts nothing.
- A failure bans the server for `ban_base * 2**(failures-1)` seconds, capped at `ban_max`; a success
  resets the count. A `brief` failure (the server said it is full: busy, not ready) counts the same
  but bans from `brief_ban_base` instead: a loaded honest server is back within a second or two,
  one that only ever says so is soon banned for `ban_max` too.
- Refusals: a server full of other trainers' work refuses (busy), and each refusal costs a round trip before
  the call goes elsewhere. Only choosing weighs it: a server's expected finish counts the odds that it refuses
  (its refusals over its answers, halving every REFUSALS_HALF_LIFE, read against the stage's rate, which is
  all an untried server has) times how long its refusals took (else a round trip to it). Without it, every
  trainer kept trying the fast servers the others kept full (bench/sim, 1,000 peers with one task queued a
  server: eight refusals a call, and the slowest servers idle). A server only moves its own odds, and the
  stage's rate a little (a call a ban: one refusing everything is banned for longer each time).
- Relayed servers (behind NAT, reached through another peer's relay, as their records say) lose ties:
  once measured, one is chosen only where it should finish sooner than every direct server by
  RELAYED_MARGIN, since its relay also carries other peers' traffic and may go away.
- Work served: each server's answered work (samples, a backward counting `backward_ratio` forwards) over
  the last SERVED_WINDOW seconds (`served`), as the trainer saw it: only replies it used, none from before
  a server was caught. The trainer publishes it so that a stage server deciding whether to leave can weigh
  its stage-mates by what trainers really got from them, not by what they claim (swarm/serving/rebalance.py).
- Ties between equal servers (at start every server is untried, so all are equal) go by peer id, or, with
  a `tie_salt` (a trainer gives its own peer id), by a hash of the salt and the peer id: many trainers
  starting together then spread their first calls instead of all sending them to the same server
  (bench/sim found that herd: 40 trainers' first probes queued behind one another on one server).
- A server missing from a lookup keeps its estimates and ban but is not chosen; it is forgotten
  after missing for `forget_after` seconds, so a lookup that misses a record briefly does not turn a
  measured slow server back into an untried newcomer.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from swarm.protocol import BACKWARD, FORWARD

# A backward from the forward's kept graph costs about two forwards (three when it must recompute the
# forward); only until a server's own times are measured.
BACKWARD_TO_FORWARD = 2.0
REPROBE_SPACING = 50  # a server's estimates go stale no sooner than this many times its last answer's duration
# An untried server is expected this much faster than its calibrated claim: a claim is measured once, at start,
# on a machine that may have been busier then (twofold swings seen here), so a newcomer claiming about the speed
# of a measured server is still tried; one claiming less than half of it is not, while the others have room
CLAIM_OPTIMISM = 2.0
SERVED_WINDOW = 120.0  # seconds of answered work `served` counts
# Each call opens a fresh libp2p stream, whose yamux flow-control window starts at 256 KiB (go-yamux's initial
# stream window): each window of a message past the first waits a round trip for the receiver's update
# (bench/stream_probe.py: 1.2 MB at 100 ms one way took about five round trips)
STREAM_WINDOW = 256 * 1024
MAX_ROUND_TRIP = 60.0  # seconds: a round trip measured longer than this is taken as this
REFUSALS_HALF_LIFE = 60.0  # seconds: how fast what a server's refusals said of its load fades
PRIOR_WEIGHT = 1.0  # a server's refusals are read against the stage's as if the stage's rate were one call of its own
MAX_REFUSED = 0.95  # a refusal rate taken as at most this (a choice costs at most 19 refusals' round trips)
RELAYED_MARGIN = 1.1  # a relayed server's expected finish counts this much longer when servers are compared


@dataclass(eq=False)
class Ticket:
    """A task sent to a server; hand it back to the balancer when its call ends."""

    peer_id: str
    kind: str
    size: int  # samples
    sent: float  # balancer clock
    seq: int  # send order within the balancer
    first_in_line: bool  # nothing else of this trainer's was outstanding on the server when sent


@dataclass
class Refusals:
    """Calls refused as busy and calls answered, each count halving every REFUSALS_HALF_LIFE seconds, and how
    long a refusal took to come back (an EMA): what choosing a server that may refuse should cost."""

    refused: float = 0.0
    answered: float = 0.0
    seconds: float | None = None
    at: float = 0.0  # when the counts were last decayed

    def decay(self, now: float) -> None:
        factor = 0.5 ** (max(0.0, now - self.at) / REFUSALS_HALF_LIFE)
        self.refused *= factor
        self.answered *= factor
        self.at = now

    def count(self, now: float, refused: bool, took: float | None = None, alpha: float = 0.1) -> None:
        self.decay(now)
        if not refused:
            self.answered += 1
            return
        self.refused += 1
        if took is not None:
            self.seconds = took if self.seconds is None else self.seconds + alpha * (took - self.seconds)


@dataclass
class ServerState:
    peer_id: str
    service: dict[str, float] = field(default_factory=dict)  # kind -> EMA seconds/sample, own queue excluded
    latency: dict[str, float] = field(default_factory=dict)  # kind -> EMA seconds/sample when first in line
    open: dict[int, Ticket] = field(default_factory=dict)  # seq -> task sent and not yet answered, in send order
    last_done: float = float("-inf")  # when this trainer's last task there was answered
    stale_at: float = float("inf")  # from then on, once idle, its estimates are re-tested
    failures: int = 0
    banned_until: float = 0.0
    missing_since: float | None = None  # None while the latest lookup lists it
    caught_at: float = float("-inf")  # when it was last caught answering wrongly (`ban`)
    vouched: bool = False  # one of its own replies was used (checked, where anything could check it)
    claim: float | None = None  # samples/s (forward and backward) its record announces, if any
    round_trip: float | None = None  # seconds, as this trainer last measured it (a ping), if it did
    served: deque = field(default_factory=deque)  # (when answered, work): replies used, the last SERVED_WINDOW s
    refusals: Refusals = field(default_factory=Refusals)

    @property
    def measured(self) -> bool:
        return bool(self.service)


class StageBalancer:
    """Server choice for one stage of the pipeline."""

    def __init__(
        self,
        ema_alpha: float = 0.1,
        ban_base: float = 15.0,
        ban_max: float = 300.0,
        brief_ban_base: float = 1.0,
        default_seconds_per_sample: float = 0.01,  # a forward's, before any server is measured
        backward_ratio: float = BACKWARD_TO_FORWARD,
        forget_after: float = 60.0,
        reprobe_after: float | None = 30.0,  # None: estimates never go stale
        clock: Callable[[], float] = time.monotonic,
        tie_salt: str | None = None,  # None: ties go by peer id; else by a hash of this and the peer id
        # kind -> (bytes a call sends, bytes its reply brings) per sample: with a server's round trip, what its
        # calls spend on the network before it is measured (None: not counted)
        wire_bytes: Mapping[str, tuple[float, float]] | None = None,
    ):
        self.ema_alpha = ema_alpha
        self.ban_base = ban_base
        self.ban_max = ban_max
        self.brief_ban_base = brief_ban_base
        self.default_seconds_per_sample = default_seconds_per_sample
        self.backward_ratio = backward_ratio
        self.forget_after = forget_after
        self.reprobe_after = reprobe_after
        self.clock = clock
        self.tie_salt = tie_salt
        self.wire_bytes = dict(wire_bytes or {})
        self.servers: dict[str, ServerState] = {}  # listed or recently missing
        self.relayed: set[str] = set()  # listed servers reached through a relay (their records say so)
        self._seq = itertools.count()
        self._calibrated: dict[str, float] = {}  # kind -> _calibration's value, until an estimate or claim changes
        self.refusals = Refusals()  # the stage's, all servers together

    # --- which servers there are -----------------------------------------------------------------

    def update_servers(self, peer_ids: Iterable[str], relayed: Iterable[str] = (),
                       claims: Mapping[str, float] | None = None) -> None:
        """Set the servers of the latest lookup (those `relayed` among them are reached through a relay;
        `claims`: the samples/s their records announce); the others are kept, unchosen, up to
        `forget_after`."""
        now, listed = self.clock(), set(peer_ids)
        self.relayed = set(relayed) & listed
        claims = claims or {}
        self._calibrated.clear()
        for peer_id in sorted(listed):
            state = self.servers.setdefault(peer_id, ServerState(peer_id))
            state.missing_since = None
            claim = claims.get(peer_id)
            state.claim = claim if claim is not None and math.isfinite(claim) and claim > 0 else None
        for peer_id, state in list(self.servers.items()):
            if peer_id in listed:
                continue
            if state.missing_since is None:
                state.missing_since = now
            if now - state.missing_since >= self.forget_after:
                del self.servers[peer_id]

    def measured_round_trip(self, peer_id: str, seconds: float) -> None:
        """A round trip to the server, as this trainer measured it (a ping): what an untried server's calls are
        expected to spend on the network. Ignored for a server not listed, or a value not finite and positive."""
        state = self.servers.get(peer_id)
        if state is not None and math.isfinite(seconds) and seconds > 0:
            state.round_trip = min(seconds, MAX_ROUND_TRIP)

    def network_seconds(self, peer_id: str, task_size: int, kind: str) -> float | None:
        """Seconds a call of `task_size` samples should spend on the network to this server, by its measured round
        trip: half a round trip each way, and a round trip for each stream window of a message past its first
        (None without a round trip or the run's wire bytes)."""
        rtt, per_sample = self.servers[peer_id].round_trip, self.wire_bytes.get(kind)
        if rtt is None or per_sample is None:
            return None
        windows = sum(max(1, math.ceil(task_size * b / STREAM_WINDOW)) for b in per_sample)
        return rtt * (windows - 1)  # (2 messages: 2 half round trips, and windows - 2 more)

    def listed(self) -> list[str]:
        """Servers of the latest lookup, banned or not."""
        return [p for p, s in self.servers.items() if s.missing_since is None]

    def available(self, exclude: Iterable[str] = ()) -> list[str]:
        """Listed servers that are not banned now and not excluded."""
        now, skip = self.clock(), set(exclude)
        return [p for p in self.listed() if self.servers[p].banned_until <= now and p not in skip]

    def soonest_unbanned(self, exclude: Iterable[str] = ()) -> str | None:
        """The listed server whose ban ends first: the one to retry when every server is banned."""
        skip = set(exclude)
        listed = [self.servers[p] for p in self.listed() if p not in skip]
        return min(listed, key=lambda s: (s.banned_until, s.peer_id)).peer_id if listed else None

    # --- choosing --------------------------------------------------------------------------------

    def choose(self, task_size: int, kind: str, exclude: Iterable[str] = (), prefer: str | None = None,
               pin: bool = False) -> Ticket | None:
        """The available server where the task should finish first (None if there is none), charged for it.

        A backward `prefer`s the server that ran its forward, which kept the graph and so saves
        recomputing the forward: that server is chosen unless even with the saving it would finish
        later than the best other one; with `pin`, whenever it is available.
        """
        candidates = self.available(exclude)
        if not candidates:
            return None
        # A server on probation already answering its probe waits for that answer, unless no other can
        # take the task (at start every server is unmeasured: work must still flow).
        settled = [p for p in candidates if not (self.on_probation(p) and self.servers[p].open)]
        candidates = settled or candidates
        # On a tie an untried server goes first: it is assumed as fast as the fastest, and with one
        # task in flight it would otherwise never get the probe that tells.
        best = min(candidates, key=lambda p: (self._ranked_finish(p, task_size, kind), not self.untried(p),
                                              self._tie(p)))
        if prefer is not None and prefer != best and prefer in candidates:
            saving = self.expected_seconds(prefer, task_size, FORWARD) + self.refusal_cost(best) - \
                self.refusal_cost(prefer)
            if pin or self.expected_finish(prefer, task_size, kind) - saving <= \
                    self.expected_finish(best, task_size, kind):
                best = prefer
        return self.charge(best, task_size, kind)

    def _tie(self, peer_id: str) -> str:
        if self.tie_salt is None:
            return peer_id
        return hashlib.blake2b(f"{self.tie_salt}/{peer_id}".encode(), digest_size=8).hexdigest()

    def _ranked_finish(self, peer_id: str, task_size: int, kind: str) -> float:
        finish = self.expected_finish(peer_id, task_size, kind)
        # an untried one is still tried at once, as any newcomer: the margin applies to what was measured
        finish = finish * RELAYED_MARGIN if peer_id in self.relayed and not self.untried(peer_id) else finish
        return finish + self.refusal_cost(peer_id)

    def refusal_cost(self, peer_id: str) -> float:
        """Seconds the refusals a call to this server should meet cost, by the odds that it refuses (its own
        refusals and answers, read against the stage's rate) times how long a refusal of it took (else a round
        trip to it, else the stage's refusals' time). 0 while no server of the stage refused lately."""
        stage = self.refusals
        if stage.refused <= 0 or stage.seconds is None:
            return 0.0
        own = self.servers[peer_id].refusals
        now = self.clock()
        stage.decay(now)
        own.decay(now)
        prior = stage.refused / (stage.refused + stage.answered + 1)  # (+1: a rate of faded counts fades too)
        p = min((own.refused + PRIOR_WEIGHT * prior) / (own.refused + own.answered + PRIOR_WEIGHT), MAX_REFUSED)
        return p / (1 - p) * (own.seconds or self.servers[peer_id].round_trip or stage.seconds)

    def on_probation(self, peer_id: str) -> bool:
        """Whether the server has yet to answer us successfully with a reply of its own (its answers as a
        spot check's witness time it, but vouch for nothing), ever or since its last failure."""
        state = self.servers[peer_id]
        return not state.vouched or state.failures > 0

    def untried(self, peer_id: str) -> bool:
        """Whether the server has no estimate that counts: never answered us, or stale and idle."""
        state = self.servers[peer_id]
        return not state.measured or (not state.open and self.clock() >= state.stale_at)

    def charge(self, peer_id: str, task_size: int, kind: str) -> Ticket:
        """Count a task sent to this server as outstanding until its ticket is handed back."""
        if kind not in (FORWARD, BACKWARD):
            raise ValueError(f"task kind must be {FORWARD!r} or {BACKWARD!r}, got {kind!r}")
        state = self.servers[peer_id]
        ticket = Ticket(peer_id, kind, task_size, self.clock(), next(self._seq), first_in_line=not state.open)
        state.open[ticket.seq] = ticket
        return ticket

    def expected_finish(self, peer_id: str, task_size: int, kind: str) -> float:
        """Seconds until a task sent to this server now should be answered, our work ahead of it included."""
        return self._finish(peer_id, self.servers[peer_id].open.values(), task_size, kind)

    def outstanding_seconds(self, peer_id: str) -> float:
        """Expected seconds of the tasks this trainer has sent the server and not had answered."""
        return sum(self.expected_seconds(peer_id, t.size, t.kind) for t in self.servers[peer_id].open.values())

    def expected_seconds(self, peer_id: str, task_size: int, kind: str) -> float:
        """How long the server should compute a task of `task_size` samples, by our estimate."""
        state = self.servers[peer_id]
        if state.claim is not None and self.untried(peer_id):
            network = self.network_seconds(peer_id, task_size, kind)
            if network is not None:  # its claim is its compute alone; the network is what this trainer measured
                return task_size * self._claimed(state.claim, kind) + network
        return task_size * self.expected_seconds_per_sample(peer_id, kind)

    def expected_seconds_per_sample(self, peer_id: str, kind: str) -> float:
        state = self.servers[peer_id]
        own = self._own(state.service, kind)
        if own is not None and not self.untried(peer_id):
            return own
        if state.claim is not None:
            return self._claimed(state.claim, kind) * self._calibration(kind) / CLAIM_OPTIMISM
        known = [e for s in self.servers.values() if (e := self._own(s.service, kind)) is not None]
        if known:
            return min(known)
        default = self.default_seconds_per_sample
        return default * self.backward_ratio if kind == BACKWARD else default

    def _claimed(self, claim: float, kind: str) -> float:
        """Seconds a sample of `kind` takes at a claimed throughput of forward and backward (samples/s)."""
        share = self.backward_ratio if kind == BACKWARD else 1.0
        return share / ((1.0 + self.backward_ratio) * claim)

    def _calibration(self, kind: str) -> float:
        """What this trainer measures of claimed servers, over what they claim: the median, 1 if none."""
        if kind not in self._calibrated:
            ratios = sorted(e / self._claimed(s.claim, kind) for s in self.servers.values()
                            if s.claim is not None and (e := self._own(s.service, kind)) is not None)
            self._calibrated[kind] = ratios[(len(ratios) - 1) // 2] if ratios else 1.0
        return self._calibrated[kind]

    def _finish(self, peer_id: str, ahead: Iterable[Ticket], task_size: int, kind: str) -> float:
        # Tasks ahead are valued at today's estimates: once a slow newcomer is measured, the tasks it
        # still holds weigh what they will really take.
        queued = sum(self.expected_seconds(peer_id, t.size, t.kind) for t in ahead)
        queued += self.expected_seconds(peer_id, task_size, kind)
        latency = None if self.untried(peer_id) else self._own(self.servers[peer_id].latency, kind)
        return queued if latency is None else max(queued, task_size * latency)

    def _own(self, estimates: dict[str, float], kind: str) -> float | None:
        if kind in estimates:
            return estimates[kind]
        if kind == BACKWARD and FORWARD in estimates:
            return estimates[FORWARD] * self.backward_ratio
        if kind == FORWARD and BACKWARD in estimates:
            return estimates[BACKWARD] / self.backward_ratio
        return None

    def timeout(self, ticket: Ticket, multiplier: float, floor: float, ceiling: float) -> float:
        """How long to wait for the ticket's answer: a multiple of its expected finish, within [floor, ceiling].

        The finish counts our tasks sent to the server before it, so a long queue of our own is not
        taken for a dead server; a server we have never timed gets the ceiling, so a slow newcomer is
        measured, not banned.
        """
        state = self.servers.get(ticket.peer_id)
        if state is None or not state.measured:
            return ceiling
        ahead = [t for seq, t in state.open.items() if seq < ticket.seq]
        finish = self._finish(ticket.peer_id, ahead, ticket.size, ticket.kind)
        return min(max(multiplier * finish, floor), ceiling)

    # --- how calls ended -------------------------------------------------------------------------

    def report_success(self, ticket: Ticket, answered: float | None = None, vouch: bool = True) -> None:
        """The server answered (at `answered` on the balancer's clock, if that was before now: a reply
        checked before it counts): update its estimates of the ticket's kind and lift any ban. Unless
        `vouch` is False (a witness's answer, which nothing checked), its reply ends its probation."""
        state = self._close(ticket)
        if state is None or ticket.sent <= state.caught_at:  # an answer from before it was caught clears nothing
            return
        done = self.clock() if answered is None else answered
        size = max(ticket.size, 1)
        if ticket.sent >= state.stale_at:  # a re-test: the old estimates no longer count
            state.service.clear()
            self._calibrated.clear()
            state.latency.clear()
        # First in first out: this task's service began when ours before it was answered, if later
        # than its sending.
        self._update(state.service, ticket.kind, (done - max(ticket.sent, state.last_done)) / size)
        if ticket.first_in_line:
            self._update(state.latency, ticket.kind, (done - ticket.sent) / size)
        state.last_done = max(state.last_done, done)
        if self.reprobe_after is not None:
            state.stale_at = done + max(self.reprobe_after, REPROBE_SPACING * (done - ticket.sent))
        state.failures = 0
        state.banned_until = 0.0
        state.refusals.count(self.clock(), refused=False)
        self.refusals.count(self.clock(), refused=False)
        state.vouched = state.vouched or vouch
        if vouch:
            state.served.append((done, size * (self.backward_ratio if ticket.kind == BACKWARD else 1.0)))
            self._forget_served(state, done)

    def served(self) -> dict[str, float]:
        """Work (forward samples' worth) each server answered in the last SERVED_WINDOW seconds, in replies this
        trainer used; servers with none are left out."""
        now, work = self.clock(), {}
        for peer_id, state in self.servers.items():
            self._forget_served(state, now)
            if state.served:
                work[peer_id] = sum(w for _, w in state.served)
        return work

    @staticmethod
    def _forget_served(state: ServerState, now: float) -> None:
        while state.served and state.served[0][0] < now - SERVED_WINDOW:
            state.served.popleft()

    def report_failure(self, ticket: Ticket, brief: bool = False, refused: bool | None = None) -> float:
        """Ban the server with exponential backoff (from `brief_ban_base` if `brief`); returns the ban's
        length in seconds. A `refused` call (by default, a `brief` failure: the server said it is full) also
        counts toward its refusal rate (refusal_cost)."""
        state = self._close(ticket)
        if state is None:
            return 0.0
        state.failures += 1
        if (brief if refused is None else refused):
            now = self.clock()
            state.refusals.count(now, True, now - ticket.sent, self.ema_alpha)
            self.refusals.count(now, True, now - ticket.sent, self.ema_alpha)
        base = min(self.brief_ban_base, self.ban_base) if brief else self.ban_base
        duration = min(base * 2 ** (state.failures - 1), self.ban_max)
        state.banned_until = max(state.banned_until, self.clock() + duration)
        return duration

    def hold_off(self, ticket: Ticket, seconds: float) -> None:
        """Leave the server out for `seconds` with no verdict on it: the call never reached it (our p2p
        daemon held off dialing it, see swarm.protocol.DialHeldOff). Its failures and estimates stand."""
        state = self._close(ticket)
        if state is not None:
            state.banned_until = max(state.banned_until, self.clock() + seconds)

    def ban(self, peer_id: str, seconds: float) -> None:
        """Ban the server for `seconds` whatever its calls said (it was caught answering wrongly): counted
        as a failure, and its estimates dropped, since the answers that made them cannot be trusted."""
        state = self.servers.get(peer_id)
        if state is None:
            return
        state.failures += 1
        state.caught_at = self.clock()
        state.banned_until = max(state.banned_until, state.caught_at + seconds)
        state.service.clear()
        state.latency.clear()
        state.served.clear()  # what it answered before it was caught counts for nothing
        state.vouched = False
        self._calibrated.clear()

    def pardon(self, peer_id: str) -> None:
        """Take back one failure reported for the server, and its ban: the fault turned out to be ours.

        Its ban is lifted whole: it was chosen for the call, so any earlier ban had ended.
        """
        state = self.servers.get(peer_id)
        if state is None or state.failures == 0:
            return
        state.failures -= 1
        state.banned_until = 0.0

    def release(self, ticket: Ticket) -> None:
        """The call ended with no verdict on the server (cancelled, or our request was refused)."""
        self._close(ticket)

    def _close(self, ticket: Ticket) -> ServerState | None:
        """The ticket's server if the ticket was still open (it is closed now), else None."""
        state = self.servers.get(ticket.peer_id)
        if state is None or state.open.pop(ticket.seq, None) is None:
            return None
        return state

    def _update(self, estimates: dict[str, float], kind: str, sample: float) -> None:
        self._calibrated.clear()
        old = estimates.get(kind)
        estimates[kind] = sample if old is None else old + self.ema_alpha * (sample - old)


def most_served(balancers: Iterable[StageBalancer], limit: int) -> list[tuple[str, int, float]]:
    """(server, stage, work) of the `limit` servers that answered the most work lately (StageBalancer.served), one
    balancer a stage, the most worked first: what a trainer publishes of them."""
    served = [(peer_id, stage, work) for stage, balancer in enumerate(balancers)
              for peer_id, work in balancer.served().items() if math.isfinite(work)]
    served.sort(key=lambda item: -item[2])
    return served[:limit]
