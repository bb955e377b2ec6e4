"""ZeRO-style sharding of a stage's AdamW moments: layout, rendezvous ownership, a round's plan, the
chunk AdamW arithmetic, StageOptimizer.step_sharded, and the sharded-round mailbox's checks (no network)."""

from __future__ import annotations

import asyncio
import copy
import math
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest
import torch
from hivemind.proto import runtime_pb2
from torch import nn

from swarm.averaging import collective
from swarm.averaging.collective import (
    EARLY_ROUNDS,
    GRAD,
    LIMITS,
    MAX_ROUND_KEY,
    MEAN,
    MESSAGE_CHUNKS,
    MESSAGE_ELEMENTS,
    NORM,
    STATE,
    TENSORS_OF,
    UPDATE,
    Item,
    Mailbox,
)
from swarm.config import OptimizerConfig
from swarm.optim import StageOptimizer, lr_at
from swarm.protocol.codec import encode_tensor
from swarm.protocol.errors import ProtocolError
from swarm.protocol.framing import decode_metadata, encode_metadata
from swarm.zero import (
    MAX_CHUNK_ELEMENTS,
    ChunkMoments,
    Layout,
    MemberInfo,
    PlanError,
    adam_chunk,
    clip_coefficient,
    make_plan,
    targets,
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
    {"step": -1, "samples": 1, "layout": "h", "held": []},
    {"step": 1, "samples": -1, "layout": "h", "held": []},
    {"step": True, "samples": 1, "layout": "h", "held": []},
    {"step": 1, "samples": False, "layout": "h", "held": []},
    {"step": 1.0, "samples": 1, "layout": "h", "held": []},
    {"step": 1, "samples": 1.5, "layout": "h", "held": []},
    {"step": "1", "samples": 1, "layout": "h", "held": []},
    {"step": 1, "samples": 1, "layout": 5, "held": []},
    {"samples": 1, "layout": "h", "held": []},
    {"step": 1, "samples": 1, "layout": "h"},
    {"step": 1, "samples": 1, "layout": "h", "held": (0, 1)},
    {"step": 1, "samples": 1, "layout": "h", "held": {0: 1}},
    {"step": 1, "samples": 1, "layout": "h", "held": [4]},
    {"step": 1, "samples": 1, "layout": "h", "held": [-1]},
    {"step": 1, "samples": 1, "layout": "h", "held": [True]},
    {"step": 1, "samples": 1, "layout": "h", "held": [1.0]},
    {"step": 1, "samples": 1, "layout": "h", "held": ["0"]},
    {"step": 1, "samples": 1, "layout": "h", "held": [0, 1, 2, 3, 0]},  # more entries than chunks
])
def test_member_info_from_wire_refuses_malformed_data(data):
    with pytest.raises(PlanError):
        MemberInfo.from_wire(data, 4)


def test_member_info_from_wire_accepts_the_edges():
    # step and samples 0 are fine (a fresh stage, a member with nothing to send), as is every chunk held
    info = MemberInfo.from_wire({"step": 0, "samples": 0, "layout": "h", "held": [0, 1, 2, 3]}, 4)
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
    base = dict(lr=1e-2, min_lr=1e-3, warmup_steps=0, total_steps=100, weight_decay=0.1, grad_clip=0.0,
                batch_size=8, micro_batch_size=4)
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


# ---------------------------------------------------------------------------------------------------------------
# collective.Mailbox: checks of what arrives, without a network

SENDER, OTHER, STRANGER = "12D3KooWsender00000001", "12D3KooWother000000002", "12D3KooWstranger000003"


def mailbox() -> Mailbox:
    # chunks [0, 8), [8, 16), [16, 17): the last one has a single element
    return Mailbox(p2p=None, loop=None, prefix="x", layout=Layout([(10,), (7,)], chunk_elements=8), send_timeout=1.0)


def request(meta: dict, *tensors: torch.Tensor) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=encode_metadata(meta),
                                     tensors=[encode_tensor(t, "float32") for t in tensors])


def many_chunks_mailbox() -> Mailbox:
    # one element a chunk: room for more chunk ids than one message may list
    layout = Layout([(2 * MESSAGE_CHUNKS,)], chunk_elements=1)
    return Mailbox(p2p=None, loop=None, prefix="x", layout=layout, send_timeout=1.0)


