"""Co-owners of a chunk cross-check each other (swarm.averaging.crosscheck): the pure rules, AdamW's bits
wherever a chunk is computed, and whole sharded rounds of several members over an in-memory transport
(every message encoded and parsed as on the wire, only libp2p left out) with one member lying."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from swarm.averaging.collective import STATE, UPDATE, Hyper, Item, Mailbox, RoundFailed
from swarm.averaging.crosscheck import (
    DIGEST_BYTES,
    NORM,
    NORM_RTOL,
    Dispute,
    chunk_square_sums,
    digest,
    dropped,
    moments_digest,
    norms_agree,
    settle,
    settle_norms,
    settle_updates,
    summary,
)
from swarm.averaging.zero_round import run_round
from swarm.zero import ChunkMoments, Layout, MemberInfo, adam_chunks, clip_coefficient, make_plan

pytestmark = pytest.mark.timeout(60)

A, B, C, D = "peer-a", "peer-b", "peer-c", "peer-d"

# ---------------------------------------------------------------------------------------------------------------
# the rules


def test_settle_agreement_is_no_dispute():
    assert settle(0, "update", [A, B], [b"x", b"x"], bytes.__eq__) is None
    assert settle(0, "update", [A], [b"x"], bytes.__eq__) is None


def test_settle_two_owners_that_disagree_drop_the_chunk_and_name_both():
    dispute = settle(3, "update", [A, B], [b"x", b"y"], bytes.__eq__)
    assert dispute == Dispute(3, "update", A, (B,), kept=False)


def test_settle_three_owners_a_strict_majority_decides():
    # the primary backed by one co-owner: its result counts, the dissenter is named
    assert settle(0, "update", [A, B, C], [b"x", b"x", b"y"], bytes.__eq__) == Dispute(0, "update", A, (C,), True)
    # the primary outvoted (its co-owners agree with each other): dropped
    assert settle(0, "update", [A, B, C], [b"y", b"x", b"x"], bytes.__eq__) == Dispute(0, "update", A, (B, C), False)
    # nobody agrees: dropped
    assert settle(0, "update", [A, B, C], [b"x", b"y", b"z"], bytes.__eq__).kept is False
    # two against two: no strict majority
    assert settle(0, "update", [A, B, C, D], [b"x", b"x", b"y", b"y"], bytes.__eq__).kept is False


def test_norms_agree_within_rtol_and_when_both_are_not_finite():
    assert norms_agree(1.0, 1.0 + 0.5 * NORM_RTOL)
    assert not norms_agree(1.0, 1.0 + 2 * NORM_RTOL)
    assert norms_agree(0.0, 0.0)
    assert not norms_agree(0.0, 1e-30)
    assert norms_agree(math.nan, math.inf)  # (everyone skips the step)
    assert not norms_agree(math.nan, 1.0) and not norms_agree(1.0, math.inf)


def plan_of(owners: dict[int, list[str]], members=(A, B, C)):
    """A Plan-like object: each chunk's owners, primary first, all holding it."""
    return SimpleNamespace(primary=tuple(o[0] for _, o in sorted(owners.items())),
                           co_owners=tuple(tuple(o[1:]) for _, o in sorted(owners.items())), members=members)


def test_settle_norms_counts_the_primarys_sum_where_the_owners_agree_and_nothing_where_it_is_dropped():
    plan = plan_of({0: [A, B], 1: [B, C], 2: [C], 3: [A, B, C]})
    sums = {(0, A): 1.0, (0, B): 1.0, (1, B): 4.0, (1, C): 9.0, (2, C): 16.0, (3, A): 25.0, (3, B): 25.0, (3, C): 0.0}
    counted, disputes = settle_norms(plan, sums)
    assert counted == [1.0, 16.0, 25.0]  # chunk 1 dropped (two owners disagree), chunk 3 kept by a majority
    assert disputes == [Dispute(1, NORM, B, (C,), False), Dispute(3, NORM, A, (C,), True)]
    assert dropped(disputes) == [1]


def test_settle_updates_looks_only_at_chunks_with_several_owners():
    plan = plan_of({0: [A, B], 1: [C], 2: [B, A]})
    digests = {(0, A): b"1", (0, B): b"1", (2, B): b"2", (2, A): b"3"}  # (none for chunk 1: one owner)
    assert settle_updates(plan, digests) == [Dispute(2, "update", B, (A,), False)]


