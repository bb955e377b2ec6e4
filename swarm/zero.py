"""ZeRO-style sharding of a stage's optimizer state: layout, ownership, a round's plan, chunk AdamW.

Pure logic, no I/O (the collective that carries it is :mod:`swarm.averaging.collective`).

- :class:`Layout`: the stage's trainable parameters, flattened in ``StageOptimizer.params`` order
  and cut into fixed chunks; its hash names the layout so peers with another one never mix.
- Ownership: chunk c's targets are the ``replicas`` members of highest rendezvous weight
  ``H(layout, c, peer)``, so a member joining or leaving moves only the chunks it gains or held.
- :func:`make_plan`: from what every member of a round said (its step, samples, the chunks whose
  moments it holds at that step), who reduces and steps each chunk (its primary: the best-ranked
  target that holds it, else the best-ranked holder), who co-steps it (the other targets that hold
  it) and who receives its moments (targets that do not). A pure function of the round's members,
  so every member computes the same plan.
- :func:`adam_chunk`: AdamW's moment update and step direction on one chunk, the arithmetic of
  ``torch.optim.AdamW`` (single-tensor path); decoupled weight decay and the learning rate are
  applied by each replica to its parameters, so the update ``u`` sent to every member is all they need.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

# Chunks are the unit of ownership, not of messages (those pack many chunks): small chunks balance the
# owners' shares (a member's share is binomial around r/n over the chunks), large ones cost Python time
# per chunk. 2048 cuts configs/small.yaml's stage 1 (6.3M parameters) into 3079 chunks: a member's share
# then has a standard deviation of about 3% of r/n at n = 4, r = 1 (bench/zero.py: 1024 costs rounds
# 5-25% longer, 2048 and 4096 the same).
DEFAULT_CHUNK_ELEMENTS = 2**11
MAX_CHUNK_ELEMENTS = 2**17  # a chunk's moments (two of them) fit one message under hivemind's 2 MiB cap
# The messages of a sharded round, as swarm.averaging.collective sends them: members that send others
# (version 1: co-owners got the primary's mean instead of every gradient) cannot share a round
PROTOCOL = 2


class PlanError(ValueError):
    """The members of a round disagree on something a sharded step needs (step, layout)."""


class Layout:
    """The trainable parameters of a stage as one flat float32 vector cut into chunks."""

    def __init__(self, shapes: Sequence[Sequence[int]], chunk_elements: int = DEFAULT_CHUNK_ELEMENTS):
        if not 0 < chunk_elements <= MAX_CHUNK_ELEMENTS:
            raise ValueError(f"chunk size must be in (0, {MAX_CHUNK_ELEMENTS}], got {chunk_elements}")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.sizes)
        self.chunk_elements = chunk_elements
        self.num_chunks = max(1, -(-self.numel // chunk_elements))
        text = repr((self.shapes, chunk_elements)).encode()
        self.hash = hashlib.blake2b(text, digest_size=8).hexdigest()

    def bounds(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_elements
        return start, min(start + self.chunk_elements, self.numel)

    def chunk_numel(self, chunk: int) -> int:
        start, end = self.bounds(chunk)
        return end - start

    def flatten(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """One float32 vector of `tensors` (None: zeros), in layout order."""
        if len(tensors) != len(self.sizes):
            raise ValueError(f"got {len(tensors)} tensors for a layout of {len(self.sizes)}")
        flat = torch.zeros(self.numel, dtype=torch.float32)
        for view, tensor in zip(self.views(flat), tensors):
            if tensor is not None:
                view.copy_(tensor.detach())
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat vector."""
        return [part.view(shape) for part, shape in zip(flat.split(self.sizes), self.shapes)]


def weight(layout_hash: str, chunk: int, peer: str) -> bytes:
    """The rendezvous weight of `peer` for `chunk` (compare as bytes: higher wins)."""
    return hashlib.blake2b(f"{layout_hash}/{chunk}/{peer}".encode(), digest_size=16).digest()