def test_mailbox_parses_a_good_grad_message():
    box = mailbox()
    tensor = torch.randn(8)
    round_key, messages = box._parse(request({"round": "5:g", "kind": GRAD, "chunks": [1]}, tensor), SENDER)
    assert round_key == "5:g"
    assert len(messages) == 1
    key, payload = messages[0]
    assert key == (GRAD, 1, SENDER)
    assert torch.equal(payload, tensor)


def test_mailbox_parses_every_kind():
    box = mailbox()
    one = torch.tensor([0.5])
    for kind in (UPDATE, MEAN):
        _, [(key, payload)] = box._parse(request({"round": "r", "kind": kind, "chunks": [2]}, one), SENDER)
        assert key == (kind, 2, SENDER)
        assert torch.equal(payload, one)
    _, [(key, value)] = box._parse(request({"round": "r", "kind": NORM, "chunks": [], "value": 2.5}), SENDER)
    assert key == (NORM, 0, SENDER) and value == 2.5
    meta = {"round": "r", "kind": STATE, "chunks": [2], "steps": [3]}
    _, [(key, state)] = box._parse(request(meta, one, one * 2), SENDER)
    assert key == (STATE, 2, SENDER)
    assert isinstance(state, ChunkMoments) and state.steps == 3
    assert torch.equal(state.exp_avg, one) and torch.equal(state.exp_avg_sq, one * 2)
    longest = "k" * MAX_ROUND_KEY  # the longest round key allowed still parses
    assert box._parse(request({"round": longest, "kind": GRAD, "chunks": [2]}, one), SENDER)[0] == longest


@pytest.mark.parametrize("value", [0.0, math.inf, math.nan])
def test_mailbox_takes_a_zero_or_non_finite_norm(value):
    # a non-finite norm is every member's signal to skip the step, so it must travel
    _, [(key, got)] = mailbox()._parse(request({"round": "r", "kind": NORM, "chunks": [], "value": value}), SENDER)
    assert key == (NORM, 0, SENDER)
    assert got == value or (math.isnan(value) and math.isnan(got))


@pytest.mark.parametrize("kind", [GRAD, UPDATE, MEAN])
@pytest.mark.parametrize("chunks", [[0, 1, 2], [0, 2], [1, 2], [0, 1]])
def test_mailbox_splits_a_packed_message_into_its_chunks(kind, chunks):
    box = mailbox()
    flat = torch.randn(box.layout.numel)
    tensor = torch.cat([flat[slice(*box.layout.bounds(c))] for c in chunks])
    _, messages = box._parse(request({"round": "r", "kind": kind, "chunks": chunks}, tensor), SENDER)
    assert [key for key, _ in messages] == [(kind, c, SENDER) for c in chunks]
    for c, (_, payload) in zip(chunks, messages):
        assert payload.shape == (box.layout.chunk_numel(c),)
        assert torch.equal(payload, flat[slice(*box.layout.bounds(c))])


def test_mailbox_splits_packed_moments_with_their_own_step_counts():
    box = mailbox()
    exp_avg, exp_avg_sq = torch.randn(17), torch.rand(17)
    meta = {"round": "r", "kind": STATE, "chunks": [0, 1, 2], "steps": [4, 1, 9]}
    _, messages = box._parse(request(meta, exp_avg, exp_avg_sq), SENDER)
    assert [key for key, _ in messages] == [(STATE, c, SENDER) for c in (0, 1, 2)]
    for (c, steps), (_, moments) in zip([(0, 4), (1, 1), (2, 9)], messages):
        start, end = box.layout.bounds(c)
        assert isinstance(moments, ChunkMoments) and moments.steps == steps
        assert torch.equal(moments.exp_avg, exp_avg[start:end])
        assert torch.equal(moments.exp_avg_sq, exp_avg_sq[start:end])


def test_mailbox_takes_as_many_chunks_as_a_message_may_list_and_no_more():
    box = many_chunks_mailbox()
    ids = list(range(1, 2 * MESSAGE_CHUNKS, 2))  # (not consecutive: any increasing ids will do)
    assert len(ids) == MESSAGE_CHUNKS
    _, messages = box._parse(request({"round": "r", "kind": GRAD, "chunks": ids}, torch.arange(len(ids)) * 1.0),
                             SENDER)
    assert [(key, float(payload)) for key, payload in messages] == [((GRAD, c, SENDER), float(i))
                                                                    for i, c in enumerate(ids)]
    for over in ([*ids, ids[-1] + 1], list(range(MESSAGE_CHUNKS + 1))):
        with pytest.raises(ValueError):
            box._parse(request({"round": "r", "kind": GRAD, "chunks": over}, torch.zeros(len(over))), SENDER)