def test_summary_names_the_owners_and_what_happened():
    disputes = [Dispute(1, "update", B, (A,), False), Dispute(4, "update", B, (A,), False),
                Dispute(2, NORM, C, (A,), True)]
    lines = summary(disputes, A)
    assert lines == ["2 chunks: the update of primary peer-b disagrees with that of this server; not stepped "
                     "(dropped from this round)",
                     "1 chunks: the norm of primary peer-c disagrees with that of this server; kept by a majority "
                     "of owners"]
    assert B in summary(disputes, D)[0] and A in summary(disputes, D)[0]


def test_digest_changes_with_any_bit_and_binds_a_step_count():
    x = torch.randn(100)
    y = x.clone()
    y.view(torch.int32)[57] ^= 1  # the last bit of one element
    assert len(digest(x)) == DIGEST_BYTES
    assert digest(x) == digest(x.clone()) and digest(x) != digest(y)
    m = ChunkMoments(x, x.abs(), 3)
    assert moments_digest(m) != moments_digest(ChunkMoments(x, x.abs(), 4))
    assert moments_digest(m) != moments_digest(ChunkMoments(x.abs(), x, 3))


@pytest.mark.parametrize("sizes", [[4, 4, 4, 2], [4, 4, 4], [3], [5, 1], [], [0, 0]])
def test_chunk_square_sums_of_each_piece(sizes):
    values = torch.randn(sum(sizes))
    expected = [float(p.double().square().sum()) for p in values.split(sizes)] if sizes else []
    assert chunk_square_sums(values, sizes) == pytest.approx(expected, rel=1e-6)  # (float32 norms)


# ---------------------------------------------------------------------------------------------------------------
# AdamW's bits: the same wherever a chunk is computed (co-owners compare their results by hash)


def random_chunks(count: int, size: int, seed: int, steps=5):
    generator = torch.Generator().manual_seed(seed)
    moments = [ChunkMoments(torch.randn(size, generator=generator) * 0.01,
                            torch.rand(size, generator=generator) * 1e-4, steps) for _ in range(count)]
    return moments, [torch.randn(size, generator=generator) * 0.01 for _ in range(count)]


def test_adam_chunks_gives_a_chunk_the_same_bits_in_any_batch_and_position():
    moments, grads = random_chunks(24, 333, 0)  # (333: not a multiple of any vector width)
    moments[5] = ChunkMoments.zeros(333)  # a fresh chunk beside chunks with a history
    stepped, updates = adam_chunks(moments, grads, 0.9, 0.95, 1e-8)
    for subset in ([7], [23, 0, 7], list(range(1, 24, 3)), [5, 6], list(range(24))[::-1]):
        sub_stepped, sub_updates = adam_chunks([moments[i] for i in subset], [grads[i] for i in subset],
                                               0.9, 0.95, 1e-8)
        for i, s, u in zip(subset, sub_stepped, sub_updates):
            assert digest(u) == digest(updates[i]), (subset, i)
            assert moments_digest(s) == moments_digest(stepped[i])


ISA_SCRIPT = """
import hashlib, torch
from swarm.averaging.crosscheck import digest, moments_digest
from swarm.zero import ChunkMoments, adam_chunks
values = [((i * 2654435761) % 2**32) / 2**32 - 0.5 for i in range(20 * 2048)]  # (the same floats anywhere)
x = torch.tensor(values)
moments = [ChunkMoments(x[i::20][:2048] * 0.01, x[i::20][:2048].abs() * 1e-4, 5) for i in range(10)]
grads = [x[i::20][:2048] * 0.02 for i in range(10, 20)]
stepped, updates = adam_chunks(moments, grads, 0.9, 0.95, 1e-8)
h = hashlib.sha256(b"".join(digest(u) + moments_digest(s) for s, u in zip(stepped, updates))).hexdigest()
print(torch.backends.cpu.get_cpu_capability(), h)
"""


