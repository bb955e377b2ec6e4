"""Co-owners of a chunk check each other's results in a sharded round (pure logic, no I/O).

With r >= 2 owners per chunk (averaging.zero.replicas), every owner that holds a chunk's moments
receives every member's gradient sum of that chunk and computes what the primary computes: the
chunk's sum of squares (its share of the global norm) and, once the norm is known, its AdamW update.
Each member then decides the same way for every chunk from what it got:

- the chunk's sum of squares counts towards the global norm only if the owners agree on it
  (relative NORM_RTOL: sums of the same float32 values, in float64, in whatever order the CPU adds);
- the primary's update is applied only if the owners agree on it bit for bit (the primary sends the
  update itself, each co-owner a DIGEST_BYTES hash of its own: swarm.zero.adam_chunks gives the same
  bits on any CPU, wherever the chunk sits in a batch);
- otherwise the primary's result counts only if a strict majority of the chunk's owners agrees with
  it, which needs r >= 3; with r = 2 a disagreement leaves the chunk as it was before the round (its
  parameters and, on its owners, its moments), on every honest member alike, and the dispute names
  both owners (one of them lied or was lied to; nothing here tells which).

A receiver of a chunk's moments (an owner that did not hold them) also compares their hash with each
co-owner's and refuses moments that disagree, or that no AdamW could have made (swarm.zero.moments_bounded,
the only check where the sender is the chunk's one holder); it then does not hold the chunk after the round.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from swarm.zero import ChunkMoments, Layout, Plan

# 8 bytes of sha256: a liar that knows the honest result would need about 2**64 tries to find another
# one with the same digest (a second preimage, not a birthday collision); 8 bytes keep a message of 1024
# chunks' digests within the metadata limit
DIGEST_BYTES = 8
# two owners take the norm of the same float32 values in float32, perhaps in another order (another CPU's
# vector width): they differ by about 1e-7 relative, well below this, and a lie within it moves the global
# norm, and the clipping, by nothing that matters
NORM_RTOL = 1e-5
UPDATE, NORM, BOUND = "update", "norm", "bound"


def digest(*tensors: torch.Tensor, steps: int | None = None) -> bytes:
    """The hash of float32 `tensors` (and a moments' step count) by which owners compare results."""
    h = hashlib.sha256()
    for tensor in tensors:
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.requires_grad:
            tensor = tensor.detach().to(torch.float32).contiguous()
        h.update(tensor.numpy())  # (a round hashes thousands of chunks: no copy, no conversion on the way)
    if steps is not None:
        h.update(steps.to_bytes(8, "little", signed=True))
    return h.digest()[:DIGEST_BYTES]


def moments_digest(moments: ChunkMoments) -> bytes:
    return digest(moments.exp_avg, moments.exp_avg_sq, steps=moments.steps)


def chunk_square_sums(values: torch.Tensor, sizes: Sequence[int]) -> list[float]:
    """Sum of squares of each consecutive piece of float32 `values` of the given sizes (from float32 norms:
    a fifth of the time of float64 sums, and precise to about 1e-7, enough to clip by)."""
    sums: list[float] = []
    start = 0
    if sizes and len(set(sizes[:-1])) == 1:  # all but perhaps the last the same: one reduction over a view
        size, full = sizes[0], len(sizes) - 1
        if size:
            sums = torch.linalg.vector_norm(values[:size * full].view(full, size), dim=1).double().square().tolist()
        else:
            sums = [0.0] * full
        start = size * full
        sizes = sizes[-1:]
    for size in sizes:
        sums.append(float(torch.linalg.vector_norm(values[start:start + size]).double().square()))
        start += size
    return sums


def norms_agree(a: float, b: float) -> bool:
    """Two owners' sums of squares of one chunk agree (both non-finite also agree: then everyone skips)."""
    if a == b:
        return True
    if not (math.isfinite(a) and math.isfinite(b)):
        return not math.isfinite(a) and not math.isfinite(b)
    return abs(a - b) <= NORM_RTOL * max(abs(a), abs(b))


@dataclass(frozen=True)
class Dispute:
    """Owners of a chunk that disagree on what (NORM or UPDATE) in a round."""

    chunk: int
    what: str
    primary: str
    dissenters: tuple[str, ...]  # owners whose result differs from the primary's
    kept: bool  # the primary's result still counts (a strict majority of the owners agrees with it)


def owners_of(plan: Plan, chunk: int) -> tuple[str, ...]:
    """The owners that compute `chunk` in this round, its primary first."""
    return (plan.primary[chunk], *plan.co_owners[chunk])


def settle(chunk: int, what: str, owners: Sequence[str], values: Sequence, same: Callable[[object, object], bool]
           ) -> Dispute | None:
    """None if every owner's value agrees with the primary's (owners[0]); else the dispute."""
    agreeing = [same(value, values[0]) for value in values]
    if all(agreeing):
        return None
    dissenters = tuple(owner for owner, agrees in zip(owners, agreeing) if not agrees)
    return Dispute(chunk, what, owners[0], dissenters, kept=2 * sum(agreeing) > len(owners))


def settle_norms(plan: Plan, sums: Mapping[tuple[int, str], float]) -> tuple[list[float], list[Dispute]]:
    """(each chunk's sum of squares that counts, in chunk order; the disputes) from every owner's
    sum of each chunk (keyed (chunk, owner)). A chunk whose primary is outvoted counts for nothing."""
    counted, disputes = [], []
    for chunk in range(len(plan.primary)):
        owners = owners_of(plan, chunk)
        dispute = settle(chunk, NORM, owners, [sums[(chunk, owner)] for owner in owners], norms_agree)
        if dispute is not None:
            disputes.append(dispute)
        if dispute is None or dispute.kept:
            counted.append(sums[(chunk, owners[0])])
    return counted, disputes


def settle_updates(plan: Plan, digests: Mapping[tuple[int, str], bytes]) -> list[Dispute]:
    """The disputes over the chunks' updates, from every owner's digest of each (keyed (chunk, owner))."""
    disputes = []
    for chunk in range(len(plan.primary)):
        owners = owners_of(plan, chunk)
        if len(owners) > 1:
            dispute = settle(chunk, UPDATE, owners, [digests[(chunk, owner)] for owner in owners], bytes.__eq__)
            if dispute is not None:
                disputes.append(dispute)
    return disputes


def out_of_bound(plan: Plan, updates: torch.Tensor, layout: Layout, bound: float) -> list[Dispute]:
    """A dispute for each chunk whose update (in the flat `updates`) no AdamW step could have: the one check
    of a chunk nobody else computes (a single holder, or r = 1); every chunk gets it."""
    if math.isinf(bound) or not _largest(updates) > bound:  # (one pass over all; a nan is refused elsewhere)
        return []
    return [Dispute(c, BOUND, plan.primary[c], (), kept=False) for c in range(layout.num_chunks)
            if _largest(updates[slice(*layout.bounds(c))]) > bound]


def _largest(values: torch.Tensor) -> float:
    return float(values.abs().max()) if values.numel() else 0.0


def dropped(disputes: Sequence[Dispute]) -> list[int]:
    """The chunks that stay as they were before the round: their primary's result was outvoted or undecided."""
    return sorted({d.chunk for d in disputes if not d.kept})


def summary(disputes: Sequence[Dispute], me: str) -> list[str]:
    """One line per (primary, dissenters, kind of result): how many chunks, and whether they were dropped."""
    groups: dict[tuple[str, tuple[str, ...], str, bool], int] = {}
    for d in disputes:
        key = (d.primary, d.dissenters, d.what, d.kept)
        groups[key] = groups.get(key, 0) + 1
    lines = []
    for (primary, dissenters, what, kept), count in sorted(groups.items()):
        others = ", ".join("this server" if peer == me else peer for peer in dissenters)
        verdict = "kept by a majority of owners" if kept else "not stepped (dropped from this round)"
        who = "this server" if primary == me else f"primary {primary}"
        if what == BOUND:
            lines.append(f"{count} chunks: the update of {who} is larger than any AdamW step; {verdict}")
        else:
            lines.append(f"{count} chunks: the {what} of {who} disagrees with that of {others}; {verdict}")
    return lines