def test_the_largest_state_message_fits_the_metadata_limit():
    # the most chunk ids a message may list, each as large as msgpack makes them, with large step counts
    box = Mailbox(p2p=None, loop=None, prefix="x", send_timeout=1.0,
                  layout=Layout([(2**16 + MESSAGE_CHUNKS,)], chunk_elements=1))
    ids = list(range(2**16, 2**16 + MESSAGE_CHUNKS))
    meta = {"round": "r" * MAX_ROUND_KEY, "kind": STATE, "chunks": ids, "steps": [2**40] * MESSAGE_CHUNKS}
    assert len(encode_metadata(meta)) <= LIMITS.max_metadata_bytes
    _, messages = box._parse(request(meta, torch.zeros(MESSAGE_CHUNKS), torch.zeros(MESSAGE_CHUNKS)), SENDER)
    assert len(messages) == MESSAGE_CHUNKS and messages[-1][1].steps == 2**40


def test_mailbox_takes_metadata_up_to_its_limit():
    meta = {"round": "r", "kind": GRAD, "chunks": [0], "pad": ""}
    # "pad" grows from a 1-byte to a 3-byte string header once it is over 255 bytes
    meta["pad"] = "x" * (LIMITS.max_metadata_bytes - len(encode_metadata(meta)) - 2)
    assert len(encode_metadata(meta)) == LIMITS.max_metadata_bytes
    assert len(mailbox()._parse(request(meta, torch.zeros(8)), SENDER)[1]) == 1
    meta["pad"] += "x"
    with pytest.raises(ProtocolError):
        mailbox()._parse(request(meta, torch.zeros(8)), SENDER)


