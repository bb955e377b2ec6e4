"""Spot checks: a server's well-formed reply is compared with what other servers of its stage say.

A reply of the right shape with finite numbers can still be wrong: a server that skips the work and
answers at once with zeros is measured as the fastest, gets most of the calls, and its outputs and
gradients poison every stage upstream. So now and then (`SPOT_CHECK_RATE`, and always for a server's
probe: its first answer, or its first since a failure) the trainer asks a *witness*, another server
of the stage chosen at random (speed would pick an instant liar), for evidence it can compare:

- a forward's output: the witness runs the same forward at the same time (one optimizer step moves
  a stage's outputs by up to 100% early in a run, so only replies of the same moment compare); the
  outputs must agree within `OUTPUT_TOLERANCE` (relative L2 distance);
- a backward's input gradient g (every stage but the first, the last stage's fused call included):
  once g is known, the witness evaluates the stage at h + eps*u and h - eps*u, u = g / |g|, forward
  only, so no gradient is accumulated twice. Their difference estimates the derivative along u,
  which g claims is |g|; on the last stage their mean is the loss, which the reply claims too.
  Central differences at eps = `PROBE_STEP` * |h| are within 2% of the true derivative, in bfloat16
  and with mixture-of-experts routing too; the tolerances (`SLOPE_RATIO`, `LOSS_TOLERANCE`) also
  cover a step taken in between (early in a run of configs/tiny.yaml one step moves the derivative
  by up to 0.44x and the loss by 9%).

A reply computed on predicted parameters (look-ahead: a forward ahead, or any call while the server's round
runs on the step it predicts) says so (`ahead` in its metadata), and counts as an answer of a moment of its
own, between its step and the next: replicas at one step predict from different shares of the batch, and
early in a run their outputs differed by more than OUTPUT_TOLERANCE, which banned honest servers as liars
(bench/rebalance.py). A server saying `ahead` where others do not is excused as one at another step is: a
strike, not a ban, until STRIKES.

A witness whose two forwards straddle its own optimizer step, or whose call fails, says nothing that
compares: another is asked (`WITNESS_ATTEMPTS` in all) rather than let the reply pass unchecked.
When the witness disagrees a second one decides: the one of the three the other two agree against
is wrong. If its reported optimizer step is one the others do not report, a step may explain it
(replicas apply a step a few milliseconds apart): it gets a strike, and `STRIKES` among its last
`STRIKE_WINDOW` checks of that kind count as wrong, so a server cannot hide behind made-up steps,
nor clear its record with honest answers of the other kind. A wrong server is banned for its
balancer's longest ban, its peer id logged; a wrong reply (or a struck one) is not used: the call is
retried on another server. Two servers alone cannot say which is wrong: the dispute is logged and
the reply used, unless one of the two is a newcomer (it has yet to answer us well) and the other is
not: the newcomer gets a strike, its answer is not used, and it stays on probation. Where the two
answered at moments that do not compare (another step, or both on predictions, each from its own
share of the batch: early in a run, while every step has a round, that is most answers), nothing
says it lied: no strike, but its answer is not used and it is held off as a busy server is
(`Verdict.UNLIKE`: a ban from the balancer's brief base, doubling while it lasts), so a liar making
up moments is soon left out for the balancer's longest ban, and an honest one is back within
seconds. A newcomer's answers as a witness do not end its probation. What a check catches is
gross: zeros, noise, a flipped or scaled-up gradient, a made-up loss. A reply within the tolerances
(a gradient with some noise added, scaled by less than `SLOPE_RATIO`) passes, and so does a lie two
witnesses share (colluding servers).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import random
import secrets
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from swarm.protocol import BACKWARD, FORWARD, StageReply, StageRequest
from swarm.routing.balancer import StageBalancer

log = logging.getLogger(__name__)

SPOT_CHECK_RATE = 1 / 32  # of the calls whose reply can be checked; a server's probes are always checked
OUTPUT_TOLERANCE = 0.25  # forward outputs agree within this relative L2 distance
LOSS_TOLERANCE = 0.25  # losses agree within this relative difference
SLOPE_RATIO = 4.0  # derivatives agree if of the same sign and within this factor of each other
PROBE_STEP = 1e-2  # eps of the central differences, relative to the norm of the stage's input
STRIKES = 3  # disputes lost with another step as excuse, among a server's last STRIKE_WINDOW checks of a kind,
STRIKE_WINDOW = 12  # that count as one lost without (an honest server has one now and then, rarely 3 in 12)
WITNESS_ATTEMPTS = 3  # witnesses asked, one after another, for one finding that compares
TINY = 1e-12  # below this a norm or a derivative counts as zero


@dataclass
class Finding:
    """What one server says about the quantity a check compares, and at which optimizer step."""

    peer: str
    step: int | None = None  # the moment it answered at (`moment`): its step, or between it and the next
    output: torch.Tensor | None = None  # forward: the stage's output
    loss: float | None = None  # last stage: the micro-batch's mean loss
    slope: float | None = None  # backward: the derivative of the objective along the probe direction


def moment(reply: StageReply) -> int | None:
    """When a reply was computed, as a Finding's step: 2 x its step, plus 1 if on that step's predicted
    successor (`ahead`); None if it says no step."""
    if reply.server_step is None:
        return None
    return 2 * reply.server_step + (1 if reply.info.get("ahead") is True else 0)


def moment_label(value: int | None) -> str:
    return "unknown" if value is None else f"{value // 2}" + (" ahead" if value % 2 else "")


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / max(|a|, |b|): 0 for equal tensors, 1 against zeros, about 1.4 against unrelated noise."""
    a, b = a.detach().float(), b.detach().float()
    scale = max(float(a.norm()), float(b.norm()))
    return 0.0 if scale < TINY else float((a - b).norm()) / scale


