"""Catch-up: a replica takes its stage's state from one of the stage's servers, and serves its own.

A joining server downloads it before it serves (:meth:`CatchUp.load_state_from_peers`). A server
behind its stage's step, or one whose state came from another round than a better-ranked replica's
at the same step, downloads it beside compute (:meth:`CatchUp.run`, on the averaging thread) and
adopts it between two requests, on the compute thread. Every downloaded state passes
:class:`~swarm.averaging.intake.StateIntake`'s checks first; a failed download is retried after a
pause that doubles each time. A component of StageAverager: it owns the intake and the retry pause,
and uses its averager (`host`) for the replica's state, ledger, metrics and progress.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from swarm.averaging.errors import AveragingError, StateDownloadError
from swarm.averaging.intake import Loaded, StateIntake
from swarm.averaging.metrics import FAILED, SUCCEEDED
from swarm.averaging.progress import StageView
from swarm.averaging.rounds import Phase
from swarm.averaging.tracker import PROGRESS_TTL_PERIODS
from swarm.state import StateInfo, StateRejected, flatten

log = logging.getLogger(__name__)

DOWNLOAD_RETRY_PAUSE = 0.5  # first pause between state download attempts; doubles on each failure
DOWNLOAD_RETRY_PAUSE_MAX = 30.0


class CatchUp:
    """A replica's state downloads and uploads (see the module's docstring)."""

    def __init__(self, host, intake: StateIntake):
        self.host, self.intake = host, intake
        self.pause = DOWNLOAD_RETRY_PAUSE  # before the next try after a failed download; doubles each time
        self.next_at = 0.0  # monotonic time before which no catch-up is tried

    def may_run(self) -> bool:
        return time.monotonic() >= self.next_at

    def load_state_from_peers(self, timeout: float | None = None) -> None:
        """Take the stage's state (parameters, moments, step) from one of its servers.

        Retries until `timeout` (default: averaging.state_download_timeout), then raises StateDownloadError.
        """
        host = self.host
        config, closing, tracker = host.config, host.closing, host.tracker
        timeout = config.state_download_timeout if timeout is None else timeout
        started = time.monotonic()
        deadline = started + timeout
        # servers announced ONLINE may be dead: once their progress records would have expired, stop waiting
        nobody_after = started + (PROGRESS_TTL_PERIODS + 2) * config.progress_period
        pause, problem = DOWNLOAD_RETRY_PAUSE, "no server of the stage offered its state"
        while not closing.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                tracker.read()  # what the stage's servers say, to check the state against
                if not tracker.others() and time.monotonic() >= nobody_after:
                    problem = "no server of the stage published its progress: they seem to be gone"
                    break
                if not host.established():  # nobody's word counts yet: watch the stage a while longer
                    problem = (f"no server of the stage has been watched for averaging.min_tenure "
                               f"({config.min_tenure:g}s) yet")
                    closing.wait(min(config.progress_period, max(0.0, deadline - time.monotonic())))
                    continue
                loaded = self.intake.fetch(remaining)
                if loaded is not None and self.adopt(loaded, 0):  # (joining: any step will do)
                    return
            except (AveragingError, StateRejected) as e:
                problem = str(e)
            closing.wait(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, DOWNLOAD_RETRY_PAUSE_MAX)
        raise StateDownloadError(
            f"could not download the state of stage {host.stage} from its servers within "
            f"{time.monotonic() - started:.0f}s "
            f"({problem}); check that this machine can reach them, or raise averaging.state_download_timeout"
        )

    def start(self, view: StageView) -> None:
        """Start a download beside compute (compute thread)."""
        self.host.enter(Phase.CATCHING_UP)
        self.host.start_job(self.run, view)

    def run(self, view: StageView) -> Callable[[], None]:
        """Download the stage's state (averaging thread); what it returns adopts it on the compute thread."""
        host = self.host
        host.groups.disarm()  # (a round at this step would wait for a group this server no longer joins)
        why = ("behind its stage" if view.behind else
               "its state differs from a better-ranked replica's at the same step (another round, or a round "
               "that lost a member partway)" if view.diverged else
               "its stage's elder is behind it, out of any round (a stage of two follows its elder)")
        try:
            loaded = self.intake.fetch(host.config.state_download_timeout)
        except AveragingError as e:
            loaded, why = None, f"{why}: {e}"
            host.check_process()
        # behind: only a later step helps (a liar claiming one must not make us reload our own step); deferring
        # to the elder: its state, whatever its step (only the elder is believed for it: progress.backs_state)
        deferring = view.defer and not (view.behind or view.diverged)
        min_step = 0 if deferring else view.step + view.behind
        return functools.partial(self.end, loaded, why, min_step, deferring)

    def end(self, loaded: Loaded | None, why: str, min_step: int, deferring: bool = False) -> None:
        """Adopt what the download brought, if anything passes (compute thread)."""
        host = self.host
        host.enter(Phase.COLLECTING)
        if loaded is not None and deferring and self._own_again(loaded):
            # the elder had caught up meanwhile (its record lagged a round both took): replacing this replica's
            # state by the same one would only drop the samples computed since
            self.pause = DOWNLOAD_RETRY_PAUSE
            log.info("stage %d: its elder's state is this one's own (step %d, the same round): kept it, and the "
                     "%d samples computed since", host.stage, host.step_count, host.optimizer.samples)
            return
        ok = False
        if loaded is not None:
            try:
                ok = self.adopt(loaded, min_step)
            except StateRejected as e:
                why = f"{why}: {e}"
        if ok:
            self.pause = DOWNLOAD_RETRY_PAUSE
            log.info("stage %d: caught up with its peers at step %d: %s", host.stage, host.step_count, why)
        else:
            self.next_at = time.monotonic() + self.pause
            self.pause = min(2 * self.pause, DOWNLOAD_RETRY_PAUSE_MAX)
            log.warning("stage %d: could not download the stage's state (%s); will retry", host.stage, why)
            host.tracker.nudge()  # (so the retry is not left to the next progress period)

    def _own_again(self, loaded: Loaded) -> bool:
        """Whether a downloaded state says it is this replica's own: the same step, made by the same round."""
        try:
            info = StateInfo.from_dict(loaded[0])
        except StateRejected:
            return False  # (adopt refuses it, saying why)
        state = self.host.state
        return (info.step, info.round_id) == (state.step, state.round_id)

    def adopt(self, loaded: Loaded, min_step: int) -> bool:
        """Replace the replica's state with one a peer sent, if it passes every check (StateIntake.vet,
        StageState.check). Raises StateRejected (and refuses that peer's state for a while) if not."""
        host = self.host
        try:
            info, named = self.intake.vet(loaded)
            with host.state.lock:
                if info.step < min_step:
                    host.metrics.downloads[FAILED].inc()
                    return False
                accumulated = host.optimizer.samples  # (the load zeroes the accumulation)
                host.state.load_state_dict(info, named)  # checks names, shapes, dtypes, finiteness first
                dropped = accumulated + host.ledger.state_replaced()  # (computed on the state just replaced)
                if dropped:
                    host.metrics.dropped_samples.inc(dropped)
                    log.info("stage %d: dropped %d samples computed on the replaced state", host.stage, dropped)
                host.params_changed()
        except StateRejected as e:
            raise self.intake.refuse(loaded, e) from None
        host.metrics.downloads[SUCCEEDED].inc()
        host.state_adopted()
        return True

    def state_for_peer(self) -> tuple[dict, list[torch.Tensor]]:
        # called by hivemind on a thread of ours when a peer downloads our state
        with self.host.state.lock:
            return flatten(*self.host.state.state_dict(shards=False))  # (a joiner's rounds bring it its chunks)