def state(chunks: list, steps, *tensors: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
    meta = {"round": "r", "kind": STATE, "chunks": chunks}
    if steps is not None:
        meta["steps"] = steps
    return meta, list(tensors)


@pytest.mark.parametrize("meta, tensors", [
    # kinds
    ({"round": "r", "kind": "gradient", "chunks": [0]}, [torch.zeros(8)]),
    ({"round": "r", "chunks": [0]}, [torch.zeros(8)]),
    # chunk ids: of this layout, ints, strictly increasing, in a list
    ({"round": "r", "kind": GRAD, "chunks": [3]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [1, 3]}, [torch.zeros(9)]),
    ({"round": "r", "kind": GRAD, "chunks": [-1]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [-1, 0]}, [torch.zeros(16)]),
    ({"round": "r", "kind": GRAD, "chunks": [True]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, True]}, [torch.zeros(16)]),
    ({"round": "r", "kind": GRAD, "chunks": [0.0]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 1.0]}, [torch.zeros(16)]),
    ({"round": "r", "kind": GRAD, "chunks": ["0"]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [None]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [[0]]}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 0]}, [torch.zeros(16)]),  # a repeat
    ({"round": "r", "kind": GRAD, "chunks": [1, 1]}, [torch.zeros(16)]),
    ({"round": "r", "kind": GRAD, "chunks": [1, 0]}, [torch.zeros(16)]),  # decreasing
    ({"round": "r", "kind": GRAD, "chunks": [2, 1, 0]}, [torch.zeros(17)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 2, 1]}, [torch.zeros(17)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 1, 1, 2]}, [torch.zeros(25)]),
    ({"round": "r", "kind": GRAD}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunk": 0}, [torch.zeros(8)]),  # the old single-chunk form
    ({"round": "r", "kind": GRAD, "chunks": 0}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": None}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": "0"}, [torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": {"0": 0}}, [torch.zeros(8)]),
    # a tensor kind needs at least one chunk
    ({"round": "r", "kind": GRAD, "chunks": []}, [torch.zeros(0)]),
    ({"round": "r", "kind": GRAD, "chunks": []}, [torch.zeros(8)]),
    ({"round": "r", "kind": UPDATE, "chunks": []}, [torch.zeros(0)]),
    ({"round": "r", "kind": MEAN, "chunks": []}, [torch.zeros(0)]),
    state([], [], torch.zeros(0), torch.zeros(0)),
    # the number of tensors
    ({"round": "r", "kind": GRAD, "chunks": [0]}, []),
    ({"round": "r", "kind": GRAD, "chunks": [0]}, [torch.zeros(8), torch.zeros(8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 1]}, [torch.zeros(8), torch.zeros(8)]),  # one tensor, not one a chunk
    state([0], [1], torch.zeros(8)),
    ({"round": "r", "kind": NORM, "chunks": [], "value": 1.0}, [torch.zeros(8)]),
    # sizes: the sum of the listed chunks', in float32
    ({"round": "r", "kind": GRAD, "chunks": [1]}, [torch.zeros(7)]),  # chunk 1 has 8 elements
    ({"round": "r", "kind": GRAD, "chunks": [2]}, [torch.zeros(8)]),  # chunk 2 has 1
    ({"round": "r", "kind": GRAD, "chunks": [0, 1]}, [torch.zeros(8)]),  # two chunks have 16
    ({"round": "r", "kind": GRAD, "chunks": [0, 1]}, [torch.zeros(17)]),
    ({"round": "r", "kind": GRAD, "chunks": [0, 2]}, [torch.zeros(16)]),  # 9
    ({"round": "r", "kind": UPDATE, "chunks": [0, 1, 2]}, [torch.zeros(16)]),  # 17
    ({"round": "r", "kind": GRAD, "chunks": [0]}, [torch.zeros(MESSAGE_ELEMENTS + 1)]),  # over the cap, never decoded
    ({"round": "r", "kind": GRAD, "chunks": [0]}, [torch.zeros(2, 4)]),  # the right count in the wrong shape
    ({"round": "r", "kind": GRAD, "chunks": [0, 1]}, [torch.zeros(2, 8)]),
    ({"round": "r", "kind": GRAD, "chunks": [0]}, [torch.zeros(8, dtype=torch.int64)]),
    state([1, 2], [1, 1], torch.zeros(9), torch.zeros(8)),  # both tensors have every chunk's elements
    state([1, 2], [1, 1], torch.zeros(8), torch.zeros(9)),
    # norms: a float >= 0 and no chunks
    ({"round": "r", "kind": NORM, "chunks": []}, []),
    ({"round": "r", "kind": NORM, "value": 1.0}, []),
    ({"round": "r", "kind": NORM, "chunk": 0, "value": 1.0}, []),  # the old form
    ({"round": "r", "kind": NORM, "chunks": [0], "value": 1.0}, []),
    ({"round": "r", "kind": NORM, "chunks": [0, 1], "value": 1.0}, []),
    ({"round": "r", "kind": NORM, "chunks": [], "value": 1}, []),
    ({"round": "r", "kind": NORM, "chunks": [], "value": True}, []),
    ({"round": "r", "kind": NORM, "chunks": [], "value": "1.0"}, []),
    ({"round": "r", "kind": NORM, "chunks": [], "value": [1.0]}, []),
    ({"round": "r", "kind": NORM, "chunks": [], "value": -math.inf}, []),
    # moments: one step count >= 1 a chunk, finite values, second moments >= 0
    state([2], None, torch.ones(1), torch.ones(1)),
    state([2], 1, torch.ones(1), torch.ones(1)),  # the old single count
    state([2], [0], torch.ones(1), torch.ones(1)),
    state([2], [-1], torch.ones(1), torch.ones(1)),
    state([2], [True], torch.ones(1), torch.ones(1)),
    state([2], [1.0], torch.ones(1), torch.ones(1)),
    state([2], ["1"], torch.ones(1), torch.ones(1)),
    state([2], [None], torch.ones(1), torch.ones(1)),
    state([2], [], torch.ones(1), torch.ones(1)),
    state([2], [1, 1], torch.ones(1), torch.ones(1)),  # more counts than chunks
    state([1, 2], [1], torch.ones(9), torch.ones(9)),  # fewer
    state([0, 1, 2], [1, 1], torch.ones(17), torch.ones(17)),
    state([1, 2], [1, 0], torch.ones(9), torch.ones(9)),
    state([2], [1], torch.tensor([math.nan]), torch.ones(1)),
    state([2], [1], torch.ones(1), torch.tensor([math.inf])),
    state([2], [1], torch.ones(1), torch.tensor([-1e-3])),
    state([1, 2], [1, 1], torch.ones(9), torch.cat([torch.ones(8), torch.tensor([-1e-3])])),  # in the last chunk
    state([1, 2], [1, 1], torch.cat([torch.tensor([math.inf]), torch.ones(8)]), torch.ones(9)),  # in the first
    # a non-finite update or mean gradient (a gradient may be: every member then skips the step)
    ({"round": "r", "kind": UPDATE, "chunks": [0]}, [torch.cat([torch.ones(7), torch.tensor([math.nan])])]),
    ({"round": "r", "kind": MEAN, "chunks": [0, 1]}, [torch.cat([torch.tensor([math.inf]), torch.ones(15)])]),
    # round keys
    ({"round": "r" * (MAX_ROUND_KEY + 1), "kind": GRAD, "chunks": [0]}, [torch.zeros(8)]),
    ({"round": "", "kind": GRAD, "chunks": [0]}, [torch.zeros(8)]),
    ({"round": 5, "kind": GRAD, "chunks": [0]}, [torch.zeros(8)]),
    ({"kind": GRAD, "chunks": [0]}, [torch.zeros(8)]),
    # metadata over its limit
    ({"round": "r", "kind": GRAD, "chunks": [0], "pad": "x" * LIMITS.max_metadata_bytes}, [torch.zeros(8)]),
])
def test_mailbox_refuses_malformed_messages(meta, tensors):
    with pytest.raises((ValueError, ProtocolError)):
        mailbox()._parse(request(meta, *tensors), SENDER)


