"""StateIntake: states that come from the stage's other servers, and the checks before one is used.

A download goes to the best-ranked server (by its signed progress record) that offers its state,
skipping servers whose state was refused lately, and a server may send at most about twice this
stage's state in bytes. What comes is checked here for what only the stage can vouch for
(progress.backs_state): its sender must be an established server of the stage (watched for
averaging.min_tenure), its step must not lie beyond what most established servers publish in their
(signed) progress records, this server's own counted, and its parameters must be those most
established servers at its step publish (their fingerprints), at least one of them besides the
sender unless the stage has only the two; then the sender must have served the stage before this
server did (progress.seniors: the elder leads). StageState.check then holds it to this replica's
names, shapes and dtypes, and finite values. A refused state is logged with its reason and its
sender is not asked again for REFUSED_PEER_SECONDS (UNBACKED_PEER_SECONDS if only the stage's
records did not back it: they change); one that came incomplete (its stream ended early, which
happens between healthy peers here) only for INCOMPLETE_PEER_SECONDS, since the sender may well be
the only one that holds the stage's state.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from swarm.averaging.metrics import FAILED, AveragingMetrics
from swarm.averaging.process import AveragingProcess
from swarm.averaging.progress import ProgressRecord, backs_state, param_fingerprint
from swarm.state import StageState, StateIncomplete, StateInfo, StateRejected, StateUnbacked, unflatten

log = logging.getLogger(__name__)

REFUSED_PEER_SECONDS = 300.0  # a peer whose state failed its checks is not asked again for this long
# nor one whose state the stage's records did not back, for this long: the records change (a dead server's expires,
# a round ends), and an honest peer refused for a moment must not stay refused for minutes
UNBACKED_PEER_SECONDS = 15.0
INCOMPLETE_PEER_SECONDS = 5.0  # nor one whose state came incomplete, for this long

Loaded = tuple[Any, list[torch.Tensor], str]  # (metadata, tensors, the peer that sent them)


class StateIntake:
    """Downloads a stage's state from its servers and vets what comes (see the module docstring)."""

    def __init__(self, state: StageState, process: AveragingProcess, metrics: AveragingMetrics,
                 others: Callable[[], Sequence[ProgressRecord]], fingerprint_rtol: float, closing: threading.Event,
                 own: Callable[[], ProgressRecord | None], established: Callable[[], Collection[str]],
                 elders: Callable[[], Collection[str]] | None = None):
        self.state, self.process, self.metrics, self.others = state, process, metrics, others
        self.own, self.established, self.elders = own, established, elders
        self.rtol, self.closing = fingerprint_rtol, closing
        self.max_bytes = 2 * state.nbytes() + 2**20
        self._refused: dict[str, float] = {}  # peer id -> monotonic time until which its state is not asked for

    def fetch(self, timeout: float) -> Loaded | None:
        """A state from the best-ranked established server not refused lately; None if none came within
        `timeout`, or if no server of the stage is established yet (then nothing is downloaded)."""
        now = time.monotonic()
        refused = [peer for peer, until in self._refused.items() if until > now]
        sources = self.established()
        if not sources:
            return None
        ranks = {record.peer_id: record.priority for record in self.others()}
        ranked = sorted(sources, key=lambda peer: (-ranks.get(peer, -math.inf), peer))  # best-ranked first
        loaded = self.process.download_state(timeout, self.closing, refused, self.max_bytes, only=ranked)
        if loaded is None:
            self.metrics.downloads[FAILED].inc()
        return loaded

    def vet(self, loaded: Loaded) -> tuple[StateInfo, dict[str, Any]]:
        """What a state says it is and its tensors, if the stage's established servers back it
        (progress.backs_state); else StateRejected."""
        metadata, tensors, sender = loaded
        info, named = unflatten(metadata, tensors)
        fingerprint = param_fingerprint(self.state.params_of(named))
        problem = backs_state(sender, info.step, fingerprint, self.own(), self.others(), self.established(),
                              self.rtol, None if self.elders is None else self.elders())
        if problem is not None:
            raise StateUnbacked(problem)
        return info, named

    def refuse(self, loaded: Loaded, problem: StateRejected) -> StateRejected:
        """Count and log a refused state, skip its sender for a while; the error to raise."""
        peer = loaded[2]
        self.metrics.downloads[FAILED].inc()
        if isinstance(problem, StateIncomplete):
            self._refused[peer] = time.monotonic() + INCOMPLETE_PEER_SECONDS
            log.warning("stage %d: the state %s sent came incomplete (%s); will ask again", self.state.stage, peer,
                        problem)
            return problem
        self.metrics.rejected_states.inc()
        pause = UNBACKED_PEER_SECONDS if isinstance(problem, StateUnbacked) else REFUSED_PEER_SECONDS
        self._refused[peer] = time.monotonic() + pause
        log.warning("stage %d: refused the state %s sent: %s", self.state.stage, peer, problem)
        return StateRejected(f"{peer} sent a state that failed its checks: {problem}")
