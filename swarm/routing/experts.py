"""A stage server's side of remote experts: which host runs each expert's tokens, and what happens
when hosts fail or are slow.

:class:`ExpertDispatcher` (async, on the P2P event loop) knows the expert servers from their DHT
records and keeps one :class:`~swarm.routing.balancer.StageBalancer` per expert, so each expert's
tokens go to the host where they should be answered first, under an adaptive timeout (multiplier
times the expected time, with a floor). A forward sends each host one request holding the tokens
of every expert chosen there (batched per expert), all hosts at once. A host that fails or times
out is banned and its experts are retried on their other hosts; an expert none of whose hosts
answers in time is *lost* for this micro-batch. A backward goes to every host of the block, each
getting the gradient of its experts' tokens and the micro-batch's sample count (zero rows for an
expert given no token), so every replica of an expert accumulates the same gradient and steps
with the stages.

:class:`RemoteExperts` is the :class:`~swarm.model.moe.ExpertRunner` the stage's MoE blocks call
on the backend's worker thread. A lost expert's slots become UNAVAILABLE: the token goes on with
the experts that answered, gates renormalized over them (swarm.model.moe.gates), if no more than
``top_k - k_min`` of its top-k experts were lost (a slot dropped for capacity is routing, not a
loss), else the micro-batch is refused (:class:`ExpertsUnavailable`) for the trainer to retry.
Under gradients, the expert outputs are an autograd node whose backward is the backward call above.

Which experts a micro-batch's forward lost is reported in the stage's reply (`moe_lost`), and the
trainer sends it back with the backward: the backward, which recomputes the forward, leaves those
experts out too, whatever the network does meanwhile. An expert that answered the forward but not
the recomputation (or not the backward) is left out of the backward only: counted as lost in backward.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID

from swarm.model.moe import UNAVAILABLE, Dispatch, RoutingPlan
from swarm.protocol import (
    BACKWARD,
    DEFAULT_LIMITS,
    FORWARD,
    RemoteStageError,
    StageClient,
    StageRequest,
    StageUnavailable,
    WireLimits,
    experts_namespace,
)
from swarm.routing.balancer import StageBalancer, Ticket
from swarm.routing.pipeline import FULL_CODES, PipelineSettings

log = logging.getLogger(__name__)


class ExpertsUnavailable(RuntimeError):
    """Too few of some token's experts answered (``model.moe.k_min``): the micro-batch cannot go on now."""


@dataclass
class ExpertStats:
    """What happened to expert calls, per MoE block (Prometheus counters read these)."""

    calls: defaultdict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))  # requests sent
    failures: defaultdict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))  # of them, failed
    lost_slots: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))  # slots of lost experts
    backward_lost: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))  # experts a backward missed
    latency: list[tuple[int, str, float]] = field(default_factory=list)  # (layer, kind, seconds), drained by metrics


