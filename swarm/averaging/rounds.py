"""The kinds of round a stage's servers average in, behind one interface, and the values that say where a
replica's averaging stands.

- :class:`Phase`: what runs beside a replica's compute now: nothing (collecting samples towards the next
  step), a round for the next step, a download of the stage's state, or, for good, nothing ever again
  (solo: the averaging process died). One value, changed only through ``StageAverager.enter``.
- :class:`Retries`: when the stage's next round may run, and how many failed tries its batch has had.
  Pure: no threads, no I/O.
- :class:`Round`: one kind of round. When one is due (:meth:`Round.due`) the compute thread starts it
  (:meth:`Round.start`): it takes what the round averages from the replica and hands the network part
  to the averaging thread (``StageAverager.start_job``), or steps at once if the replica is alone; the
  network part returns what the compute thread then applies. Kinds:

  - :class:`PlainRound` (here): the stage's mean gradient through hivemind's all-reduce;
  - ``ShardedRound`` (:mod:`swarm.averaging.sharded`): averaging.zero, the moments sharded;
  - ``OuterRound`` (:mod:`swarm.averaging.local`): the low-communication mode's pseudo-gradients.

  A round uses its averager (``host``) only through :class:`RoundHost` (StageAverager is one), and
  owns what only its kind needs (the buffers of the all-reduce, the sharded layout, the outer step's
  error feedback). A new kind of round is one new subclass, chosen in ``StageAverager.make_round``.
"""

from __future__ import annotations

import enum
import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from hivemind.averaging.control import StepControl

from swarm.averaging.errors import AveragingError
from swarm.averaging.metrics import FAILED, LOCAL, SUCCEEDED
from swarm.averaging.process import total_samples
from swarm.averaging.progress import StageView, round_of

log = logging.getLogger(__name__)

# Failed rounds in a row whose batch tries again before a server steps on its own samples alone. A member that
# gave up on matchmaking while its group formed fails the others' all-reduce only after next_chunk_timeout,
# so the two ends of one failure meet again a try or two apart.
MAX_FAILED_TRIES = 3
ROUND_RETRY_PAUSE = 0.25  # first pause before a failed round's batch tries again; doubles up to the max
ROUND_RETRY_PAUSE_MAX = 8.0

Apply = Callable[[], "dict[str, Any] | None"]  # what a round's network part hands the compute thread to run


class Phase(enum.Enum):
    COLLECTING = "collecting"  # samples accumulate towards the next step; nothing runs beside compute
    ROUND = "round"  # a round for the next step runs beside compute: new samples count towards the one after
    CATCHING_UP = "catching up"  # a download of the stage's state runs beside compute
    SOLO = "solo"  # the averaging process died: this server steps on its own samples from now on


class Retries:
    """When a stage's next round may run, and how many failed tries its batch has had since a round succeeded.

    A failed round's batch tries again after a pause that doubles with each failure; after `max_tries` failed
    tries the replica steps on its own samples instead, and keeps doing so (no more tries) until a round
    succeeds: a stage whose rounds keep failing pays the tries once, not at every step.
    """

    def __init__(self, max_tries: int = MAX_FAILED_TRIES, first_pause: float = ROUND_RETRY_PAUSE,
                 max_pause: float = ROUND_RETRY_PAUSE_MAX):
        self.max_tries, self.first_pause, self.max_pause = max_tries, first_pause, max_pause
        self.tries = 0  # failed tries since the last round that succeeded
        self.pause = first_pause  # the pause after the next failure
        self.next_at = 0.0  # monotonic time before which no round runs

    def may_run(self, now: float) -> bool:
        return now >= self.next_at

    def another_try(self) -> bool:
        """Whether a failed round's batch tries again (counted), rather than the replica stepping alone."""
        if self.tries >= self.max_tries:
            return False
        self.tries += 1
        return True

    def wait(self, now: float) -> None:
        """No round before the pause is over; the next pause is twice as long."""
        self.next_at = now + self.pause
        self.pause = min(2 * self.pause, self.max_pause)

    def hold(self, now: float) -> None:
        """No round before the current pause is over (a round that made no step, not a failure)."""
        self.next_at = now + self.pause

    def succeeded(self) -> None:
        self.tries, self.pause = 0, self.first_pause

    def gave_up(self) -> None:
        """The replica stepped alone after a failure: no more tries until a round succeeds."""
        self.tries = self.max_tries