def test_adam_chunks_gives_the_same_bits_with_and_without_vector_instructions():
    # torch's vectorized and scalar loops (fused multiply-add or not) once rounded lerp and addcmul differently
    results = []
    for capability in ("default", None):
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        if capability is not None:
            env["ATEN_CPU_CAPABILITY"] = capability
        done = subprocess.run([sys.executable, "-c", ISA_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=50, check=True)
        results.append(done.stdout.split())
    (isa_off, hash_off), (isa_native, hash_native) = results
    assert isa_off == "DEFAULT"
    assert hash_off == hash_native, f"{isa_off} and {isa_native} step the same chunks to different bits"


# ---------------------------------------------------------------------------------------------------------------
# whole rounds over an in-memory transport

LAYOUT = Layout([(60,), (37,)], chunk_elements=8)  # 13 chunks, the last of 1 element
HYPER = Hyper(0.9, 0.95, 1e-8, grad_clip=1.0)


class Swarm:
    """Members whose mailboxes hand each message (encoded as on the wire) straight to the receiver's."""

    def __init__(self, members: list[str], replicas: int, held_by_targets: bool = True, seed: int = 0):
        self.members = sorted(members)
        self.boxes = {m: Mailbox(p2p=None, loop=SimpleNamespace(run=lambda coro, timeout: asyncio.run(coro)),
                                 prefix="x", layout=LAYOUT, send_timeout=10.0) for m in self.members}
        for member, box in self.boxes.items():
            box._send_all = self._sender(member)
        generator = torch.Generator().manual_seed(seed)
        self.truth = {}  # moments of 6 steps on random gradients
        for c in range(LAYOUT.num_chunks):
            moments = ChunkMoments.zeros(LAYOUT.chunk_numel(c))
            for _ in range(6):
                moments = adam_chunks([moments], [torch.randn(moments.exp_avg.numel(), generator=generator) * 0.01],
                                      HYPER.beta1, HYPER.beta2, HYPER.eps)[0][0]
            self.truth[c] = moments
        self.grads = {m: torch.randn(LAYOUT.numel, generator=generator) for m in self.members}
        self.samples = {m: 4 for m in self.members}
        owners = make_plan(LAYOUT, {m: MemberInfo(6, 4, LAYOUT.hash, frozenset(range(LAYOUT.num_chunks)))
                                    for m in self.members}, replicas).targets
        self.held = {m: {c: self.truth[c] for c in range(LAYOUT.num_chunks) if m in owners[c]} for m in self.members}
        self.replicas = replicas

    def _sender(self, member: str):
        async def send_all(requests):
            for peer, request in requests:
                box = self.boxes[peer]
                box._deliver(*box._parse(request, member))
        return send_all

    def plan(self):
        infos = {m: MemberInfo(6, self.samples[m], LAYOUT.hash, frozenset(self.held[m])) for m in self.members}
        return make_plan(LAYOUT, infos, self.replicas)

    def run(self, key: str = "7:g", max_samples: float = math.inf) -> dict:
        plan, results = self.plan(), {}

        def one(member: str) -> None:
            try:
                results[member] = run_round(self.boxes[member], key, plan, member, self.grads[member],
                                            self.held[member], HYPER, time.monotonic() + 20.0, max_samples)
            except RoundFailed as e:
                results[member] = e

        threads = [threading.Thread(target=one, args=(m,)) for m in self.members]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30.0)
        return results

    def honest_update(self, grads: dict | None = None, samples: dict | None = None) -> torch.Tensor:
        """What one optimizer computes from the members' gradients (or `grads`: each a flat sum over `samples`)
        and the moments."""
        grads, samples = grads or self.grads, samples or self.samples
        return self.update_from(sum(grads[m] for m in self.members) / sum(samples.values()))

    def update_from(self, mean: torch.Tensor) -> torch.Tensor:
        """What one optimizer computes from a mean gradient and the moments."""
        pieces = mean.split([LAYOUT.chunk_numel(c) for c in range(LAYOUT.num_chunks)])
        _, scale = clip_coefficient([float(p.double().square().sum()) for p in pieces], HYPER.grad_clip)
        _, updates = adam_chunks([self.truth[c] for c in range(LAYOUT.num_chunks)], [p * scale for p in pieces],
                                 HYPER.beta1, HYPER.beta2, HYPER.eps)
        return torch.cat(updates)


def lie_about(kind: str, change) -> callable:
    """An outbound seam that rewrites every item of `kind` this member sends."""
    return lambda items: [change(item) if item.kind == kind else item for item in items]


def chunk_slice(c: int) -> slice:
    return slice(*LAYOUT.bounds(c))


@pytest.mark.parametrize("members, replicas", [(3, 2), (4, 2), (4, 3), (2, 2)])
def test_honest_rounds_agree_everywhere_and_equal_one_optimizer(members, replicas):
    swarm = Swarm([A, B, C, D][:members], replicas)
    results = swarm.run()
    reference = swarm.honest_update()
    for result in results.values():
        assert not isinstance(result, Exception), result
        assert result.disputes == [] and result.dropped == []
        torch.testing.assert_close(result.update, reference, rtol=1e-5, atol=1e-7)
        assert torch.equal(result.update, results[swarm.members[0]].update)  # bitwise the same on every member


