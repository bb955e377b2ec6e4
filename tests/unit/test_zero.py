"""ZeRO-style sharding of a stage's AdamW moments: layout, rendezvous ownership, a round's plan, the
chunk AdamW arithmetic and StageOptimizer.step_sharded (the mailbox: test_zero_mailbox.py)."""

from __future__ import annotations

import copy
import math

import msgpack
import pytest
import torch
from torch import nn

from swarm.config import OptimizerConfig
from swarm.optim import StageOptimizer, lr_at
from swarm.zero import (
    MAX_CHUNK_ELEMENTS,
    PROTOCOL,
    ChunkMoments,
    Layout,
    MemberInfo,
    PlanError,
    adam_chunk,
    clip_coefficient,
    make_plan,
    moments_bounded,
    targets,
    update_bound,
)

pytestmark = pytest.mark.timeout(60)

PEERS = [f"peer-{name}" for name in ("alpha", "bravo", "charlie", "delta", "echo")]


# ---------------------------------------------------------------------------------------------------------------
# Layout


def test_layout_chunks_cover_every_element_once_and_the_last_is_short():
    layout = Layout([(3, 4), (5,), (2, 2, 2)], chunk_elements=7)  # 12 + 5 + 8 = 25 elements
    assert layout.numel == 25
    assert layout.num_chunks == 4
    covered = torch.zeros(layout.numel, dtype=torch.int64)
    for chunk in range(layout.num_chunks):
        start, end = layout.bounds(chunk)
        assert layout.chunk_numel(chunk) == end - start
        covered[start:end] += 1
    assert covered.eq(1).all()
    assert [layout.chunk_numel(c) for c in range(4)] == [7, 7, 7, 4]
    # chunks are contiguous and in order: the first starts at 0 and the last ends at numel
    assert layout.bounds(0)[0] == 0 and layout.bounds(3)[1] == 25
    assert all(layout.bounds(c)[1] == layout.bounds(c + 1)[0] for c in range(3))


def test_layout_an_exact_multiple_has_no_short_chunk():
    layout = Layout([(4, 4)], chunk_elements=8)
    assert layout.num_chunks == 2
    assert [layout.chunk_numel(c) for c in range(2)] == [8, 8]


def test_layout_flatten_and_views_round_trip_with_none_as_zeros():
    layout = Layout([(2, 3), (4,), (1, 2)], chunk_elements=5)
    a, c = torch.randn(2, 3), torch.randn(1, 2)
    flat = layout.flatten([a, None, c])
    assert flat.shape == (layout.numel,) and flat.dtype == torch.float32
    views = layout.views(flat)
    assert [tuple(v.shape) for v in views] == [(2, 3), (4,), (1, 2)]
    torch.testing.assert_close(views[0], a)
    torch.testing.assert_close(views[1], torch.zeros(4))  # a parameter without a gradient counts as zeros
    torch.testing.assert_close(views[2], c)
    # views alias the flat vector: writing one writes the other (what step code relies on)
    views[1].fill_(3.0)
    assert flat[6:10].eq(3.0).all()
    with pytest.raises(ValueError):
        layout.flatten([a, None])  # one tensor per parameter, no fewer


def test_layout_hash_names_shapes_and_chunk_size():
    base = Layout([(3, 4), (5,)], chunk_elements=8)
    assert base.hash == Layout([(3, 4), (5,)], chunk_elements=8).hash
    assert base.hash == Layout([[3, 4], [5]], chunk_elements=8).hash  # lists or tuples: the same layout
    assert base.hash != Layout([(3, 4), (5,)], chunk_elements=9).hash
    # the same number of elements in another shape is another layout: chunks would map to other parameters
    assert base.hash != Layout([(4, 3), (5,)], chunk_elements=8).hash
    assert base.hash != Layout([(5,), (3, 4)], chunk_elements=8).hash


def test_layout_refuses_chunk_sizes_out_of_range():
    with pytest.raises(ValueError):
        Layout([(4,)], chunk_elements=0)
    with pytest.raises(ValueError):
        Layout([(4,)], chunk_elements=-1)
    with pytest.raises(ValueError):
        Layout([(4,)], chunk_elements=MAX_CHUNK_ELEMENTS + 1)
    assert Layout([(4,)], chunk_elements=MAX_CHUNK_ELEMENTS).num_chunks == 1