def slopes_agree(a: float, b: float) -> bool:
    if abs(a) < TINY or abs(b) < TINY:
        return abs(a) < TINY and abs(b) < TINY
    return (a > 0) == (b > 0) and max(abs(a), abs(b)) <= SLOPE_RATIO * min(abs(a), abs(b))


def agree(a: Finding, b: Finding) -> bool:
    """Whether two findings say the same, within the tolerances (their steps aside)."""
    if a.output is not None and b.output is not None and relative_distance(a.output, b.output) > OUTPUT_TOLERANCE:
        return False
    if a.loss is not None and b.loss is not None and \
            abs(a.loss - b.loss) > LOSS_TOLERANCE * max(abs(a.loss), abs(b.loss)):
        return False
    return a.slope is None or b.slope is None or slopes_agree(a.slope, b.slope)


def like_for_like(a: Finding, b: Finding) -> bool:
    """Whether two findings are of one moment that compares: the same step, not on predicted parameters (two
    replicas predict the next parameters from different shares of the batch). A finding with no step compares
    with any (a server saying no step gets no excuse)."""
    return a.step is None or b.step is None or (a.step == b.step and a.step % 2 == 0)


def minority(claim: Finding, first: Finding, second: Finding) -> Finding | None:
    """The one the other two agree against, or None if no two of the three agree (or all do)."""
    ab, ac, bc = agree(claim, first), agree(claim, second), agree(first, second)
    if bc and not ab and not ac:
        return claim
    if ac and not ab and not bc:
        return first
    if ab and not ac and not bc:
        return second
    return None


