"""The hosts of one expert stay equal: they average its parameters every ``averaging.expert_replica_period``.

Why the hosts of an expert part: every micro-batch's backward goes to every host of the block, so
replicas of an expert take the same gradients and step together, until one misses a backward (a failed
call, a restart, the seconds between taking its state and being listed by the stage servers); nothing
else brings it back to its peers.

Why periods and not steps: a host steps an expert when a backward of the next batch reaches it, so a
host that missed that one steps later, and a round keyed by the step could wait for a host that is not
there yet. Rounds are keyed by the wall-clock period instead (the n-th since the epoch, in the group
key), so whoever hosts the expert now meets in the same round; a host whose clock is off by more than
the matchmaking window misses rounds (each failed round is logged).

What is averaged: the expert's parameters in every MoE block (one flat float32 tensor per block:
identical lists on every host of the expert), uncompressed, so the means are the same on every member
up to float rounding. AdamW's moments stay each host's own, as the inner optimizer's do in local SGD
(DiLoCo): they estimate each host's own gradients, the parameters are the model. A host joining an
expert downloads its whole state (parameters, moments, step) from a live host through the same
averaging process (hivemind's state sharing), checked by ExpertState.load_state_dict before it
replaces anything.

Applying a round: it averages a snapshot; the host then adds (mean - snapshot) to its parameters on
its worker thread, so a step taken while the round ran is kept. A round that fails, or whose mean is
not finite, changes nothing. Members weigh equally (a weight claimed above 1 counts as 1), and the
reducers aggregate with the stages' CenteredClip (swarm.averaging.robust): with three or more hosts an
outlier moves the mean by at most its share of the clip radius; two cannot be told apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from swarm.averaging.codecs import installed_compression
from swarm.averaging.process import AveragingProcess, RoundFailed
from swarm.config import AveragingConfig
from swarm.dht import SwarmRecords, online
from swarm.dht.keys import expert_averaging_prefix
from swarm.experts import ExpertState
from swarm.state import StateRejected, flatten, unflatten

log = logging.getLogger("swarm.expert")

HOST_CALL_TIMEOUT = 60.0  # a snapshot or an update, queued behind the host's tasks
DOWNLOAD_RETRY_PAUSE = 1.0  # seconds before asking the donors again when none sent a state
MATCHMAKING_SHARE = 0.1  # the last tenth of a period is kept free of matchmaking (see ExpertReplicas.average)
DOWNLOAD_TRIES = 3  # asks of the donors for one expert's state (each a few seconds when they are gone)


class ExpertReplicas:
    """The averaging of one expert (`state`) with its other hosts; its state offered to hosts joining it."""

    def __init__(self, state: ExpertState, dht: Any, records: SwarmRecords, settings: AveragingConfig, *,
                 run_id: str, announce_period: float, peer_id: str, counter: Any = None):
        """Forks the averaging process (`wait_started` waits until it serves: the processes of a server's
        experts start side by side). `settings`: the run's averaging section."""
        self.state, self.records, self.peer_id = state, records, peer_id
        self.expert = state.stage
        self.period = settings.expert_replica_period
        self.config = settings
        host = state.host
        buffers = [torch.zeros(sum(p.numel() for p in host.optimizers[layer, self.expert].params))
                   for layer in host.layers]
        self.process = AveragingProcess(buffers, dht, prefix=expert_averaging_prefix(run_id, self.expert),
                                        config=self.config, compression=installed_compression("none"),
                                        state_source=self._state_for_peer,
                                        declare_period=max(self.period, announce_period),
                                        max_weight=1.0)
        self.process.launch()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = {"succeeded": 0, "failed": 0}  # for tests; `counter` (a Prometheus one) for operators
        self._counter = counter

    def wait_started(self, timeout: float) -> None:
        self.process.wait_started(timeout)

    # joining
    def download(self, donors: Sequence[str], timeout: float) -> int | None:
        """Take the expert's state from the first of `donors` (peer ids, best first) that sends one that fits;
        the step it is at, or None. Runs before the host is handed to its worker thread.

        Each of DOWNLOAD_TRIES tries is bounded on its own (a donor that never answers costs one try, not the
        whole `timeout`); one that got nothing (no offer in the DHT yet, or every donor failed) is made again
        a moment later."""
        left, deadline = list(donors), time.monotonic() + timeout
        attempt = 2 * self.config.next_chunk_timeout + self.config.request_timeout
        for _ in range(DOWNLOAD_TRIES):
            if not left or time.monotonic() >= deadline or self._stop.is_set():
                break
            started = time.monotonic()
            # a sender of more than an honest state's bytes is cut off (and the next one asked)
            got = self.process.download_state(min(attempt, deadline - started), self._stop, only=left,
                                              max_bytes=self.state.nbytes() + 2**16)
            if got is None:
                log.info("expert %d: no state from %d host(s) within %.1fs; trying again", self.expert, len(left),
                         time.monotonic() - started)
                self._stop.wait(DOWNLOAD_RETRY_PAUSE)
                continue
            metadata, tensors, peer = got
            left = [donor for donor in left if donor != peer]
            try:
                info, named = unflatten(metadata, tensors)
                self.state.load_state_dict(info, named)
            except StateRejected as e:
                log.warning("expert %d: the state %s sent does not fit (%s)", self.expert, peer, e)
                continue
            log.info("expert %d: state of step %d taken from %s", self.expert, info.step, peer)
            return info.step
        return None

    def _state_for_peer(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        # on a thread of hivemind's, when a peer downloads: read between two tasks on the host's worker
        return flatten(*self.state.host.submit(self.state.state_dict).result(HOST_CALL_TIMEOUT))

    # averaging
    def start(self) -> None:
        """Offer the state to joiners, and average every period (if the period is not 0)."""
        self.process.share_state(True)
        if self.period > 0:
            self._thread = threading.Thread(target=self._average_forever, name=f"replicas{self.expert}", daemon=True)
            self._thread.start()

    def _average_forever(self) -> None:
        while not self._stop.wait(self.period - time.time() % self.period):
            index = round(time.time() / self.period)  # the boundary just reached (a wait may end a hair early)
            others = self.other_hosts()
            if not others:
                continue
            outcome = "failed"
            try:
                self.average(index, others)
                outcome = "succeeded"
                log.debug("expert %d: round %d with %d other host(s) done", self.expert, index, len(others))
            except RoundFailed as e:
                log.info("expert %d: round %d with %d other host(s) failed: %s", self.expert, index, len(others), e)
            except Exception as e:  # noqa: BLE001 - the host shutting down, a closed process: the next period tries again
                log.warning("expert %d: averaging round %d failed: %s", self.expert, index, e)
            self.rounds[outcome] += 1
            if self._counter is not None:
                self._counter.labels(expert=str(self.expert), outcome=outcome).inc()

    def other_hosts(self) -> list[str]:
        """The peer ids of the expert's other ONLINE hosts, as the DHT says now."""
        hosts = online(self.records.lookup_expert_hosts(), other_than=self.peer_id)
        return sorted(r.peer_id for r in hosts if self.expert in r.experts)

    def average(self, index: int, others: Sequence[str]) -> None:
        """One round (`index`: the period, in the group key) with the hosts `others`; RoundFailed changes nothing."""
        host = self.state.host
        snapshot = host.submit(self._parameters).result(HOST_CALL_TIMEOUT)
        with self.process.buffers() as buffers:
            for buffer, values in zip(buffers, snapshot):
                buffer.copy_(values)
        # The group must form before the next period begins: a host whose round still looks for a group then
        # (its matchmaking_timeout longer than the period) would start its next round a period after the others
        # started theirs, and hosts failing that way in turn were seen to miss each other for a minute on end
        window = min(self.config.matchmaking_timeout, (index + 1 - MATCHMAKING_SHARE) * self.period - time.time())
        if window <= 0:
            raise RoundFailed(f"period {index} had no time left to form a group")
        control = self.process.arm(index, len(others) + 1, {"step": index}, others, matchmaking_timeout=window)
        self.process.run_round(control, 1.0, self._stop, nobody_left=lambda: False)
        with self.process.buffers() as buffers:
            mean = [buffer.clone() for buffer in buffers]
        if not all(torch.isfinite(t).all() for t in mean):
            raise RoundFailed("the mean is not finite")
        host.submit(self._apply, snapshot, mean).result(HOST_CALL_TIMEOUT)

    def _parameters(self) -> list[torch.Tensor]:
        host = self.state.host
        return [torch.cat([p.detach().reshape(-1) for p in host.optimizers[layer, self.expert].params])
                for layer in host.layers]

    def _apply(self, snapshot: list[torch.Tensor], mean: list[torch.Tensor]) -> None:
        # on the host's worker thread: what the round moved, added to what the parameters are now
        host = self.state.host
        with torch.no_grad():
            for layer, before, after in zip(host.layers, snapshot, mean):
                params = host.optimizers[layer, self.expert].params
                for p, delta in zip(params, (after - before).split([p.numel() for p in params])):
                    p.add_(delta.view_as(p))

    def stop(self) -> None:
        """Stop averaging (a round under way gives up); the state is no longer offered once closed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.config.matchmaking_timeout + self.config.allreduce_timeout
                              + self.config.request_timeout + HOST_CALL_TIMEOUT)

    def close(self) -> None:
        self.stop()
        self.process.close()