# ---------------------------------------------------------------------------------------------------------------
# Rendezvous ownership


def test_targets_are_deterministic_and_ignore_member_order():
    layout_hash = Layout([(100,)], chunk_elements=10).hash
    for chunk in range(10):
        first = targets(layout_hash, chunk, PEERS, 2)
        assert first == targets(layout_hash, chunk, list(reversed(PEERS)), 2)
        assert first == targets(layout_hash, chunk, sorted(PEERS, key=lambda p: p[::-1]), 2)


def test_targets_returns_min_of_replicas_and_members_distinct():
    layout_hash = Layout([(100,)], chunk_elements=10).hash
    for n in range(1, len(PEERS) + 1):
        members = PEERS[:n]
        for replicas in (1, 2, 3, 7):
            chosen = targets(layout_hash, 3, members, replicas)
            assert len(chosen) == min(replicas, n)
            assert len(set(chosen)) == len(chosen)
            assert set(chosen) <= set(members)
    # the best-ranked target does not depend on how many replicas are asked for
    assert targets(layout_hash, 3, PEERS, 1) == targets(layout_hash, 3, PEERS, 3)[:1]


def test_targets_depend_on_the_layout():
    # another layout spreads chunks differently; the same chunk need not land on the same peers
    a, b = Layout([(100,)], chunk_elements=1).hash, Layout([(100,)], chunk_elements=2).hash
    assert any(targets(a, c, PEERS, 1) != targets(b, c, PEERS, 1) for c in range(50))


def test_removing_a_member_moves_only_its_chunks_and_they_keep_their_other_target():
    layout_hash = Layout([(400,)], chunk_elements=1).hash
    gone = PEERS[1]
    rest = [p for p in PEERS if p != gone]
    moved = 0
    for chunk in range(400):
        before = targets(layout_hash, chunk, PEERS, 2)
        after = targets(layout_hash, chunk, rest, 2)
        if gone in before:
            moved += 1
            survivor = next(p for p in before if p != gone)
            assert survivor in after  # its surviving co-owner still owns it: its moments survive
            assert len(set(after) - set(before)) == 1  # exactly one new owner takes the leaver's place
        else:
            assert after == before  # nothing else changes, not even the order
    assert moved > 0  # the member did own something


def test_adding_a_member_changes_a_chunk_only_by_the_newcomer_entering():
    layout_hash = Layout([(400,)], chunk_elements=1).hash
    old, newcomer = PEERS[:4], PEERS[4]
    gained = 0
    for chunk in range(400):
        before = set(targets(layout_hash, chunk, old, 2))
        after = set(targets(layout_hash, chunk, old + [newcomer], 2))
        if after != before:
            gained += 1
            assert newcomer in after
            assert len(after - before) == 1 and len(before - after) == 1
        else:
            assert newcomer not in after
    assert gained > 0


@pytest.mark.parametrize("replicas", [1, 2])
def test_ownership_is_balanced_among_members(replicas):
    layout_hash = Layout([(400,)], chunk_elements=1).hash
    members = PEERS[:4]
    owned = dict.fromkeys(members, 0)
    for chunk in range(400):
        for peer in targets(layout_hash, chunk, members, replicas):
            owned[peer] += 1
    fair = 400 * replicas / len(members)
    assert sum(owned.values()) == 400 * replicas
    for peer, count in owned.items():
        assert 0.6 * fair <= count <= 1.4 * fair, (peer, count, fair)


# ---------------------------------------------------------------------------------------------------------------
# make_plan


def plan_layout() -> Layout:
    return Layout([(40,)], chunk_elements=10)  # 4 chunks


def infos_holding(layout: Layout, held: dict[str, set[int]], samples: dict[str, int] | None = None,
                  step: int = 7) -> dict[str, MemberInfo]:
    samples = samples or {}
    return {peer: MemberInfo(step, samples.get(peer, 4), layout.hash, frozenset(chunks))
            for peer, chunks in held.items()}


