"""Sharded rounds (averaging.zero): StageAverager's steps when the stage's AdamW moments are sharded.

The group forms as for averaging (StageAverager._meet); then swarm.averaging.collective reduce-scatters
the gradients to the chunks' owners, who step them, and all-gathers the updates; the compute thread
applies the step. A failed round changes nothing: its samples count towards the next try, after a pause.
A chunk whose owners disagreed (swarm.averaging.crosscheck) stays as it was before the round, and the
owners' peer ids are logged.
A mixin: it uses StageAverager's state (its config, metrics, locks, process and mailbox).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from swarm.averaging.crosscheck import summary
from swarm.averaging.errors import AveragingError
from swarm.averaging.metrics import FAILED, LOCAL, SUCCEEDED
from swarm.averaging.process import total_samples
from swarm.averaging.progress import StageView, round_of
from swarm.averaging.zero_round import RoundResult, run_round
from swarm.zero import MemberInfo, Plan, PlanError, make_plan

log = logging.getLogger(__name__)

ROUND_RETRY_PAUSE = 0.25  # first pause before a failed round's batch tries again; doubles up to the max
ROUND_RETRY_PAUSE_MAX = 8.0
ALONE_GRACE_ROUNDS = 3  # matchmaking timeouts a server alone waits before stepping on the chunks it holds


class ShardedRounds:
    """StageAverager's sharded rounds (see the module's docstring)."""

    def _average_sharded(self, view: StageView, grads: list[torch.Tensor | None], samples: int) -> Callable[[], Any]:
        """A sharded round (averaging thread): the group forms as for averaging, then the collective
        (swarm.averaging.collective) reduce-scatters gradients to the chunks' owners, who step them, and
        all-gathers the updates. Alone, the same math without the network."""
        failure: Exception | None = None
        with self._in_round():
            try:
                plan, late, result = self._sharded_round(view, grads, samples)
            except (AveragingError, PlanError) as e:
                failure = e
        if failure is not None:
            self._check_process()
            log.warning("stage %d: sharded round for step %d failed (%s); its %d samples count towards the next try",
                        self.stage, view.step + 1, failure, samples)
            return functools.partial(self._retry_later, grads, samples)
        outcome = SUCCEEDED if len(plan.members) > 1 else LOCAL
        return functools.partial(self._apply_sharded, result, plan, outcome, late, samples)

    def _apply_sharded(self, result: RoundResult, plan: Plan, outcome: str, late: int, own: int) -> dict[str, Any]:
        """Apply a sharded round's update (compute thread): the same on every member; keep the moments of
        the chunks this server owns now. `late` of the round's samples came while the round before ran;
        `own` were this server's."""
        shards = self.optimizer.shards
        self._round_pause = ROUND_RETRY_PAUSE
        samples = sum(min(n, self.max_member_samples) for n in plan.samples.values())  # (as the round counted them)
        with self.state.lock:
            self.metrics.rounds[outcome].inc()  # (first: whoever sees the step sees how it was made)
            if result.update is None:  # a non-finite gradient norm: every member skips alike
                stats = {"step": self.optimizer.step_count, "lr": 0.0, "grad_norm": result.grad_norm,
                         "samples": samples, "skipped": True}
            else:
                kept = self._layout.flatten(self.optimizer.params) if result.dropped else None
                stats = self.optimizer.step_sharded(result.update, samples, result.grad_norm)
                if kept is not None:  # (weight decay too: a dropped chunk is exactly as it was)
                    self._restore_chunks(kept, result.dropped)
                shards.replace(result.moments, self.optimizer.step_count)
                self.state.set_round(round_of(self.optimizer.step_count, list(plan.members)), len(plan.members))
            self._averaging = False
            self._params_changed()
        if result.fresh and plan.step > 0:
            self.metrics.chunks_reinitialized.inc(len(result.fresh))
            log.warning("stage %d: %d chunks of the optimizer state had no live holder at step %d (every owner "
                        "left): their moments start again from zero", self.stage, len(result.fresh), plan.step)
        for line in summary(result.disputes, self.peer_id):
            log.warning("stage %d: step %d: %s", self.stage, plan.step + 1, line)
        if result.capped:
            log.warning("stage %d: step %d: %s claimed more than %d samples: counted as that many", self.stage,
                        plan.step + 1, result.capped, self.max_member_samples)
        for member, count in result.left_out.items():
            log.warning("stage %d: step %d: left out %d chunks of %s's gradient (non-finite values)", self.stage,
                        plan.step + 1, count, member)
        if result.refused_moments:
            log.warning("stage %d: step %d: refused the moments of %d chunks from %s: a co-owner's differ, or no "
                        "AdamW could have made them",
                        self.stage, plan.step + 1, len(result.refused_moments),
                        sorted({plan.primary[c] for c in result.refused_moments}))
        self.metrics.chunk_transfers["received"].inc(result.transfers_in)
        self.metrics.chunk_transfers["sent"].inc(result.transfers_out)
        self.metrics.sent(result.bytes_sent)
        self.metrics.group_size.set(len(plan.members))
        self._after_step()
        return {**stats, "averaging": outcome, "group_size": len(plan.members), "late": late,
                "own_samples": own, "own_late": self.ledger.own_late(own)}

    def _restore_chunks(self, kept: torch.Tensor, chunks: list[int]) -> None:
        """Put the parameters of `chunks` back to their values in `kept` (flat, as Layout.flatten gives)."""
        params = self.optimizer.params
        flat = self._layout.flatten(params)
        for c in chunks:
            start, end = self._layout.bounds(c)
            flat[start:end] = kept[start:end]
        with torch.no_grad():
            for param, view in zip(params, self._layout.views(flat)):
                param.copy_(view)

    def _check_alone(self, step: int, held: frozenset[int]) -> None:
        """A server that sees no other may step alone only on moments it holds whole, or once it has been alone
        for ALONE_GRACE_ROUNDS matchmaking timeouts: until then the others may only be unseen for a moment,
        and stepping would restart the moments of the chunks they own."""
        if step == 0 or len(held) == self._layout.num_chunks:
            return
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        waited = now - self._alone_since
        if waited < ALONE_GRACE_ROUNDS * self.config.matchmaking_timeout:
            raise PlanError(f"no other server of the stage is seen and this one holds {len(held)} of "
                            f"{self._layout.num_chunks} chunks of the moments (alone for {waited:.0f}s)")

    def _retry_later(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """A sharded round failed (compute thread): its samples go back to the accumulation for the next try
        (a replica cannot step on its own where others hold the moments)."""
        self.metrics.rounds[FAILED].inc()
        self._put_back(grads, samples)

    def _sharded_round(self, view: StageView, grads: list[torch.Tensor | None],
                       samples: int) -> tuple[Plan, int, RoundResult]:
        """Meet the group (or find this server alone), plan the round, and run it: (plan, late samples, result)."""
        shards = self.optimizer.shards
        held = shards.held_at(view.step)
        info = MemberInfo(view.step, samples, self._layout.hash, held)
        if view.group_size > 1:
            gathered, _ = self._meet(view, samples, {"zero": info.to_wire()})
            _, late = total_samples(gathered, view.step)
            infos = {peer.to_base58(): MemberInfo.from_wire(data.get("zero"), self._layout.num_chunks)
                     for peer, data in gathered.items()}
            group_ids = {data.get("group_id") for data in gathered.values()}
            round_key = f"{view.step}:{group_ids.pop() if len(group_ids) == 1 else ''}"
        else:
            self._check_alone(view.step, held)
            infos, late, round_key = {self.peer_id: info}, self.ledger.late_in_round, f"{view.step}:alone"
        plan = make_plan(self._layout, infos, self._zero.replicas)
        if self.peer_id not in plan.members:
            raise PlanError("this server is not among the round's members")
        if len(plan.members) > 1:
            self._alone_since = None
        result = run_round(self._mailbox, round_key, plan, self.peer_id, self._layout.flatten(grads),
                           shards.chunks if held else {}, self._hyper,
                           time.monotonic() + self.config.allreduce_timeout, self.max_member_samples)
        return plan, late, result