class ExpertDispatcher:
    """Sends a block's tokens to the expert servers of the run; see the module docstring."""

    def __init__(self, p2p: P2P, run_id: str, num_experts: int, wire_dtype: str = "float32",
                 settings: PipelineSettings | None = None, limits: WireLimits = DEFAULT_LIMITS,
                 balancer_factory: Callable[[], StageBalancer] = StageBalancer):
        self.p2p, self.run_id, self.num_experts = p2p, run_id, num_experts
        self.wire_dtype, self.limits = wire_dtype, limits
        self.settings = settings or PipelineSettings()
        self.balancers = [balancer_factory() for _ in range(num_experts)]
        self.hosted: dict[str, list[int]] = {}  # host peer id -> the experts it hosts, from the latest lookup
        self.stats = ExpertStats()
        self._background: set[asyncio.Future] = set()  # backwards to hosts nobody waits for, still running

    def update_hosts(self, hosts: dict[str, Iterable[int]]) -> None:
        """Set the ONLINE expert servers: peer id -> expert indices (those out of range are ignored).

        A host missing from one lookup (a DHT read that came back short, or one that left) stays known,
        unchosen for forwards but still sent backwards, until its balancers forget it.
        """
        fresh = {peer: sorted({e for e in experts if 0 <= e < self.num_experts}) for peer, experts in hosts.items()}
        for e, balancer in enumerate(self.balancers):
            balancer.update_servers(peer for peer, experts in fresh.items() if e in experts)
        known = {peer for balancer in self.balancers for peer in balancer.servers}
        self.hosted = {**{peer: experts for peer, experts in self.hosted.items() if peer in known}, **fresh}

    def hosts_of(self, expert: int) -> list[str]:
        return self.balancers[expert].listed()

    async def forward(self, layer: int, inputs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Outputs of each expert on its rows `inputs[e]`; an expert missing from the result is lost."""
        pending = {e for e, rows in inputs.items() if rows.shape[0]}
        tried: dict[int, set[str]] = defaultdict(set)
        outputs: dict[int, torch.Tensor] = {}
        while pending:
            groups: dict[str, list[tuple[int, Ticket]]] = defaultdict(list)
            for e in sorted(pending):
                balancer, size = self.balancers[e], int(inputs[e].shape[0])
                ticket = balancer.choose(size, FORWARD, exclude=tried[e])
                if ticket is None:  # every host banned: try the one whose ban ends first, once (as stages do)
                    peer = balancer.soonest_unbanned(exclude=tried[e])
                    ticket = None if peer is None else balancer.charge(peer, size, FORWARD)
                if ticket is None:  # no host left to try: lost for this micro-batch
                    pending.discard(e)
                    continue
                groups[ticket.peer_id].append((e, ticket))
            if not groups:
                break
            replies = await self._gather(groups, (self._call(layer, FORWARD, peer, items, inputs)
                                                  for peer, items in groups.items()))
            for (peer, items), reply in zip(groups.items(), replies):
                if reply is None:
                    for e, _ in items:
                        tried[e].add(peer)
                    continue
                for (e, _), out in zip(items, torch.split(reply, [int(inputs[e].shape[0]) for e, _ in items])):
                    outputs[e] = out
                    pending.discard(e)
        return outputs

    async def backward(self, layer: int, inputs: dict[int, torch.Tensor], grads: dict[int, torch.Tensor],
                       samples: int, stage_step: int | None = None) -> dict[int, torch.Tensor]:
        """Send every known host the gradients of its experts' rows (every expert of the block, zero rows
        for those given no token) and `samples`; the input gradient of each expert whose rows some host
        answered for. `inputs` and `grads` hold an entry for every expert of the block.

        Hosts that are banned or were missing from the last lookup get theirs too, so a replica that
        failed a call once (or a lookup missed) does not fall behind its peers, but nobody waits for
        them: their calls finish in the background, unless an expert given rows has no other host.
        A host both banned and gone from the lookup (its record expired: it left) gets none.
        """
        groups: dict[str, list[tuple[int, Ticket]]] = {}
        healthy: set[str] = set()
        now = self.balancers[0].clock()
        for peer, experts in sorted(self.hosted.items()):
            known = [e for e in experts if peer in self.balancers[e].servers
                     and not _gone(self.balancers[e].servers[peer], now)]
            if not known:
                continue
            groups[peer] = [(e, self.balancers[e].charge(peer, max(1, int(inputs[e].shape[0])), BACKWARD))
                            for e in known]
            if any(peer in self.balancers[e].available() for e in known):
                healthy.add(peer)
        covered = {e for peer in healthy for e, _ in groups[peer]}
        waited = {peer: items for peer, items in groups.items()
                  if peer in healthy or any(inputs[e].shape[0] and e not in covered for e, _ in items)}
        for peer, items in groups.items():
            if peer not in waited:
                task = asyncio.ensure_future(self._call(layer, BACKWARD, peer, items, inputs, grads, samples,
                                                        stage_step, quiet=True))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        replies = await self._gather(waited, (self._call(layer, BACKWARD, peer, items, inputs, grads, samples,
                                                         stage_step) for peer, items in waited.items()))
        result: dict[int, torch.Tensor] = {}
        for items, reply in zip(waited.values(), replies):
            if reply is None:
                continue
            for (e, _), grad in zip(items, torch.split(reply, [int(inputs[e].shape[0]) for e, _ in items])):
                result.setdefault(e, grad)
        return result

    async def _gather(self, groups: dict[str, list[tuple[int, Ticket]]], calls: Iterable) -> list:
        """Run the calls at once; every ticket goes back to its balancer whatever happens, also when the
        caller gives up on them (cancelled) or a call raises what it does not expect."""
        try:
            return await asyncio.gather(*calls)
        finally:
            for items in groups.values():
                for expert, ticket in items:
                    self.balancers[expert].release(ticket)  # does nothing for a ticket already reported

    async def _call(self, layer: int, kind: str, peer: str, items: Sequence[tuple[int, Ticket]],
                    inputs: dict[int, torch.Tensor], grads: dict[int, torch.Tensor] | None = None,
                    samples: int | None = None, stage_step: int | None = None, quiet: bool = False
                    ) -> torch.Tensor | None:
        """One request to `peer` for the experts of `items`; its one output tensor, or None if it failed
        (every ticket is handed back either way, failures banning the host for those experts). A `quiet`
        call's failure (to a banned host, expected) is logged at debug level only."""
        rows = [(e, int(inputs[e].shape[0])) for e, _ in items]
        x = torch.cat([inputs[e] for e, _ in items])
        grad = None if grads is None else torch.cat([grads[e] for e, _ in items])
        request = StageRequest(kind, layer, uuid.uuid4().hex, x, grad_outputs=grad, wire_dtype=self.wire_dtype,
                               experts=rows, samples=samples, stage_step=stage_step)
        settings = self.settings
        timeout = max(self.balancers[e].timeout(t, settings.timeout_multiplier, settings.timeout_floor,
                                                settings.request_timeout) for e, t in items)
        client = StageClient(self.p2p, PeerID.from_base58(peer), experts_namespace(self.run_id), limits=self.limits,
                             timeout=timeout)
        self.stats.calls[layer, kind] += 1
        started = asyncio.get_running_loop().time()
        try:
            reply = await client.call(request)
            out = reply.tensors[0] if len(reply.tensors) == 1 else None
            if out is None or tuple(out.shape) != tuple(x.shape) or not out.is_floating_point() \
                    or not torch.isfinite(out).all():
                raise StageUnavailable(f"a reply of {len(reply.tensors)} tensor(s) that does not fit the request")
        except (StageUnavailable, RemoteStageError) as e:
            self.stats.failures[layer, kind] += 1
            full = isinstance(e, RemoteStageError) and e.code in FULL_CODES  # a brief ban, as a stage server's
            for expert, ticket in items:
                self.balancers[expert].report_failure(ticket, brief=full)
                self.balancers[expert].release(ticket)
            log.log(logging.DEBUG if quiet else logging.WARNING, "expert %s of block %d on %s failed (%s)", kind,
                    layer, peer[-8:], e)
            return None
        self.stats.latency.append((layer, kind, asyncio.get_running_loop().time() - started))
        for expert, ticket in items:
            self.balancers[expert].report_success(ticket)
            self.balancers[expert].release(ticket)
        return out


