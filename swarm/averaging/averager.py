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
import functools
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

from swarm.averaging.ahead import Armed, GroupsAhead
from swarm.averaging.catchup import DOWNLOAD_RETRY_PAUSE, StateCatchUp
from swarm.averaging.channel import ProgressChannel
from swarm.averaging.codecs import installed_compression
from swarm.averaging.collective import Hyper, Mailbox
from swarm.averaging.errors import AveragingError
from swarm.averaging.intake import StateIntake
from swarm.averaging.ledger import SampleLedger
from swarm.averaging.metrics import FAILED, LOCAL, SUCCEEDED, AveragingMetrics
from swarm.averaging.process import AveragingProcess, total_samples
from swarm.averaging.progress import (
    ProgressRecord,
    StageView,
    fingerprint_rtol,
    lone_elder,
    param_fingerprint,
    plausible,
    round_of,
    sharing_priority,
    stage_view,
)
from swarm.averaging.sharded import ROUND_RETRY_PAUSE, ROUND_RETRY_PAUSE_MAX, ShardedRounds
from swarm.averaging.tracker import PROGRESS_TTL_PERIODS, StageProgressTracker
from swarm.config import RunConfig
from swarm.dht.keys import averaging_prefix
from swarm.state import StageState
from swarm.zero import Layout, ShardedMoments

MAX_MEMBER_BATCHES = 4  # a member's claimed samples count for at most this many of its stage's batches
# Failed rounds in a row whose batch tries again before a server steps on its own samples alone. A member that
# gave up on matchmaking while its group formed fails the others' all-reduce only after next_chunk_timeout,
# so the two ends of one failure meet again a try or two apart.
MAX_FAILED_TRIES = 3

log = logging.getLogger(__name__)

PROCESS_START_TIMEOUT = 30.0  # forking the averaging process until it serves
CHANNEL_CALL_TIMEOUT = 10.0  # registering or removing the progress handler

RequestStep = Callable[[], Future | None]  # asks the backend's worker thread to call step() soon


