"""Spot checks: a server's well-formed reply is compared with what other servers of its stage say.

A reply of the right shape with finite numbers can still be wrong: a server that skips the work and
answers at once with zeros is measured as the fastest, gets most of the calls, and its outputs and
gradients poison every stage upstream. So now and then (`SPOT_CHECK_RATE`, and always for a server's
probe: its first answer, or its first since a failure) the trainer asks a *witness*, another server
of the stage chosen at random (speed would pick an instant liar), for evidence it can compare:

- a forward's output: the witness runs the same forward; the outputs must agree within
  `OUTPUT_TOLERANCE` (relative L2 distance), compared only at the same optimizer step (one step moves
  a stage's outputs by up to tens of percent) and when no remote expert was lost;
- a backward's input gradient g (every stage but the first; the last stage's fused call too): the
  witness evaluates the stage at h + eps*u and h - eps*u, u = g / |g|, forward only, so nothing is
  accumulated twice. Their difference estimates the derivative along u, which g claims is |g|; on
  the last stage their mean is the loss, which the reply claims too. Central differences at
  eps = `PROBE_STEP` * |h| are within a few percent of the true derivative, in bfloat16 and with
  mixture-of-experts routing too (measured on configs/tiny.yaml and moe.yaml); the bound on their
  ratio (`SLOPE_RATIO`) also covers a step taken between the reply and the witness's forwards.

When the witness disagrees, a second witness decides: the one of the three the other two agree
against is banned (`StageBalancer.ban`), its peer id logged; a rejected reply's call is retried on
another server. Two servers alone cannot say which is wrong: the disagreement is logged, nothing is
banned. What a check catches is gross: zeros, noise, a flipped or scaled-up gradient, a made-up loss.
A reply within the tolerances (a gradient with some noise added, scaled by less than `SLOPE_RATIO`)
passes, as does a lie the witnesses share (two colluding servers checked by each other).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from swarm.protocol import BACKWARD, FORWARD, StageReply, StageRequest

SPOT_CHECK_RATE = 1 / 32  # of the calls whose reply can be checked; a server's probes are always checked
OUTPUT_TOLERANCE = 0.25  # forward outputs agree within this relative L2 distance
LOSS_TOLERANCE = 0.1  # losses agree within this relative difference (a step between them moves it ~1%)
SLOPE_RATIO = 4.0  # derivatives agree if of the same sign and within this factor of each other
PROBE_STEP = 1e-2  # eps of the central differences, relative to the norm of the stage's input
TINY = 1e-12  # below this a norm or a derivative counts as zero


@dataclass
class Finding:
    """What one server says about the quantity a check compares."""

    peer: str
    output: torch.Tensor | None = None  # forward: the stage's output
    loss: float | None = None  # last stage: the micro-batch's mean loss
    slope: float | None = None  # backward: the derivative of the objective along the probe direction


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
    """Whether two findings say the same, within the tolerances."""
    if a.output is not None and b.output is not None and relative_distance(a.output, b.output) > OUTPUT_TOLERANCE:
        return False
    if a.loss is not None and b.loss is not None and abs(a.loss - b.loss) > LOSS_TOLERANCE * max(abs(a.loss),
                                                                                                  abs(b.loss)):
        return False
    return a.slope is None or b.slope is None or slopes_agree(a.slope, b.slope)


def minority(claim: Finding, first: Finding, second: Finding) -> str | None:
    """The peer the other two agree against, or None if no two of the three agree (or all do)."""
    ab, ac, bc = agree(claim, first), agree(claim, second), agree(first, second)
    if bc and not ab and not ac:
        return claim.peer
    if ac and not ab and not bc:
        return first.peer
    if ab and not ac and not bc:
        return second.peer
    return None


class SpotCheck:
    """One reply to check: the claim it makes, the requests a witness answers, what its answers say."""

    def __init__(self, request: StageRequest, reply: StageReply, peer: str, last: bool):
        self.request, self.reply, self.last = request, reply, last
        self.claim = Finding(peer)
        self.witness_requests: list[StageRequest] = []
        self.eps = 0.0
        self.direction: torch.Tensor | None = None
        if request.kind == FORWARD and not last:
            self.claim.output = reply.tensors[0]
            self.witness_requests = [self._forward(request.inputs)]
        elif request.kind == BACKWARD and reply.tensors:
            self._slope_check()

    @classmethod
    def of(cls, request: StageRequest, reply: StageReply, peer: str, last: bool) -> SpotCheck | None:
        """The check of this reply, or None if it has nothing checkable (a first stage's backward, an
        evaluation, a call that went without some remote experts)."""
        if "moe_lost" in reply.info or request.moe_lost:
            return None
        check = cls(request, reply, peer, last)
        return check if check.witness_requests else None

    def _slope_check(self) -> None:
        request, reply = self.request, self.reply
        h = request.inputs.detach().float()
        grad = reply.tensors[0].detach().float()
        norm = float(grad.norm())
        if norm < TINY:  # a zero gradient claims a zero derivative in every direction: try any one
            direction = torch.randn(h.shape, generator=torch.Generator().manual_seed(secrets.randbits(62)))
            direction /= direction.norm()
        else:
            direction = grad / norm
        self.eps = PROBE_STEP * float(h.norm())
        if self.eps < TINY:
            return
        self.direction = direction
        self.claim.slope = norm
        if self.last:
            self.claim.loss = float(reply.info["loss"])
        self.witness_requests = [self._forward(h + self.eps * direction), self._forward(h - self.eps * direction)]

    def _forward(self, inputs: torch.Tensor) -> StageRequest:
        r = self.request
        # An id of its own, unlabelled: a checked server never sees these, a witness cannot tell them apart.
        return StageRequest(FORWARD, r.stage, f"{r.request_id[:200]}:{secrets.token_hex(4)}", inputs,
                            targets=r.targets if self.last else None, wire_dtype=r.wire_dtype)

    def finding(self, peer: str, replies: list[StageReply]) -> Finding | None:
        """What a witness's replies say; None if they cannot be compared (another step, experts lost)."""
        if any("moe_lost" in reply.info for reply in replies):
            return None
        if self.claim.output is not None:
            if replies[0].server_step != self.reply.server_step:
                return None
            return Finding(peer, output=replies[0].tensors[0])
        steps = [reply.server_step for reply in replies]
        if self.reply.server_step is not None and any(s is None or abs(s - self.reply.server_step) > 1 for s in steps):
            return None  # a server steps during a backward: one step apart is as close as they can be
        plus, minus = (reply.tensors[0].detach().float() for reply in replies)
        if self.last:  # the mean loss: the objective is the loss summed over the micro-batch
            n = int(self.request.inputs.shape[0])
            slope = n * (float(plus) - float(minus)) / (2 * self.eps)
            finding = Finding(peer, loss=(float(plus) + float(minus)) / 2, slope=slope)
        else:
            grad_outputs = self.request.grad_outputs.detach().float()
            finding = Finding(peer, slope=float((grad_outputs * (plus - minus)).sum()) / (2 * self.eps))
        return finding if math.isfinite(finding.slope) else None