def targets(layout_hash: str, chunk: int, members: Sequence[str], replicas: int) -> list[str]:
    """The members that should own `chunk`: the `replicas` of highest weight, best first."""
    ranked = sorted(members, key=lambda peer: weight(layout_hash, chunk, peer), reverse=True)
    return ranked[:max(1, min(replicas, len(ranked)))]


@dataclass(frozen=True)
class MemberInfo:
    """What one member says about itself when its round's group forms."""

    step: int
    samples: int
    layout: str
    held: frozenset[int]  # chunks whose moments it holds, current at `step`

    def to_wire(self) -> dict:
        return {"step": self.step, "samples": self.samples, "layout": self.layout, "held": sorted(self.held),
                "protocol": PROTOCOL}

    @classmethod
    def from_wire(cls, data: object, num_chunks: int) -> MemberInfo:
        """Parse what a member sent; PlanError unless every field has its type and range."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a member sent {type(data).__name__} instead of its sharding info")
        if data.get("protocol") != PROTOCOL:
            raise PlanError(f"a member runs another version of sharded rounds ({data.get('protocol')!r}; "
                            f"this server runs {PROTOCOL}): upgrade every server of the stage")
        step, samples, layout, held = (data.get(k) for k in ("step", "samples", "layout", "held"))
        if not _is_int(step) or not _is_int(samples) or step < 0 or samples < 0 or not isinstance(layout, str):
            raise PlanError(f"a member sent malformed sharding info: step {step!r}, samples {samples!r}")
        if not isinstance(held, list) or len(held) > num_chunks or \
                not all(_is_int(c) and 0 <= c < num_chunks for c in held):
            raise PlanError("a member sent a malformed list of held chunks")
        return cls(step, samples, layout, frozenset(held))


@dataclass(frozen=True)
class Plan:
    """Who does what with each chunk in one sharded round (the same on every member)."""

    step: int
    members: tuple[str, ...]  # sorted
    samples: Mapping[str, int]
    targets: tuple[tuple[str, ...], ...]  # per chunk, best first
    primary: tuple[str, ...]  # per chunk: reduces the gradient, steps, sends the update
    co_owners: tuple[tuple[str, ...], ...]  # per chunk: targets other than the primary that hold it
    receivers: tuple[tuple[str, ...], ...]  # per chunk: targets that get its moments from the primary
    unheld: tuple[int, ...]  # chunks nobody holds: their moments start from zero
    total_samples: int = field(default=0)

    def primary_of(self, peer: str) -> list[int]:
        return [c for c, p in enumerate(self.primary) if p == peer]

    def owned_by(self, peer: str) -> list[int]:
        return [c for c, owners in enumerate(self.targets) if peer in owners]

    def senders(self) -> list[str]:
        """Members whose gradients count (those with samples)."""
        return [m for m in self.members if self.samples[m] > 0]


def make_plan(layout: Layout, infos: Mapping[str, MemberInfo], replicas: int) -> Plan:
    """The round's plan from every member's info (keyed by the member's peer id)."""
    if not infos:
        raise PlanError("a round with no members")
    steps = {info.step for info in infos.values()}
    if len(steps) != 1:
        raise PlanError(f"the members are at different steps: {sorted(steps)}")
    layouts = {info.layout for info in infos.values()}
    if layouts != {layout.hash}:
        raise PlanError(f"the members' parameter layouts differ ({sorted(layouts)}; ours is {layout.hash})")
    members = tuple(sorted(infos))
    total = sum(info.samples for info in infos.values())
    if total <= 0:
        raise PlanError("nobody in the round has samples")
    all_targets, primary, co_owners, receivers, unheld = [], [], [], [], []
    for chunk in range(layout.num_chunks):
        owners = targets(layout.hash, chunk, members, replicas)
        holders = [m for m in owners if chunk in infos[m].held]
        if not holders:  # a member that is no longer a target may still hold it (a joiner took its place)
            holders = sorted((m for m in members if chunk in infos[m].held),
                             key=lambda peer: weight(layout.hash, chunk, peer), reverse=True)
        if not holders:
            unheld.append(chunk)
        first = holders[0] if holders else owners[0]
        primary.append(first)
        co_owners.append(tuple(m for m in owners if m != first and chunk in infos[m].held))
        receivers.append(tuple(m for m in owners if m != first and chunk not in infos[m].held))
        all_targets.append(tuple(owners))
    return Plan(step=steps.pop(), members=members, samples={m: infos[m].samples for m in members},
                targets=tuple(all_targets), primary=tuple(primary), co_owners=tuple(co_owners),
                receivers=tuple(receivers), unheld=tuple(unheld), total_samples=total)


@dataclass
class ChunkMoments:
    """AdamW's state of one chunk: first and second moments, and how many steps made them."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: int

    @classmethod
    def zeros(cls, numel: int) -> ChunkMoments:
        return cls(torch.zeros(numel), torch.zeros(numel), 0)

    @property
    def nbytes(self) -> int:
        return (self.exp_avg.numel() + self.exp_avg_sq.numel()) * 4


class ShardedMoments:
    """The chunks of a stage's AdamW state this replica holds, and the step they are current at."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.chunks: dict[int, ChunkMoments] = {}
        self.step = 0

    def held_at(self, step: int) -> frozenset[int]:
        """The chunks whose moments are those of `step` (none if they are of another step)."""
        return frozenset(self.chunks) if step == self.step else frozenset()

    def replace(self, chunks: Mapping[int, ChunkMoments], step: int) -> None:
        """Hold `chunks` (of `step`) from now on, copied into storage of their own: what a round returns are
        views of larger tensors (messages, batches of chunks), which would otherwise stay alive whole."""
        order = sorted(chunks)
        sizes = [chunks[c].exp_avg.numel() for c in order]
        if order:
            exp_avg = torch.cat([chunks[c].exp_avg for c in order]).split(sizes)
            exp_avg_sq = torch.cat([chunks[c].exp_avg_sq for c in order]).split(sizes)
            self.chunks = {c: ChunkMoments(m, v, chunks[c].steps) for c, m, v in zip(order, exp_avg, exp_avg_sq)}
        else:
            self.chunks = {}
        self.step = step

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.chunks.values())