def _gone(state, now: float) -> bool:
    """A host banned and missing from the latest lookup: it left, or died and its record expired."""
    return state.missing_since is not None and state.banned_until > now


@dataclass
class ExpertCall:
    """What a stage request tells its MoE blocks, and what they tell it back."""

    samples: int | None = None  # sequences of a micro-batch being trained; None: forward only
    stage_step: int | None = None  # the stage's optimizer step, for the experts' backward
    lost_in: dict[int, list[int]] = field(default_factory=dict)  # per block: experts the forward went without
    lost_out: dict[int, list[int]] = field(default_factory=dict)  # per block: experts lost by this request


_calls = threading.local()


@contextmanager
def expert_call(samples: int | None = None, lost_in: Sequence[tuple[int, list[int]]] | None = None,
                stage_step: int | None = None) -> Iterator[ExpertCall]:
    """The context of one stage request on this thread, for the MoE blocks it runs."""
    call = ExpertCall(samples, stage_step, {layer: list(experts) for layer, experts in (lost_in or ())})
    previous = getattr(_calls, "current", None)
    _calls.current = call
    try:
        yield call
    finally:
        _calls.current = previous


class RemoteExperts:
    """The ExpertRunner of a stage whose experts live on expert servers; see the module docstring."""

    def __init__(self, dispatcher: ExpertDispatcher, run: Callable, k_min: int, timeout: float):
        self.dispatcher = dispatcher
        self.run = run  # runs a coroutine on the P2P loop and waits at most `timeout` (BackgroundLoop.run)
        self.k_min = k_min
        self.timeout = timeout

    def __call__(self, layer: int, u: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, RoutingPlan]:
        call = getattr(_calls, "current", None) or ExpertCall()
        num_experts = self.dispatcher.num_experts
        plan = plan.without(call.lost_in.get(layer, ()))
        n, k = plan.experts.shape
        dispatch = Dispatch.of(plan, num_experts)
        rows = u.detach().float()[dispatch.tokens]
        inputs = dict(enumerate(torch.split(rows, dispatch.counts)))
        try:
            outputs = self.run(self.dispatcher.forward(layer, inputs), self.timeout)
        except TimeoutError:  # BackgroundLoop.run gave up: the calls were cancelled, their tickets handed back
            raise ExpertsUnavailable(f"block {layer}: the expert calls did not finish within {self.timeout:g}s"
                                     ) from None
        lost = sorted(e for e, count in enumerate(dispatch.counts) if count and e not in outputs)
        if lost:
            call.lost_out[layer] = lost
            plan = plan.without(lost)
        # Capacity drops are routing, not failures: a token needs k_min of its top-k not lost to the network.
        missing = (plan.status == UNAVAILABLE).sum(dim=1)
        short = missing > k - self.k_min
        if bool(short.any()):
            raise ExpertsUnavailable(
                f"block {layer}: {int(short.sum())} token(s) lost more than {k - self.k_min} of their {k} experts "
                f"(k_min {self.k_min}); experts {lost} did not answer")
        if lost:  # counted once the micro-batch goes on without them
            self.dispatcher.stats.lost_slots[layer] += int(sum(dispatch.counts[e] for e in lost))
        dispatch = Dispatch.of(plan, num_experts)
        flat = torch.cat([outputs[e] for e, count in enumerate(dispatch.counts) if count] or [rows[:0]])
        flat = flat.to(u.dtype)
        if call.samples is not None and torch.is_grad_enabled() and u.requires_grad:
            kept = u[dispatch.tokens]
            backward = _Backward(self, layer, dispatch, kept.detach(), call.samples, call.stage_step)
            flat = _ExpertOutputs.apply(kept, flat, backward)
        return dispatch.scatter(flat, n, k), plan