@pytest.mark.parametrize("members, replicas", [(3, 2), (4, 2)])
def test_a_primary_that_sends_wrong_updates_is_dropped_from_the_round_and_named(members, replicas):
    swarm = Swarm([A, B, C, D][:members], replicas)
    liar = swarm.members[1]
    swarm.boxes[liar].outbound = lie_about(UPDATE, lambda item: replace(item, tensors=(item.tensors[0] * 0 + 1.0,)))
    plan = swarm.plan()
    lied = plan.primary_of(liar)
    assert lied and all(plan.co_owners[c] for c in lied)
    results = swarm.run()
    reference = swarm.honest_update()
    for member in swarm.members:
        if member == liar:
            continue
        result = results[member]
        assert result.dropped == lied
        assert {d.primary for d in result.disputes} == {liar} and all(not d.kept for d in result.disputes)
        for c in range(LAYOUT.num_chunks):  # the liar's chunks: left as they were; the others: stepped
            expected = torch.zeros(LAYOUT.chunk_numel(c)) if c in lied else reference[chunk_slice(c)]
            torch.testing.assert_close(result.update[chunk_slice(c)], expected, rtol=1e-5, atol=1e-7)
            if c in result.moments and c in lied:  # its owners keep the moments they had
                assert result.moments[c] is swarm.held[member][c]
        assert any(liar in line for line in summary(result.disputes, member))
        assert torch.equal(result.update, results[[m for m in swarm.members if m != liar][0]].update)


def test_with_three_owners_the_majority_keeps_an_honest_primarys_update_and_names_the_lying_co_owner():
    swarm = Swarm([A, B, C, D], 3)
    liar = swarm.members[2]
    swarm.boxes[liar].outbound = lie_about("check", lambda item: replace(item, digest=b"\0" * len(item.digest)))
    plan = swarm.plan()
    co_owned = [c for c in range(LAYOUT.num_chunks) if liar in plan.co_owners[c]]
    assert co_owned
    results = swarm.run()
    reference = swarm.honest_update()
    for member in swarm.members:
        if member != liar:
            result = results[member]
            assert result.dropped == []
            assert {(d.chunk, d.dissenters, d.kept) for d in result.disputes} == {(c, (liar,), True) for c in co_owned}
            torch.testing.assert_close(result.update, reference, rtol=1e-5, atol=1e-7)


def test_a_primary_that_inflates_its_sums_of_squares_cannot_shrink_everyones_step():
    # a sum of squares of 1e30 would clip every chunk's gradient to almost nothing: a silent stall
    swarm = Swarm([A, B, C], 2)
    liar = swarm.members[0]
    swarm.boxes[liar].outbound = lie_about(NORM, lambda item: replace(item, value=1e30))
    plan = swarm.plan()
    results = swarm.run()
    computed = {c for c in range(LAYOUT.num_chunks) if liar in (plan.primary[c], *plan.co_owners[c])}
    honest = [m for m in swarm.members if m != liar]
    for member in honest:
        result = results[member]
        assert set(result.dropped) == computed
        assert {d.chunk for d in result.disputes if d.what == NORM} == computed
        assert {d.chunk for d in result.disputes} == computed  # (the liar also stepped with another norm)
        assert result.grad_norm < 1e10  # the norm of the chunks whose owners agree
        assert result.update.abs().sum() > 0
    assert torch.equal(results[honest[0]].update, results[honest[1]].update)


def test_a_receiver_refuses_moments_a_co_owner_contradicts():
    # r = 3: a joiner's chunks have two holders, one to send the moments and one to vouch for them (with r = 2
    # the joiner's co-target is their only holder, and the moments it hands over are not checked)
    swarm = Swarm([A, B, C, D], 3)
    newcomer = swarm.members[3]
    plan = swarm.plan()
    given = [c for c in range(LAYOUT.num_chunks) if newcomer in plan.targets[c]]
    swarm.held[newcomer] = {}  # it joined: a target of its chunks, holding none yet
    plan = swarm.plan()
    assert all(newcomer in plan.receivers[c] and plan.co_owners[c] for c in given)
    liar = plan.primary[given[0]]
    poisoned = [c for c in given if plan.primary[c] == liar]
    # (moments some AdamW could have made, so that only the co-owner's digest tells them apart)
    swarm.boxes[liar].outbound = lie_about(STATE, lambda item: replace(
        item, tensors=(item.tensors[0] * 0.5, item.tensors[1])))
    results = swarm.run()
    result = results[newcomer]
    assert result.refused_moments == poisoned
    assert not set(poisoned) & set(result.moments)
    assert set(given) - set(poisoned) <= set(result.moments)
    assert result.dropped == []  # the update was not in question: every member steps it alike


