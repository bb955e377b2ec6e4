"""A micro-batch's trip through the remote stages: forward, loss on the last stage, backward.

Forward goes stage by stage, keeping every stage's input. The last stage does forward and backward
in one call (it computes the loss from the targets, so logits never cross the network) and
returns the loss and the gradient of its input. Backward then goes back stage by stage.

Servers keep no per-request state: a backward carries the stage input again and the server
recomputes the forward. So when the server that did a stage's forward is gone, the backward goes
to another server of that stage, which re-runs the forward from the saved input before the
backward; the micro-batch completes instead of being dropped. A backward goes to the server that ran
its forward if that one is about as fast; whenever it can take it when the forward ran on look-ahead
parameters (its reply says `ahead`: no other server has them), and in the low-communication mode
(averaging.mode local, whose replicas differ between outer steps; `PipelineSettings.pin_backward`).

Each call goes to the server of its stage where it should be answered first, given this trainer's
work already outstanding there (see StageBalancer). The balancer's ticket for the call is handed
back exactly once, whether the call succeeds, fails or is cancelled, so no work stays charged to a
server. A call that fails bans that server and is retried on another; a stage with no server to
try makes the trip wait, visibly, until one appears or `max_wait` runs out.

An error reply is a failure of the server that sent it, whatever its code: a stranger's `bad_request`
is a claim like any other. It bans the server (briefly for `busy` and `not_ready`, which say it is
full) and the call goes to another. A request that is really ours at fault is refused by every
server of the stage: then the micro-batch is dropped after one refusal from each, and those bans
are taken back (`StageBalancer.pardon`), so a bad micro-batch of ours costs no server its place.

A well-formed reply may still be wrong: some are spot-checked against other servers of the stage
(swarm.routing.spot_checks); a server caught is banned for the balancer's longest ban and the call
retried elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID

from swarm.config import NetworkConfig
from swarm.protocol import (
    BACKWARD,
    BAD_REQUEST,
    BUSY,
    DEFAULT_LIMITS,
    FORWARD,
    INTERNAL,
    NOT_READY,
    WRONG_STAGE,
    DialHeldOff,
    ProtocolError,
    RemoteStageError,
    StageClient,
    StageReply,
    StageRequest,
    StageUnavailable,
    WireLimits,
    stage_namespace,
)
from swarm.protocol.messages import check_moe_lost
from swarm.routing.balancer import StageBalancer, Ticket
from swarm.routing.spot_checks import SPOT_CHECK_RATE, SpotCheck, Verdict, Witnesses

log = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """A micro-batch could not complete (no server for a stage within `max_wait`, or every server of a
    stage refused it as a bad request)."""


FULL_CODES = frozenset({BUSY, NOT_READY})  # the server is full or not serving yet: a brief ban, then back
KNOWN_CODES = frozenset({BAD_REQUEST, BUSY, INTERNAL, NOT_READY, WRONG_STAGE})  # counted by name; others as "other"
DIAL_HOLD_OFF = 5.0  # seconds libp2p holds off redialing an address after a dial that did not complete (at first)
HELD_OFF_REASON = "our p2p daemon holds off dialing it for a few seconds after a dial that did not complete"


@dataclass
class PipelineSettings:
    """Timeouts of the trainer side, in seconds (from the run config's network section)."""

    request_timeout: float = 60.0  # the most one forward or backward call may take
    timeout_multiplier: float = 5.0  # a call times out after this many times its expected duration...
    timeout_floor: float = 5.0  # ...but never sooner than this
    max_wait: float = 600.0  # how long a micro-batch may wait for a stage with no usable server
    retry_pause: float = 0.5  # first pause before retrying a stage whose servers all failed
    max_retry_pause: float = 15.0  # the pause doubles per round up to this
    # A backward goes to the server that ran its forward whenever that server can take it (the stages average in
    # the low-communication mode: their replicas differ between outer steps), not only when it is about as fast
    pin_backward: bool = False

    @classmethod
    def from_config(cls, network: NetworkConfig) -> PipelineSettings:
        return cls(request_timeout=network.request_timeout, timeout_multiplier=network.timeout_multiplier,
                   timeout_floor=network.timeout_floor)


@dataclass
class PipelineStats:
    calls: int = 0
    failures: int = 0  # failed calls, each retried on another server or later
    bad_replies: int = 0  # of them, replies that did not fit the request (shape, dtype, non-finite, no loss)
    error_replies: Counter = field(default_factory=Counter)  # of them, error replies by code
    held_off: Counter = field(default_factory=Counter)  # by stage: calls our p2p daemon did not send (DialHeldOff)
    refused: int = 0  # micro-batches dropped because every server of a stage refused them as bad requests
    spot_checks: int = 0  # replies checked against a witness
    disputes: int = 0  # of them, replies a witness disagreed with
    rejected: int = 0  # replies not used after a check (retried elsewhere: a backward's server counted it anyway)
    caught: Counter = field(default_factory=Counter)  # servers banned by a spot check, by stage
    stage_failures: Counter = field(default_factory=Counter)  # failures by stage
    stage_bad_replies: Counter = field(default_factory=Counter)  # bad replies by stage
    waiting_stages: set[int] = field(default_factory=set)


class RemotePipeline:
    """Drives micro-batches through the stage servers of one run."""

    def __init__(
        self,
        p2p: P2P,
        run_id: str,
        num_stages: int,
        wire_dtype: str = "float32",
        settings: PipelineSettings | None = None,
        balancer_factory: Callable[[], StageBalancer] = StageBalancer,
        hidden_size: int | None = None,
        limits: WireLimits = DEFAULT_LIMITS,
        spot_check_rate: float = SPOT_CHECK_RATE,
        rng: random.Random | None = None,
    ):
        self.p2p = p2p
        self.run_id = run_id
        self.num_stages = num_stages
        self.wire_dtype = wire_dtype
        self.hidden_size = hidden_size  # a forward's output is [batch, seq, hidden_size] (None: not checked)
        self.limits = limits  # the largest reply taken in (stage_wire_limits of the run)
        self.settings = settings or PipelineSettings()
        self.balancers = [balancer_factory() for _ in range(num_stages)]
        self.stats = PipelineStats()
        self.spot_check_rate = spot_check_rate  # 0: no spot checks, not even of probes
        self.rng = rng or random.Random()
        self.witnesses = [Witnesses(stage, balancer, functools.partial(self._attempt, stage), self.rng, self.stats)
                          for stage, balancer in enumerate(self.balancers)]
        self.stage_steps: dict[int, int] = {}  # the optimizer step each stage's server last replied with
        self._servers_changed = asyncio.Event()

    def update_servers(self, peers_by_stage: dict[int, Sequence[str]], relayed: Iterable[str] = (),
                       claims: Mapping[str, float] | None = None) -> None:
        """Set the ONLINE servers of each stage (peer ids as strings), e.g. after a DHT lookup; those in
        `relayed` are reached through a relay, and lose ties to direct ones; `claims`: the samples/s their
        records announce, taken for a server's speed until it is measured (see StageBalancer).

        A server missing from one lookup keeps what its balancer learned about it (see StageBalancer).
        """
        relayed = set(relayed)
        for stage, balancer in enumerate(self.balancers):
            balancer.update_servers(peers_by_stage.get(stage, ()), relayed, claims)
        self._servers_changed.set()

    async def train(self, x: torch.Tensor, y: torch.Tensor, request_id: str) -> float:
        """Forward and backward of one micro-batch through every stage; returns its mean loss."""
        inputs, steps, servers, lost, ahead = [x], [], [], [], []
        for stage in range(self.num_stages - 1):
            reply = await self._call(stage, FORWARD, request_id, inputs[stage], backward_follows=True)
            inputs.append(reply.tensors[0])
            steps.append(reply.server_step)
            servers.append(reply.server)
            ahead.append(reply.info.get("ahead") is True)
            lost.append(reply.info.get("moe_lost"))  # experts the forward went without: so will the backward
        last = self.num_stages - 1
        reply = await self._call(last, BACKWARD, request_id, inputs[last], targets=y)
        loss = float(reply.info["loss"])
        for stage in range(last - 1, -1, -1):
            grad = reply.tensors[0]
            # The server that ran the forward holds its graph: the backward there needs no recomputation. One
            # that ran it on look-ahead parameters (its own prediction of the step) is the only one that can
            # give its gradient: pinned there while it can take it.
            reply = await self._call(stage, BACKWARD, request_id, inputs[stage], grad_outputs=grad,
                                     forward_step=steps[stage], prefer=servers[stage], moe_lost=lost[stage],
                                     pin=ahead[stage])
        return loss

    async def evaluate(self, x: torch.Tensor, y: torch.Tensor, request_id: str) -> float:
        """Mean loss of a batch through every stage, forward only (nothing accumulates)."""
        h = x
        for stage in range(self.num_stages):
            targets = y if stage == self.num_stages - 1 else None
            reply = await self._call(stage, FORWARD, request_id, h, targets=targets)
            h = reply.tensors[0]
        return float(h)

    async def _call(
        self,
        stage: int,
        kind: str,
        request_id: str,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        grad_outputs: torch.Tensor | None = None,
        forward_step: int | None = None,
        backward_follows: bool = False,
        prefer: str | None = None,
        moe_lost: list | None = None,
        pin: bool = False,
    ) -> StageReply:
        """One call on some server of `stage` (`prefer`red if it is not much slower, or `pin`ned there while it can
        take it), retried on others."""
        request = StageRequest(kind, stage, request_id, inputs, targets=targets, grad_outputs=grad_outputs,
                               wire_dtype=self.wire_dtype, forward_step=forward_step,
                               backward_follows=backward_follows, moe_lost=moe_lost)
        balancer = self.balancers[stage]
        size = int(inputs.shape[0])
        deadline = time.monotonic() + self.settings.max_wait
        tried: set[str] = set()
        refused: dict[str, str] = {}  # peer -> its message: servers that called this request bad
        pause = self.settings.retry_pause
        while True:
            ticket = balancer.choose(size, kind, exclude=tried | refused.keys(), prefer=prefer,
                                     pin=pin or self.settings.pin_backward)
            if ticket is None and balancer.listed():
                self._check_refusals(stage, kind, refused)
                # Every server of the stage is banned or was tried: rather than sit out the whole ban
                # (a stage often has a single server), retry the one whose ban ends first, after a
                # pause that doubles each time. One that refused the request is not asked again.
                await self._pause(stage, pause, deadline)
                pause = min(pause * 2, self.settings.max_retry_pause)
                tried.clear()
                peer = balancer.soonest_unbanned(exclude=refused)
                ticket = None if peer is None else balancer.charge(peer, size, kind)
            if ticket is None:
                await self._wait_for_servers(stage, deadline)
                continue
            # The stage's only server (or the one a pinned backward belongs on) is asked to take the call however
            # long it waits: refused by time, the call would only wait here and ask again, or recompute elsewhere
            # (swarm.worker.auto_max_wait). Not the last one of several left unbanned: committed to a long queue
            # there, its micro-batch waited longer than for a ban to end (bench/sim, 1,000 peers: 0.4% of calls so
            # asked put the mean trip from 82.8 s to 95.4)
            pinned = (pin or self.settings.pin_backward) and ticket.peer_id == prefer
            request.patient = pinned or balancer.listed() == [ticket.peer_id]
            check = self._check_of(stage, request, balancer.on_probation(ticket.peer_id))
            witnesses = self.witnesses[stage]
            # A forward's witness computes at the same moment, so at the same optimizer step.
            early = None if check is None or check.slopes else \
                asyncio.ensure_future(witnesses.ask(check, {ticket.peer_id}))
            self.stats.calls += 1
            reply = None
            try:
                # A checked reply counts as the server's success only once the check passes: till then
                # a probing server stays on probation, one call at a time.
                reply = await self._attempt(stage, request, ticket, refused, report=check is None)
                if reply is not None and check is not None:
                    answered = balancer.clock()  # its speed is its own, the check's time left out
                    first = None if early is None else await early
                    verdict = await witnesses.judge(check, check.claim(ticket.peer_id, reply), first)
                    if verdict is Verdict.USE:
                        balancer.report_success(ticket, answered)
                    else:
                        reply = None  # not used: retried on another server, like a failure
                        self.stats.rejected += 1
                        if verdict is Verdict.UNLIKE:  # no lie shown, none disproved: held off as a busy server
                            balancer.report_failure(ticket, brief=True, refused=False)
            finally:
                # After a failure, a refused request or a cancellation the task is no longer the
                # server's; a reported success already closed the ticket, so this does nothing then.
                balancer.release(ticket)
                if early is not None and not early.done():
                    early.cancel()
            if reply is not None:
                if reply.server_step is not None:
                    self.stage_steps[stage] = reply.server_step
                return reply
            tried.add(ticket.peer_id)

    def _check_of(self, stage: int, request: StageRequest, probe: bool) -> SpotCheck | None:
        """The spot check of this call, if it gets one: every probe's, else at `spot_check_rate`."""
        if self.spot_check_rate <= 0 or not (probe or self.rng.random() < self.spot_check_rate):
            return None
        return SpotCheck.of(request, stage == self.num_stages - 1)

    def _check_refusals(self, stage: int, kind: str, refused: dict[str, str]) -> None:
        """Drop the micro-batch if every listed server of the stage called the request bad: the fault is
        ours, so their bans for it are taken back. Servers that failed otherwise (down, timed out) keep
        the trip waiting until their records expire, so a lone server's word never drops a micro-batch
        while an honest one may still take it."""
        listed = self.balancers[stage].listed()
        if not refused or not set(listed) <= refused.keys():
            return
        for peer in refused:
            self.balancers[stage].pardon(peer)
        self.stats.refused += 1
        message = next(iter(refused.values()))
        raise PipelineError(f"every server of stage {stage} ({len(refused)}) refused the {kind} request as bad: "
                            f"{message}")

    async def _attempt(self, stage: int, request: StageRequest, ticket: Ticket,
                       refused: dict[str, str] | None = None, report: bool = True,
                       vouch: bool = True) -> StageReply | None:
        """One call on the ticket's server: its reply (reported a success, if `report`; one that ends its
        probation, if `vouch`) or None (reported a failure); a server that calls the request bad is added
        to `refused`."""
        balancer, peer, kind = self.balancers[stage], ticket.peer_id, request.kind
        timeout = balancer.timeout(ticket, self.settings.timeout_multiplier, self.settings.timeout_floor,
                                   self.settings.request_timeout)
        try:
            reply = await self._send(stage, peer, request, timeout)
        except DialHeldOff as e:
            # Not the server's failure: a dial to it moments ago did not complete (often another call's, given
            # up by its own timeout on a long link), so the daemon tried nothing. The server is left out until
            # libp2p's hold-off ends, unbanned: a call that does reach it gives the verdict.
            balancer.hold_off(ticket, DIAL_HOLD_OFF)
            self.stats.held_off[stage] += 1
            log.info("stage %d %s on %s not sent: %s; trying another server, this one again in %.0fs", stage, kind,
                     peer[-8:], HELD_OFF_REASON, DIAL_HOLD_OFF)
            log.debug("%s", e)
            return None
        except (StageUnavailable, RemoteStageError) as e:
            # An error reply is that server's failure, like silence: it is banned and the call goes elsewhere.
            code = e.code if isinstance(e, RemoteStageError) else None
            if code == BAD_REQUEST and refused is not None:
                refused[peer] = e.message
            ban = balancer.report_failure(ticket, brief=code in FULL_CODES)
            if code is not None:  # a stranger picks the code: counting each distinct one would grow without bound
                self.stats.error_replies[code if code in KNOWN_CODES else "other"] += 1
            self.stats.failures += 1
            self.stats.stage_failures[stage] += 1
            log.warning("stage %d %s on %s failed (%s); banned for %.0fs, retrying", stage, kind, peer[-8:], e, ban)
            return None
        problem = self._reply_problem(stage, request, reply)
        if problem is not None:  # a reply cut short, a server of another version, or one lying
            ban = balancer.report_failure(ticket)
            self.stats.failures += 1
            self.stats.bad_replies += 1
            self.stats.stage_failures[stage] += 1
            self.stats.stage_bad_replies[stage] += 1
            log.warning("stage %d %s on %s replied %s; banned for %.0fs, retrying", stage, kind, peer[-8:], problem,
                        ban)
            return None
        if report:
            balancer.report_success(ticket, vouch=vouch)
        reply.server = peer
        return reply

    def _reply_problem(self, stage: int, request: StageRequest, reply: StageReply) -> str | None:
        """What is wrong with a server's reply, or None: every number a trainer uses from a server is checked.

        A forward's output has the input's batch and sequence (and the run's hidden size), a backward's
        input gradient the input's shape; the last stage's loss is present and finite; floats are finite.
        """
        last, kind = stage == self.num_stages - 1, request.kind
        expected = 0 if (kind == BACKWARD and stage == 0) else 1
        if len(reply.tensors) != expected:
            return f"{len(reply.tensors)} tensors instead of {expected}"
        if kind == BACKWARD and last:
            loss = reply.info.get("loss")
            if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
                return f"a loss of {loss!r} instead of a finite number"
        if "moe_lost" in reply.info:
            try:
                check_moe_lost(reply.info["moe_lost"])
            except ProtocolError as e:
                return f"a malformed moe_lost ({e})"
        if not reply.tensors:
            return None
        out, x = reply.tensors[0], request.inputs
        if kind == BACKWARD:
            shape = tuple(x.shape)
        elif last:  # an evaluation: the loss, as a 0-dim tensor
            shape = ()
        else:
            shape = tuple(x.shape[:2]) + ((self.hidden_size,) if self.hidden_size else tuple(out.shape[2:]))
        if tuple(out.shape) != shape:
            return f"a tensor of shape {list(out.shape)} instead of {list(shape)}"
        if not out.is_floating_point():
            return f"a {out.dtype} tensor instead of floats"
        if not torch.isfinite(out).all():
            return "non-finite values"
        return None

    async def _send(self, stage: int, peer: str, request: StageRequest, timeout: float) -> StageReply:
        """The one RPC of a call (a seam: tests replace it to run the routing without a network)."""
        client = StageClient(self.p2p, PeerID.from_base58(peer), stage_namespace(self.run_id, stage),
                             limits=self.limits, timeout=timeout)
        return await client.call(request)

    async def _pause(self, stage: int, seconds: float, deadline: float) -> None:
        if time.monotonic() + seconds > deadline:
            raise PipelineError(f"no working server for stage {stage} within {self.settings.max_wait:.0f}s")
        log.info("every server of stage %d failed recently; retrying in %.1fs", stage, seconds)
        await asyncio.sleep(seconds)

    async def _wait_for_servers(self, stage: int, deadline: float) -> None:
        if stage not in self.stats.waiting_stages:
            log.warning("stage %d has no ONLINE server; waiting for one to appear", stage)
            self.stats.waiting_stages.add(stage)
        while not self.balancers[stage].listed():
            if time.monotonic() > deadline:
                raise PipelineError(f"no server for stage {stage} within {self.settings.max_wait:.0f}s")
            self._servers_changed.clear()
            try:
                await asyncio.wait_for(self._servers_changed.wait(), self.settings.retry_pause)
            except asyncio.TimeoutError:
                pass
        if stage in self.stats.waiting_stages:
            self.stats.waiting_stages.discard(stage)
            log.info("stage %d has a server again; resuming", stage)
