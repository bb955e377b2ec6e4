"""ExpertHost: what an expert server computes, checked against make_expert modules and StageOptimizers run by hand."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from swarm.config import ModelConfig, MoEConfig, OptimizerConfig, RunConfig
from swarm.experts import ExpertHost, ExpertState
from swarm.model import make_expert
from swarm.optim import StageOptimizer
from swarm.state import StateRejected
from swarm.threads import WrongThread

pytestmark = pytest.mark.timeout(30)

HOSTED = [0, 2]
D = 16
CLOSE = dict(rtol=1e-6, atol=1e-6)


def run_config(moe: bool = True) -> RunConfig:
    settings = MoEConfig(every=1, num_experts=4, top_k=2, expert_servers=True) if moe else None
    return RunConfig(
        model=ModelConfig(vocab_size=256, seq_len=8, n_layer=2, n_head=2, d_model=D, moe=settings),
        optimizer=OptimizerConfig(batch_size=8, micro_batch_size=4, lr=1e-2, warmup_steps=1),
    ).validate()


CONFIG = run_config()


@pytest.fixture
def host():
    built = ExpertHost(CONFIG, [2, 0, 2])  # in any order, repeated: hosted once each, sorted
    yield built
    built.shutdown()


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def untouched(host: ExpertHost) -> bool:
    """Nothing accumulated: no gradient, no sample, no token counted, no step."""
    return (host.samples == 0 and host.step == 0 and all(count == 0 for count in host.tokens.values())
            and all(opt.samples == 0 for opt in host.optimizers.values())
            and all(p.grad is None for module in host.modules.values() for p in module.parameters()))


def state(host: ExpertHost) -> dict:
    return {key: {k: v.clone() for k, v in module.state_dict().items()} for key, module in host.modules.items()}


def test_the_host_builds_the_reference_experts_of_every_moe_block(host):
    assert host.experts == HOSTED and host.layers == [0, 1]
    assert sorted(host.modules) == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert host.max_rows == 2 * 4 * 8  # top_k * micro_batch_size * seq_len
    for (layer, e), module in host.modules.items():
        torch.testing.assert_close(module.state_dict(), make_expert(CONFIG.model, layer, e).state_dict(), rtol=0,
                                   atol=0)
    # different experts (and blocks) are different modules
    assert not torch.equal(host.modules[0, 0].up.weight, host.modules[0, 2].up.weight)
    assert not torch.equal(host.modules[0, 0].up.weight, host.modules[1, 0].up.weight)


def test_forward_runs_each_expert_on_its_rows_and_accumulates_nothing(host):
    x = rand(5, D)
    out = host.forward(1, [(2, 3), (0, 2)], x)
    expected = torch.cat([make_expert(CONFIG.model, 1, 2)(x[:3]), make_expert(CONFIG.model, 1, 0)(x[3:])])
    assert out.shape == (5, D) and not out.requires_grad
    torch.testing.assert_close(out, expected.detach(), **CLOSE)
    # zero rows for an expert: nothing of it in the output
    torch.testing.assert_close(host.forward(1, [(0, 0), (2, 5)], x), make_expert(CONFIG.model, 1, 2)(x).detach(),
                               **CLOSE)
    assert untouched(host)


def test_backward_matches_autograd_and_every_hosted_expert_steps_after_a_full_batch(host):
    layer = 1
    x1, g1 = rand(6, D, seed=1), rand(6, D, seed=2)
    x2, g2 = rand(3, D, seed=3), rand(3, D, seed=4)
    before = state(host)

    # By hand: fresh experts, the same gradient sums, a StageOptimizer each.
    ref = {e: make_expert(CONFIG.model, layer, e) for e in HOSTED}
    ref_opt = {e: StageOptimizer(module, CONFIG.optimizer) for e, module in ref.items()}
    leaf1 = x1.clone().requires_grad_(True)
    ref[0](leaf1).backward(g1)  # expert 0 gets all 6 rows of the first micro-batch, expert 2 none
    leaf2 = x2.clone().requires_grad_(True)
    ref[0](leaf2).backward(g2)

    grad1, stats1 = host.backward(layer, [(0, 6), (2, 0)], x1, g1, samples=4)
    torch.testing.assert_close(grad1, leaf1.grad, **CLOSE)
    assert stats1 == [] and host.step == 0 and host.samples == 4
    assert [host.optimizers[layer, e].samples for e in HOSTED] == [4, 4]  # the expert given no row counts too
    assert host.tokens[layer, 0] == 6 and host.tokens[layer, 2] == 0
    assert host.modules[layer, 0].up.weight.grad is not None
    assert all(p.grad is None for p in host.modules[layer, 2].parameters())
    assert all(opt.samples == 0 for (lay, _), opt in host.optimizers.items() if lay != layer)  # other block: none

    grad2, stats2 = host.backward(layer, [(2, 0), (0, 3)], x2, g2, samples=4)
    torch.testing.assert_close(grad2, leaf2.grad, **CLOSE)
    assert len(stats2) == 2 and not any(s["skipped"] for s in stats2)
    assert host.samples == 8 and host.tokens[layer, 0] == 9
    assert [host.optimizers[layer, e].step_count for e in HOSTED] == [1, 1]
    assert all(host.optimizers[layer, e].samples == 0 for e in HOSTED)
    assert all(host.optimizers[0, e].step_count == 0 for e in HOSTED)  # the other block took no backward

    for e in HOSTED:
        ref_opt[e].add_samples(8)
        ref_opt[e].step()
        torch.testing.assert_close(host.modules[layer, e].state_dict(), ref[e].state_dict(), **CLOSE)
    # expert 0 moved; expert 2 had no gradient all batch: AdamW left it as it was (no weight decay either)
    assert not torch.equal(host.modules[layer, 0].up.weight, before[layer, 0]["up.weight"])
    torch.testing.assert_close(host.modules[layer, 2].state_dict(), before[layer, 2], rtol=0, atol=0)
    torch.testing.assert_close(host.modules[0, 0].state_dict(), before[0, 0], rtol=0, atol=0)

    # the other block's batch, all of it to expert 2: now every hosted expert of every block stepped once
    for seed in (9, 10):
        host.backward(0, [(0, 0), (2, 2)], rand(2, D, seed=seed), rand(2, D, seed=seed + 10), samples=4)
    assert host.step == 1 and host.samples == 16
    assert all(opt.step_count == 1 and opt.samples == 0 for opt in host.optimizers.values())
    torch.testing.assert_close(host.modules[0, 0].state_dict(), before[0, 0], rtol=0, atol=0)
    assert not torch.equal(host.modules[0, 2].up.weight, before[0, 2]["up.weight"])


def test_backward_of_several_experts_splits_the_gradient_by_rows(host):
    x, g = rand(7, D, seed=5), rand(7, D, seed=6)
    grad, _ = host.backward(0, [(2, 4), (0, 3)], x, g, samples=2)
    expected = []
    for e, part, part_grad in ((2, x[:4], g[:4]), (0, x[4:], g[4:])):
        leaf = part.clone().requires_grad_(True)
        module = make_expert(CONFIG.model, 0, e)
        module(leaf).backward(part_grad)
        expected.append(leaf.grad)
        for p, p_ref in zip(host.modules[0, e].parameters(), module.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, **CLOSE)
    torch.testing.assert_close(grad, torch.cat(expected), **CLOSE)
    assert host.tokens[0, 2] == 4 and host.tokens[0, 0] == 3 and host.samples == 2


def with_value(tensor: torch.Tensor, value: float) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[tensor.numel() // 2] = value
    return tensor


GOOD_X, GOOD_G = rand(4, D, seed=7), rand(4, D, seed=8)
BAD = {
    # name: (layer, rows, inputs, grad, message fragment)
    "not an moe block": (2, [(0, 4)], GOOD_X, GOOD_G, "not a mixture of experts"),
    "negative block": (-1, [(0, 4)], GOOD_X, GOOD_G, "not a mixture of experts"),
    "expert not hosted": (0, [(0, 2), (1, 2)], GOOD_X, GOOD_G, "not hosted here"),
    "wrong d_model": (0, [(0, 4)], rand(4, D + 1), rand(4, D + 1), f"\\[rows, {D}\\]"),
    "3-d inputs": (0, [(0, 4)], rand(1, 4, D), rand(1, 4, D), f"\\[rows, {D}\\]"),
    "1-d inputs": (0, [(0, 4)], rand(4), rand(4), f"\\[rows, {D}\\]"),
    "integer inputs": (0, [(0, 4)], torch.ones(4, D, dtype=torch.long), GOOD_G, "must be floats"),
    "nan inputs": (0, [(0, 4)], with_value(GOOD_X, float("nan")), GOOD_G, "non-finite"),
    "inf inputs": (0, [(0, 4)], with_value(GOOD_X, float("-inf")), GOOD_G, "non-finite"),
    "grad shape": (0, [(0, 4)], GOOD_X, rand(3, D), "gradient must be floats of the inputs' shape"),
    "integer grad": (0, [(0, 4)], GOOD_X, torch.ones(4, D, dtype=torch.long), "gradient must be floats"),
    "nan grad": (0, [(0, 4)], GOOD_X, with_value(GOOD_G, float("nan")), "gradient has non-finite"),
    "inf grad": (0, [(0, 4)], GOOD_X, with_value(GOOD_G, float("inf")), "gradient has non-finite"),
    "rows over max_rows": (0, [(0, 65)], rand(65, D), rand(65, D), "at most 64 rows"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_check_refuses_bad_requests_and_they_change_nothing(host, name):
    layer, rows, x, g, match = BAD[name]
    before = state(host)
    with pytest.raises(ValueError, match=match):
        host.check(layer, rows, x, g)
    with pytest.raises(ValueError, match=match):
        host.backward(layer, rows, x, g, samples=4)
    if "grad" not in name:  # a forward carries no gradient
        with pytest.raises(ValueError, match=match):
            host.forward(layer, rows, x)
    assert untouched(host)
    for key, module in host.modules.items():
        torch.testing.assert_close(module.state_dict(), before[key], rtol=0, atol=0)
    # and the host still answers a good request
    host.backward(0, [(0, 4)], GOOD_X, GOOD_G, samples=4)
    assert host.samples == 4 and host.optimizers[0, 0].samples == 4


def test_check_accepts_a_good_request_and_max_rows_is_configurable():
    host = ExpertHost(CONFIG, HOSTED, max_rows=3)
    try:
        host.check(0, [(0, 1), (2, 2)], rand(3, D), rand(3, D))
        host.check(0, [(0, 3)], rand(3, D, seed=1).double())  # any float dtype
        with pytest.raises(ValueError, match="at most 3 rows"):
            host.forward(0, [(0, 4)], rand(4, D))
    finally:
        host.shutdown()


@pytest.mark.parametrize("experts", [[], [4], [-1], [0, 4]], ids=["none", "too-high", "negative", "one-too-high"])
def test_a_host_of_experts_out_of_range_is_refused(experts):
    with pytest.raises(ValueError, match="subset of 0..3"):
        ExpertHost(CONFIG, experts)


def test_a_run_without_moe_has_nothing_to_host():
    with pytest.raises(ValueError, match="no mixture of experts"):
        ExpertHost(run_config(moe=False), [0])


def test_an_expert_behind_the_stage_ends_its_batch_where_the_stage_did(host):
    """It missed the batch's second micro-batch (a failed call): the next backward, from a stage at step 1,
    makes it step first on the 4 samples it has, then count the new micro-batch toward batch 2."""
    rows = [(0, 3), (2, 0)]
    x, g = rand(3, D, seed=1), rand(3, D, seed=2)
    reference = make_expert(CONFIG.model, 0, 0)
    optimizer = StageOptimizer(reference, CONFIG.optimizer)
    (reference(x) * g).sum().backward()
    optimizer.add_samples(4)
    optimizer.step()

    host.backward(0, rows, x, g, samples=4, stage_step=0)
    assert host.optimizers[0, 0].step_count == 0  # in step with the stage: nothing more
    _, stats = host.backward(0, rows, rand(3, D, seed=3), rand(3, D, seed=4), samples=4, stage_step=1)
    assert [s["samples"] for s in stats] == [4, 4]  # experts 0 and 2 of block 0 stepped on what they had
    assert host.optimizers[0, 0].step_count == 1 and host.optimizers[0, 0].samples == 4
    torch.testing.assert_close(host.modules[0, 0].state_dict(), reference.state_dict(), **CLOSE)
    # a stage far ahead cannot make it skip: one step per request at most, and none without samples
    _, stats = host.backward(0, [(0, 0), (2, 0)], x[:0], g[:0], samples=4, stage_step=50)
    assert host.optimizers[0, 0].step_count == 2 and len(stats) == 2


@pytest.mark.parametrize("name", ["adamw", "nadamw"])  # (NAdam's state has its momentum product too)
def test_an_expert_handed_over_steps_on_exactly_as_it_would_have(name):
    config = copy.deepcopy(CONFIG)
    config.optimizer.name, config.optimizer.beta1 = name, 0.99 if name == "nadamw" else 0.9
    config.validate()
    giver, taker = ExpertHost(config, HOSTED), ExpertHost(config, HOSTED)
    try:
        for seed in range(3):  # three steps of block 1 on the giver
            for part in (0, 1):
                giver.backward(1, [(0, 3), (2, 3)], rand(6, D, seed=10 * seed + part), rand(6, D, seed=99 - seed),
                               samples=4)
        assert giver.optimizers[1, 0].step_count == 3
        meta, tensors = giver.export_expert(1, 0)
        taker.import_expert(1, 0, meta, tensors)
        for host in (giver, taker):  # the same next step on both
            for part in (0, 1):
                host.backward(1, [(0, 6), (2, 0)], rand(6, D, seed=50 + part), rand(6, D, seed=60 + part), samples=4)
        torch.testing.assert_close(taker.modules[1, 0].state_dict(), giver.modules[1, 0].state_dict(), **CLOSE)
        assert taker.optimizers[1, 0].step_count == 4
    finally:
        giver.shutdown()
        taker.shutdown()


def test_once_handed_to_its_worker_only_the_worker_changes_the_experts(host):
    host.hand_over(host.owner, timeout=10)
    layer = host.layers[0]
    x, g = rand(3, CONFIG.model.d_model), rand(3, CONFIG.model.d_model, seed=1)
    with pytest.raises(WrongThread, match="accumulate of the hosted experts"):
        host.backward(layer, [(host.experts[0], 3)], x, g, samples=1)  # on the test's thread
    assert untouched(host)
    host.submit(host.backward, layer, [(host.experts[0], 3)], x, g, 1).result(10)  # on the worker: fine
    assert not untouched(host)


def trained_state(config=CONFIG) -> tuple:
    """An ExpertState of expert 2 after two steps of every block, and the host (the caller shuts it down)."""
    giver = ExpertHost(config, HOSTED)
    for seed in range(2):
        for layer in giver.layers:
            giver.backward(layer, [(0, 3), (2, 3)], rand(6, D, seed=seed), rand(6, D, seed=seed + 7), samples=8)
    return giver, ExpertState(giver, 2)


def test_an_expert_state_moves_whole_from_one_host_to_another():
    giver, state = trained_state()
    taker = ExpertHost(CONFIG, [2])
    try:
        info, tensors = state.state_dict()
        assert info.stage == 2 and info.step == 2 == state.step
        assert sorted(tensors) == sorted(f"{layer}.{name}" for layer in giver.layers for name in
                                         ("parameters", "exp_avg", "exp_avg_sq", "gradient", "counts", "adam_step"))
        assert state.nbytes() >= sum(t.numel() * t.element_size() for t in tensors.values())
        ExpertState(taker, 2).load_state_dict(info, tensors)
        for layer in giver.layers:
            torch.testing.assert_close(taker.modules[layer, 2].state_dict(), giver.modules[layer, 2].state_dict(),
                                       rtol=0, atol=0)
            assert taker.optimizers[layer, 2].step_count == 2
            mine, theirs = taker.optimizers[layer, 2].moments(), giver.optimizers[layer, 2].moments()
            assert mine.keys() == theirs.keys() and mine
            for key in mine:
                torch.testing.assert_close(mine[key].float(), theirs[key].float(), rtol=0, atol=0)
    finally:
        giver.shutdown()
        taker.shutdown()


def _forged(tensors: dict, layer: int) -> list:
    """(what, info changes, tensors) of states a stranger could send instead of `tensors`."""
    good = tensors[f"{layer}.parameters"]
    return [
        ("another expert", {"stage": 0}, tensors),
        ("a block missing", {}, {k: v for k, v in tensors.items() if not k.startswith(f"{layer}.")}),
        ("an unknown tensor", {}, {**tensors, f"{layer}.extra": good}),
        ("parameters short", {}, {**tensors, f"{layer}.parameters": good[:-1]}),
        ("parameters of another dtype", {}, {**tensors, f"{layer}.parameters": good.double()}),
        ("a NaN", {}, {**tensors, f"{layer}.parameters": torch.cat([good[:-1], torch.tensor([float("nan")])])}),
        ("a moment without the other", {}, {**tensors, f"{layer}.exp_avg_sq": torch.zeros(0)}),
        ("counts as floats", {}, {**tensors, f"{layer}.counts": tensors[f"{layer}.counts"].double()}),
        ("negative samples", {}, {**tensors, f"{layer}.counts": torch.tensor([2, -1])}),
        ("adam step not a number", {}, {**tensors, f"{layer}.adam_step": torch.zeros(2, dtype=torch.float64)}),
        ("another step than it says", {"step": 7}, tensors),
    ]


@pytest.mark.parametrize("case", range(11))
def test_a_forged_expert_state_is_refused_and_changes_nothing(case):
    giver, state = trained_state()
    taker = ExpertHost(CONFIG, [2])
    try:
        info, tensors = state.state_dict()
        what, changes, forged = _forged(tensors, giver.layers[-1])[case]  # the last block: the first would load
        before = {key: {k: v.clone() for k, v in m.state_dict().items()} for key, m in taker.modules.items()}
        with pytest.raises(StateRejected):
            ExpertState(taker, 2).load_state_dict(dataclasses.replace(info, **changes), forged)
        for key, module in taker.modules.items():  # not even the blocks before the bad one
            torch.testing.assert_close(module.state_dict(), before[key], rtol=0, atol=0, msg=what)
        assert all(opt.step_count == 0 and not opt.moments() for opt in taker.optimizers.values()), what
    finally:
        giver.shutdown()
        taker.shutdown()
