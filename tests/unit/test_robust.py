"""Robust aggregation (swarm/averaging/robust.py) and the reducer that applies it inside hivemind's all-reduce."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from swarm.averaging.robust import RobustPolicy, aggregate, centered_clip, coordinate_median, sanitize
from swarm.hivemind_internals import PolicyPartReducer

pytestmark = pytest.mark.timeout(30)


def honest(n: int, d: int = 4000, seed: int = 0) -> list[torch.Tensor]:
    """Mean gradients of n members: a common signal plus each member's own noise."""
    g = torch.Generator().manual_seed(seed)
    signal = torch.randn(d, generator=g)
    return [signal + 0.5 * torch.randn(d, generator=g) for _ in range(n)]


def weighted_mean(parts, weights):
    return sum(p * w for p, w in zip(parts, weights)) / sum(weights)


@pytest.mark.parametrize("weight, value, kept", [
    (8.0, 1.0, 8.0), (100.0, 1.0, 32.0), (0.0, 1.0, 0.0), (-3.0, 1.0, 0.0), (float("nan"), 1.0, 0.0),
    (float("inf"), 1.0, 0.0), (8.0, float("nan"), 0.0), (8.0, float("inf"), 0.0), (True, 1.0, 0.0),
])
def test_sanitize_caps_weights_and_drops_what_is_not_finite(weight, value, kept):
    part, counted = sanitize(torch.full((5,), value), weight, max_weight=32.0)
    assert counted == kept
    assert torch.isfinite(part).all()


@pytest.mark.parametrize("n", [3, 4, 7])
def test_nobody_attacking_gives_the_weighted_mean(n):
    parts, weights = honest(n), [float(w) for w in (3, 30, 8, 1, 16, 4, 9)[:n]]
    torch.testing.assert_close(aggregate(parts, weights), weighted_mean(parts, weights), atol=1e-5, rtol=1e-5)


def test_two_members_or_method_mean_average_plainly():
    parts = honest(2) + [torch.full((4000,), 1e6)]
    torch.testing.assert_close(aggregate(parts[:2], [1.0, 3.0]), weighted_mean(parts[:2], [1.0, 3.0]))
    torch.testing.assert_close(aggregate(parts, [1.0, 1.0, 1.0], "mean"), weighted_mean(parts, [1.0] * 3))
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(parts, [1.0] * 3, "median")


@pytest.mark.parametrize("liars", [1, 2])
def test_a_liars_pull_is_bounded_by_its_share_times_the_radius(liars):
    """Any values, at the capped weight: the result moves at most share x tau from the honest mean."""
    good = honest(5 - liars, seed=liars)
    weights = [4.0] * len(good) + [16.0] * liars
    for scale in (1e3, 1e6, -1e6):
        parts = good + [scale * torch.randn(4000) for _ in range(liars)]
        result = aggregate(parts, weights)
        start = coordinate_median(torch.stack(parts))
        tau = 4.0 * float((torch.stack(parts) - start).norm(dim=1).median())
        share = 16.0 * liars / sum(weights)
        # honest members are not clipped (checked), so result - honest mean = share x (start - honest mean)
        # + the liars' clipped offsets, each at most tau
        assert all(float((p - start).norm()) <= tau for p in good)
        honest_mean = weighted_mean(good, weights[:len(good)])
        assert float((result - honest_mean).norm()) <= share * tau + float((honest_mean - start).norm()) * share


def test_non_finite_contributions_are_dropped_and_all_dropped_is_nan():
    parts = honest(3)
    kept = [sanitize(p, 4.0, 32.0) for p in parts[:2]] + [sanitize(torch.full((4000,), float("nan")), 4.0, 32.0)]
    result = aggregate([p for p, _ in kept], [w for _, w in kept])
    torch.testing.assert_close(result, weighted_mean(parts[:2], [4.0, 4.0]))
    assert torch.isnan(aggregate([torch.zeros(3)], [0.0])).all()


def test_identical_majority_is_the_answer():
    same = torch.ones(10)
    assert torch.equal(centered_clip(torch.stack([same, same, 5 * same]), torch.ones(3, dtype=torch.float64), 4.0),
                       same)


