"""StageAverager's groups formed ahead: the group of a stage's next round forms while its batch fills.

As soon as a server has applied a step (or sees a server of its stage come or go), it starts
hivemind's matchmaking for the next round with the step's group key and a trigger
(:meth:`AveragingProcess.arm`); when its batch is full, the round takes that control and triggers it
(StageAverager._average), so the all-reduce starts as soon as every member has closed its batch.
Everything here runs on the averaging thread, except :meth:`GroupsAhead._arm_soon`, which queues it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

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
    """StageAverager's groups formed ahead (see the module's docstring)."""

    @property
    def group_formed_ahead(self) -> bool:
        """Whether the group of the round for this server's step has formed, waiting for the batch."""
        armed = self._armed
        return armed is not None and armed.step == self.state.step and armed.control.stage == AWAITING_TRIGGER

    def _arm_ahead(self) -> None:
        """Begin forming the group of the round for this server's step now, so that it has formed by the
        time the batch is full: the round then starts as soon as every member has closed its batch."""
        self._arm_queued = False
        if self._closing.is_set() or self.solo or self._averaging:  # (averaging: the next round is armed at close)
            return
        view = self.view()
        armed = self._armed
        if armed is not None and armed.fits(view, self._group_target(view)):
            return
        self._disarm()
        if view.needs_state or view.group_size < 2:  # a download comes first, or nobody to meet yet
            return
        try:
            control = self._process.arm(view.step, view.group_size, {"step": view.step}, view.members)
        except AveragingError as e:
            log.debug("stage %d: could not form the group for step %d ahead: %s", self.stage, view.step + 1, e)
            self._check_process()
            return
        self._armed = armed = Armed(view.step, self._group_target(view), control)
        # a group that did not form in time is formed anew (not one this server gave up on: it is no longer armed)
        control.add_done_callback(lambda _: self._armed is armed and not control.triggered and self._arm_soon())
        log.debug("stage %d: forming the group of %d for step %d ahead", self.stage, armed.size, view.step + 1)

    def _armed_for(self, view: StageView) -> StepControl:
        """The round for `view`'s step: the one armed ahead if it fits, else one armed now."""
        armed, self._armed = self._armed, None
        if armed is not None and armed.fits(view, self._group_target(view)):
            self.metrics.armed_rounds["ahead"].inc()
            return armed.control
        if armed is not None:
            log.debug("stage %d: the group formed ahead for step %d of %d does not fit step %d of %d: %s",
                      self.stage, armed.step + 1, armed.size, view.step + 1, self._group_target(view),
                      "it failed" if armed.control.done() else "cancelled")
            armed.control.cancel()
        self.metrics.armed_rounds["now"].inc()
        return self._process.arm(view.step, view.group_size, {"step": view.step}, view.members)

    def _group_target(self, view: StageView) -> int:
        return max(2, min(view.group_size, self.config.target_group_size))

    def _disarm(self) -> None:
        armed, self._armed = self._armed, None
        if armed is not None:
            log.debug("stage %d: no longer forming the group of %d for step %d", self.stage, armed.size, armed.step + 1)
            with contextlib.suppress(Exception):  # (a process that is gone has nothing to cancel)
                armed.control.cancel()

    def _arm_soon(self) -> None:
        if self._zero is None and self._request_step is not None and not self._closing.is_set() \
                and not self._arm_queued:
            self._arm_queued = True
            with contextlib.suppress(RuntimeError):  # (shut down meanwhile)
                self._jobs.submit(self._arm_ahead)