class StageAverager(GroupsAhead, ShardedRounds, StateCatchUp):
    """A :class:`~swarm.averaging.stepper.StageStepper` for a stage that several servers serve.

    Create it on the main thread (it forks hivemind's averaging process), load the stage's state
    with :meth:`load_state_from_peers` if the stage already has servers, then :meth:`start` it.
    """

    def __init__(self, state: StageState, dht: hivemind.DHT, config: RunConfig, *,
                 owner_key: bytes, peer_id: str, registry: CollectorRegistry | None = None,
                 start_timeout: float = PROCESS_START_TIMEOUT):
        self.state, self.optimizer, self.stage, self.peer_id = state, state.optimizer, state.stage, peer_id
        stage, optimizer = self.stage, self.optimizer
        self.config = config.averaging
        self.batch_size = config.optimizer.batch_size
        # What a member's claim of samples counts for at most, in the weights of the all-reduce and in the
        # step's sample count (robust.py). A stage steps once its members hold a batch between them; an
        # honest member holds more only with samples that came in while the round before ran (seen: 1.5
        # batches on loaded cores), so 4 batches leave honest members their weight and bound a liar's.
        self.max_member_samples = MAX_MEMBER_BATCHES * self.batch_size * self._steps_per_round()
        self.metrics = AveragingMetrics(registry or CollectorRegistry(), stage)
        self.solo = False  # True once the averaging process died: this server then trains alone
        self._closing = threading.Event()
        self._request_step: RequestStep | None = None
        self._requested: Future | None = None  # the last step requested, until the worker ran it
        # Rounds and catch-up downloads run here, beside compute, one at a time; each job returns what
        # the compute thread then applies between two requests.
        self._jobs = ThreadPoolExecutor(1, thread_name_prefix=f"averaging{stage}")
        self._job: Future | None = None  # (set and cleared on the compute thread)
        self._averaging = False  # a round for the next step is under way: new samples count towards the one after
        self.ledger = SampleLedger()  # late samples, and those held while a batch is due (ledger.py)
        self._download_pause = DOWNLOAD_RETRY_PAUSE
        self._next_download = 0.0  # monotonic time before which no catch-up is tried
        self._channel: ProgressChannel | None = None
        self._armed: Armed | None = None  # the group of the next round, forming ahead (averaging thread)
        self._arm_queued = False
        self._fingerprint: list[float] = []
        self._fingerprint_rtol = fingerprint_rtol(self._round_compression())
        self._params_changed()
        prefix = averaging_prefix(config.run_id, stage)
        ttl = PROGRESS_TTL_PERIODS * self.config.progress_period
        self._compression = installed_compression(self._round_compression())
        self._zero = self.config.zero if self.config.zero.enabled else None
        self._mailbox: Mailbox | None = None
        self._alone_since: float | None = None  # sharded: since when this server has seen no other
        self._next_round = 0.0  # sharded: monotonic time before which no round is retried
        self._round_pause = ROUND_RETRY_PAUSE
        self._failed_tries = 0  # rounds whose samples went back to try again since the last one that succeeded
        self._prefix = prefix
        if self._zero is not None:  # a round only forms the group; the collective carries the rest
            self._layout = Layout([p.shape for p in optimizer.params], self._zero.chunk_elements)
            optimizer.shards = ShardedMoments(self._layout)
            self._hyper = Hyper(config.optimizer.beta1, config.optimizer.beta2, config.optimizer.eps,
                                config.optimizer.grad_clip)
            buffers = [torch.zeros(1)]
        else:
            buffers = [torch.zeros(p.shape, dtype=torch.float32) for p in optimizer.params]
        self._process = AveragingProcess(buffers, dht, prefix=prefix, config=self.config,
                                         compression=self._compression, state_source=self._state_for_peer,
                                         declare_period=ttl, all_reduce=self._zero is None,
                                         max_weight=self.max_member_samples)
        self._counted_sent = 0  # of the averaging process's all-reduce bytes, what the metrics have
        self._count_lock = threading.Lock()  # (counted after each round, and when the metrics are read)
        self.metrics.before_scrape = self._count_sent
        self._process.start_process(start_timeout)
        self._intake = StateIntake(state, self._process, self.metrics, lambda: self._tracker.others(),
                                   self._fingerprint_rtol, self._closing, own=self._own_if_started,
                                   established=self._established, elders=lambda: self._tracker.elders())
        self._tracker = StageProgressTracker(dht, prefix, owner_key, peer_id, self.config.progress_period,
                                             self.config.request_timeout, self._own_record, self._on_progress)

    def _steps_per_round(self) -> int:
        """Optimizer steps of a server's between two rounds (what a member's samples may span)."""
        return 1

    def _round_compression(self) -> str:
        """How what rounds average travels (an averaging.compression value)."""
        return self.config.compression

    # StageStepper (every method on the backend's compute thread)
    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    def accumulate(self, grads: Sequence[torch.Tensor | None], n: int) -> None:
        """Count the samples towards the step they make, or hold them for the next if its batch is full.

        While a round runs, samples count towards the step after it however many come: holding them
        for later would make them two steps stale, and refusing them would make the servers wait.
        So a stage whose rounds take longer than a batch's compute takes larger steps (the samples
        that came during the round are in the step's stats as ``late``).
        """
        if not self._averaging and self._full(self.view()):  # a batch is due: these would make it larger
            self.ledger.hold(grads, n)
        else:
            with self.state.lock:
                self.optimizer.accumulate(grads, n)
                if self._averaging:
                    self.ledger.count_late(n)
                    self.metrics.late_samples.inc(n)
        self._tracker.nudge()

    def samples_to_step(self) -> int | None:
        """Samples the stage's batch still needs, by every server's progress (StageStepper); None while a round
        or a download runs (its samples already run on look-ahead parameters, or a state replaces them)."""
        if self._job is not None or self._averaging:
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
        return (view.needs_state and self._may_download()) or (self._full(view) and self._may_average())

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
        job = self._job
        if job is not None:
            if not job.done():
                return None
            self._job = None
            try:
                apply = job.result()  # what to apply, here on the compute thread
            except Exception:  # a bug: the batch it had is lost, training goes on
                log.exception("stage %d: an averaging job failed", self.stage)
                apply = self._end_round
            stats = apply()
            if stats is None and self.optimizer.samples > 0 and self._request_step is not None \
                    and not self._closing.is_set() and self.ready:
                # A job that made no step of ours (a round we joined with no samples, a download): the
                # samples that came meanwhile may fill a batch already, and a server training alone
                # hears of no progress that would ask again.
                self._requested = self._request_step()
            return stats
        if self._channel is None:
            self._refresh()  # decide on what the others publish now, not a period ago
        view = self.view()
        if view.needs_state and self._may_download():
            self._start_job(self._catch_up, view)
            return None
        if not self._full(view) or not self._may_average():
            return None
        sharded = self._zero is not None  # (even alone: only the chunks' owners hold their moments)
        if view.group_size == 1 and not sharded and self.optimizer.samples == 0:
            # a batch that servers ahead closed, none of it ours, and nobody here to meet: no step on
            # nothing (Adam's moments would still move the weights); the catch-up brings the stage's state
            return None
        with self.state.lock:  # the batch goes to the round; held samples start the next one
            grads, samples = self.optimizer.take_gradients()
            held, held_samples = self.ledger.start_round()
            if held is not None:  # samples held while the batch was due start the next one
                self.optimizer.accumulate(held, held_samples)
            if view.group_size > 1 or sharded:
                self._averaging = True
        if sharded:
            self._start_job(self._average_sharded, view, grads, samples)
            self._tracker.nudge()
            return None
        if view.group_size == 1:  # nobody else at this step or behind it
            return self._apply(self._mean(grads, samples), samples, LOCAL, [self.peer_id], samples)
        if self.optimizer.config.lookahead and samples > 0:  # (a round joined with no samples: nothing to go by)
            self._look_ahead(grads, samples)
        self._start_job(self._average, view, grads, samples)
        self._tracker.nudge()  # the others count our new samples towards the step after this round's
        return None

    def _full(self, view: StageView) -> bool:
        return view.closed or view.samples >= self.batch_size

    def _may_average(self) -> bool:
        return time.monotonic() >= self._next_round

    def _start_job(self, fn: Callable[..., Callable[[], Any]], *args: Any) -> None:
        self._job = self._jobs.submit(fn, *args)
        self._job.add_done_callback(self._job_done)

    def _job_done(self, _: Future) -> None:
        # (a callback, so the job counts as done for the step it asks for)
        if self._request_step is not None and not self._closing.is_set():
            self._requested = self._request_step()

    # lifecycle
    def start(self, request_step: RequestStep, channel: ProgressChannel | None = None) -> None:
        """Publish progress, serve this replica's state to peers, and ask for steps via `request_step`.

        With a `channel`, progress also goes straight to the stage's other servers and theirs comes
        straight here (see :mod:`swarm.averaging.channel`); without one, only through the DHT.
        """
        self._request_step = request_step
        if self._zero is not None:
            if channel is None:
                raise AveragingError("sharded optimizer state (averaging.zero) needs the server's P2P channel")
            mailbox = Mailbox(channel.p2p, channel.loop, self._prefix, self._layout, self.config.next_chunk_timeout)
            channel.loop.run(mailbox.open(), CHANNEL_CALL_TIMEOUT)
            self._mailbox = mailbox
        if channel is not None:
            channel.loop.run(channel.open(self._tracker.receive), CHANNEL_CALL_TIMEOUT)
            self._channel = channel
        self._tracker.start(self._channel)
        self._share_state()
        self._arm_soon()

    def shutdown(self) -> None:
        """Leave the stage's averaging: others stop counting this server at once. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._tracker.stop(leave=True)
        self._close_channel()
        self._close_mailbox()
        self._disarm()
        self._jobs.shutdown(wait=False, cancel_futures=True)  # a job under way ends soon: it watches _closing
        self._process.close()

    def state_loaded(self) -> None:
        """The replica's state was replaced from elsewhere (a checkpoint) before start(): take note of it."""
        with self.state.lock:
            self._params_changed()

    @property
    def busy(self) -> bool:
        """Whether a round or a download is under way beside compute."""
        return self._job is not None

    @property
    def process_id(self) -> int | None:
        """The pid of the averaging process (for operators, and tests that kill it)."""
        return self._process.process_id

    def view(self) -> StageView:
        """This server's view of its stage now (others as of the last progress read)."""
        own = self._own_record()
        established, elders = self._established(), self._tracker.elders()
        others = [] if self.solo else self._tracker.others()
        others = plausible(others, own.step, lone_elder(others, established, elders))
        return stage_view(own, others, self._fingerprint_rtol, established, elders)

    def _established(self) -> set[str]:
        """The stage's servers this one has watched for averaging.min_tenure (swarm.tenure)."""
        return self._tracker.established(self.config.min_tenure)

    def _own_if_started(self) -> ProgressRecord | None:
        """This server's record once it serves (a joiner's fresh weights are no vote)."""
        return self._own_record() if self._request_step is not None else None

    # rounds (on the averaging thread; each returns what the compute thread applies)
    def _average(self, view: StageView, grads: list[torch.Tensor | None], samples: int) -> Callable[[], Any]:
        started = time.monotonic()
        failure: AveragingError | None = None
        with self._in_round():
            try:
                control = self._armed_for(view)
                self._load_buffers(grads, samples)
                gathered, start_latency = self._run_round(control, samples)
                total, _ = total_samples(gathered, view.step, self.max_member_samples)
                mean = self._read_buffers()
            except AveragingError as e:
                failure = e
        self._count_sent()  # a failed round sent parts too
        if failure is not None:
            self._check_process()
            if samples > 0 and view.group_size > 1 and self._failed_tries < MAX_FAILED_TRIES:
                # Everyone else in the round failed it too, most likely (a member that left matchmaking just
                # as the group formed makes the others' all-reduce miss its part): all retrying keeps the
                # replicas equal, where each stepping alone parts them, and a catch-up then throws away the
                # work of all but one (seen in clusters at batch 128: README, Averaging)
                self._failed_tries += 1
                log.warning("stage %d: averaging for step %d failed (%s); its %d samples count towards try %d of %d",
                            self.stage, view.step + 1, failure, samples, self._failed_tries + 1,
                            MAX_FAILED_TRIES + 1)
                return functools.partial(self._try_again, grads, samples)
            log.warning("stage %d: averaging for step %d failed (%s); stepping on this server's %d samples alone",
                        self.stage, view.step + 1, failure, samples)
            if samples == 0:  # nothing of our own to step on: wait to catch up
                return self._end_round
            return functools.partial(self._apply, self._mean(grads, samples), samples, FAILED, [self.peer_id], samples)
        group = len(gathered)
        self.metrics.group_size.set(group)
        log.debug("stage %d: averaged %d samples over %d servers in %.3fs (group formed after %.3fs)", self.stage,
                  total, group, time.monotonic() - started, start_latency)
        return functools.partial(self._apply, mean, total, SUCCEEDED, [peer.to_base58() for peer in gathered],
                                 samples)

    @contextlib.contextmanager
    def _in_round(self) -> Iterator[None]:
        """A round's network part, counted in the round metrics (in progress while it runs, and its time)."""
        started = time.monotonic()
        self.metrics.in_round.set(1)
        try:
            yield
        finally:
            self.metrics.in_round.set(0)
            self.metrics.round_seconds.observe(time.monotonic() - started)

    def _meet(self, view: StageView, samples: int, extra: dict[str, Any]) -> tuple[dict[Any, Any], float]:
        """Form this round's group with the servers at our step now (a sharded round, whose gather data
        says what each member holds): each member's gather data (ours: step, samples, late samples and
        `extra`), and the round's start latency."""
        control = self._process.arm(view.step, view.group_size,
                                    {"step": view.step, "samples": samples, "late": self.ledger.late_in_round, **extra},
                                    view.members)
        return self._run_round(control, samples)

    def _run_round(self, control: StepControl, samples: int) -> tuple[dict[Any, Any], float]:
        gathered, start_latency = self._process.run_round(control, float(samples), self._closing,
                                                          lambda: self.view().group_size == 1)
        self.metrics.round_start_seconds.observe(start_latency)
        return gathered, start_latency

    def _apply(self, mean: list[torch.Tensor | None], samples: int, outcome: str, members: list[str],
               own: int) -> dict[str, Any]:
        """Step on the stage's mean gradient (compute thread): the same math on every member of the round.

        `own`: how many of the `samples` were this server's (``own_late`` of them came while the round
        before ran).
        """
        with self.state.lock:
            self.state.leave_look_ahead()
            if outcome == SUCCEEDED:
                self._failed_tries, self._round_pause = 0, ROUND_RETRY_PAUSE
            elif outcome == FAILED:  # no more tries until a round succeeds: a stage whose rounds keep failing
                self._failed_tries = MAX_FAILED_TRIES  # pays them once, not at every step
            self.metrics.rounds[outcome].inc()  # (first: whoever sees the step sees how it was made)
            stats = self.optimizer.step_with(mean, samples)
            if not stats["skipped"]:  # (a non-finite gradient: every member skips alike)
                self.state.set_round(round_of(self.optimizer.step_count, members), len(members))
            self._averaging = False
            self._params_changed()
        self._after_step()
        return {**stats, "averaging": outcome, "group_size": len(members), "own_samples": own,
                "own_late": self.ledger.own_late(own)}

    def _count_sent(self) -> None:
        """Add what the averaging process's all-reduce sent since the last count to the metrics."""
        with self._count_lock:
            total = self._process.all_reduce_bytes.value
            sent, self._counted_sent = total - self._counted_sent, total
            if sent:
                self.metrics.sent(sent)

    def _try_again(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """A failed round's batch goes back to the accumulation, to try again after a pause (compute thread)."""
        self.metrics.retried.inc()
        self._put_back(grads, samples)

    def _put_back(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """A failed round's samples count towards the next try, after a pause that doubles with each failure."""
        with self.state.lock:
            self.state.leave_look_ahead()
            if samples > 0:
                self.optimizer.accumulate(grads, samples)
            self.ledger.round_failed()
            self._averaging = False
        self._next_round = time.monotonic() + self._round_pause
        self._round_pause = min(2 * self._round_pause, ROUND_RETRY_PAUSE_MAX)
        self._tracker.nudge()

    def _end_round(self) -> None:
        with self.state.lock:
            self.state.leave_look_ahead()
            self._averaging = False
        self._tracker.nudge()

    def _look_ahead(self, grads: list[torch.Tensor | None], samples: int) -> None:
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
    def _mean(grads: list[torch.Tensor | None], samples: int) -> list[torch.Tensor | None]:
        with torch.no_grad():
            return [None if g is None else g.div_(samples) for g in grads]

    def _after_step(self) -> None:
        self._count_state_bytes()
        self._share_state()
        self._tracker.nudge()
        self._arm_soon()

    def _count_state_bytes(self) -> None:
        shards = self.optimizer.shards
        sharded = shards.nbytes if shards is not None else 0
        self.metrics.optimizer_state_bytes.set(sharded + self.optimizer.state_bytes())
        self.metrics.chunks_owned.set(len(shards.chunks) if shards is not None else 0)

    def _params_changed(self) -> None:
        """Fingerprint the parameters just made (call with the state lock held, or before start)."""
        self._fingerprint = param_fingerprint(self.state.shared_params)
        for part, value in zip(("sum", "sum_of_squares"), self._fingerprint):
            self.metrics.fingerprint.labels(stage=str(self.stage), part=part).set(value)

    @property
    def held_samples(self) -> int:
        """Samples held apart while the stage's batch was due (they start the next one)."""
        return self.ledger.held_samples

    def _load_buffers(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """Our mean gradient into the averaging buffers (zeros if we have no samples: weight 0)."""
        with self._process.buffers() as buffers, torch.no_grad():
            for grad, buffer in zip(grads, buffers):
                if grad is None or samples == 0:
                    buffer.zero_()
                else:
                    torch.div(grad, samples, out=buffer)

    def _read_buffers(self) -> list[torch.Tensor]:
        with self._process.buffers() as buffers:
            return [buffer.clone() for buffer in buffers]

    # progress
    def _own_record(self) -> ProgressRecord:
        with self.state.lock:  # one moment's step, samples and round, not either side of a step
            step, samples, round_, group, fingerprint, averaging = (
                self.state.step, self._published_samples(), self.state.round_id, self.state.group,
                self._fingerprint, self._averaging)
        return ProgressRecord(peer_id=self.peer_id, step=step, samples=samples, round_id=round_, group=group,
                              priority=sharing_priority(step, group, round_, self.peer_id),
                              fingerprint=fingerprint, averaging=averaging)

    def _published_samples(self) -> int:
        """The samples this server's record says it brings towards the stage's next round."""
        return self.optimizer.samples

    def _refresh(self) -> None:
        if not self.solo:
            try:
                self._tracker.refresh()
            except Exception as e:  # a DHT hiccup: decide on the last view
                log.debug("stage %d: progress refresh failed: %s", self.stage, e)

    def _close_mailbox(self) -> None:
        mailbox, self._mailbox = self._mailbox, None
        if mailbox is not None and mailbox.loop.is_running:
            try:
                mailbox.loop.run(mailbox.close(), CHANNEL_CALL_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - leaving anyway
                log.debug("closing the sharded-round handler: %s", e)

    def _close_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and channel.loop.is_running:
            try:
                channel.loop.run(channel.close(), CHANNEL_CALL_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - leaving anyway
                log.debug("closing the progress channel: %s", e)

    def _check_process(self) -> None:
        """If the averaging process died, leave the stage's averaging for good and train alone.

        Peers would otherwise keep waiting for this server in their rounds, and keep trying to
        download a state it can no longer serve.
        """
        if self.solo or self._closing.is_set() or self._process.is_alive():
            return
        self.solo = True
        self._disarm()
        self._tracker.stop(leave=True)
        self._close_channel()
        code = self._process.exitcode
        stopped = code in (-signal.SIGTERM, -signal.SIGINT)  # most likely with this whole peer
        log.log(logging.WARNING if stopped else logging.ERROR,
                "stage %d: the averaging process %s; this server leaves its stage's averaging and steps on its own "
                "samples from now on: restart it to average again", self.stage,
                f"was stopped by signal {-code}" if stopped else f"died (exit code {code})")

    def _on_progress(self) -> None:
        self._check_process()
        armed = self._armed
        if self._job is None and (armed is None or armed.size != self._group_target(self.view())):
            self._arm_soon()  # (a server of the stage came or went: form the group of the next round anew)
        if self._request_step is None or (self._requested is not None and not self._requested.done()):
            return
        if self.ready:
            self._requested = self._request_step()