def test_make_plan_is_the_same_whatever_the_order_of_infos():
    layout = plan_layout()
    members = PEERS[:4]
    infos = infos_holding(layout, {p: {i % 4, (i + 1) % 4} for i, p in enumerate(members)},
                          {p: i for i, p in enumerate(members)})
    plan = make_plan(layout, infos, 2)
    shuffled = {peer: infos[peer] for peer in (members[2], members[0], members[3], members[1])}
    assert make_plan(layout, shuffled, 2) == plan
    assert plan.members == tuple(sorted(members))


def test_make_plan_refuses_disagreeing_or_empty_rounds():
    layout = plan_layout()
    good = infos_holding(layout, {PEERS[0]: set(), PEERS[1]: set()})
    make_plan(layout, good, 2)  # the baseline is accepted: each case below breaks one thing
    with pytest.raises(PlanError):
        make_plan(layout, {PEERS[0]: good[PEERS[0]], PEERS[1]: MemberInfo(8, 4, layout.hash, frozenset())}, 2)
    with pytest.raises(PlanError):
        make_plan(layout, {**good, PEERS[2]: MemberInfo(7, 4, Layout([(41,)], 10).hash, frozenset())}, 2)
    with pytest.raises(PlanError):  # every member agrees, but on a layout other than ours
        other = Layout([(40,)], chunk_elements=20).hash
        make_plan(layout, {p: MemberInfo(7, 4, other, frozenset()) for p in PEERS[:2]}, 2)
    with pytest.raises(PlanError):
        make_plan(layout, infos_holding(layout, {PEERS[0]: set(), PEERS[1]: set()}, {PEERS[0]: 0, PEERS[1]: 0}), 2)
    with pytest.raises(PlanError):
        make_plan(layout, {}, 2)


def test_make_plan_assigns_primary_co_owners_receivers_and_unheld_chunks():
    layout = plan_layout()
    members = PEERS[:3]
    owners = [targets(layout.hash, c, members, 2) for c in range(4)]
    outsiders = [next(p for p in members if p not in owners[c]) for c in range(4)]
    held: dict[str, set[int]] = {p: set() for p in members}
    # chunk 0: everyone holds it
    for p in members:
        held[p].add(0)
    # chunk 1: only the second-ranked target and the non-target hold it
    held[owners[1][1]].add(1)
    held[outsiders[1]].add(1)
    # chunk 2: only the non-target holds it (the targets are newcomers, its old owner is still here)
    held[outsiders[2]].add(2)
    # chunk 3: nobody holds it
    plan = make_plan(layout, infos_holding(layout, held), 2)
    assert plan.targets == tuple(tuple(o) for o in owners)

    assert plan.primary[0] == owners[0][0]  # the best-ranked target that holds it
    assert plan.co_owners[0] == (owners[0][1],)
    assert plan.receivers[0] == ()

    # a target that holds it beats a non-target that holds it, even one ranked below the other target
    assert plan.primary[1] == owners[1][1]
    assert plan.co_owners[1] == ()
    assert plan.receivers[1] == (owners[1][0],)

    # no target holds it: the holder steps it and hands the moments to both targets
    assert plan.primary[2] == outsiders[2]
    assert plan.co_owners[2] == ()
    assert plan.receivers[2] == tuple(owners[2])

    # nobody holds it: the best target starts from zero moments and sends them to the other
    assert plan.unheld == (3,)
    assert plan.primary[3] == owners[3][0]
    assert plan.co_owners[3] == ()
    assert plan.receivers[3] == (owners[3][1],)

    for c in range(4):  # the primary is never among those it sends to
        assert plan.primary[c] not in plan.co_owners[c] + plan.receivers[c]
    for peer in members:
        assert plan.owned_by(peer) == [c for c in range(4) if peer in owners[c]]
        assert plan.primary_of(peer) == [c for c in range(4) if plan.primary[c] == peer]