class RoundHost(Protocol):
    """What a round (and the averager's other components) may use of its averager: the round helpers."""

    state: Any  # swarm.state.StageState, and its optimizer (swarm.optim.StageOptimizer)
    optimizer: Any
    stage: int
    peer_id: str
    config: Any  # the averaging section of the run's config
    run_optimizer: Any  # the optimizer section
    batch_size: int
    max_member_samples: int
    metrics: Any  # swarm.averaging.metrics.AveragingMetrics
    ledger: Any  # swarm.averaging.ledger.SampleLedger
    retries: Retries
    groups: Any  # swarm.averaging.ahead.GroupsAhead
    tracker: Any  # swarm.averaging.tracker.StageProgressTracker
    process: Any  # swarm.averaging.process.AveragingProcess
    prefix: str
    in_flight: bool

    # compute thread
    def enter(self, phase: Phase) -> None: ...
    def take_batch(self, in_round: bool) -> tuple[list[torch.Tensor | None], int]: ...
    def look_ahead(self, grads: list[torch.Tensor | None], samples: int) -> None: ...
    def start_job(self, fn: Callable[..., Apply], *args: Any) -> None: ...
    def put_back(self, grads: list[torch.Tensor | None], samples: int) -> None: ...
    def try_again(self, grads: list[torch.Tensor | None], samples: int) -> None: ...
    def end_round(self) -> None: ...
    def params_changed(self) -> None: ...
    def after_step(self) -> None: ...

    # averaging thread
    def in_round(self) -> AbstractContextManager[None]: ...
    def run_round(self, control: StepControl, samples: int) -> tuple[dict[Any, Any], float]: ...
    def count_sent(self) -> None: ...
    def check_process(self) -> None: ...

    # anywhere
    def mean(self, grads: list[torch.Tensor | None], samples: int) -> list[torch.Tensor | None]: ...