def test_mailbox_refuses_metadata_that_is_not_a_map():
    bad = runtime_pb2.ExpertRequest(metadata=encode_metadata([1, 2]))
    with pytest.raises(ProtocolError):
        mailbox()._parse(bad, SENDER)


def test_mailbox_refuses_a_negative_norm():
    # a partial sum of squares is never negative; accepting one lets a single member make every member's
    # clip_coefficient raise ValueError (math domain error) instead of RoundFailed, or silently shrink the norm
    with pytest.raises(ValueError):
        mailbox()._parse(request({"round": "r", "kind": NORM, "chunks": [], "value": -1.0}), SENDER)


def test_handle_delivers_a_packed_message_and_refuses_a_bad_one():
    box = mailbox()
    inbox = box.open_round("r", [SENDER])
    context = SimpleNamespace(remote_id=SimpleNamespace(to_base58=lambda: SENDER))
    tensor = torch.randn(9)
    reply = asyncio.run(box._handle(request({"round": "r", "kind": UPDATE, "chunks": [1, 2]}, tensor), context))
    assert decode_metadata(reply.metadata) == {"ok": True}
    assert torch.equal(inbox.messages[(UPDATE, 1, SENDER)], tensor[:8])
    assert torch.equal(inbox.messages[(UPDATE, 2, SENDER)], tensor[8:])
    reply = asyncio.run(box._handle(request({"round": "r", "kind": UPDATE, "chunks": [0, 0]}, torch.zeros(16)),
                                    context))
    assert "error" in decode_metadata(reply.metadata)
    assert box.dropped == 1
    assert set(inbox.messages) == {(UPDATE, 1, SENDER), (UPDATE, 2, SENDER)}


def test_deliver_to_an_open_round_takes_members_only():
    box = mailbox()
    inbox = box.open_round("r", [SENDER, OTHER])
    with pytest.raises(ValueError):
        box._deliver("r", [((GRAD, 0, STRANGER), torch.zeros(8))])
    with pytest.raises(ValueError):
        box._deliver("r", [((GRAD, 0, STRANGER), torch.zeros(8)), ((GRAD, 1, STRANGER), torch.zeros(8))])
    first, second = torch.ones(8), torch.full((8,), 2.0)
    box._deliver("r", [((GRAD, 0, SENDER), first)])
    box._deliver("r", [((GRAD, 0, SENDER), second)])  # a repeat never replaces what came first
    got = inbox.wait([(GRAD, 0, SENDER)], time.monotonic() + 1.0)
    assert torch.equal(got[(GRAD, 0, SENDER)], first)
    assert not any(sender == STRANGER for _, _, sender in inbox.messages)


def test_deliver_puts_every_chunk_of_a_packed_message():
    box = mailbox()
    inbox = box.open_round("r", [SENDER])
    parts = [torch.full((8,), 1.0), torch.full((8,), 2.0), torch.full((1,), 3.0)]
    box._deliver("r", [((MEAN, c, SENDER), part) for c, part in enumerate(parts)])
    got = inbox.wait([(MEAN, c, SENDER) for c in range(3)], time.monotonic() + 1.0)
    for c, part in enumerate(parts):
        assert torch.equal(got[(MEAN, c, SENDER)], part)


