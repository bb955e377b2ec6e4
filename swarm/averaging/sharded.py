"""Sharded rounds (averaging.zero): a stage's rounds when its AdamW moments are sharded (a Round, rounds.py).

The group forms as for averaging (ShardedRound.meet); then swarm.averaging.collective reduce-scatters
the gradients to the chunks' owners, who step them, and all-gathers the updates; the compute thread
applies the step. A failed round changes nothing: its samples count towards the next try, after a pause.
A chunk whose owners disagreed (swarm.averaging.crosscheck) stays as it was before the round, and the
owners' peer ids are logged. The round owns the layout of the chunks, the hyperparameters the owners
step with, and the mailbox the collective's messages come through.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch

from swarm.averaging.collective import Hyper, Mailbox
from swarm.averaging.crosscheck import summary
from swarm.averaging.errors import AveragingError
from swarm.averaging.metrics import FAILED, LOCAL, SUCCEEDED
from swarm.averaging.process import total_samples
from swarm.averaging.progress import StageView, round_of
from swarm.averaging.rounds import Apply, Phase, Round
from swarm.averaging.zero_round import RoundResult, run_round
from swarm.zero import Layout, MemberInfo, Plan, PlanError, ShardedMoments, make_plan

log = logging.getLogger(__name__)

ALONE_GRACE_ROUNDS = 3  # matchmaking timeouts a server alone waits before stepping on the chunks it holds
CHANNEL_CALL_TIMEOUT = 10.0  # registering or removing the collective's handler


class ShardedRound(Round):
    """A stage's rounds with sharded moments (see the module's docstring)."""

    forms_ahead = False  # (a round meets with what each member holds now: MemberInfo)

    def __init__(self, host, zero):
        super().__init__(host)
        self.zero = zero  # the averaging.zero section
        optimizer = host.optimizer
        self.layout = Layout([p.shape for p in optimizer.params], zero.chunk_elements)
        optimizer.shards = ShardedMoments(self.layout)
        opt = host.run_optimizer
        self.hyper = Hyper(opt.beta1, opt.beta2, opt.eps, opt.grad_clip)
        self.mailbox: Mailbox | None = None
        self.alone_since: float | None = None  # since when this server has seen no other

    def buffers(self) -> list[torch.Tensor]:
        return [torch.zeros(1)]  # (the collective carries the gradients, not hivemind's all-reduce)

    @property
    def all_reduce(self) -> bool:
        return False

    def open(self, channel) -> None:
        if channel is None:
            raise AveragingError("sharded optimizer state (averaging.zero) needs the server's P2P channel")
        mailbox = Mailbox(channel.p2p, channel.loop, self.host.prefix, self.layout, self.host.config.next_chunk_timeout)
        channel.loop.run(mailbox.open(), CHANNEL_CALL_TIMEOUT)
        self.mailbox = mailbox

    def close(self) -> None:
        mailbox, self.mailbox = self.mailbox, None
        if mailbox is not None and mailbox.loop.is_running:
            try:
                mailbox.loop.run(mailbox.close(), CHANNEL_CALL_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - leaving anyway
                log.debug("closing the sharded-round handler: %s", e)

    def start(self, view: StageView) -> None:
        """Even alone, the round runs beside compute: only the chunks' owners hold their moments."""
        host = self.host
        grads, samples = host.take_batch(in_round=True)
        host.start_job(self.run, view, grads, samples)
        host.tracker.nudge()

    def run(self, view: StageView, grads: list[torch.Tensor | None], samples: int) -> Apply:
        """The network part (averaging thread): the group forms as for averaging, then the collective
        (swarm.averaging.collective) reduce-scatters gradients to the chunks' owners, who step them, and
        all-gathers the updates. Alone, the same math without the network."""
        host = self.host
        failure: Exception | None = None
        with host.in_round():
            try:
                plan, late, result = self._round(view, grads, samples)
            except (AveragingError, PlanError) as e:
                failure = e
        if failure is not None:
            host.check_process()
            log.warning("stage %d: sharded round for step %d failed (%s); its %d samples count towards the next try",
                        host.stage, view.step + 1, failure, samples)
            return functools.partial(self.retry_later, grads, samples)
        outcome = SUCCEEDED if len(plan.members) > 1 else LOCAL
        return functools.partial(self.apply, result, plan, outcome, late, samples)

    def apply(self, result: RoundResult, plan: Plan, outcome: str, late: int, own: int) -> dict[str, Any]:
        """Apply a sharded round's update (compute thread): the same on every member; keep the moments of
        the chunks this server owns now. `late` of the round's samples came while the round before ran;
        `own` were this server's."""
        host = self.host
        optimizer, state, metrics = host.optimizer, host.state, host.metrics
        shards = optimizer.shards
        host.retries.succeeded()
        samples = sum(min(n, host.max_member_samples) for n in plan.samples.values())  # (as the round counted them)
        with state.lock:
            metrics.rounds[outcome].inc()  # (first: whoever sees the step sees how it was made)
            if result.update is None:  # a non-finite gradient norm: every member skips alike
                stats = {"step": optimizer.step_count, "lr": 0.0, "grad_norm": result.grad_norm,
                         "samples": samples, "skipped": True}
            else:
                kept = self.layout.flatten(optimizer.params) if result.dropped else None
                stats = optimizer.step_sharded(result.update, samples, result.grad_norm)
                if kept is not None:  # (weight decay too: a dropped chunk is exactly as it was)
                    self._restore_chunks(kept, result.dropped)
                shards.replace(result.moments, optimizer.step_count)
                state.set_round(round_of(optimizer.step_count, list(plan.members)), len(plan.members))
            host.enter(Phase.COLLECTING)
            host.params_changed()
        stage, step = host.stage, plan.step + 1
        if result.fresh and plan.step > 0:
            metrics.chunks_reinitialized.inc(len(result.fresh))
            log.warning("stage %d: %d chunks of the optimizer state had no live holder at step %d (every owner "
                        "left): their moments start again from zero", stage, len(result.fresh), plan.step)
        for line in summary(result.disputes, host.peer_id):
            log.warning("stage %d: step %d: %s", stage, step, line)
        if result.capped:
            log.warning("stage %d: step %d: %s claimed more than %d samples: counted as that many", stage, step,
                        result.capped, host.max_member_samples)
        for member, count in result.left_out.items():
            log.warning("stage %d: step %d: left out %d chunks of %s's gradient (non-finite values)", stage, step,
                        count, member)
        if result.refused_moments:
            log.warning("stage %d: step %d: refused the moments of %d chunks from %s: a co-owner's differ, or no "
                        "AdamW could have made them", stage, step, len(result.refused_moments),
                        sorted({plan.primary[c] for c in result.refused_moments}))
        metrics.chunk_transfers["received"].inc(result.transfers_in)
        metrics.chunk_transfers["sent"].inc(result.transfers_out)
        metrics.sent(result.bytes_sent)
        metrics.group_size.set(len(plan.members))
        host.after_step()
        return {**stats, "averaging": outcome, "group_size": len(plan.members), "late": late,
                "own_samples": own, "own_late": host.ledger.own_late(own)}

    def retry_later(self, grads: list[torch.Tensor | None], samples: int) -> None:
        """A sharded round failed (compute thread): its samples go back to the accumulation for the next try
        (a replica cannot step on its own where others hold the moments)."""
        self.host.metrics.rounds[FAILED].inc()
        self.host.put_back(grads, samples)

    def meet(self, view: StageView, samples: int, extra: dict[str, Any]) -> tuple[dict[Any, Any], float]:
        """Form this round's group with the servers at our step now, with gather data that says what each
        member holds: each member's gather data (ours: step, samples, late samples and `extra`), and the
        round's start latency."""
        host = self.host
        control = host.process.arm(view.step, view.group_size,
                                   {"step": view.step, "samples": samples, "late": host.ledger.late_in_round,
                                    **extra}, view.members)
        return host.run_round(control, samples)

    def _restore_chunks(self, kept: torch.Tensor, chunks: list[int]) -> None:
        """Put the parameters of `chunks` back to their values in `kept` (flat, as Layout.flatten gives)."""
        params = self.host.optimizer.params
        flat = self.layout.flatten(params)
        for c in chunks:
            start, end = self.layout.bounds(c)
            flat[start:end] = kept[start:end]
        with torch.no_grad():
            for param, view in zip(params, self.layout.views(flat)):
                param.copy_(view)

    def _check_alone(self, step: int, held: frozenset[int]) -> None:
        """A server that sees no other may step alone only on moments it holds whole, or once it has been alone
        for ALONE_GRACE_ROUNDS matchmaking timeouts: until then the others may only be unseen for a moment,
        and stepping would restart the moments of the chunks they own."""
        if step == 0 or len(held) == self.layout.num_chunks:
            return
        now = time.monotonic()
        if self.alone_since is None:
            self.alone_since = now
        waited = now - self.alone_since
        if waited < ALONE_GRACE_ROUNDS * self.host.config.matchmaking_timeout:
            raise PlanError(f"no other server of the stage is seen and this one holds {len(held)} of "
                            f"{self.layout.num_chunks} chunks of the moments (alone for {waited:.0f}s)")

    def _round(self, view: StageView, grads: list[torch.Tensor | None],
               samples: int) -> tuple[Plan, int, RoundResult]:
        """Meet the group (or find this server alone), plan the round, and run it: (plan, late samples, result)."""
        host = self.host
        shards = host.optimizer.shards
        held = shards.held_at(view.step)
        info = MemberInfo(view.step, samples, self.layout.hash, held)
        if view.group_size > 1:
            gathered, _ = self.meet(view, samples, {"zero": info.to_wire()})
            _, late = total_samples(gathered, view.step)
            infos = {peer.to_base58(): MemberInfo.from_wire(data.get("zero"), self.layout.num_chunks)
                     for peer, data in gathered.items()}
            group_ids = {data.get("group_id") for data in gathered.values()}
            round_key = f"{view.step}:{group_ids.pop() if len(group_ids) == 1 else ''}"
        else:
            self._check_alone(view.step, held)
            infos, late, round_key = {host.peer_id: info}, host.ledger.late_in_round, f"{view.step}:alone"
        plan = make_plan(self.layout, infos, self.zero.replicas)
        if host.peer_id not in plan.members:
            raise PlanError("this server is not among the round's members")
        if len(plan.members) > 1:
            self.alone_since = None
        result = run_round(self.mailbox, round_key, plan, host.peer_id, self.layout.flatten(grads),
                           shards.chunks if held else {}, self.hyper,
                           time.monotonic() + host.config.allreduce_timeout, host.max_member_samples)
        return plan, late, result
