"""StageAverager: the servers of one stage step together, on the gradient of all their samples.

Each server accumulates gradient sums as a lone server would. When the servers whose samples make
the same step hold a full batch between them (collective progress, :mod:`swarm.averaging.tracker`),
each closes its batch: it hands the batch's gradient to an averaging round and goes on serving. The
round runs on a thread of its own, beside compute: every server of the stage joins it, even one
with no samples (weight 0), and the all-reduce yields ``sum of all gradient sums / all samples``.
The round's group forms ahead, while the batch fills (hivemind's matchmaking with a trigger), so the
all-reduce starts as soon as every member has closed its batch.
Meanwhile the compute thread keeps answering forwards and backwards on the parameters of step t,
and their gradients count towards step t+2 (one step of delay: they are applied to the parameters
of step t+1; weight stashing keeps each consistent with the parameters its forward used). When the
round ends, the compute thread applies the step between two requests: the same StageOptimizer math
on the same averaged gradient on every replica, so the replicas stay equal. The compute thread
never waits on the network; what it spends on averaging (closing a batch, applying a step or a
downloaded state) is exported as ``swarm_averaging_compute_seconds_total``.

A round that fails (no group, a member gone, a timeout) never stops training. Its batch tries again
after a short pause, with the samples that came meanwhile (the other members, most likely failed
too, do the same, so the replicas stay equal); after MAX_FAILED_TRIES failures in a row the server
steps on its own gradient and says so (log and metrics). Every replica knows which round made its state; one
whose state came from another round than a better-ranked replica's at the same step (a lone step, a
group that formed apart) downloads that replica's state, as does a server behind its stage's step;
the download too runs beside compute, and its state replaces the replica's between two requests.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import hivemind
import torch
from hivemind.averaging.control import StepControl
from prometheus_client import CollectorRegistry

from swarm.averaging.ahead import GroupsAhead
from swarm.averaging.catchup import CatchUp
from swarm.averaging.channel import ProgressChannel
from swarm.averaging.codecs import installed_compression
from swarm.averaging.intake import StateIntake
from swarm.averaging.ledger import SampleLedger
from swarm.averaging.metrics import AveragingMetrics
from swarm.averaging.process import AveragingProcess
from swarm.averaging.progress import (
    DEFER_HOLD_PERIODS,
    DeferHold,
    ProgressRecord,
    StageView,
    fingerprint_rtol,
    lone_elder,
    param_fingerprint,
    plausible,
    sharing_priority,
    stage_view,
)
from swarm.averaging.rounds import MAX_FAILED_TRIES, Phase, PlainRound, Retries, Round
from swarm.averaging.sharded import ShardedRound
from swarm.averaging.tracker import PROGRESS_TTL_PERIODS, StageProgressTracker
from swarm.config import AveragingConfig
from swarm.dht.keys import averaging_prefix
from swarm.drain import RoundTimes
from swarm.state import StageState

__all__ = ["MAX_FAILED_TRIES", "PROCESS_START_TIMEOUT", "StageAverager", "averaging_prefix"]

MAX_MEMBER_BATCHES = 4  # a member's claimed samples count for at most this many of its stage's batches

log = logging.getLogger(__name__)

PROCESS_START_TIMEOUT = 30.0  # forking the averaging process until it serves
CHANNEL_CALL_TIMEOUT = 10.0  # registering or removing the progress handler

RequestStep = Callable[[], Future | None]  # asks the backend's worker thread to call step() soon


class StageAverager:
    """A :class:`~swarm.averaging.stepper.StageStepper` for a stage that several servers serve.

    Create it on the main thread (it forks hivemind's averaging process), load the stage's state
    with :meth:`load_state_from_peers` if the stage already has servers, then :meth:`start` it.

    Its round helpers (rounds.RoundHost: what a Round and the components may use) are public; the rest
    is its own.
    """

    def __init__(self, state: StageState, dht: hivemind.DHT, settings: AveragingConfig, *, run_id: str,
                 owner_key: bytes, peer_id: str, registry: CollectorRegistry | None = None,
                 start_timeout: float = PROCESS_START_TIMEOUT):
        """`settings`: the run's averaging section (the optimizer's is the state's optimizer's)."""
        self.state, self.optimizer, self.stage, self.peer_id = state, state.optimizer, state.stage, peer_id
        stage = self.stage
        self.config = settings
        self.run_optimizer = state.optimizer.config
        self.batch_size = self.run_optimizer.batch_size
        # What a member's claim of samples counts for at most, in the weights of the all-reduce and in the
        # step's sample count (robust.py). A stage steps once its members hold a batch between them; an
        # honest member holds more only with samples that came in while the round before ran (seen: 1.5
        # batches on loaded cores), so 4 batches leave honest members their weight and bound a liar's.
        self.max_member_samples = MAX_MEMBER_BATCHES * self.batch_size * self._steps_per_round()
        self.metrics = AveragingMetrics(registry or CollectorRegistry(), stage)
        self.phase = Phase.COLLECTING
        self._phase_lock = threading.Lock()  # (solo is entered from any thread, the others on the compute thread)
        self.closing = threading.Event()
        self._request_step: RequestStep | None = None
        self._requested: Future | None = None  # the last step requested, until the worker ran it
        # Rounds and catch-up downloads run here, beside compute, one at a time; each job returns what
        # the compute thread then applies between two requests.
        self._jobs = ThreadPoolExecutor(1, thread_name_prefix=f"averaging{stage}")
        self._job: Future | None = None  # the round or download under way (set and cleared on the compute thread)
        self.ledger = SampleLedger()  # late samples, and those held while a batch is due (ledger.py)
        self.round_times = RoundTimes()  # how long rounds take here: forwards wait one out (swarm.drain)
        self.retries = Retries()
        self._channel: ProgressChannel | None = None
        self._fingerprint: list[float] = []
        self._fingerprint_rtol = fingerprint_rtol(self._round_compression())
        self._defer_hold = DeferHold(DEFER_HOLD_PERIODS * self.config.progress_period)
        self.params_changed()
        self.prefix = averaging_prefix(run_id, stage)
        self.round = self.make_round()
        ttl = PROGRESS_TTL_PERIODS * self.config.progress_period
        self.process = AveragingProcess(self.round.buffers(), dht, prefix=self.prefix, config=self.config,
                                        compression=installed_compression(self._round_compression()),
                                        state_source=self._state_for_peer, declare_period=ttl,
                                        all_reduce=self.round.all_reduce, max_weight=self.max_member_samples)
        self._counted_sent = 0  # of the averaging process's all-reduce bytes, what the metrics have
        self._count_lock = threading.Lock()  # (counted after each round, and when the metrics are read)
        self.metrics.before_scrape = self.count_sent
        self.process.start_process(start_timeout)
        self.tracker = StageProgressTracker(dht, self.prefix, owner_key, peer_id, self.config.progress_period,
                                            self.config.request_timeout, self._own_record, self._on_progress)
        intake = StateIntake(state, self.process, self.metrics, lambda: self.tracker.others(),
                             self._fingerprint_rtol, self.closing, own=self._own_if_started,
                             established=self.established, elders=lambda: self.tracker.elders())
        self.catch_up = CatchUp(self, intake)
        self.groups = GroupsAhead(stage, self.process, self.config.target_group_size, self.metrics, view=self.view,
                                  may_form=self._may_form_group, submit=self._jobs.submit,
                                  on_error=self.check_process)

    def make_round(self) -> Round:
        """The kind of round this stage runs (rounds.py): sharded with averaging.zero, else plain."""
        return ShardedRound(self, self.config.zero) if self.config.zero.enabled else PlainRound(self)

    def _steps_per_round(self) -> int:
        """Optimizer steps of a server's between two rounds (what a member's samples may span)."""
        return 1

    def _round_compression(self) -> str:
        """How what rounds average travels (an averaging.compression value)."""
        return self.config.compression

    # the phase
    def enter(self, phase: Phase) -> None:
        """Change the phase; once solo, always solo."""
        with self._phase_lock:
            if self.phase is not Phase.SOLO:
                self.phase = phase

    @property
    def solo(self) -> bool:
        """Whether the averaging process died: this server then trains alone."""
        return self.phase is Phase.SOLO

    @property
    def in_flight(self) -> bool:
        """Whether a round for the next step is under way: new samples count towards the one after."""
        return self.phase is Phase.ROUND

    # StageStepper (every method on the backend's compute thread)
    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    def accumulate(self, grads: Sequence[torch.Tensor | None], n: int, awaited: bool = False,
                   predicted: bool = False) -> int:
        """Count the samples towards the step they make, or hold them for the next if its batch is full.

        While a round runs, samples count towards the step after it however many come: holding them
        for later would make them two steps stale, and refusing them would make the servers wait.
        So a stage whose rounds take longer than a batch's compute takes larger steps (the samples
        that came during the round are in the step's stats as ``late``). Samples the due batch `awaited` count
        towards it (swarm.drain).
        """
        in_flight = self.in_flight
        later = False
        if not awaited and not in_flight and self.round.due(self.view()):  # a batch is due: these would make it larger
            self.ledger.hold(grads, n)
            later = True
        else:
            with self.state.lock:
                self.optimizer.accumulate(grads, n)
                if in_flight:
                    self.ledger.count_late(n)
                    self.metrics.late_samples.inc(n)
                    later = True
        self.tracker.nudge()
        return 2 if later else 1

    def samples_to_step(self) -> int | None:
        """Samples the stage's batch still needs, by every server's progress (StageStepper); None while a round
        or a download runs (its samples already run on look-ahead parameters, or a state replaces them)."""
        if self._job is not None or self.in_flight:
            return None
        view = self.view()
        if view.needs_state:
            return None
        return 0 if view.closed else max(0, self.batch_size - view.samples)

    @property
    def ready(self) -> bool:
        job = self._job
        if job is not None:  # a round or a download runs beside compute: nothing to do until it ends
            return job.done()
        view = self.view()
        return (view.needs_state and self.catch_up.may_run()) or (self.round.due(view) and self._may_average())

    @property
    def closes_batch(self) -> bool:
        return self._job is None and not self.view().needs_state

    def step(self) -> dict[str, Any] | None:
        """Apply what a finished round or download brought, or start one; never waits on the network.

        Returns the stats of a step of this replica's own, None otherwise (a round started, or the
        parameters came from a peer's state).
        """
        started = time.perf_counter()
        try:
            return self._advance()
        finally:
            self.metrics.compute_seconds.inc(time.perf_counter() - started)

    def _advance(self) -> dict[str, Any] | None:
        if self._job is not None:
            stats = self._finish_job()
            if stats is None and self.optimizer.samples > 0:
                # A job that made no step of ours (a round we joined with no samples, a download): the
                # samples that came meanwhile may fill a batch already, and a server training alone
                # hears of no progress that would ask again.
                self._ask_again()
            return stats
        if self._channel is None:
            self._refresh()  # decide on what the others publish now, not a period ago
        view = self.view()
        if view.needs_state and self.catch_up.may_run():
            self.catch_up.start(view)
            return None
        if not self.round.due(view) or not self._may_average():
            return None
        return self.round.start(view)

    def _finish_job(self) -> dict[str, Any] | None:
        """Apply what the job under way brought, if it is done (compute thread)."""
        job = self._job
        if not job.done():
            return None
        self._job = None
        try:
            apply = job.result()  # what to apply, here on the compute thread
        except Exception:  # a bug: the batch it had is lost, training goes on
            log.exception("stage %d: an averaging job failed", self.stage)
            apply = self.end_round
        return apply()

    def _ask_again(self) -> None:
        """Ask the worker for another step now if one is ready (a job just ended: nothing else would ask)."""
        if self._request_step is not None and not self.closing.is_set() and self.ready:
            self._requested = self._request_step()

    def _may_average(self) -> bool:
        return self.retries.may_run(time.monotonic())

    # round helpers (compute thread)
    def take_batch(self, in_round: bool) -> tuple[list[torch.Tensor | None], int]:
        """The batch's gradient sums and samples, for a round (`in_round`: one that runs beside compute, so
        samples that come meanwhile are late); samples held while it was due start the next one."""
        with self.state.lock:
            grads, samples = self.optimizer.take_gradients()
            held, held_samples = self.ledger.start_round()
            if held is not None:
                self.optimizer.accumulate(held, held_samples)
            if in_round:
                self.enter(Phase.ROUND)
        return grads, samples

    def start_job(self, fn: Callable[..., Callable[[], Any]], *args: Any) -> None:
        """Run `fn(*args)` on the averaging thread; what it returns, the compute thread applies next."""
        self._job = self._jobs.submit(fn, *args)
        self._job.add_done_callback(self._job_done)

    def _job_done(self, _: Future) -> None:
        # (a callback, so the job counts as done for the step it asks for)
        if self._request_step is not None and not self.closing.is_set():
            self._requested = self._request_step()

    def try_again(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """A failed round's batch goes back to the accumulation, to try again after a pause (compute thread)."""
        self.metrics.retried.inc()
        self.put_back(grads, samples)

    def put_back(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """A failed round's samples count towards the next try, after a pause that doubles with each failure."""
        with self.state.lock:
            self.state.leave_look_ahead()
            if samples > 0:
                self.optimizer.accumulate(grads, samples)
            self.ledger.round_failed()
            self.enter(Phase.COLLECTING)
        self.retries.wait(time.monotonic())
        self.tracker.nudge()

    def end_round(self) -> None:
        """A job ended with nothing to apply."""
        with self.state.lock:
            self.state.leave_look_ahead()
            self.enter(Phase.COLLECTING)
        self.tracker.nudge()

    def look_ahead(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """Run the samples that come during this round on the parameters its step will about make (compute thread).

        The step the optimizer would take on this server's own share of the batch differs from the round's
        only through the others' gradients, so what is computed on it now and applied after the round is
        nearly fresh (bench/staleness.py). The parameters the state is at are kept aside: snapshots
        (checkpoints, a peer's download) and the round's own step use them.
        """
        ahead = self.optimizer.preview(grads, samples)
        with self.state.lock:
            self.state.enter_look_ahead(ahead)

    @staticmethod
    def mean(grads: list[torch.Tensor | None], samples: int) -> list[torch.Tensor | None]:
        with torch.no_grad():
            return [None if g is None else g.div_(samples) for g in grads]

    def after_step(self) -> None:
        """The replica's parameters changed (a step, an adopted state): share and publish them."""
        self._count_state_bytes()
        self._share_state()
        self.tracker.nudge()
        self.groups.arm_soon()

    def state_adopted(self) -> None:
        """A state downloaded from a peer replaced the replica's (compute thread)."""
        self.after_step()

    def params_changed(self) -> None:
        """Fingerprint the parameters just made (call with the state lock held, or before start)."""
        self._fingerprint = param_fingerprint(self.state.shared_params)
        for part, value in zip(("sum", "sum_of_squares"), self._fingerprint):
            self.metrics.fingerprint.labels(stage=str(self.stage), part=part).set(value)

    # round helpers (averaging thread)
    @contextlib.contextmanager
    def in_round(self) -> Iterator[None]:
        """A round's network part, counted in the round metrics (in progress while it runs, and its time)."""
        started = time.monotonic()
        self.metrics.in_round.set(1)
        self.round_times.begin()
        try:
            yield
        finally:
            self.round_times.end()
            self.metrics.in_round.set(0)
            self.metrics.round_seconds.observe(time.monotonic() - started)

    def run_round(self, control: StepControl, samples: int) -> tuple[dict[Any, Any], float]:
        """Trigger the round whose group `control` forms, with `samples` as our weight: each member's gather
        data, and the round's start latency."""
        gathered, start_latency = self.process.run_round(control, float(samples), self.closing,
                                                         lambda: self.view().group_size == 1)
        self.metrics.round_start_seconds.observe(start_latency)
        return gathered, start_latency

    def count_sent(self) -> None:
        """Add what the averaging process's all-reduce sent since the last count to the metrics."""
        with self._count_lock:
            total = self.process.all_reduce_bytes.value
            sent, self._counted_sent = total - self._counted_sent, total
            if sent:
                self.metrics.sent(sent)

    def check_process(self) -> None:
        """If the averaging process died, leave the stage's averaging for good and train alone.

        Peers would otherwise keep waiting for this server in their rounds, and keep trying to
        download a state it can no longer serve.
        """
        if self.solo or self.closing.is_set() or self.process.is_alive():
            return
        self.enter(Phase.SOLO)
        self.groups.disarm()
        self.tracker.stop(leave=True)
        self._close_channel()
        code = self.process.exitcode
        stopped = code in (-signal.SIGTERM, -signal.SIGINT)  # most likely with this whole peer
        log.log(logging.WARNING if stopped else logging.ERROR,
                "stage %d: the averaging process %s; this server leaves its stage's averaging and steps on its own "
                "samples from now on: restart it to average again", self.stage,
                f"was stopped by signal {-code}" if stopped else f"died (exit code {code})")

    # lifecycle
    def start(self, request_step: RequestStep, channel: ProgressChannel | None = None) -> None:
        """Publish progress, serve this replica's state to peers, and ask for steps via `request_step`.

        With a `channel`, progress also goes straight to the stage's other servers and theirs comes
        straight here (see :mod:`swarm.averaging.channel`); without one, only through the DHT.
        """
        self._request_step = request_step
        self.round.open(channel)
        if channel is not None:
            channel.loop.run(channel.open(self.tracker.receive), CHANNEL_CALL_TIMEOUT)
            self._channel = channel
        self.tracker.start(self._channel)
        self._share_state()
        self.groups.arm_soon()

    def load_state_from_peers(self, timeout: float | None = None) -> None:
        """Take the stage's state from one of its servers before serving (catchup.CatchUp)."""
        self.catch_up.load_state_from_peers(timeout)

    def shutdown(self) -> None:
        """Leave the stage's averaging: others stop counting this server at once. Idempotent."""
        if self.closing.is_set():
            return
        self.closing.set()
        self.tracker.stop(leave=True)
        self._close_channel()
        self.round.close()
        self.groups.disarm()
        self._jobs.shutdown(wait=False, cancel_futures=True)  # a job under way ends soon: it watches closing
        self.process.close()

    def state_loaded(self) -> None:
        """The replica's state was replaced from elsewhere (a checkpoint) before start(): take note of it."""
        with self.state.lock:
            self.params_changed()

    @property
    def busy(self) -> bool:
        """Whether a round or a download is under way beside compute."""
        return self._job is not None

    @property
    def group_formed_ahead(self) -> bool:
        """Whether the group of the round for this server's step has formed, waiting for the batch."""
        return self.groups.formed(self.state.step)

    @property
    def process_id(self) -> int | None:
        """The pid of the averaging process (for operators, and tests that kill it)."""
        return self.process.process_id

    def view(self) -> StageView:
        """This server's view of its stage now (others as of the last progress read)."""
        own = self._own_record()
        established, elders = self.established(), self.tracker.elders()
        others = [] if self.solo else self.tracker.others()
        others = plausible(others, own.step, lone_elder(others, established, elders))
        return self._defer_hold(stage_view(own, others, self._fingerprint_rtol, established, elders))

    def established(self) -> set[str]:
        """The stage's servers this one has watched for averaging.min_tenure (swarm.tenure)."""
        return self.tracker.established(self.config.min_tenure)

    def _own_if_started(self) -> ProgressRecord | None:
        """This server's record once it serves (a joiner's fresh weights are no vote)."""
        return self._own_record() if self._request_step is not None else None

    def _may_form_group(self) -> bool:
        """Whether the next round's group may form ahead now (GroupsAhead)."""
        return (self.round.forms_ahead and self._request_step is not None and not self.closing.is_set()
                and self.phase not in (Phase.SOLO, Phase.ROUND))

    def _count_state_bytes(self) -> None:
        shards = self.optimizer.shards
        sharded = shards.nbytes if shards is not None else 0
        self.metrics.optimizer_state_bytes.set(sharded + self.optimizer.state_bytes())
        self.metrics.chunks_owned.set(len(shards.chunks) if shards is not None else 0)

    @property
    def held_samples(self) -> int:
        """Samples held apart while the stage's batch was due (they start the next one)."""
        return self.ledger.held_samples

    def _state_for_peer(self) -> tuple[dict, list[torch.Tensor]]:
        return self.catch_up.state_for_peer()  # (hivemind calls it on a thread of ours)

    def _share_state(self) -> None:
        if self._request_step is not None and not self.closing.is_set():  # started, not closed
            self.process.share_state(True)

    # progress
    def _own_record(self) -> ProgressRecord:
        with self.state.lock:  # one moment's step, samples and round, not either side of a step
            step, samples, round_, group, fingerprint, in_flight = (
                self.state.step, self._published_samples(), self.state.round_id, self.state.group,
                self._fingerprint, self.in_flight)
        return ProgressRecord(peer_id=self.peer_id, step=step, samples=samples, round_id=round_, group=group,
                              priority=sharing_priority(step, group, round_, self.peer_id),
                              fingerprint=fingerprint, averaging=in_flight)

    def _published_samples(self) -> int:
        """The samples this server's record says it brings towards the stage's next round."""
        return self.optimizer.samples

    def _refresh(self) -> None:
        if not self.solo:
            try:
                self.tracker.refresh()
            except Exception as e:  # a DHT hiccup: decide on the last view
                log.debug("stage %d: progress refresh failed: %s", self.stage, e)

    def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and channel.loop.is_running:
            try:
                channel.loop.run(channel.close(), CHANNEL_CALL_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - leaving anyway
                log.debug("closing the progress channel: %s", e)

    def _on_progress(self) -> None:
        self.check_process()
        if self._job is None and self.groups.stale():
            self.groups.arm_soon()  # (a server of the stage came or went: form the group of the next round anew)
        if self._request_step is None or (self._requested is not None and not self._requested.done()):
            return
        if self.ready:
            self._requested = self._request_step()