class SpotCheck:
    """One call to check: the claim its reply makes, the requests a witness answers, what they say."""

    def __init__(self, request: StageRequest, last: bool):
        self.request, self.last = request, last
        self.outputs = request.kind == FORWARD and not last  # an evaluation (the last stage's forward) is not
        self.slopes = request.kind == BACKWARD and request.stage > 0  # the first stage returns no gradient
        # A forward's witness is asked at once, with the call; a backward's once its gradient is known.
        self.witness_requests = [self._forward(request.inputs)] if self.outputs else []
        self.eps = 0.0

    @classmethod
    def of(cls, request: StageRequest, last: bool) -> SpotCheck | None:
        """The check of a call, or None if its reply will have nothing checkable."""
        check = cls(request, last)
        return check if (check.outputs or check.slopes) and not request.moe_lost else None

    def claim(self, peer: str, reply: StageReply) -> Finding | None:
        """What the reply claims; None if it cannot be compared (it went without some remote experts)."""
        if "moe_lost" in reply.info:
            return None
        if self.outputs:
            return Finding(peer, moment(reply), output=reply.tensors[0])
        h, grad = self.request.inputs.detach().float(), reply.tensors[0].detach().float()
        norm = float(grad.norm())
        if norm < TINY:  # a zero gradient claims a zero derivative in every direction: try any one
            direction = torch.randn(h.shape, generator=torch.Generator().manual_seed(secrets.randbits(62)))
            direction /= direction.norm()
        else:
            direction = grad / norm
        self.eps = PROBE_STEP * float(h.norm())
        if self.eps < TINY:
            return None
        self.witness_requests = [self._forward(h + self.eps * direction), self._forward(h - self.eps * direction)]
        loss = float(reply.info["loss"]) if self.last else None
        return Finding(peer, moment(reply), loss=loss, slope=norm)

    def _forward(self, inputs: torch.Tensor) -> StageRequest:
        r = self.request
        # An id of its own, unlabelled: a checked server never sees these, a witness cannot tell them apart.
        return StageRequest(FORWARD, r.stage, f"{r.request_id[:200]}:{secrets.token_hex(4)}", inputs,
                            targets=r.targets if self.last else None, wire_dtype=r.wire_dtype)

    def finding(self, peer: str, replies: Sequence[StageReply]) -> Finding | None:
        """What a witness's replies say; None if they cannot be compared (experts lost, steps apart)."""
        if any("moe_lost" in reply.info for reply in replies):
            return None
        steps = {moment(reply) for reply in replies}
        if len(steps) > 1:  # it stepped (or entered or left a look-ahead) between its two forwards
            return None
        step = steps.pop()
        if self.outputs:
            return Finding(peer, step, output=replies[0].tensors[0])
        plus, minus = (reply.tensors[0].detach().float() for reply in replies)
        if self.last:  # the mean loss: the objective is the loss summed over the micro-batch
            n = int(self.request.inputs.shape[0])
            found = Finding(peer, step, loss=(float(plus) + float(minus)) / 2,
                            slope=n * (float(plus) - float(minus)) / (2 * self.eps))
        else:
            grad_outputs = self.request.grad_outputs.detach().float()
            found = Finding(peer, step, slope=float((grad_outputs * (plus - minus)).sum()) / (2 * self.eps))
        return found if math.isfinite(found.slope) else None


class Verdict(enum.Enum):
    """What a spot check says of a reply."""

    USE = "use"  # it passed, or nothing could judge it
    WRONG = "wrong"  # not used: wrong, or a newcomer's struck for a dispute nothing settles
    UNLIKE = "unlike"  # not used: a newcomer's, disputed at a moment that does not compare (held off briefly)


Attempt = Callable[..., Awaitable[StageReply | None]]  # (request, ticket, vouch=True): the pipeline's _attempt