def test_make_plan_picks_the_best_ranked_of_several_non_target_holders():
    layout = plan_layout()
    members = PEERS[:4]
    chunk = 0
    ranked = targets(layout.hash, chunk, members, len(members))  # every member, best first
    held: dict[str, set[int]] = {p: set() for p in members}
    held[ranked[2]].add(chunk)
    held[ranked[3]].add(chunk)
    plan = make_plan(layout, infos_holding(layout, held), 1)
    assert plan.targets[chunk] == (ranked[0],)
    assert plan.primary[chunk] == ranked[2]
    assert plan.receivers[chunk] == (ranked[0],)
    assert chunk not in plan.unheld


def test_make_plan_co_owners_hold_the_chunk_and_receivers_do_not():
    layout = Layout([(60,)], chunk_elements=5)  # 12 chunks
    members = PEERS[:5]
    # a pseudo-random pattern of holdings, fixed so the test is reproducible
    gen = torch.Generator().manual_seed(3)
    held = {p: {c for c in range(12) if torch.rand(1, generator=gen).item() < 0.5} for p in members}
    plan = make_plan(layout, infos_holding(layout, held), 3)
    for c in range(12):
        assert set(plan.co_owners[c]) == {p for p in plan.targets[c] if p != plan.primary[c] and c in held[p]}
        assert set(plan.receivers[c]) == {p for p in plan.targets[c] if p != plan.primary[c] and c not in held[p]}
        holders = [p for p in members if c in held[p]]
        assert (c in plan.unheld) == (not holders)
        if holders:
            assert c in held[plan.primary[c]]


def test_plan_senders_and_total_samples():
    layout = plan_layout()
    members = PEERS[:4]
    samples = {members[0]: 3, members[1]: 0, members[2]: 5, members[3]: 0}
    plan = make_plan(layout, infos_holding(layout, {p: set() for p in members}, samples), 2)
    assert plan.senders() == sorted([members[0], members[2]])
    assert plan.total_samples == 8
    assert dict(plan.samples) == samples
    assert plan.step == 7


# ---------------------------------------------------------------------------------------------------------------
# MemberInfo on the wire


def test_member_info_round_trips_through_the_wire():
    info = MemberInfo(12, 5, "abcd", frozenset({0, 3, 2}))
    wire = info.to_wire()
    assert wire["held"] == [0, 2, 3]
    assert MemberInfo.from_wire(wire, 4) == info
    # as it really travels: msgpack in the matchmaking metadata
    assert MemberInfo.from_wire(msgpack.unpackb(msgpack.packb(wire), raw=False), 4) == info


@pytest.mark.parametrize("data", [
    None,
    [1, 2, 3],
    "step",
    {"protocol": PROTOCOL, "step": -1, "samples": 1, "layout": "h", "held": []},
    {"protocol": PROTOCOL, "step": 1, "samples": -1, "layout": "h", "held": []},
    {"protocol": PROTOCOL, "step": True, "samples": 1, "layout": "h", "held": []},
    {"protocol": PROTOCOL, "step": 1, "samples": False, "layout": "h", "held": []},
    {"protocol": PROTOCOL, "step": 1.0, "samples": 1, "layout": "h", "held": []},
    {"protocol": PROTOCOL, "step": 1, "samples": 1.5, "layout": "h", "held": []},
    {"protocol": PROTOCOL, "step": "1", "samples": 1, "layout": "h", "held": []},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": 5, "held": []},
    {"protocol": PROTOCOL, "samples": 1, "layout": "h", "held": []},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h"},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h", "held": (0, 1)},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h", "held": {0: 1}},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h", "held": [4]},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h", "held": [-1]},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h", "held": [True]},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h", "held": [1.0]},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h", "held": ["0"]},
    {"protocol": PROTOCOL, "step": 1, "samples": 1, "layout": "h", "held": [0, 1, 2, 3, 0]},  # more entries than chunks
    {"step": 1, "samples": 1, "layout": "h", "held": []},  # a member of version 1: co-owners wait for a mean
    {"protocol": PROTOCOL + 1, "step": 1, "samples": 1, "layout": "h", "held": []},
    {"protocol": str(PROTOCOL), "step": 1, "samples": 1, "layout": "h", "held": []},
])
def test_member_info_from_wire_refuses_malformed_data(data):
    with pytest.raises(PlanError):
        MemberInfo.from_wire(data, 4)