def test_the_policy_reducer_runs_hivemind_s_part_protocol():
    """Three senders, two parts, contributions arriving out of order: each part is the policy's aggregate."""
    policy = RobustPolicy(max_weight=16.0)
    parts = [honest(3, d=6, seed=s) for s in (1, 2)]  # parts[part][sender]
    parts[0][2] = parts[0][2] * 1e6  # sender 2 lies in part 0...
    parts[1][2] = torch.full((6,), math.nan)  # ...and sends NaN in part 1
    weights = [4.0, 8.0, 1e9]

    made = []

    async def run() -> list[torch.Tensor]:
        reducer = PolicyPartReducer([torch.Size([6]), torch.Size([6])], 3, policy)  # (needs the running loop)
        made.append(reducer)

        async def sender(index: int) -> list[torch.Tensor]:
            return [await reducer.accumulate_part(index, part, parts[part][index], weights[index]) for part in (0, 1)]

        # gather starts them in this order, each running to its first wait: the last sender's part comes first
        results = dict(zip((2, 1, 0), await asyncio.gather(*(sender(i) for i in (2, 1, 0)))))
        return [results[i] for i in range(3)]

    results = asyncio.run(asyncio.wait_for(run(), 10))
    # what each sender's samples counted as (the round's sample count when weights are set after matchmaking)
    assert made[0].sender_weights == [4.0, 8.0, 16.0]
    for part in (0, 1):
        counted = [policy.sanitize(parts[part][i], weights[i]) for i in range(3)]
        expected = policy.aggregate([p for p, _ in counted], [w for _, w in counted])
        for sender_results in results:  # every sender gets the same averaged part back
            torch.testing.assert_close(sender_results[part], expected)
    torch.testing.assert_close(results[0][1], weighted_mean(parts[1][:2], weights[:2]))


def test_a_canonical_reducer_gives_every_sender_the_same_rounded_part_and_keeps_it():
    """With canonical (float8's grid), each part's aggregate is rounded once, and kept by part index for the replies
    (PolicyAllReduceRunner sends it as it is)."""
    from swarm.averaging.codecs import float8_grid

    policy = RobustPolicy(max_weight=16.0, method="mean")
    parts = [honest(2, d=300, seed=s) for s in (3, 4)]
    made = []

    async def run() -> list[list[torch.Tensor]]:
        reducer = PolicyPartReducer([torch.Size([300]), torch.Size([300])], 2, policy, canonical=float8_grid)
        made.append(reducer)

        async def sender(index: int) -> list[torch.Tensor]:
            return [await reducer.accumulate_part(index, part, parts[part][index], 1.0) for part in (0, 1)]

        return await asyncio.gather(*(sender(i) for i in range(2)))

    results = asyncio.run(asyncio.wait_for(run(), 10))
    for part in (0, 1):
        expected = float8_grid(weighted_mean(parts[part], [1.0, 1.0]))
        assert torch.equal(made[0].results[part], expected)
        assert all(torch.equal(sender[part], expected) for sender in results)
        assert not torch.equal(expected, weighted_mean(parts[part], [1.0, 1.0]))  # (it did round)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 9])
def test_coordinate_median_matches_sorting(n):
    xs = torch.randn(n, 1000)
    xs[0, :500] *= 1e30  # a liar's huge values must not round the others away
    ordered = xs.sort(dim=0).values
    expected = ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
    torch.testing.assert_close(coordinate_median(xs), expected)


def test_a_member_takes_a_canonical_reply_as_its_part_and_refuses_one_of_another_shape():
    """PolicyAllReduceRunner(canonical=...) on the member's side: another reducer's reply is the part's value (the
    update is its difference to the member's own part); a reply of another shape is refused before anything is
    registered (a stranger reducer's reply must not broadcast); a failed reducer's parts stay the member's own."""
    from types import SimpleNamespace

    from hivemind.averaging.partition import TensorPartContainer

    from swarm.hivemind_internals import PolicyAllReduceRunner

    local = torch.arange(12, dtype=torch.float32)

    async def run() -> list[torch.Tensor]:
        container = TensorPartContainer([local.clone()], [1, 1, 1], part_size_bytes=16)  # a part of 4 a peer
        runner = SimpleNamespace(tensor_part_container=container, ordered_peer_ids=["me", "r1", "r2"], peer_id="me")
        PolicyAllReduceRunner._take_results_as_values(runner)
        container.register_processed_part(0, 0, torch.full((4,), 0.5))  # own: hivemind registers a difference
        with pytest.raises(ValueError, match="shape"):
            container.register_processed_part(1, 0, torch.ones(1))  # would broadcast over the part
        container.register_processed_part(1, 0, torch.full((4,), 100.0))  # a value: the update is 100 - local
        container.register_failed_reducer(2)  # nothing changes there
        return [t async for t in container.iterate_output_tensors()]

    (update,) = asyncio.run(asyncio.wait_for(run(), 10))
    expected = torch.cat([torch.full((4,), 0.5), 100.0 - local[4:8], torch.zeros(4)])
    assert torch.equal(update, expected)