class Witnesses:
    """Asks the witnesses of one stage and settles disputes; keeps the strikes of its servers."""

    def __init__(self, stage: int, balancer: StageBalancer, attempt: Attempt, rng: random.Random, stats):
        self.stage, self.balancer, self.attempt, self.rng = stage, balancer, attempt, rng
        self.stats = stats  # the pipeline's PipelineStats: calls, spot_checks, disputes, caught
        self.record: dict[tuple[str, str], deque[bool]] = {}  # (peer, kind) -> its last checks: struck or not

    async def ask(self, check: SpotCheck, exclude: set[str]) -> Finding | None:
        """What a server of the stage picked at random (not by speed: an instant liar is the fastest) says;
        asked again, up to WITNESS_ATTEMPTS times, while what it says cannot be compared."""
        for _ in range(WITNESS_ATTEMPTS):
            # A witness that stepped between its two forwards, or failed, is no evidence either way: taken
            # for none, a probe would pass unchecked, and a liar's first answer be used.
            found, asked = await self._ask_once(check, exclude)
            if found is not None or not asked:
                return found
        return None

    async def _ask_once(self, check: SpotCheck, exclude: set[str]) -> tuple[Finding | None, bool]:
        """One witness's finding, and whether there was a witness to ask."""
        balancer = self.balancer
        others = [p for p in balancer.available(exclude) if not balancer.on_probation(p)]
        others = others or balancer.available(exclude)
        if not others or not check.witness_requests:
            return None, False
        peer = self.rng.choice(sorted(others))
        size = int(check.request.inputs.shape[0])
        tickets = [balancer.charge(peer, size, FORWARD) for _ in check.witness_requests]
        # A witness's answers time it, but nothing checks them: they do not end its probation (only its own
        # checked replies do), else a liar picked as a witness early would have its lies trusted after.
        try:
            replies = await asyncio.gather(*(self.attempt(r, t, vouch=False)
                                             for r, t in zip(check.witness_requests, tickets)))
        finally:
            for ticket in tickets:
                balancer.release(ticket)
        self.stats.calls += len(tickets)
        return (None if any(r is None for r in replies) else check.finding(peer, replies)), True

    async def judge(self, check: SpotCheck, claim: Finding | None, first: Finding | None) -> Verdict:
        """Judge a reply's claim with the first witness's finding (asked before, or now if None)."""
        if claim is None:
            return Verdict.USE
        if first is None and check.slopes:
            first = await self.ask(check, {claim.peer})
        if first is None:
            return Verdict.USE
        self.stats.spot_checks += 1
        kind = check.request.kind
        if agree(claim, first):
            self._note(claim.peer, kind, struck=False)
            self._note(first.peer, kind, struck=False)
            return Verdict.USE
        self.stats.disputes += 1
        second = await self.ask(check, {claim.peer, first.peer})
        wrong = None if second is None else minority(claim, first, second)
        newcomer = None if wrong is not None else self._newcomer_of(claim, first)
        if newcomer is not None:
            # No third settles it, but one of the two is a newcomer (on probation: it has yet to answer us well)
            # and the other is not: the newcomer gets a strike, and its answer is not used. It stays on
            # probation, so its next answer is checked too. Else a liar that joins while the stage's other
            # servers are banned or busy would have its lies used from its first call.
            elder = first if newcomer is claim else claim
            if not like_for_like(newcomer, elder):
                # (three strikes within a second banned an honest replica early in a run, its stage's other
                # replica answering on predictions, and halved the stage for the ban's 300 s)
                log.info("spot check of stage %d %s: newcomer %s disagrees with %s, which answered us before, at "
                         "steps %s and %s, which do not compare; its answer is not used", self.stage, kind,
                         newcomer.peer, elder.peer, moment_label(newcomer.step), moment_label(elder.step))
                return Verdict.UNLIKE if newcomer is claim else Verdict.USE
            strikes = self._note(newcomer.peer, kind, struck=True)
            log.info("spot check of stage %d %s: newcomer %s disagrees with %s, which answered us before, and no "
                     "third server settles it; %d of %d strikes", self.stage, kind, newcomer.peer, elder.peer,
                     strikes, STRIKES)
            if strikes >= STRIKES:
                self._ban(newcomer, [elder], kind)
            return Verdict.WRONG if newcomer is claim else Verdict.USE
        if wrong is None:
            # Two replicas at different steps compute different things: a stage of two whose servers are steps
            # apart (one catching up) would say so on most checks, which is no news for whoever reads the log
            apart = claim.step is not None and first.step is not None and claim.step != first.step
            (log.info if apart else log.warning)(
                "spot check of stage %d %s on %s: witness %s disagrees and no third server settles it%s", self.stage,
                check.request.kind, claim.peer, first.peer,
                f" (they answered at steps {moment_label(claim.step)} and {moment_label(first.step)})" if apart else "")
            return Verdict.USE
        others = [f for f in (claim, first, second) if f is not wrong]
        for f in others:
            self._note(f.peer, kind, struck=False)
        excused = wrong.step is not None and all(f.step is not None and f.step != wrong.step for f in others)
        if not excused or self._note(wrong.peer, kind, struck=True) >= STRIKES:
            self._ban(wrong, others, kind)
        return Verdict.WRONG if wrong is claim else Verdict.USE

    def _newcomer_of(self, claim: Finding, witness: Finding) -> Finding | None:
        """The one of the two on probation (yet to answer us well) if the other is not, else None."""
        balancer = self.balancer
        if claim.peer not in balancer.servers or witness.peer not in balancer.servers:
            return None
        on = [f for f in (claim, witness) if balancer.on_probation(f.peer)]
        return on[0] if len(on) == 1 else None

    def _ban(self, wrong: Finding, others: Sequence[Finding], kind: str) -> None:
        self.record.pop((wrong.peer, kind), None)
        self.balancer.ban(wrong.peer, self.balancer.ban_max)
        self.stats.caught[self.stage] += 1
        log.warning("spot check of stage %d %s: server %s answered wrongly (%s against it); banned for %.0fs",
                    self.stage, kind, wrong.peer, ", ".join(sorted(f.peer for f in others)), self.balancer.ban_max)

    def strikes(self, peer: str, kind: str) -> int:
        return sum(self.record.get((peer, kind), ()))

    def _note(self, peer: str, kind: str, struck: bool) -> int:
        """Add a check's outcome to the server's record; its strikes now."""
        if len(self.record) > 2 * len(self.balancer.servers) + 2:  # servers the balancer forgot, forgotten here
            self.record = {key: value for key, value in self.record.items() if key[0] in self.balancer.servers}
        record = self.record.setdefault((peer, kind), deque(maxlen=STRIKE_WINDOW))
        record.append(struck)
        return sum(record)
