"""StageAverager's state downloads: a replica takes its stage's state from one of the stage's servers.

A joining server downloads it before it serves (:meth:`StateCatchUp.load_state_from_peers`). A
server behind its stage's step, or one whose state came from another round than a better-ranked
replica's at the same step, downloads it beside compute (:meth:`StateCatchUp._catch_up`, on the
averaging thread) and adopts it between two requests, on the compute thread. Every downloaded state
passes :class:`~swarm.averaging.intake.StateIntake`'s checks first; a failed download is retried
after a pause that doubles each time. The same replica serves its own state to its peers.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from swarm.averaging.errors import AveragingError, StateDownloadError
from swarm.averaging.intake import Loaded
from swarm.averaging.metrics import FAILED, SUCCEEDED
from swarm.averaging.progress import StageView
from swarm.averaging.tracker import PROGRESS_TTL_PERIODS
from swarm.state import StateRejected, flatten

log = logging.getLogger(__name__)

DOWNLOAD_RETRY_PAUSE = 0.5  # first pause between state download attempts; doubles on each failure
DOWNLOAD_RETRY_PAUSE_MAX = 30.0


class StateCatchUp:
    """StageAverager's state downloads and uploads (see the module's docstring)."""

    def load_state_from_peers(self, timeout: float | None = None) -> None:
        """Take the stage's state (parameters, moments, step) from one of its servers.

        Retries until `timeout` (default: averaging.state_download_timeout), then raises StateDownloadError.
        """
        timeout = self.config.state_download_timeout if timeout is None else timeout
        started = time.monotonic()
        deadline = started + timeout
        # servers announced ONLINE may be dead: once their progress records would have expired, stop waiting
        nobody_after = started + (PROGRESS_TTL_PERIODS + 2) * self.config.progress_period
        pause, problem = DOWNLOAD_RETRY_PAUSE, "no server of the stage offered its state"
        while not self._closing.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self._tracker.read()  # what the stage's servers say, to check the state against
                if not self._tracker.others() and time.monotonic() >= nobody_after:
                    problem = "no server of the stage published its progress: they seem to be gone"
                    break
                if not self._established():  # nobody's word counts yet: watch the stage a while longer
                    problem = (f"no server of the stage has been watched for averaging.min_tenure "
                               f"({self.config.min_tenure:g}s) yet")
                    self._closing.wait(min(self.config.progress_period, max(0.0, deadline - time.monotonic())))
                    continue
                if self._download(remaining):
                    return
            except (AveragingError, StateRejected) as e:
                problem = str(e)
            self._closing.wait(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(2 * pause, DOWNLOAD_RETRY_PAUSE_MAX)
        raise StateDownloadError(
            f"could not download the state of stage {self.stage} from its servers within "
            f"{time.monotonic() - started:.0f}s "
            f"({problem}); check that this machine can reach them, or raise averaging.state_download_timeout"
        )

    # catching up (on the averaging thread; what it returns runs on the compute thread)
    def _catch_up(self, view: StageView) -> Callable[[], None]:
        """Download the stage's state (averaging thread); what it returns adopts it on the compute thread."""
        self._disarm()  # (a round at this step would wait for a group this server no longer joins)
        why = ("behind its stage" if view.behind else
               "its state differs from a better-ranked replica's at the same step (another round, or a round "
               "that lost a member partway)" if view.diverged else
               "its stage's elder is behind it, out of any round (a stage of two follows its elder)")
        try:
            loaded = self._fetch(self.config.state_download_timeout)
        except AveragingError as e:
            loaded, why = None, f"{why}: {e}"
            self._check_process()
        # behind: only a later step helps (a liar claiming one must not make us reload our own step); deferring
        # to the elder: its state, whatever its step (only the elder is believed for it: progress.backs_state)
        min_step = 0 if view.defer and not (view.behind or view.diverged) else view.step + view.behind
        return functools.partial(self._end_catch_up, loaded, why, min_step)

    def _end_catch_up(self, loaded: Loaded | None, why: str, min_step: int) -> None:
        ok = False
        if loaded is not None:
            try:
                ok = self._adopt(loaded, min_step)
            except StateRejected as e:
                why = f"{why}: {e}"
        if ok:
            self._download_pause = DOWNLOAD_RETRY_PAUSE
            log.info("stage %d: caught up with its peers at step %d: %s", self.stage, self.step_count, why)
        else:
            self._next_download = time.monotonic() + self._download_pause
            self._download_pause = min(2 * self._download_pause, DOWNLOAD_RETRY_PAUSE_MAX)
            log.warning("stage %d: could not download the stage's state (%s); will retry", self.stage, why)
            self._tracker.nudge()  # (so the retry is not left to the next progress period)

    def _download(self, timeout: float) -> bool:
        """Download and apply a peer's state (joining: any step will do); False if none came."""
        loaded = self._fetch(timeout)
        return loaded is not None and self._adopt(loaded, 0)

    def _fetch(self, timeout: float) -> Loaded | None:
        return self._intake.fetch(timeout)

    def _adopt(self, loaded: Loaded, min_step: int) -> bool:
        """Replace this replica's state with one a peer sent, if it passes every check (StateIntake.vet,
        StageState.check). Raises StateRejected (and refuses that peer's state for a while) if not."""
        try:
            info, named = self._intake.vet(loaded)
            with self.state.lock:
                if info.step < min_step:
                    self.metrics.downloads[FAILED].inc()
                    return False
                self.state.load_state_dict(info, named)  # checks names, shapes, dtypes, finiteness first
                dropped = self.ledger.state_replaced()  # (computed on the state just replaced)
                if dropped:
                    log.info("stage %d: dropped %d held samples computed on the replaced state", self.stage, dropped)
                self._params_changed()
        except StateRejected as e:
            raise self._intake.refuse(loaded, e) from None
        self.metrics.downloads[SUCCEEDED].inc()
        self._after_step()
        return True

    def _state_for_peer(self) -> tuple[dict, list[torch.Tensor]]:
        # called by hivemind on a thread of ours when a peer downloads our state
        with self.state.lock:
            return flatten(*self.state.state_dict(shards=False))  # (a joiner's rounds bring it its chunks)

    def _share_state(self) -> None:
        if self._request_step is not None and not self._closing.is_set():  # started, not closed
            self._process.share_state(True)

    def _may_download(self) -> bool:
        return time.monotonic() >= self._next_download