def test_an_honest_round_sends_every_gradient_to_each_holding_owner_and_no_more():
    swarm = Swarm([A, B, C], 2)
    sent: dict[str, list[Item]] = {m: [] for m in swarm.members}
    for member, box in swarm.boxes.items():
        box.outbound = lambda items, member=member: sent[member].extend(items) or items
    plan = swarm.plan()
    swarm.run()
    for member in swarm.members:
        grads = sorted((i.chunk, i.peer) for i in sent[member] if i.kind == "grad")
        assert grads == sorted((c, o) for c in range(LAYOUT.num_chunks)
                               for o in (plan.primary[c], *plan.co_owners[c]) if o != member)
        assert not [i for i in sent[member] if i.kind == "mean"]


def test_a_members_claim_of_samples_counts_for_at_most_max_samples():
    # a member that claims 10**9 samples would otherwise make everyone's mean gradient about 0: a stall
    swarm = Swarm([A, B, C], 2)
    liar = swarm.members[2]
    swarm.samples[liar] = 10**9
    results = swarm.run(max_samples=16)
    counted = {**swarm.samples, liar: 16}
    reference = swarm.honest_update({**swarm.grads, liar: swarm.grads[liar] * (16 / 10**9)}, counted)
    for result in results.values():
        assert result.capped == [liar]
        torch.testing.assert_close(result.update, reference, rtol=1e-5, atol=1e-7)
        assert torch.equal(result.update, results[swarm.members[0]].update)


def test_a_members_non_finite_chunk_is_left_out_and_everyone_still_steps():
    # one NaN used to make every member skip the step (the norm is not finite)
    swarm = Swarm([A, B, C], 2)
    liar = swarm.members[0]
    swarm.grads[liar][chunk_slice(4)][3] = math.nan
    results = swarm.run()
    others = [m for m in swarm.members if m != liar]
    mean = sum(swarm.grads[m] for m in swarm.members) / 12
    mean[chunk_slice(4)] = (swarm.grads[others[0]] + swarm.grads[others[1]])[chunk_slice(4)] / 8  # the two others'
    reference = swarm.update_from(mean)
    for result in results.values():
        assert result.update is not None and math.isfinite(result.grad_norm)
        torch.testing.assert_close(result.update, reference, rtol=1e-5, atol=1e-7)
        assert torch.equal(result.update, results[others[0]].update)
    # each of chunk 4's two owners left it out, and said so
    assert sorted(r.left_out.get(liar, 0) for r in results.values()) == [0, 1, 1]


def test_a_sole_holder_cannot_hand_a_joiner_moments_no_adamw_could_make():
    # r = 2: a joiner's co-target is the chunk's one holder; nobody can vouch for the moments it hands over,
    # but moments with m**2 > K * v (a tiny v under a large m: updates as large as it likes) are refused
    swarm = Swarm([A, B, C, D], 2)
    newcomer = swarm.members[3]
    swarm.held[newcomer] = {}
    plan = swarm.plan()
    given = [c for c in range(LAYOUT.num_chunks) if newcomer in plan.receivers[c]]
    assert given and not any(plan.co_owners[c] for c in given)
    liar = plan.primary[given[0]]
    forged = [c for c in given if plan.primary[c] == liar]
    swarm.boxes[liar].outbound = lie_about(STATE, lambda item: replace(
        item, tensors=(item.tensors[0] * 0 + 1.0, item.tensors[1] * 0)))
    result = swarm.run()[newcomer]
    assert result.refused_moments == forged
    assert set(given) - set(forged) <= set(result.moments)  # the honest holders' moments are taken


def test_an_update_larger_than_any_adamw_step_is_dropped_even_where_nobody_else_computes_the_chunk():
    # r = 1: each chunk has one owner, and nothing to compare it with but what AdamW can produce
    swarm = Swarm([A, B, C], 1)
    liar = swarm.members[1]
    plan = swarm.plan()
    lied = plan.primary_of(liar)
    assert lied and not any(plan.co_owners[c] for c in lied)
    swarm.boxes[liar].outbound = lie_about(UPDATE, lambda item: replace(item, tensors=(item.tensors[0] * 0 + 10.0,)))
    results = swarm.run()
    reference = swarm.honest_update()
    for member in swarm.members:
        if member != liar:
            result = results[member]
            assert result.dropped == lied
            for c in range(LAYOUT.num_chunks):
                expected = torch.zeros(LAYOUT.chunk_numel(c)) if c in lied else reference[chunk_slice(c)]
                torch.testing.assert_close(result.update[chunk_slice(c)], expected, rtol=1e-5, atol=1e-7)
            assert summary(result.disputes, member) == [
                f"{len(lied)} chunks: the update of primary {liar} is larger than any AdamW step; not stepped "
                "(dropped from this round)"]
