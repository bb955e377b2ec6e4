"""LocalAverager: the low-communication mode (averaging.mode local), DiLoCo's outer loop for one stage.

Each server of a stage steps on its own: once it holds its part of the stage's batch (the part of
the stage's samples it brought to the last round; before any, ``batch_size`` over the servers at its
step), it takes an optimizer step on those samples, an inner step, with the run's optimizer. So
each server takes about H inner steps between two outer steps however the trainers spread their
micro-batches, and the stage as many steps per sample as in the every-step mode: the
learning-rate schedule means the same. Once the stage's servers have brought
``averaging.local_steps`` (H) batches between them since the slow weights' step (their progress
records count samples since then), they meet in a round, as in the every-step mode (StageAverager:
the group forms ahead, a member gone fails the round, a replica behind or apart downloads the stage's
state), but what they average is each server's pseudo-gradient: the slow weights, which every server holds
alike, minus its own weights, weighted by the samples behind it. Every member then takes the same
outer step on the mean (StageState.outer_step: Nesterov momentum, DiLoCo's lr 0.7 and momentum 0.9
by default), so the slow weights stay equal, and goes on from them. Pseudo-gradients travel through
``averaging.pseudo_gradient_compression`` (float16 by default, float8 for 1 byte a value); with error
feedback (on by default) a server rounds its own onto the codec's grid before the round and adds what
was rounded off to its next one (swarm.averaging.feedback), so nothing the codec drops is lost, only late.

Nothing waits on the network. The round runs beside compute, and inner steps go on meanwhile: what
they do is kept on top of the new slow weights (``slow + (weights - weights at the round)``) and
counts towards the next pseudo-gradient, so no sample's work is lost (DiLoCoX's overlap; the
pseudo-gradient is then one round late for those steps). A round that fails is tried again after a
pause while inner steps go on; after MAX_FAILED_TRIES the server takes the outer step on its own
pseudo-gradient, and, its slow weights now apart from the others', downloads the stage's state as any
replica apart does. A server that sees another begin the round joins it with what it has (weight:
its samples since the slow weights' step, maybe none).

What the stage shares, publishes, checkpoints and serves to a newcomer is the slow state: the
slow weights (as the state's parameters), the outer momentum and the inner optimizer's moments, at
the slow weights' step (swarm.state). A newcomer starts from the slow weights, not from a replica's
drifted ones.

LocalAverager is a StageAverager whose stepping takes inner steps and whose round is an OuterRound
(rounds.py's interface): the round owns the pseudo-gradient handed to it, the error feedback and this
server's share of the last round; the averager owns the inner steps and the samples since the slow
weights' step.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import Any

import hivemind
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from swarm.averaging.averager import PROCESS_START_TIMEOUT, StageAverager
from swarm.averaging.codecs import grid_for
from swarm.averaging.errors import AveragingError
from swarm.averaging.feedback import ErrorFeedback
from swarm.averaging.metrics import FAILED, LOCAL, SUCCEEDED
from swarm.averaging.process import total_samples
from swarm.averaging.progress import StageView, round_of
from swarm.averaging.rounds import Apply, Phase, Round
from swarm.config import AveragingConfig
from swarm.state import StageState

log = logging.getLogger(__name__)

INNER = "inner"  # the "averaging" of an inner step's stats
# A server's part of the stage's batch is at least this over the servers (one the trainers left idle for a round
# would otherwise step on every micro-batch once they come back)
MIN_SHARE = 0.25


class OuterRound(Round):
    """The low-communication mode's round: the mean of the stage's pseudo-gradients through hivemind's
    all-reduce, then the same outer step on every member (see the module's docstring). Its host is a
    LocalAverager."""

    def __init__(self, host, settings: AveragingConfig):
        super().__init__(host)
        self.round_samples = settings.local_steps * host.batch_size  # what the stage brings to a round
        self.outer_lr, self.outer_momentum = settings.outer_lr, settings.outer_momentum
        self.feedback = ErrorFeedback(grid_for(settings.pseudo_gradient_compression)
                                      if settings.pseudo_gradient_error_feedback else None)
        self.handed = 0  # the samples of the pseudo-gradient handed to the round under way
        # this server's part of the samples of the stage's last round, and how many servers that round had
        self.share: tuple[float, int] | None = None
        self.last_drift = 0.0  # when this server last handed its weights to a round (swarm_averaging_replica_drift)

    def due(self, view: StageView) -> bool:
        """Whether the stage's servers have brought local_steps batches since the slow weights' step between them
        (alone: this server), or another server of the stage began the round."""
        if self.host.in_flight:
            return False
        if view.group_size == 1:
            return self.host.samples_since >= self.round_samples
        return view.closed or view.samples >= self.round_samples

    def start(self, view: StageView) -> dict[str, Any] | None:
        """Hand this server's pseudo-gradient to a round (or, alone, take the outer step on it now)."""
        host = self.host
        with host.state.lock:  # (a record shows the samples handed over and the round's start at once)
            delta, snapshot = host.state.pseudo_gradient()
            whole, sent = self.feedback.prepare(delta)  # (what earlier rounds' codec rounded off goes in too)
            self.last_drift = host.state.drift()
            samples, self.handed, host.samples_since = host.samples_since, host.samples_since, 0
            if view.group_size > 1:
                host.enter(Phase.ROUND)
        host.drift.set(self.last_drift)
        log.debug("stage %d: the outer round after step %d begins with %d samples of ours: %s", host.stage,
                  view.step, samples, view)
        if view.group_size == 1:
            return self.apply(whole, snapshot, LOCAL, [host.peer_id], samples)
        host.start_job(self.run, view, whole, sent, snapshot, samples)
        host.tracker.nudge()
        return None

    def run(self, view: StageView, whole: list[torch.Tensor], sent: list[torch.Tensor],
            snapshot: list[torch.Tensor], samples: int) -> Apply:
        """The network part (averaging thread). `sent`: this server's pseudo-gradient rounded as the codec
        sends it (ErrorFeedback); `whole`: unrounded, for the outer step this server takes alone if the round
        cannot be held."""
        host = self.host
        failure: AveragingError | None = None
        with host.in_round():
            try:
                control = host.groups.take(view)
                # the pseudo-gradient as sent (a weight of none: zeros); the all-reduce weighs it by `samples`
                self.load_buffers(sent, 1 if samples > 0 else 0)
                gathered, _ = host.run_round(control, samples)
                total, _ = total_samples(gathered, view.step, host.max_member_samples)
                mean = self.read_buffers()
            except AveragingError as e:
                failure = e
        host.count_sent()
        if failure is None:
            host.metrics.group_size.set(len(gathered))
            return functools.partial(self.apply, mean, snapshot, SUCCEEDED, [peer.to_base58() for peer in gathered],
                                     total)
        host.check_process()
        retries = host.retries
        if view.group_size > 1 and retries.another_try():
            log.warning("stage %d: the outer round after step %d failed (%s); inner steps go on, try %d of %d soon",
                        host.stage, view.step, failure, retries.tries + 1, retries.max_tries + 1)
            return self.failed
        log.warning("stage %d: the outer round after step %d failed (%s); taking the outer step on this server's "
                    "pseudo-gradient alone", host.stage, view.step, failure)
        if samples == 0:
            return host.end_round
        return functools.partial(self.apply, whole, snapshot, FAILED, [host.peer_id], samples)

    def failed(self) -> None:
        """The samples handed to a failed round count towards the next try (compute thread)."""
        host = self.host
        with host.state.lock:
            host.samples_since, self.handed = host.samples_since + self.handed, 0
            self.feedback.discard()
        host.try_again([], 0)

    def apply(self, mean: list[torch.Tensor], snapshot: list[torch.Tensor], outcome: str,
              members: list[str], samples: int) -> dict[str, Any]:
        """The outer step on the stage's mean pseudo-gradient (compute thread): the same on every member."""
        host = self.host
        state = host.state
        finite = all(bool(torch.isfinite(d).all()) for d in mean)
        with state.lock:
            if outcome == SUCCEEDED:
                host.retries.succeeded()
            elif outcome == FAILED:
                host.retries.gave_up()
            host.metrics.rounds[outcome].inc()
            norm = float("nan")
            if finite:  # (every member got the same mean: all skip alike)
                norm = state.outer_step(mean, snapshot, self.outer_lr, self.outer_momentum)
                if outcome != SUCCEEDED:
                    self.feedback.reset()  # (alone, the step took the whole pseudo-gradient, residual included)
                elif self.handed > 0:
                    self.feedback.commit()  # (what the round took of ours was rounded: the rest goes next time)
                else:
                    self.feedback.discard()  # (ours weighed nothing: the residual is still owed)
                state.set_round(round_of(state.step, members), len(members))
                if outcome == SUCCEEDED and samples > 0:
                    self.share = (self.handed / samples, len(members))
            else:  # (its samples count towards the next try)
                host.samples_since += self.handed
                self.feedback.discard()
            self.handed = 0
            host.enter(Phase.COLLECTING)
            host.params_changed()
        if not finite:
            log.warning("stage %d: the stage's mean pseudo-gradient is not finite; no outer step", host.stage)
            host.retries.hold(time.monotonic())
        host.after_step()
        return {"step": host.optimizer.step_count, "lr": self.outer_lr, "grad_norm": norm, "samples": samples,
                "skipped": not finite, "averaging": outcome, "group_size": len(members), "own_samples": 0,
                "outer_step": state.step}

    def replaced(self) -> None:
        """The replica now stands at slow weights from elsewhere: nothing of its own is owed to a round."""
        self.feedback.reset()
        self.last_drift = 0.0


class LocalAverager(StageAverager):
    """A :class:`~swarm.averaging.stepper.StageStepper` for a stage in the low-communication mode (module docstring).

    Built, loaded and started as a StageAverager; the state must carry the outer state
    (``StageState(..., local_steps=...)``).
    """

    round: OuterRound

    def __init__(self, state: StageState, dht: hivemind.DHT, settings: AveragingConfig, *, run_id: str,
                 owner_key: bytes, peer_id: str, registry: CollectorRegistry | None = None,
                 start_timeout: float = PROCESS_START_TIMEOUT):
        if state.outer is None:
            raise ValueError("the low-communication mode needs a state with slow weights (StageState local_steps)")
        self.local_steps = settings.local_steps
        self.samples_since = 0  # the samples of this server's inner steps since it handed the last to a round
        registry = registry or CollectorRegistry()
        super().__init__(state, dht, settings, run_id=run_id, owner_key=owner_key, peer_id=peer_id,
                         registry=registry, start_timeout=start_timeout)
        self.inner_steps = Counter("swarm_averaging_inner_steps", "Optimizer steps a server of a stage in the "
                                   "low-communication mode took on its own samples", ["stage"],
                                   registry=registry).labels(stage=str(self.stage))
        self.drift = Gauge("swarm_averaging_replica_drift", "How far this server's weights were from its stage's "
                           "slow weights, relative to them, when it last handed them to an outer round "
                           "(low-communication mode)", ["stage"],
                           registry=registry).labels(stage=str(self.stage))

    def make_round(self) -> OuterRound:
        return OuterRound(self, self.config)

    @property
    def feedback(self) -> ErrorFeedback:
        return self.round.feedback

    @property
    def last_drift(self) -> float:
        return self.round.last_drift

    def _steps_per_round(self) -> int:
        return self.local_steps

    def _round_compression(self) -> str:
        return self.config.pseudo_gradient_compression

    # StageStepper (compute thread)
    @property
    def closes_batch(self) -> bool:
        return False  # (inner steps are this server's own: they close when full, as they always did)

    def accumulate(self, grads, n: int, awaited: bool = False, predicted: bool = False) -> int:
        with self.state.lock:
            return self.optimizer.accumulate(grads, n)

    def samples_to_step(self) -> int | None:
        return max(0, self._inner_batch() - self.optimizer.samples)

    @property
    def ready(self) -> bool:
        job = self._job
        if job is not None and job.done():
            return True
        if self.optimizer.samples >= self._inner_batch():
            return True
        if job is not None:
            return False
        view = self.view()
        return (view.needs_state and self.catch_up.may_run()) or (self.round.due(view) and self._may_average())

    def _inner_batch(self) -> int:
        """What one inner step takes: this server's part of the stage's batch, as it brought that part of the
        samples of the stage's last round (before any, or when servers came or went since, an equal part). So each
        server takes about local_steps inner steps between two outer steps, however the trainers spread their
        micro-batches."""
        servers = max(1, self.view().group_size)
        share = self.round.share
        if share is None or share[1] != servers:
            part = 1 / servers
        else:
            part = max(share[0], MIN_SHARE / servers)
        return max(1, math.ceil(self.batch_size * part))

    def _published_samples(self) -> int:
        # towards the next round: those handed to the round under way count for it, not for the next
        return self.samples_since + self.optimizer.samples

    def _advance(self) -> dict[str, Any] | None:
        if self._job is not None:
            if not self._job.done():
                return self._inner_step()  # a round or a download runs beside compute: inner steps go on
            stats = self._finish_job()
            self._ask_again()
            return stats
        if self._channel is None:
            self._refresh()
        stats = self._inner_step()
        view = self.view()
        if view.needs_state and self.catch_up.may_run():
            self.catch_up.start(view)
        elif self.round.due(view) and self._may_average():
            outer = self.round.start(view)
            return outer if stats is None else stats
        return stats

    def _inner_step(self) -> dict[str, Any] | None:
        """A step on this server's own samples, if it holds its share of the batch."""
        if self.optimizer.samples < self._inner_batch():
            return None
        with self.state.lock:  # (a record reads the samples stepped on and those accumulating at one moment)
            grads, samples = self.optimizer.take_gradients()
            stats = self.optimizer.step_with(self.mean(grads, samples), samples)
            if not stats["skipped"]:
                self.samples_since += samples
        if not stats["skipped"]:
            self.inner_steps.inc()
        self.tracker.nudge()
        return {**stats, "averaging": INNER, "group_size": 1, "own_samples": samples}

    def state_adopted(self) -> None:
        self.samples_since = 0  # (this replica now stands at the slow weights)
        self.round.replaced()
        self.drift.set(0.0)
        super().state_adopted()

    def state_loaded(self) -> None:
        super().state_loaded()
        self.samples_since = 0
        self.round.feedback.reset()