def test_member_info_from_wire_accepts_the_edges():
    # step and samples 0 are fine (a fresh stage, a member with nothing to send), as is every chunk held
    info = MemberInfo.from_wire({"protocol": PROTOCOL, "step": 0, "samples": 0, "layout": "h",
                                 "held": [0, 1, 2, 3]}, 4)
    assert info == MemberInfo(0, 0, "h", frozenset(range(4)))


# ---------------------------------------------------------------------------------------------------------------
# adam_chunk against torch.optim.AdamW


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_chunk_matches_torch_adamw(weight_decay):
    lr, beta1, beta2, eps = 1e-2, 0.9, 0.95, 1e-8
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(37, generator=gen)
    grads = [torch.randn(37, generator=gen) * scale for scale in (1.0, 0.01, 3.0)]

    reference = start.clone().requires_grad_(True)
    # foreach=False: the single-tensor path whose arithmetic adam_chunk follows
    torch_opt = torch.optim.AdamW([reference], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                                  foreach=False)
    param = start.clone()
    moments = ChunkMoments.zeros(37)
    for i, grad in enumerate(grads, start=1):
        reference.grad = grad.clone()
        torch_opt.step()

        before = ChunkMoments(moments.exp_avg.clone(), moments.exp_avg_sq.clone(), moments.steps)
        new, update = adam_chunk(moments, grad, beta1, beta2, eps)
        # the moments given are left as they were: a failed round must not have touched them
        torch.testing.assert_close(moments.exp_avg, before.exp_avg, rtol=0, atol=0)
        torch.testing.assert_close(moments.exp_avg_sq, before.exp_avg_sq, rtol=0, atol=0)
        assert moments.steps == before.steps
        assert new.steps == i
        moments = new
        param = param * (1 - lr * weight_decay) - lr * update

        state = torch_opt.state[reference]
        torch.testing.assert_close(param, reference.detach(), atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(moments.exp_avg, state["exp_avg"], atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(moments.exp_avg_sq, state["exp_avg_sq"], atol=1e-7, rtol=1e-5)
    assert not torch.equal(param, start)  # the steps did move the parameter


def test_moments_of_any_gradients_are_bounded_and_forged_ones_are_not():
    gen = torch.Generator().manual_seed(3)
    moments = ChunkMoments.zeros(64)
    assert moments_bounded(moments, 0.9, 0.95)
    k = 0.01 / (0.05 * (1 - 0.81 / 0.95))
    for step in range(300):
        if step < 60:
            grad = torch.randn(64, generator=gen) * 10.0 ** float(torch.randint(-6, 6, (1,), generator=gen))
        else:  # gradients growing by beta2 / beta1 a step bring m**2 / v nearest the bound
            grad = torch.full((64,), (0.95 / 0.9) ** (step - 60))
        moments, _ = adam_chunk(moments, grad, 0.9, 0.95, 1e-8)
        assert moments_bounded(moments, 0.9, 0.95), step
    m, v = moments.exp_avg.double(), moments.exp_avg_sq.double()
    assert float((m.square() / v).max()) > 0.99 * k  # (the bound is all but reached, and still held)
    # a large first moment over a tiny second one: an update as large as a liar likes
    assert not moments_bounded(ChunkMoments(torch.ones(4), torch.zeros(4), 5), 0.9, 0.95)
    assert not moments_bounded(ChunkMoments(torch.tensor([0.0, 2.0]), torch.tensor([1.0, 2.0]), 5), 0.9, 0.95)
    assert moments_bounded(ChunkMoments(torch.tensor([0.0, 1.6]), torch.tensor([1.0, 2.0]), 5), 0.9, 0.95)
    assert moments_bounded(ChunkMoments(torch.ones(4), torch.zeros(4), 5), 0.99, 0.95)  # (no bound exists)


def test_no_adamw_update_is_larger_than_update_bound():
    bound = update_bound(0.9, 0.95)
    assert 2.5 < bound < 2.7
    assert update_bound(0.99, 0.95) == math.inf
    gen = torch.Generator().manual_seed(4)
    largest = 0.0
    for pattern in range(3):  # random, growing by beta2 / beta1 a step (m**2 / v near its bound), one spike
        moments = ChunkMoments.zeros(64)
        for step in range(200):
            if pattern == 0:
                grad = torch.randn(64, generator=gen) * 10.0 ** float(torch.randint(-6, 6, (1,), generator=gen))
            elif pattern == 1:
                grad = torch.full((64,), (0.95 / 0.9) ** step)
            else:
                grad = torch.full((64,), 1e6 if step == 1 else 1e-6)
            moments, update = adam_chunk(moments, grad, 0.9, 0.95, 1e-8)
            largest = max(largest, float(update.abs().max()))
    assert 1.0 < largest <= bound


def test_adam_chunk_leaves_the_gradient_alone():
    grad = torch.randn(8)
    kept = grad.clone()
    adam_chunk(ChunkMoments.zeros(8), grad, 0.9, 0.95, 1e-8)
    assert torch.equal(grad, kept)


def test_chunk_moments_zeros_and_nbytes():
    moments = ChunkMoments.zeros(5)
    assert moments.steps == 0
    assert moments.exp_avg.eq(0).all() and moments.exp_avg_sq.eq(0).all()
    assert moments.nbytes == 2 * 5 * 4


# ---------------------------------------------------------------------------------------------------------------
# clip_coefficient


def test_clip_coefficient_within_and_above_the_clip():
    norm, factor = clip_coefficient([0.25, 0.5, 0.25], 2.0)
    assert norm == pytest.approx(1.0) and factor == 1.0
    norm, factor = clip_coefficient([9.0, 16.0], 1.0)
    assert norm == 5.0
    assert factor == 1.0 / (5.0 + 1e-6)  # exactly StageOptimizer's formula: members must agree to the bit
    # exactly at the clip: no scaling (the same strict comparison StageOptimizer.step_with makes)
    assert clip_coefficient([4.0], 2.0) == (2.0, 1.0)


def test_clip_coefficient_zero_disables_clipping():
    norm, factor = clip_coefficient([1e6, 3e6], 0.0)
    assert norm == pytest.approx(2000.0) and factor == 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_clip_coefficient_non_finite_partial_gives_nan(bad):
    norm, factor = clip_coefficient([1.0, bad, 2.0], 1.0)
    assert math.isnan(norm) and math.isnan(factor)


def test_clip_coefficient_sums_exactly_whatever_the_order():
    # sums that float addition gets wrong in some orders: fsum gives every member the same bits
    partials = [1e16, 1.0, -1e16 + 2.0, 3.0]
    forward, backward = clip_coefficient(partials, 0.0), clip_coefficient(partials[::-1], 0.0)
    assert forward == backward
    assert forward[0] == math.sqrt(6.0)


def test_clip_coefficient_of_nothing_is_zero():
    assert clip_coefficient([], 1.0) == (0.0, 1.0)


# ---------------------------------------------------------------------------------------------------------------
# StageOptimizer.step_sharded


def stage_module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))  # a decayed matrix and undecayed vectors