@dataclass
class _Backward:
    runner: RemoteExperts
    layer: int
    dispatch: Dispatch
    rows: torch.Tensor
    samples: int
    stage_step: int | None = None

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        runner, counts = self.runner, self.dispatch.counts
        inputs = dict(enumerate(torch.split(self.rows.float(), counts)))
        grads = dict(enumerate(torch.split(grad.float(), counts)))
        try:
            result = runner.run(runner.dispatcher.backward(self.layer, inputs, grads, self.samples, self.stage_step),
                                runner.timeout)
        except TimeoutError:
            result = {}
        missing = [e for e, count in enumerate(counts) if count and e not in result]
        if missing:  # their tokens' outputs stay in the forward, as constants: no gradient through them
            runner.dispatcher.stats.backward_lost[self.layer] += len(missing)
            log.warning("block %d: no host of experts %s took the backward; their tokens get no gradient through "
                        "them", self.layer, missing)
        parts = [result[e] if e in result else torch.zeros_like(inputs[e]) for e, count in enumerate(counts) if count]
        return (torch.cat(parts) if parts else self.rows[:0].float()).to(grad.dtype)


class _ExpertOutputs(torch.autograd.Function):
    """Expert outputs as a function of their rows: the backward asks the expert servers."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, outputs: torch.Tensor, backward: _Backward) -> torch.Tensor:
        ctx.backward = backward
        return outputs.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward(grad.contiguous()), None, None
