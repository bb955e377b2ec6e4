"""Robust aggregation of one part of the stage's gradient: what a reducer makes of its members' contributions.

In an all-reduce each member reduces one part of the averaged vector, receiving that part of every
member's mean gradient and the weight (samples) it claims. hivemind takes their weighted mean, so
one member can steer the whole stage: a weight of 10**9, gradients times 10**6, or one NaN that
makes every member skip the step. A reducer here instead:

1. caps each member's weight at what it could hold (`max_weight`: 4 of its stage's batches) and gives a
   weight of 0 to a non-finite weight or a part with a non-finite value: that member's part is
   dropped, and the others still step;
2. aggregates with one step of CenteredClip (Karimireddy, He and Jaggi, "Learning from History for
   Byzantine Robust Optimization", 2021, who take one step from the last aggregate; Gorbunov et
   al.'s BTARD-SGD runs it over hivemind's all-reduce): from the coordinate-wise median of the
   members' parts (unweighted: a claimed weight cannot move it) it moves towards each contribution,
   weighted by samples, by at most `tau` = `clip_factor` times the members' median distance from
   that start. A contribution within `tau` counts in full; an outlier counts as if it were `tau`
   away, so whatever it sent, it moves the result by at most its weight share times `tau`.

When nobody attacks, honest contributions sit well within `tau` (it is several times their typical
distance), nothing is clipped, and the step lands exactly on the weighted mean: the result is the
mean up to float rounding. With two members the median is their midpoint, so both are
equally far from it and nothing can be told apart: robustness needs three or more members.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarm.config import AGGREGATIONS
from swarm.hivemind_internals import ReducerPolicy


@dataclass(frozen=True)
class RobustPolicy(ReducerPolicy):
    """The reducer policy of a stage (see the module docstring)."""

    max_weight: float  # the most samples one member's contribution counts for
    method: str = "centered_clip"
    clip_factor: float = 4.0

    def sanitize(self, part: torch.Tensor, weight: float) -> tuple[torch.Tensor, float]:
        return sanitize(part, weight, self.max_weight)

    def counted_weight(self, weight: float) -> float:
        return counted_weight(weight, self.max_weight)

    def aggregate(self, parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        return aggregate(parts, weights, self.method, self.clip_factor)


def sanitize(part: torch.Tensor, weight: float, max_weight: float) -> tuple[torch.Tensor, float]:
    """A contribution as a reducer counts it: weight capped to [0, max_weight], 0 if anything is not finite."""
    weight = counted_weight(weight, max_weight)
    if weight == 0.0:
        return part, 0.0
    if not bool(torch.isfinite(part).all()):
        return torch.zeros_like(part), 0.0
    return part, weight


def counted_weight(weight: float, max_weight: float) -> float:
    """A claimed weight as counted: capped to [0, max_weight], 0 if it is not a finite number."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        return 0.0
    return min(float(weight), max_weight)


def aggregate(parts: list[torch.Tensor], weights: list[float], method: str = "centered_clip",
              clip_factor: float = 4.0) -> torch.Tensor:
    """The aggregate of sanitized contributions (see sanitize): NaN everywhere if no weight is left."""
    if method not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {method!r}")
    kept = [(part.reshape(-1).float(), w) for part, w in zip(parts, weights) if w > 0]
    shape = parts[0].shape
    if not kept:  # nobody with samples sent a usable part: every member skips the step, as before
        return torch.full(shape, float("nan"))
    xs = torch.stack([x for x, _ in kept])
    ws = torch.tensor([w for _, w in kept], dtype=torch.float64)
    if method == "mean" or len(kept) < 3:
        return _weighted_mean(xs, ws).reshape(shape)
    return centered_clip(xs, ws, clip_factor).reshape(shape)


def centered_clip(xs: torch.Tensor, ws: torch.Tensor, clip_factor: float) -> torch.Tensor:
    """One weighted CenteredClip step over the rows of `xs` [n, d], from their coordinate-wise median.

    The start is unweighted (one member, one vote), so a member that claims a large weight cannot
    move it; the step is weighted by samples, so honest members get the exact weighted mean.
    """
    center = coordinate_median(xs)
    offsets = xs - center
    norms = offsets.norm(dim=1)
    tau = clip_factor * float(norms.median())
    if tau == 0.0:  # at least half the members sent the very same part: it is the answer
        return center
    scale = torch.clamp(tau / norms.clamp_min(torch.finfo(xs.dtype).tiny), max=1.0)
    return center + ((ws / ws.sum()).to(xs.dtype) * scale) @ offsets


def coordinate_median(xs: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of the rows of `xs` (the mean of the middle two for an even count).

    Three or four rows, the usual group, are ordered with elementwise min and max, some 20 times
    faster than sorting each coordinate. Selection only, no arithmetic on the extremes: a huge value
    (a liar's) cannot round the middle ones away.
    """
    n = len(xs)
    if n == 3:
        low, high = torch.minimum(xs[0], xs[1]), torch.maximum(xs[0], xs[1])
        return torch.maximum(low, torch.minimum(high, xs[2]))
    if n == 4:  # the middle two are the larger of the pairs' smaller values and the smaller of their larger
        second = torch.maximum(torch.minimum(xs[0], xs[1]), torch.minimum(xs[2], xs[3]))
        third = torch.minimum(torch.maximum(xs[0], xs[1]), torch.maximum(xs[2], xs[3]))
        return (second + third) / 2
    ordered = xs.sort(dim=0).values
    return ordered[n // 2] if n % 2 else ordered[n // 2 - 1:n // 2 + 1].mean(0)


def _weighted_mean(xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return (ws / ws.sum()).to(xs.dtype) @ xs
