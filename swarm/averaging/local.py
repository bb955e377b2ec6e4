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
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import hivemind
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

from swarm.averaging.averager import MAX_FAILED_TRIES, PROCESS_START_TIMEOUT, StageAverager
from swarm.averaging.codecs import grid_for
from swarm.averaging.errors import AveragingError
from swarm.averaging.feedback import ErrorFeedback
from swarm.averaging.metrics import FAILED, LOCAL, SUCCEEDED
from swarm.averaging.process import total_samples
from swarm.averaging.progress import StageView, round_of
from swarm.averaging.sharded import ROUND_RETRY_PAUSE
from swarm.config import RunConfig
from swarm.state import StageState

log = logging.getLogger(__name__)

INNER = "inner"  # the "averaging" of an inner step's stats
# A server's part of the stage's batch is at least this over the servers (one the trainers left idle for a round
# would otherwise step on every micro-batch once they come back)
MIN_SHARE = 0.25


class LocalAverager(StageAverager):
    """A :class:`~swarm.averaging.stepper.StageStepper` for a stage in the low-communication mode (module docstring).

    Built, loaded and started as a StageAverager; the state must carry the outer state
    (``StageState(..., local_steps=...)``).
    """

    def __init__(self, state: StageState, dht: hivemind.DHT, config: RunConfig, *,
                 owner_key: bytes, peer_id: str, registry: CollectorRegistry | None = None,
                 start_timeout: float = PROCESS_START_TIMEOUT):
        if state.outer is None:
            raise ValueError("the low-communication mode needs a state with slow weights (StageState local_steps)")
        self.local_steps = config.averaging.local_steps
        self.round_samples = self.local_steps * config.optimizer.batch_size  # what the stage brings to a round
        self.outer_lr, self.outer_momentum = config.averaging.outer_lr, config.averaging.outer_momentum
        self._samples_since = 0  # the samples of this server's inner steps since it handed the last to a round
        self._handed = 0  # the samples of the pseudo-gradient handed to the round under way
        # this server's part of the samples of the stage's last round, and how many servers that round had
        self._share: tuple[float, int] | None = None
        self.last_drift = 0.0  # when this server last handed its weights to a round (swarm_averaging_replica_drift)
        settings = config.averaging
        self.feedback = ErrorFeedback(grid_for(settings.pseudo_gradient_compression)
                                      if settings.pseudo_gradient_error_feedback else None)
        registry = registry or CollectorRegistry()
        super().__init__(state, dht, config, owner_key=owner_key, peer_id=peer_id, registry=registry,
                         start_timeout=start_timeout)
        self.inner_steps = Counter("swarm_averaging_inner_steps", "Optimizer steps a server of a stage in the "
                                   "low-communication mode took on its own samples", ["stage"],
                                   registry=registry).labels(stage=str(self.stage))
        self.drift = Gauge("swarm_averaging_replica_drift", "How far this server's weights were from its stage's "
                           "slow weights, relative to them, when it last handed them to an outer round "
                           "(low-communication mode)", ["stage"],
                           registry=registry).labels(stage=str(self.stage))

    def _steps_per_round(self) -> int:
        return self.local_steps

    def _round_compression(self) -> str:
        return self.config.pseudo_gradient_compression

    # StageStepper (compute thread)
    def accumulate(self, grads, n: int) -> None:
        with self.state.lock:
            self.optimizer.accumulate(grads, n)

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
        return (view.needs_state and self._may_download()) or (self._round_due(view) and self._may_average())

    def _inner_batch(self) -> int:
        """What one inner step takes: this server's part of the stage's batch, as it brought that part of the
        samples of the stage's last round (before any, or when servers came or went since, an equal part). So each
        server takes about local_steps inner steps between two outer steps, however the trainers spread their
        micro-batches."""
        servers = max(1, self.view().group_size)
        if self._share is None or self._share[1] != servers:
            share = 1 / servers
        else:
            share = max(self._share[0], MIN_SHARE / servers)
        return max(1, math.ceil(self.batch_size * share))

    def _round_due(self, view: StageView) -> bool:
        """Whether the stage's servers have brought local_steps batches since the slow weights' step between them
        (alone: this server), or another server of the stage began the round."""
        if self._averaging:
            return False
        if view.group_size == 1:
            return self._samples_since >= self.round_samples
        return view.closed or view.samples >= self.round_samples

    def _published_samples(self) -> int:
        # towards the next round: those handed to the round under way count for it, not for the next
        return self._samples_since + self.optimizer.samples

    def _advance(self) -> dict[str, Any] | None:
        job = self._job
        if job is not None:
            if not job.done():
                return self._inner_step()  # a round or a download runs beside compute: inner steps go on
            self._job = None
            try:
                apply = job.result()
            except Exception:  # a bug: this round is lost, training goes on
                log.exception("stage %d: an averaging job failed", self.stage)
                apply = self._end_round
            stats = apply()
            if self._request_step is not None and not self._closing.is_set() and self.ready:
                self._requested = self._request_step()
            return stats
        if self._channel is None:
            self._refresh()
        stats = self._inner_step()
        view = self.view()
        if view.needs_state and self._may_download():
            self._start_job(self._catch_up, view)
        elif self._round_due(view) and self._may_average():
            outer = self._start_round(view)
            return outer if stats is None else stats
        return stats

    def _inner_step(self) -> dict[str, Any] | None:
        """A step on this server's own samples, if it holds its share of the batch."""
        if self.optimizer.samples < self._inner_batch():
            return None
        with self.state.lock:  # (a record reads the samples stepped on and those accumulating at one moment)
            grads, samples = self.optimizer.take_gradients()
            stats = self.optimizer.step_with(self._mean(grads, samples), samples)
            if not stats["skipped"]:
                self._samples_since += samples
        if not stats["skipped"]:
            self.inner_steps.inc()
        self._tracker.nudge()
        return {**stats, "averaging": INNER, "group_size": 1, "own_samples": samples}

    def _start_round(self, view: StageView) -> dict[str, Any] | None:
        """Hand this server's pseudo-gradient to a round (or, alone, take the outer step on it now)."""
        with self.state.lock:  # (a record shows the samples handed over and the round's start at once)
            delta, snapshot = self.state.pseudo_gradient()
            whole, sent = self.feedback.prepare(delta)  # (what earlier rounds' codec rounded off goes in too)
            self.last_drift = self.state.drift()
            samples, self._handed, self._samples_since = self._samples_since, self._samples_since, 0
            if view.group_size > 1:
                self._averaging = True
        self.drift.set(self.last_drift)
        log.debug("stage %d: the outer round after step %d begins with %d samples of ours: %s", self.stage,
                  view.step, samples, view)
        if view.group_size == 1:
            return self._apply_outer(whole, snapshot, LOCAL, [self.peer_id], samples)
        self._start_job(self._outer_round, view, whole, sent, snapshot, samples)
        self._tracker.nudge()
        return None

    # the round (averaging thread; returns what the compute thread applies)
    def _outer_round(self, view: StageView, whole: list[torch.Tensor], sent: list[torch.Tensor],
                     snapshot: list[torch.Tensor], samples: int) -> Callable[[], Any]:
        """`sent`: this server's pseudo-gradient rounded as the codec sends it (ErrorFeedback); `whole`: unrounded,
        for the outer step this server takes alone if the round cannot be held."""
        failure: AveragingError | None = None
        with self._in_round():
            try:
                control = self._armed_for(view)
                # the pseudo-gradient as sent (a weight of none: zeros); the all-reduce weighs it by `samples`
                self._load_buffers(sent, 1 if samples > 0 else 0)
                gathered, _ = self._run_round(control, samples)
                total, _ = total_samples(gathered, view.step, self.max_member_samples)
                mean = self._read_buffers()
            except AveragingError as e:
                failure = e
        self._count_sent()
        if failure is None:
            self.metrics.group_size.set(len(gathered))
            return functools.partial(self._apply_outer, mean, snapshot, SUCCEEDED,
                                     [peer.to_base58() for peer in gathered], total)
        self._check_process()
        if view.group_size > 1 and self._failed_tries < MAX_FAILED_TRIES:
            self._failed_tries += 1
            log.warning("stage %d: the outer round after step %d failed (%s); inner steps go on, try %d of %d soon",
                        self.stage, view.step, failure, self._failed_tries + 1, MAX_FAILED_TRIES + 1)
            return self._round_failed
        log.warning("stage %d: the outer round after step %d failed (%s); taking the outer step on this server's "
                    "pseudo-gradient alone", self.stage, view.step, failure)
        if samples == 0:
            return self._end_round
        return functools.partial(self._apply_outer, whole, snapshot, FAILED, [self.peer_id], samples)

    def _round_failed(self) -> None:
        """The samples handed to a failed round count towards the next try (compute thread)."""
        with self.state.lock:
            self._samples_since, self._handed = self._samples_since + self._handed, 0
            self.feedback.discard()
        self._try_again([], 0)

    def _apply_outer(self, mean: list[torch.Tensor], snapshot: list[torch.Tensor], outcome: str,
                     members: list[str], samples: int) -> dict[str, Any]:
        """The outer step on the stage's mean pseudo-gradient (compute thread): the same on every member."""
        finite = all(bool(torch.isfinite(d).all()) for d in mean)
        with self.state.lock:
            if outcome == SUCCEEDED:
                self._failed_tries, self._round_pause = 0, ROUND_RETRY_PAUSE
            elif outcome == FAILED:
                self._failed_tries = MAX_FAILED_TRIES
            self.metrics.rounds[outcome].inc()
            norm = float("nan")
            if finite:  # (every member got the same mean: all skip alike)
                norm = self.state.outer_step(mean, snapshot, self.outer_lr, self.outer_momentum)
                if outcome != SUCCEEDED:
                    self.feedback.reset()  # (alone, the step took the whole pseudo-gradient, residual included)
                elif self._handed > 0:
                    self.feedback.commit()  # (what the round took of ours was rounded: the rest goes next time)
                else:
                    self.feedback.discard()  # (ours weighed nothing: the residual is still owed)
                self.state.set_round(round_of(self.state.step, members), len(members))
                if outcome == SUCCEEDED and samples > 0:
                    self._share = (self._handed / samples, len(members))
            else:  # (its samples count towards the next try)
                self._samples_since += self._handed
                self.feedback.discard()
            self._handed = 0
            self._averaging = False
            self._params_changed()
        if not finite:
            log.warning("stage %d: the stage's mean pseudo-gradient is not finite; no outer step", self.stage)
            self._next_round = time.monotonic() + self._round_pause
        self._after_step()
        return {"step": self.optimizer.step_count, "lr": self.outer_lr, "grad_norm": norm, "samples": samples,
                "skipped": not finite, "averaging": outcome, "group_size": len(members), "own_samples": 0,
                "outer_step": self.state.step}

    def _adopt(self, loaded, min_step: int) -> bool:
        adopted = super()._adopt(loaded, min_step)
        if adopted:
            self._samples_since = 0  # (this replica now stands at the slow weights)
            self.feedback.reset()
            self.last_drift = 0.0
            self.drift.set(0.0)
        return adopted

    def state_loaded(self) -> None:
        super().state_loaded()
        self._samples_since = 0
        self.feedback.reset()