def stage_config(**overrides) -> OptimizerConfig:
    base = dict(name="adamw", lr=1e-2, min_lr=1e-3, warmup_steps=0, total_steps=100, weight_decay=0.1,
                grad_clip=0.0, batch_size=8, micro_batch_size=4)
    return OptimizerConfig(**{**base, **overrides})


def mean_grads(module: nn.Module, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) * scale for p in module.parameters()]


def sharded_update(layout: Layout, moments: dict[int, ChunkMoments], flat_grad: torch.Tensor,
                   cfg: OptimizerConfig) -> torch.Tensor:
    """What a sharded round computes: each chunk stepped on its own, the updates put together."""
    parts = []
    for chunk in range(layout.num_chunks):
        start, end = layout.bounds(chunk)
        moments[chunk], update = adam_chunk(moments[chunk], flat_grad[start:end], cfg.beta1, cfg.beta2, cfg.eps)
        parts.append(update)
    return torch.cat(parts)


@pytest.mark.parametrize("chunk_elements", [64, 5, 1])
def test_step_sharded_matches_a_torch_step(chunk_elements):
    cfg = stage_config()
    module = stage_module()
    twin = copy.deepcopy(module)
    sharded, reference = StageOptimizer(module, cfg), StageOptimizer(twin, cfg)
    layout = Layout([p.shape for p in sharded.params], chunk_elements)
    assert layout.numel == 4 * 3 + 3 + 3 + 3
    moments = {c: ChunkMoments.zeros(layout.chunk_numel(c)) for c in range(layout.num_chunks)}
    for seed in (1, 2):
        grads = mean_grads(module, seed)
        expected = reference.step_with([g.clone() for g in grads], 8)
        update = sharded_update(layout, moments, layout.flatten(grads), cfg)
        stats = sharded.step_sharded(update, 8, expected["grad_norm"])
        assert stats["step"] == expected["step"] == sharded.step_count
        assert stats["lr"] == expected["lr"] == lr_at(seed - 1, cfg)
        assert stats["samples"] == 8 and stats["skipped"] is False
        for mine, theirs in zip(module.parameters(), twin.parameters()):
            torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=1e-5)
    # the chunks' moments, put together, are torch's moments
    torch_moments = reference.moments()
    for slot in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([getattr(moments[c], slot) for c in range(layout.num_chunks)])
        expected_flat = layout.flatten([torch_moments[f"{i}/{slot}"] for i in range(len(reference.params))])
        torch.testing.assert_close(flat, expected_flat, atol=1e-7, rtol=1e-5)
    # weight decay was applied to the matrix (it would differ from an undecayed step otherwise)
    assert not torch.equal(module[0].weight, stage_module()[0].weight)