class Round(ABC):
    """One kind of round (see the module's docstring). Every method runs on the replica's compute thread but
    the network part each kind hands to ``host.start_job``, which runs on the averaging thread."""

    forms_ahead = True  # whether the group of its next round forms while the batch fills (swarm.averaging.ahead)

    def __init__(self, host: RoundHost):
        self.host = host

    def buffers(self) -> list[torch.Tensor]:
        """The tensors the averaging process's all-reduce averages (made once, before the process forks)."""
        return [torch.zeros(p.shape, dtype=torch.float32) for p in self.host.optimizer.params]

    @property
    def all_reduce(self) -> bool:
        """Whether the averaging process carries the round's data (else it only forms the group)."""
        return True

    def load_buffers(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """Our mean into the averaging buffers (the sums over `samples`; zeros if we have none: weight 0)."""
        with self.host.process.buffers() as buffers, torch.no_grad():
            for grad, buffer in zip(grads, buffers):
                if grad is None or samples == 0:
                    buffer.zero_()
                else:
                    torch.div(grad, samples, out=buffer)

    def read_buffers(self) -> list[torch.Tensor]:
        with self.host.process.buffers() as buffers:
            return [buffer.clone() for buffer in buffers]

    def due(self, view: StageView) -> bool:
        """Whether the stage's servers hold a batch between them (or one of them closed it)."""
        return view.closed or view.samples >= self.host.batch_size

    @abstractmethod
    def start(self, view: StageView) -> dict[str, Any] | None:
        """Take what the round averages and start it; the stats of a step taken at once (alone), else None."""

    def open(self, channel) -> None:  # noqa: B027 - most kinds need nothing beside the process
        """Open what the kind needs beside the averaging process (with the server's ProgressChannel)."""

    def close(self) -> None:  # noqa: B027
        """Close what :meth:`open` opened. Idempotent."""


class PlainRound(Round):
    """The stage's mean gradient through hivemind's all-reduce: each member sends its gradient sum over its
    samples and its sample count as the weight; every member applies the same StageOptimizer step on the mean.

    A round that fails tries again (with the samples that came meanwhile) up to Retries.max_tries times, then
    the replica steps on its own gradient and says so: every member of a failed round most likely failed it
    too, and all retrying keeps the replicas equal, where each stepping alone parts them.
    """

    def start(self, view: StageView) -> dict[str, Any] | None:
        host = self.host
        if view.group_size == 1 and host.optimizer.samples == 0:
            # a batch that servers ahead closed, none of it ours, and nobody here to meet: no step on
            # nothing (Adam's moments would still move the weights); the catch-up brings the stage's state
            return None
        grads, samples = host.take_batch(in_round=view.group_size > 1)
        if view.group_size == 1:  # nobody else at this step or behind it
            return self.apply(host.mean(grads, samples), samples, LOCAL, [host.peer_id], samples)
        if host.optimizer.config.lookahead and samples > 0:  # (a round joined with no samples: nothing to go by)
            host.look_ahead(grads, samples)
        host.start_job(self.run, view, grads, samples)
        host.tracker.nudge()  # the others count our new samples towards the step after this round's
        return None

    def run(self, view: StageView, grads: list[torch.Tensor | None], samples: int) -> Apply:
        """The network part (averaging thread): what the compute thread applies."""
        host = self.host
        started = time.monotonic()
        failure: AveragingError | None = None
        with host.in_round():
            try:
                control = host.groups.take(view)
                self.load_buffers(grads, samples)
                gathered, start_latency = host.run_round(control, samples)
                total, _ = total_samples(gathered, view.step, host.max_member_samples)
                mean = self.read_buffers()
            except AveragingError as e:
                failure = e
        host.count_sent()  # a failed round sent parts too
        if failure is not None:
            host.check_process()
            retries = host.retries
            if samples > 0 and view.group_size > 1 and retries.another_try():
                # (a member that left matchmaking just as the group formed makes the others' all-reduce miss
                # its part; each stepping alone would part the replicas, and a catch-up then throws away the
                # work of all but one: seen in clusters at batch 128, README, Averaging)
                log.warning("stage %d: averaging for step %d failed (%s); its %d samples count towards try %d of %d",
                            host.stage, view.step + 1, failure, samples, retries.tries + 1, retries.max_tries + 1)
                return functools.partial(host.try_again, grads, samples)
            if samples == 0:  # nothing of our own to step on: wait to catch up
                log.warning("stage %d: averaging for step %d failed (%s); with no samples of its own, this server "
                            "waits to catch up with its stage", host.stage, view.step + 1, failure)
                return host.end_round
            log.warning("stage %d: averaging for step %d failed (%s); stepping on this server's %d samples alone",
                        host.stage, view.step + 1, failure, samples)
            return functools.partial(self.apply, host.mean(grads, samples), samples, FAILED, [host.peer_id],
                                     samples)
        group = len(gathered)
        host.metrics.group_size.set(group)
        log.debug("stage %d: averaged %d samples over %d servers in %.3fs (group formed after %.3fs)", host.stage,
                  total, group, time.monotonic() - started, start_latency)
        return functools.partial(self.apply, mean, total, SUCCEEDED, [peer.to_base58() for peer in gathered],
                                 samples)

    def apply(self, mean: list[torch.Tensor | None], samples: int, outcome: str, members: list[str],
              own: int) -> dict[str, Any]:
        """Step on the stage's mean gradient (compute thread): the same math on every member of the round.

        `own`: how many of the `samples` were this server's (``own_late`` of them came while the round
        before ran).
        """
        host = self.host
        state = host.state
        with state.lock:
            state.leave_look_ahead()
            if outcome == SUCCEEDED:
                host.retries.succeeded()
            elif outcome == FAILED:
                host.retries.gave_up()
            host.metrics.rounds[outcome].inc()  # (first: whoever sees the step sees how it was made)
            stats = host.optimizer.step_with(mean, samples)
            if not stats["skipped"]:  # (a non-finite gradient: every member skips alike)
                state.set_round(round_of(host.optimizer.step_count, members), len(members))
            host.enter(Phase.COLLECTING)
            host.params_changed()
        host.after_step()
        return {**stats, "averaging": outcome, "group_size": len(members), "own_samples": own,
                "own_late": host.ledger.own_late(own)}