def adam_chunk(moments: ChunkMoments, grad: torch.Tensor, beta1: float, beta2: float,
               eps: float) -> tuple[ChunkMoments, torch.Tensor]:
    """AdamW on one chunk: (the moments after this step, the update u). `moments` is left as it was.

    A replica applies the step as ``p = p * (1 - lr * weight_decay) - lr * u``, which is what
    torch.optim.AdamW does with the bias corrections folded into u.
    """
    stepped, updates = adam_chunks([moments], [grad], beta1, beta2, eps)
    return stepped[0], updates[0]


def adam_chunks(moments: Sequence[ChunkMoments], grads: Sequence[torch.Tensor], beta1: float, beta2: float,
                eps: float) -> tuple[list[ChunkMoments], list[torch.Tensor]]:
    """:func:`adam_chunk` on many chunks with one pass of tensor operations over the concatenation of those
    at the same step count (per-chunk Python would cost more than the arithmetic). The results are views of
    shared tensors.

    Only correctly rounded elementwise operations (subtract, multiply, add, divide, square root), never
    torch's fused lerp or addcmul, whose vectorized and scalar loops round differently: a chunk then gets
    the same bits wherever it sits in a batch, whatever the batch, thread count or CPU (AVX-512, AVX2, or
    none), so the owners of a chunk can compare their results by hash (swarm.averaging.crosscheck).
    """
    stepped: list[ChunkMoments] = [None] * len(moments)  # type: ignore[list-item]
    updates: list[torch.Tensor] = [None] * len(moments)  # type: ignore[list-item]
    batches: dict[int, list[int]] = {}  # (a chunk that starts afresh beside chunks with a history: two batches)
    for i, m in enumerate(moments):
        batches.setdefault(m.steps + 1, []).append(i)
    for steps, index in batches.items():
        sizes = [grads[i].numel() for i in index]
        grad = torch.cat([grads[i] for i in index])
        exp_avg = torch.cat([moments[i].exp_avg for i in index])
        exp_avg = (grad - exp_avg).mul_(1 - beta1).add_(exp_avg)  # torch's lerp, unfused
        exp_avg_sq = (grad * grad).mul_(1 - beta2).add_(torch.cat([moments[i].exp_avg_sq for i in index]).mul_(beta2))
        denom = exp_avg_sq.sqrt().div_(math.sqrt(1 - beta2**steps)).add_(eps)
        update = (exp_avg / denom).div_(1 - beta1**steps)
        for i, m, v, u in zip(index, exp_avg.split(sizes), exp_avg_sq.split(sizes), update.split(sizes)):
            stepped[i], updates[i] = ChunkMoments(m, v, steps), u
    return stepped, updates