def test_step_sharded_with_clipping_from_clip_coefficient_matches_step_with():
    cfg = stage_config(grad_clip=0.5)
    module = stage_module()
    twin = copy.deepcopy(module)
    sharded, reference = StageOptimizer(module, cfg), StageOptimizer(twin, cfg)
    layout = Layout([p.shape for p in sharded.params], 4)
    moments = {c: ChunkMoments.zeros(layout.chunk_numel(c)) for c in range(layout.num_chunks)}
    for seed in (3, 4):
        grads = mean_grads(module, seed, scale=2.0)  # a norm well over the clip
        expected = reference.step_with([g.clone() for g in grads], 8)
        flat = layout.flatten(grads)
        # per-chunk partial sums of squares, as the chunks' primaries would report them
        partials = [float(flat[slice(*layout.bounds(c))].double().square().sum()) for c in range(layout.num_chunks)]
        norm, factor = clip_coefficient(partials, cfg.grad_clip)
        assert norm == pytest.approx(expected["grad_norm"], rel=1e-5)
        assert factor < 1.0
        update = sharded_update(layout, moments, flat * factor, cfg)
        sharded.step_sharded(update, 8, norm)
        for mine, theirs in zip(module.parameters(), twin.parameters()):
            torch.testing.assert_close(mine, theirs, atol=1e-7, rtol=1e-5)


def test_step_sharded_refuses_an_update_of_the_wrong_size_and_changes_nothing():
    module = stage_module()
    opt = StageOptimizer(module, stage_config())
    before = [p.detach().clone() for p in module.parameters()]
    numel = sum(p.numel() for p in opt.params)
    for size in (numel - 1, numel + 1, 0):
        with pytest.raises(ValueError):
            opt.step_sharded(torch.zeros(size), 8, 1.0)
    assert opt.step_count == 0
    for param, kept in zip(module.parameters(), before):
        assert torch.equal(param, kept)


def test_state_bytes_counts_torch_moments_only():
    module = stage_module()
    numel = sum(p.numel() for p in module.parameters())
    opt = StageOptimizer(module, stage_config())
    assert opt.state_bytes() == 0
    # a sharded step keeps its moments outside torch's optimizer
    opt.step_sharded(torch.zeros(numel), 8, 0.0)
    assert opt.state_bytes() == 0
    opt.step_with(mean_grads(module, 5), 8)
    # exp_avg and exp_avg_sq in float32; the 0-dim step counters are not moments
    assert opt.state_bytes() == 8 * numel
