"""Mixture-of-experts feed-forward layer: a router picks ``top_k`` of ``num_experts`` expert MLPs per token.

The math is split into pure functions so that a stage server calling remote experts can reproduce
the single-process layer exactly (see the MoE design note, sections 3 and 4):

- :func:`route` ``probs [N, E] -> RoutingPlan``: the top-k expert ids of every token (highest
  probability first, ties to the lower id), then capacity. Each expert takes at most
  ``C = ceil(capacity_factor * N * k / E)`` slots, filled in GShard priority order: every token's
  first choice before any second choice, and within one choice by token position. A slot over
  capacity gets status :data:`DROPPED`; ``capacity_factor = 0`` drops nothing. Nothing random.
- :func:`gates` ``(probs, plan) -> w [N, k]``: for k >= 2 the token's probabilities renormalized
  over its processed slots; for k = 1 the raw probability (renormalizing one slot would make the
  gate 1 and cut the router out of the main loss). Unprocessed slots weigh 0; a token with none
  gets 0 (its residual carries it), never NaN.
- :func:`aux_loss` ``(probs, experts, E)``: the load-balancing loss ``E * sum_e f_e * P_e`` of one
  micro-batch, ``f_e`` the share of the top-k choices that are ``e`` (before capacity, not
  differentiable), ``P_e`` the mean router probability of ``e``. It is 1 when both are uniform.
- :func:`combine` ``(w, y) -> out [N, D]``: ``sum_j w[:, j] * y[:, j]``, ``y [N, k, D]`` holding the
  expert output of every slot (zeros where unprocessed).

:class:`MoEFeedForward` chains them with local experts (:func:`local_expert_outputs`). Its auxiliary
loss is not returned: the layer hands a :class:`MoERecord` (layer, plan, aux loss) to the innermost
:func:`record_moe` block open on this thread, and to nothing when none is open, so no graph is
kept alive by accident. The objective of a micro-batch of ``n`` samples is then
``(CE + aux_loss_weight * sum of the layers' aux losses) * n``; a pipeline stage adds its own
layers' term to its backward (see :func:`record_moe`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

PROCESSED = 0  # slot status: the expert ran on the token
DROPPED = 1  # slot status: over the expert's capacity; the token keeps its residual for this slot
UNAVAILABLE = 2  # slot status: no host of the expert answered in time; the token goes on without it


@dataclass(frozen=True)
class RoutingPlan:
    """Which experts each of N tokens goes to: ``experts`` and ``status`` are int64 [N, k], slot j of a
    token being its (j+1)-th choice; ``capacity`` is the most slots one expert takes (0: no limit)."""

    experts: torch.Tensor
    status: torch.Tensor
    capacity: int

    @property
    def processed(self) -> torch.Tensor:
        """bool [N, k]: the slots whose expert runs."""
        return self.status == PROCESSED

    def dropped(self) -> int:
        return int((self.status == DROPPED).sum())

    def unavailable(self) -> int:
        return int((self.status == UNAVAILABLE).sum())

    def without(self, lost: Sequence[int]) -> RoutingPlan:
        """This plan with the processed slots of the experts in `lost` marked UNAVAILABLE."""
        if not len(lost):
            return self
        hit = torch.isin(self.experts, torch.as_tensor(list(lost), dtype=self.experts.dtype)) & self.processed
        return replace(self, status=torch.where(hit, torch.full_like(self.status, UNAVAILABLE), self.status))


def capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * num_tokens * top_k / num_experts)``: the slots one expert takes; 0 for no limit."""
    if capacity_factor == 0:
        return 0
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


@torch.no_grad()
def route(probs: torch.Tensor, top_k: int, capacity_factor: float) -> RoutingPlan:
    """Top-k experts per token and their status under capacity; a pure function of ``probs`` [N, E]."""
    if probs.dim() != 2:
        raise ValueError(f"router probabilities must be [tokens, experts], got shape {list(probs.shape)}")
    n, num_experts = probs.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
    # A stable sort, not topk: equal probabilities go to the lower expert id on every device.
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k].contiguous()
    cap = capacity(n, top_k, num_experts, capacity_factor)
    status = torch.full_like(experts, PROCESSED)
    if cap:
        # Slots in priority order: all first choices by token position, then all second choices...
        ordered = experts.t().reshape(-1)
        one_hot = F.one_hot(ordered, num_experts)
        position = (one_hot.cumsum(0) - one_hot).gather(1, ordered.unsqueeze(1)).squeeze(1)  # earlier slots of e
        status = (position >= cap).long().view(top_k, n).t().contiguous() * DROPPED
    return RoutingPlan(experts, status, cap)


