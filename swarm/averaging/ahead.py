"""Groups formed ahead: the group of a stage's next round forms while its batch fills.

As soon as a server has applied a step (or sees a server of its stage come or go), it starts
hivemind's matchmaking for the next round with the step's group key and a trigger
(:meth:`AveragingProcess.arm`); when its batch is full, the round takes that control and triggers it
(:meth:`GroupsAhead.take`, from PlainRound.run), so the all-reduce starts as soon as every member has
closed its batch. A component of StageAverager that owns the group forming (`armed`) and whether its
forming is queued. Everything here runs on the averaging thread, except :meth:`GroupsAhead.arm_soon`,
which queues it there, and :meth:`GroupsAhead.stale`, a read.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hivemind.averaging.control import AveragingStage, StepControl

from swarm.averaging.errors import AveragingError
from swarm.averaging.progress import StageView

log = logging.getLogger(__name__)

AWAITING_TRIGGER = AveragingStage.AWAITING_TRIGGER


@dataclass(frozen=True)
class Armed:
    """A round whose group began to form ahead: for `step`, of `size` servers."""

    step: int
    size: int
    control: StepControl

    def fits(self, view: StageView, size: int) -> bool:
        """Whether it is the round of `view`'s step and size, still forming or formed. (A server of the stage
        that came or went since makes each member that sees it form the group anew.)"""
        return self.step == view.step and self.size == size and not self.control.done()


class GroupsAhead:
    """The group of a replica's next round, formed ahead (see the module's docstring).

    `may_form()`: whether forming one makes sense now (started, not closing, not solo, no round under way);
    `submit(fn)`: queues `fn` on the averaging thread; `view()`: the replica's view of its stage now;
    `on_error()`: called after the process refused to form one (it may have died).
    """

    def __init__(self, stage: int, process, target_group_size: int, metrics, *, view: Callable[[], StageView],
                 may_form: Callable[[], bool], submit: Callable[[Callable[[], Any]], Any],
                 on_error: Callable[[], None]):
        self.stage, self.process, self.target_group_size, self.metrics = stage, process, target_group_size, metrics
        self.view, self.may_form, self.submit, self.on_error = view, may_form, submit, on_error
        self.armed: Armed | None = None  # the group forming for the next round (averaging thread)
        self.queued = False  # a call of form() is queued on the averaging thread

    def formed(self, step: int) -> bool:
        """Whether the group of the round for `step` has formed, waiting for the batch."""
        armed = self.armed
        return armed is not None and armed.step == step and armed.control.stage == AWAITING_TRIGGER

    def stale(self) -> bool:
        """Whether no group is forming, or one of another size than the stage's view calls for now (a server
        of the stage came or went): the next round's group is to form anew. (The view is read only if a
        group is forming: this runs at every progress update.)"""
        armed = self.armed
        return armed is None or armed.size != self.target(self.view())

    def target(self, view: StageView) -> int:
        return max(2, min(view.group_size, self.target_group_size))

    def arm_soon(self) -> None:
        """Queue forming the group of the next round on the averaging thread (once: not if already queued)."""
        if self.may_form() and not self.queued:
            self.queued = True
            with contextlib.suppress(RuntimeError):  # (shut down meanwhile)
                self.submit(self.form)

    def form(self) -> None:
        """Begin forming the group of the round for the replica's step now, so that it has formed by the
        time the batch is full: the round then starts as soon as every member has closed its batch."""
        self.queued = False
        if not self.may_form():  # (a round under way: the next one is armed when it is applied)
            return
        view = self.view()
        armed = self.armed
        if armed is not None and armed.fits(view, self.target(view)):
            return
        self.disarm()
        if view.needs_state or view.group_size < 2:  # a download comes first, or nobody to meet yet
            return
        try:
            control = self.process.arm(view.step, view.group_size, {"step": view.step}, view.members)
        except AveragingError as e:
            log.debug("stage %d: could not form the group for step %d ahead: %s", self.stage, view.step + 1, e)
            self.on_error()
            return
        self.armed = armed = Armed(view.step, self.target(view), control)
        # a group that did not form in time is formed anew (not one this server gave up on: it is no longer armed)
        control.add_done_callback(lambda _: self.armed is armed and not control.triggered and self.arm_soon())
        log.debug("stage %d: forming the group of %d for step %d ahead", self.stage, armed.size, view.step + 1)

    def take(self, view: StageView) -> StepControl:
        """The round for `view`'s step (averaging thread): the one formed ahead if it fits, else one formed now."""
        armed, self.armed = self.armed, None
        if armed is not None and armed.fits(view, self.target(view)):
            self.metrics.armed_rounds["ahead"].inc()
            return armed.control
        if armed is not None:
            log.debug("stage %d: the group formed ahead for step %d of %d does not fit step %d of %d: %s",
                      self.stage, armed.step + 1, armed.size, view.step + 1, self.target(view),
                      "it failed" if armed.control.done() else "cancelled")
            armed.control.cancel()
        self.metrics.armed_rounds["now"].inc()
        return self.process.arm(view.step, view.group_size, {"step": view.step}, view.members)

    def disarm(self) -> None:
        armed, self.armed = self.armed, None
        if armed is not None:
            log.debug("stage %d: no longer forming the group of %d for step %d", self.stage, armed.size, armed.step + 1)
            with contextlib.suppress(Exception):  # (a process that is gone has nothing to cancel)
                armed.control.cancel()