def moments_bounded(moments: ChunkMoments, beta1: float, beta2: float) -> bool:
    """Whether `moments` could have come from AdamW on any gradients: m**2 <= K * v elementwise.

    With m and v the betas' averages of g and g**2, Cauchy-Schwarz gives m**2 <= K * v with
    K = (1 - beta1)**2 / ((1 - beta2) * (1 - beta1**2 / beta2)) (1.36 at 0.9, 0.95) whatever the gradients
    were, if beta1**2 < beta2. Moments from another peer that break it would make updates as large as they
    like (a tiny v under a large m); within it an update stays within a few times an honest one
    (|m_hat| / sqrt(v_hat) <= sqrt(K) * sqrt(1 - beta2**t) / (1 - beta1**t)).
    """
    if beta1**2 >= beta2:  # (no such bound: take them)
        return True
    k = (1 - beta1) ** 2 / ((1 - beta2) * (1 - beta1**2 / beta2))
    m, v = moments.exp_avg.double(), moments.exp_avg_sq.double()
    # (slack for float32 rounding of honest moments; the smallest normal float32, for v rounded to zero)
    return bool((m.square() <= v * (k * (1 + 1e-3)) + 1e-38).all())


@functools.cache
def update_bound(beta1: float, beta2: float) -> float:
    """The largest |u| an AdamW update can have from moments within :func:`moments_bounded` (inf if none):
    sqrt(K) * sqrt(1 - beta2**t) / (1 - beta1**t) at its worst step count t (2.6 at betas 0.9, 0.95)."""
    if beta1**2 >= beta2:
        return math.inf
    k = (1 - beta1) ** 2 / ((1 - beta2) * (1 - beta1**2 / beta2))
    worst = max(max(math.sqrt(1 - beta2**t) / (1 - beta1**t) for t in range(1, 100_000)), 1.0)  # (t -> inf: 1)
    return math.sqrt(k) * worst * (1 + 1e-3)  # (slack for float32 rounding)


def clip_coefficient(partial_sums: Sequence[float], grad_clip: float) -> tuple[float, float]:
    """(global gradient norm, the factor to scale every chunk's gradient by) from the owners' partial
    sums of squares, summed in a fixed order so every member gets the same bits; the factor is what
    StageOptimizer applies (1 when within the clip, nan when the norm is not finite: skip the step)."""
    norm = math.sqrt(math.fsum(partial_sums)) if all(map(math.isfinite, partial_sums)) else math.nan
    if not math.isfinite(norm):
        return norm, math.nan
    if grad_clip > 0 and norm > grad_clip:
        return norm, grad_clip / (norm + 1e-6)
    return norm, 1.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