def gates(probs: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Weights [N, k] of the slots' expert outputs: p renormalized over processed slots (k >= 2), raw p (k = 1)."""
    chosen = probs.gather(1, plan.experts) * plan.processed.to(probs.dtype)
    if plan.experts.shape[1] == 1:
        return chosen
    total = chosen.sum(dim=1, keepdim=True)
    # A token with no processed slot has weights 0/1 = 0: no NaN, and no gradient through its probabilities.
    return chosen / torch.where(total > 0, total, torch.ones_like(total))


def aux_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``E * sum_e f_e * P_e``: f from the top-k choices (before capacity), P the mean probabilities."""
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    f = counts / experts.numel()
    return num_experts * (f * probs.mean(dim=0)).sum()


def combine(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum_j w[:, j] * y[:, j]``: the layer's output [N, D] from the weights [N, k] and slot outputs [N, k, D]."""
    return (w.unsqueeze(-1) * y).sum(dim=1)


@dataclass(frozen=True)
class Dispatch:
    """The processed slots of a plan grouped by expert: ``slots`` (s = token * k + choice) sorted by
    (expert, slot), so each expert's tokens come in position order; ``counts[e]`` of them go to ``e``."""

    slots: torch.Tensor
    tokens: torch.Tensor
    counts: list[int]

    @classmethod
    def of(cls, plan: RoutingPlan, num_experts: int) -> Dispatch:
        n, k = plan.experts.shape
        slots = plan.processed.reshape(-1).nonzero().squeeze(1)
        expert_of_slot = plan.experts.reshape(-1)[slots]
        order = torch.argsort(expert_of_slot * (n * k) + slots)
        slots, expert_of_slot = slots[order], expert_of_slot[order]
        counts = torch.bincount(expert_of_slot, minlength=num_experts).tolist()
        return cls(slots, torch.div(slots, k, rounding_mode="floor"), counts)

    def scatter(self, flat: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """Slot outputs [n, k, D] from the experts' outputs concatenated in dispatch order (zeros elsewhere)."""
        return flat.new_zeros(n * k, flat.shape[-1]).index_copy(0, self.slots, flat).view(n, k, -1)


def local_expert_outputs(experts: Sequence[nn.Module], u: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """Slot outputs [N, k, D] of experts run here: one call per expert on its processed tokens in token order."""
    n, k = plan.experts.shape
    dispatch = Dispatch.of(plan, len(experts))
    chunks = torch.split(u[dispatch.tokens], dispatch.counts)
    outputs = [expert(chunk) for expert, chunk, count in zip(experts, chunks, dispatch.counts) if count]
    if not outputs:
        return u.new_zeros(n, k, u.shape[-1])
    return dispatch.scatter(torch.cat(outputs), n, k)


class ExpertRunner(Protocol):
    """Runs the experts of MoE blocks that hold none themselves (``model.moe.expert_servers``)."""

    def __call__(self, layer: int, u: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, RoutingPlan]:
        """Slot outputs [N, k, D] for ``u`` [N, D] routed by ``plan`` (differentiable in ``u`` when
        gradients are on), and the plan with the slots whose expert could not be run marked
        :data:`UNAVAILABLE`."""


class LocalExperts:
    """An :class:`ExpertRunner` over expert modules held in this process, ``experts[layer][e]``: the
    single-process reference of a run whose experts live on expert servers."""

    def __init__(self, experts: dict[int, Sequence[nn.Module]]):
        self.experts = experts

    def __call__(self, layer: int, u: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, RoutingPlan]:
        return local_expert_outputs(self.experts[layer], u, plan), plan


class Expert(nn.Module):
    """One expert: D -> hidden -> GELU -> D, like the dense MLP but without dropout (experts must be
    deterministic, since a remote host recomputes its forward in backward)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))

    def residual_projections(self) -> tuple[nn.Linear]:
        return (self.down,)


@dataclass
class MoERecord:
    """What one MoE layer's forward routed: its global block index, the plan and its aux loss (a graph node)."""

    layer: int
    plan: RoutingPlan
    aux_loss: torch.Tensor


_recorders = threading.local()


@contextmanager
def record_moe() -> Iterator[list[MoERecord]]:
    """Collect the :class:`MoERecord` of every MoE layer run on this thread inside the block, in order.

    How an objective uses it (``alpha`` = ``model.moe.aux_loss_weight``, ``n`` = samples)::

        with record_moe() as records:
            out = stage(x, targets)                     # or functional_call(stage, stashed, (x, targets))
        aux = sum(r.aux_loss for r in records)          # this stage's layers only
        # last stage:  ((out + alpha * aux) * n).backward()
        # other stage: torch.autograd.backward([out, aux], [grad_output, alpha * n])
    """
    records: list[MoERecord] = []
    stack = getattr(_recorders, "stack", None)
    if stack is None:
        stack = _recorders.stack = []
    stack.append(records)
    try:
        yield records
    finally:
        stack.pop()


def total_aux_loss(records: Sequence[MoERecord]) -> torch.Tensor | None:
    """The sum of the records' aux losses, None if there are none."""
    return sum((r.aux_loss for r in records[1:]), records[0].aux_loss) if records else None


def _emit(record: MoERecord) -> None:
    stack = getattr(_recorders, "stack", None)
    if stack:
        stack[-1].append(record)


class MoEFeedForward(nn.Module):
    """Router ``Linear(D, E)`` (no bias) on the normalized hidden states, top-k routing with capacity,
    ``E`` :class:`Expert` s; the drop-in for a block's MLP. Input [B, T, D] or [N, D], output alike.

    The router has no bias: a bias only shifts every token's preference for an expert alike, which
    is the aux loss's job, and it would add a parameter the load-balancing term pulls on directly.
    Its probabilities are computed in at least float32 (also under bfloat16 autocast), so routing
    does not hinge on bfloat16 rounding. Pass ``plan`` to force a routing (teacher forcing a recorded one).
    """

    def __init__(self, d_model: int, experts: Sequence[nn.Module] | int, top_k: int, capacity_factor: float,
                 layer: int = 0, dropout: float = 0.0):
        super().__init__()
        remote = isinstance(experts, int)
        self.num_experts = experts if remote else len(experts)
        if not 1 <= top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..{self.num_experts} (the experts), got {top_k}")
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.layer = layer
        self.router = nn.Linear(d_model, self.num_experts, bias=False)
        self.experts = None if remote else nn.ModuleList(experts)
        # Who runs the experts when this layer holds none (set by whoever hosts the block); not a submodule.
        self.runner: ExpertRunner | None = None
        self.drop = nn.Dropout(dropout)

    def forward(self, u: torch.Tensor, plan: RoutingPlan | None = None) -> torch.Tensor:
        shape = u.shape
        flat = u.reshape(-1, shape[-1])
        logits = self.router(flat)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # bf16 -> f32, f64 stays
        if plan is None:
            plan = route(probs.detach(), self.top_k, self.capacity_factor)
        if self.experts is not None:
            y = local_expert_outputs(self.experts, flat, plan)
        elif self.runner is not None:
            y, plan = self.runner(self.layer, flat, plan)
        else:
            raise RuntimeError(f"the experts of MoE block {self.layer} live on expert servers, and no runner "
                               "reaches them here")
        out = combine(gates(probs, plan), y)
        _emit(MoERecord(self.layer, plan, aux_loss(probs, plan.experts, self.num_experts)))
        return self.drop(out.to(y.dtype).view(shape))

    def extra_repr(self) -> str:
        where = "" if self.experts is not None else ", experts on expert servers"
        return (f"layer {self.layer}: top {self.top_k} of {self.num_experts}, capacity factor "
                f"{self.capacity_factor:g}{where}")