def test_early_messages_are_delivered_when_their_round_opens():
    box = mailbox()
    box._deliver("r", [((GRAD, 0, SENDER), torch.ones(8)), ((GRAD, 2, SENDER), torch.ones(1))])
    box._deliver("r", [((NORM, 0, STRANGER), 1.0)])  # membership is unknown until the round opens
    box._deliver("later", [((GRAD, 1, OTHER), torch.ones(8)), ((GRAD, 2, OTHER), torch.ones(1))])
    inbox = box.open_round("r", [SENDER, OTHER])
    assert set(inbox.messages) == {(GRAD, 0, SENDER), (GRAD, 2, SENDER)}  # the stranger's message is dropped
    assert "r" not in box._early and "later" in box._early
    assert box._early_bytes == 9 * 4  # only "later"'s message still counts against the budget
    box.close_round("r")
    # after the round closes, a late message waits among the early ones instead of reaching the old inbox
    box._deliver("r", [((GRAD, 1, OTHER), torch.ones(8))])
    assert (GRAD, 1, OTHER) not in inbox.messages


def test_early_buffer_is_bounded_in_bytes():
    box = mailbox()
    filler = torch.zeros(box.max_early_bytes // 4)  # exactly the budget
    box._deliver("r", [((GRAD, 0, SENDER), filler)])
    with pytest.raises(ValueError):
        box._deliver("r", [((GRAD, 1, SENDER), torch.zeros(8))])
    with pytest.raises(ValueError):
        box._deliver("other", [((NORM, 0, SENDER), 1.0)])
    box.forget_early()  # the rounds are over: their budget is free again
    assert box._early == {} and box._early_bytes == 0
    box._deliver("r", [((GRAD, 1, SENDER), torch.zeros(8))])


def test_early_buffer_counts_every_chunk_of_a_message_and_takes_all_or_none():
    box = mailbox()
    half = torch.zeros(box.max_early_bytes // 8)
    with pytest.raises(ValueError):  # each part fits alone; together they are over
        box._deliver("r", [((GRAD, 0, SENDER), half), ((GRAD, 1, SENDER), half), ((GRAD, 2, SENDER), torch.zeros(1))])
    assert box._early == {} and box._early_bytes == 0
    box._deliver("r", [((GRAD, 0, SENDER), half), ((GRAD, 1, SENDER), half)])
    assert box._early_bytes == box.max_early_bytes // 8 * 8
    assert [key for key, _ in box._early["r"]] == [(GRAD, 0, SENDER), (GRAD, 1, SENDER)]


def test_early_buffer_is_bounded_in_rounds_and_forget_early_keeps_what_it_is_told():
    box = mailbox()
    for i in range(EARLY_ROUNDS):
        box._deliver(f"r{i}", [((GRAD, 0, SENDER), torch.zeros(8))])
    with pytest.raises(ValueError):
        box._deliver("one-too-many", [((GRAD, 0, SENDER), torch.zeros(8))])
    box._deliver("r0", [((GRAD, 1, SENDER), torch.zeros(8))])  # more for a round already buffered is fine
    box.forget_early(keep=["r0"])
    assert list(box._early) == ["r0"]
    assert box._early_bytes == 2 * 8 * 4
    box._deliver("one-too-many", [((GRAD, 0, SENDER), torch.zeros(8))])  # room again
    inbox = box.open_round("r0", [SENDER])
    assert set(inbox.messages) == {(GRAD, 0, SENDER), (GRAD, 1, SENDER)}


def test_inbox_wait_fails_after_its_deadline_naming_what_is_missing():
    box = mailbox()
    inbox = box.open_round("r", [SENDER, OTHER])
    box._deliver("r", [((GRAD, 0, SENDER), torch.zeros(8))])
    started = time.monotonic()
    with pytest.raises(collective.RoundFailed, match=r"1 messages did not come in time \(grad from " + OTHER[-8:]):
        inbox.wait([(GRAD, 0, SENDER), (GRAD, 0, OTHER)], time.monotonic() + 0.05)
    assert time.monotonic() - started < 1.0  # it gives up at the deadline, not after a wait slice


def test_inbox_wait_wakes_when_a_message_arrives():
    box = mailbox()
    inbox = box.open_round("r", [SENDER])
    timer = threading.Timer(0.05, box._deliver, args=("r", [((NORM, 0, SENDER), 0.25)]))
    timer.start()
    try:
        started = time.monotonic()
        got = inbox.wait([(NORM, 0, SENDER)], time.monotonic() + 5.0)
        assert got == {(NORM, 0, SENDER): 0.25}
        assert time.monotonic() - started < 1.0  # woken by the message, not by polling to the deadline
    finally:
        timer.cancel()


# ---------------------------------------------------------------------------------------------------------------
# collective._packed and the way Mailbox.send builds its messages

PACK_LAYOUT = Layout([(10,), (7,), (33,)], chunk_elements=8)  # 7 chunks: six of 8 elements, the last of 2


def chunk_items(peers: list[str], kinds: list[str], chunks: list[int], layout: Layout = PACK_LAYOUT,
                seed: int = 0) -> list[Item]:
    generator = torch.Generator().manual_seed(seed)
    items = []
    for peer in peers:
        for kind in kinds:
            for c in chunks:
                n = layout.chunk_numel(c)
                tensors = tuple(torch.rand(n, generator=generator) for _ in range(TENSORS_OF[kind]))
                items.append(Item(peer, kind, c, tensors, steps=c + 1 if kind == STATE else 0))
    return items


def check_packing(items: list[Item], batches: list[list[Item]]) -> None:
    """What every packing must be: each item exactly once, one (peer, kind) and increasing chunks a message,
    within the message limits, and greedy (a message is only cut where the next item would not fit)."""
    assert sorted(id(item) for batch in batches for item in batch) == sorted(id(item) for item in items)
    assert all(batches)
    for batch in batches:
        assert len({(item.peer, item.kind) for item in batch}) == 1
        chunks = [item.chunk for item in batch]
        assert all(a < b for a, b in zip(chunks, chunks[1:]))
        assert len(batch) <= collective.MESSAGE_CHUNKS
        assert sum(t.numel() for item in batch for t in item.tensors) <= collective.MESSAGE_ELEMENTS
    for before, after in zip(batches, batches[1:]):
        if (before[0].peer, before[0].kind) == (after[0].peer, after[0].kind):
            assert before[-1].chunk < after[0].chunk
            elements = sum(t.numel() for item in [*before, after[0]] for t in item.tensors)
            assert len(before) == collective.MESSAGE_CHUNKS or elements > collective.MESSAGE_ELEMENTS


def test_packed_groups_items_by_peer_and_kind_in_chunk_order():
    items = chunk_items([OTHER, SENDER, STRANGER], [GRAD, UPDATE, MEAN, STATE], list(range(7)))
    shuffled = [items[i] for i in torch.randperm(len(items), generator=torch.Generator().manual_seed(1))]
    batches = collective._packed(shuffled)
    check_packing(shuffled, batches)
    # small items: one message for each (peer, kind)
    assert len(batches) == 3 * 4
    assert all([item.chunk for item in batch] == list(range(7)) for batch in batches)


def test_packed_of_nothing_is_no_message():
    assert collective._packed([]) == []


@pytest.mark.parametrize("seed", range(8))
def test_packed_stays_within_small_limits(monkeypatch, seed):
    monkeypatch.setattr(collective, "MESSAGE_ELEMENTS", 40)
    monkeypatch.setattr(collective, "MESSAGE_CHUNKS", 3)
    generator = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(60):
        peer = [OTHER, SENDER, STRANGER][int(torch.randint(3, (1,), generator=generator))]
        kind = [GRAD, UPDATE, MEAN, STATE][int(torch.randint(4, (1,), generator=generator))]
        chunk = int(torch.randint(100, (1,), generator=generator))
        size = int(torch.randint(1, 21, (1,), generator=generator))  # a state item has two tensors: up to 40
        items.append(Item(peer, kind, chunk, tuple(torch.zeros(size) for _ in range(TENSORS_OF[kind]))))
    unique = list({(item.peer, item.kind, item.chunk): item for item in items}.values())
    check_packing(unique, collective._packed(unique))


def test_packed_counts_every_tensor_of_an_item_against_the_element_limit():
    quarter = torch.zeros(MESSAGE_ELEMENTS // 4)
    grads = [Item(OTHER, GRAD, c, (quarter,)) for c in range(8)]
    states = [Item(OTHER, STATE, c, (quarter, quarter), 1) for c in range(8)]
    batches = collective._packed(grads + states)
    check_packing(grads + states, batches)
    assert [(batch[0].kind, len(batch)) for batch in batches] == [(GRAD, 4), (GRAD, 4), (STATE, 2), (STATE, 2),
                                                                  (STATE, 2), (STATE, 2)]
    # the largest chunk's moments still fit one message alone
    largest = torch.zeros(MAX_CHUNK_ELEMENTS)
    moments = [Item(OTHER, STATE, c, (largest, largest), 1) for c in range(3)]
    assert [len(batch) for batch in collective._packed(moments)] == [1, 1, 1]


def test_packed_lists_at_most_message_chunks_chunks_a_message():
    one = torch.zeros(1)
    items = [Item(SENDER, UPDATE, c, (one,)) for c in range(2 * MESSAGE_CHUNKS + 5)]
    batches = collective._packed(items)
    check_packing(items, batches)
    assert [len(batch) for batch in batches] == [MESSAGE_CHUNKS, MESSAGE_CHUNKS, 5]


def requests_as_send_builds_them(round_key: str, items: list[Item]) -> list[tuple[str, runtime_pb2.ExpertRequest]]:
    """Mailbox.send's messages, built the same way (without a network)."""
    requests = []
    for batch in collective._packed(items):
        first = batch[0]
        meta = {"round": round_key, "kind": first.kind, "chunks": [item.chunk for item in batch]}
        if first.kind == STATE:
            meta["steps"] = [item.steps for item in batch]
        tensors = [torch.cat([item.tensors[i] for item in batch]) for i in range(len(first.tensors))]
        requests.append((first.peer, collective._request(meta, tensors)))
    return requests


def check_received(items: list[Item], requests: list[tuple[str, runtime_pb2.ExpertRequest]], layout: Layout,
                   round_key: str) -> None:
    """Parse every request as its peer would (we are its sender) and compare with the items packed into it."""
    box = Mailbox(p2p=None, loop=None, prefix="x", layout=layout, send_timeout=1.0)
    received = {}
    for peer, req in requests:
        got_key, messages = box._parse(req, SENDER)
        assert got_key == round_key
        for (kind, chunk, sender), payload in messages:
            assert sender == SENDER
            assert (peer, kind, chunk) not in received
            received[(peer, kind, chunk)] = payload
    assert set(received) == {(item.peer, item.kind, item.chunk) for item in items}
    for item in items:
        payload = received[(item.peer, item.kind, item.chunk)]
        if item.kind == STATE:
            assert isinstance(payload, ChunkMoments) and payload.steps == item.steps
            assert torch.equal(payload.exp_avg, item.tensors[0])
            assert torch.equal(payload.exp_avg_sq, item.tensors[1])
        else:
            assert torch.equal(payload, item.tensors[0])


@pytest.mark.parametrize("limits", [None, (20, 3), (16, 1)])
def test_packed_messages_parse_back_into_the_items(monkeypatch, limits):
    if limits is not None:  # (the receiver checks the same constants, patched alike)
        monkeypatch.setattr(collective, "MESSAGE_ELEMENTS", limits[0])
        monkeypatch.setattr(collective, "MESSAGE_CHUNKS", limits[1])
    items = chunk_items([OTHER, STRANGER], [GRAD, UPDATE, MEAN, STATE], [0, 1, 3, 4, 6])
    items += chunk_items([SENDER], [STATE], [6, 2, 5], seed=1)  # (the last chunk is short)
    requests = requests_as_send_builds_them("7:r", items)
    if limits is None:
        assert len(requests) == 2 * 4 + 1
    check_received(items, requests, PACK_LAYOUT, "7:r")


def test_packed_messages_of_many_chunks_parse_back_into_the_items():
    layout = Layout([(3 * MESSAGE_CHUNKS + 7,)], chunk_elements=1)
    chunks = list(range(layout.num_chunks))
    items = chunk_items([OTHER], [UPDATE, STATE], chunks, layout=layout)
    requests = requests_as_send_builds_them("r", items)
    assert len(requests) == 2 * 4
    check_received(items, requests, layout, "r")


def test_send_packs_its_items_and_norms_into_messages_that_parse_back():
    box = Mailbox(p2p=None, loop=SimpleNamespace(run=lambda coro, timeout: asyncio.run(coro)), prefix="x",
                  layout=PACK_LAYOUT, send_timeout=1.0)
    captured = []

    async def send_all(requests):
        captured.extend(requests)

    box._send_all = send_all
    items = chunk_items([OTHER, STRANGER], [GRAD, UPDATE, MEAN, STATE], list(range(7)), seed=2)
    sent = box.send("3:s", items, time.monotonic() + 10.0, norm=([OTHER, STRANGER], 1.5))
    assert sent == sum(len(t.buffer) for _, req in captured for t in req.tensors)
    assert sent == sum(t.numel() for item in items for t in item.tensors) * 4
    norms = [(peer, req) for peer, req in captured if not req.tensors]
    assert sorted(peer for peer, _ in norms) == sorted([OTHER, STRANGER])
    for _, req in norms:
        assert box._parse(req, SENDER) == ("3:s", [((NORM, 0, SENDER), 1.5)])
    check_received(items, [(peer, req) for peer, req in captured if req.tensors], PACK_LAYOUT, "3:s")
    captured.clear()
    assert box.send("3:s", [], time.monotonic() + 10.0) == 0 and captured == []
