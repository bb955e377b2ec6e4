"""Mixture of experts: routing plan, gates, aux loss, the layer against a per-token loop, config, stages, reference."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from swarm.config import ConfigError, ModelConfig, MoEConfig, RunConfig, StagesConfig
from swarm.model import GPT, build_stage, build_stages, make_block, make_expert, record_moe, split_model
from swarm.model.moe import (
    DROPPED,
    PROCESSED,
    Expert,
    MoEFeedForward,
    aux_loss,
    capacity,
    gates,
    route,
    total_aux_loss,
)
from swarm.reference import ReferenceTrainer

pytestmark = pytest.mark.timeout(60)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# four tokens over three experts; top-2 choices: (0, 1), (0, 2), (1, 2), (0, 1)
PROBS = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.2, 0.5, 0.3], [0.7, 0.2, 0.1]], dtype=torch.float64)


def moe_model(**moe) -> ModelConfig:
    settings = {"every": 2, "num_experts": 4, "top_k": 2, "capacity_factor": 1.0, "aux_loss_weight": 0.01, **moe}
    return ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=2, d_model=16, seed=3, moe=MoEConfig(**settings))


def moe_run(num_stages: int = 2, **moe) -> RunConfig:
    return RunConfig(model=moe_model(**moe), stages=StagesConfig(num_stages=num_stages)).validate()


def naive_route(probs: torch.Tensor, k: int, cap: int) -> tuple[list[list[int]], list[list[int]]]:
    """Top-k (stable) and GShard priority written as plain loops."""
    n, e = probs.shape
    experts = [sorted(range(e), key=lambda j: (-float(probs[t, j]), j))[:k] for t in range(n)]
    status, used = [[PROCESSED] * k for _ in range(n)], [0] * e
    for choice in range(k):
        for t in range(n):
            chosen = experts[t][choice]
            if cap and used[chosen] >= cap:
                status[t][choice] = DROPPED
            else:
                used[chosen] += 1
    return experts, status


# ---- plan: top-k, capacity, priority --------------------------------------------------------------


def test_plan_gives_first_choices_priority_over_second_choices_then_token_position():
    cf = 0.375  # C = ceil(0.375 * 4 tokens * 2 / 3 experts) = 1
    plan = route(PROBS, top_k=2, capacity_factor=cf)
    assert plan.capacity == 1 == capacity(4, 2, 3, cf)
    assert plan.experts.tolist() == [[0, 1], [0, 2], [1, 2], [0, 1]]
    # expert 0: token 0's first choice; expert 1: token 2's FIRST choice beats token 0's earlier second choice;
    # expert 2: token 1's second choice (token 2's comes later)
    assert plan.status.tolist() == [[0, 1], [1, 0], [0, 1], [1, 1]]
    assert plan.dropped() == 5


def test_plan_without_capacity_drops_nothing_and_ties_go_to_the_lower_expert():
    plan = route(PROBS, top_k=2, capacity_factor=0.0)
    assert plan.capacity == 0 and plan.dropped() == 0
    uniform = route(torch.full((5, 4), 0.25), top_k=3, capacity_factor=0.0)
    assert uniform.experts.tolist() == [[0, 1, 2]] * 5


@pytest.mark.parametrize("k, cf", [(1, 1.0), (2, 1.25), (2, 0.5), (3, 0.7), (2, 0.0)])
def test_plan_matches_a_loop_and_is_deterministic(k, cf):
    gen = torch.Generator().manual_seed(k)
    probs = torch.softmax(torch.randn(64, 6, generator=gen), dim=-1)
    plan = route(probs, k, cf)
    experts, status = naive_route(probs, k, plan.capacity)
    assert plan.experts.tolist() == experts and plan.status.tolist() == status
    again = route(probs.clone(), k, cf)
    assert torch.equal(again.experts, plan.experts) and torch.equal(again.status, plan.status)
    if cf:  # no expert over capacity
        kept = plan.experts[plan.processed]
        assert int(torch.bincount(kept, minlength=6).max()) <= plan.capacity == math.ceil(cf * 64 * k / 6)


# ---- gates and aux loss ---------------------------------------------------------------------------


def test_gates_k1_are_the_raw_probability_and_zero_when_dropped():
    plan = route(PROBS, top_k=1, capacity_factor=0.5)  # C = ceil(0.5 * 4 / 3) = 1: only token 0 keeps expert 0
    assert plan.experts.tolist() == [[0], [0], [1], [0]] and plan.status.tolist() == [[0], [1], [0], [1]]
    assert gates(PROBS, plan).tolist() == [[0.5], [0.0], [0.5], [0.0]]


def test_gates_k2_renormalize_over_processed_slots_and_never_nan():
    plan = route(PROBS, top_k=2, capacity_factor=0.375)  # status [[0, 1], [1, 0], [0, 1], [1, 1]]
    assert gates(PROBS, plan).tolist() == [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]
    full = gates(PROBS, route(PROBS, top_k=2, capacity_factor=0.0))
    assert torch.allclose(full[0], torch.tensor([0.5 / 0.8, 0.3 / 0.8], dtype=torch.float64))
    probs = PROBS.clone().requires_grad_(True)
    gates(probs, plan).sum().backward()  # a token with nothing processed: zero gradient, not NaN
    assert torch.isfinite(probs.grad).all() and probs.grad[3].abs().sum() == 0


def test_aux_loss_is_one_when_routing_is_uniform():
    probs = torch.full((8, 4), 0.25, dtype=torch.float64)
    experts = torch.arange(8).remainder(4).unsqueeze(1)
    assert aux_loss(probs, experts, 4).item() == pytest.approx(1.0)
    balanced_pairs = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert aux_loss(probs[:4], balanced_pairs, 4).item() == pytest.approx(1.0)


def test_aux_loss_by_hand_counts_choices_before_capacity_and_grads_through_p_only():
    probs = PROBS.clone().requires_grad_(True)
    plan = route(PROBS, top_k=2, capacity_factor=0.375)  # drops do not change f
    f = torch.tensor([3, 3, 2], dtype=torch.float64) / 8  # expert 0 chosen 3 times, 1 three times, 2 twice
    p_mean = PROBS.mean(0)
    value = aux_loss(probs, plan.experts, 3)
    assert value.item() == pytest.approx(3 * float((f * p_mean).sum()))
    value.backward()
    assert torch.allclose(probs.grad, (3 * f / 4).expand(4, 3))


# ---- the layer --------------------------------------------------------------------------------------


def make_layer(k: int, cf: float, num_experts: int = 4, d: int = 8, hidden: int = 12) -> MoEFeedForward:
    torch.manual_seed(0)  # nn.Linear's default init; the model's parts are seeded separately
    experts = [Expert(d, hidden) for _ in range(num_experts)]
    return MoEFeedForward(d, experts, k, cf, layer=5).double()


def naive_forward(layer: MoEFeedForward, u: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's choice, then each processed slot's expert on that token alone."""
    flat = u.reshape(-1, u.shape[-1])
    probs = torch.softmax(layer.router(flat), dim=-1).detach()
    plan = route(probs, layer.top_k, layer.capacity_factor)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        kept = [(int(e), float(probs[t, e])) for e, s in zip(plan.experts[t], plan.status[t]) if s == PROCESSED]
        norm = 1.0 if layer.top_k == 1 else sum(p for _, p in kept)
        for e, p in kept:
            out[t] += p / norm * layer.experts[e](flat[t : t + 1])[0]
    return out.view(u.shape)


@pytest.mark.parametrize("k, cf", [(1, 1.0), (2, 0.5), (2, 0.0), (3, 0.8)])
def test_layer_equals_a_per_token_loop_over_experts(k, cf):
    layer = make_layer(k, cf)
    u = torch.randn(3, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with record_moe() as records:
        out = layer(u)
    assert torch.allclose(out, naive_forward(layer, u), atol=1e-12, rtol=0)
    (record,) = records
    assert record.layer == 5 and record.plan.experts.shape == (21, k)
    if cf == 0.5:
        assert record.plan.dropped() > 0  # the case exercises drops
    probs = torch.softmax(layer.router(u.reshape(-1, 8)), dim=-1)
    assert torch.allclose(record.aux_loss, aux_loss(probs, record.plan.experts, 4))


def test_layer_with_a_forced_plan_uses_it_and_records_nothing_outside_a_recorder():
    layer = make_layer(2, 0.0)
    u = torch.randn(5, 8, dtype=torch.float64)
    with record_moe() as records:
        free = layer(u)
    forced = layer(u, plan=records[0].plan)  # no recorder open: nothing kept, no error
    assert torch.equal(free, forced)
    with record_moe() as outer:
        with record_moe() as inner:
            layer(u)
        assert len(inner) == 1 and outer == []


@pytest.mark.parametrize("k", [1, 2])
def test_gradients_reach_the_router_and_every_expert_used(k):
    layer = make_layer(k, 1.0)
    u = torch.randn(4, 6, 8, dtype=torch.float64, requires_grad=True)
    out = layer(u)
    out.square().sum().backward()  # the main loss alone: the router learns through the gates (also for k = 1)
    assert layer.router.weight.grad.abs().sum() > 0 and u.grad.abs().sum() > 0
    for expert in layer.experts:
        assert expert.up.weight.grad is not None and expert.down.weight.grad.abs().sum() > 0
    layer.zero_grad()
    with record_moe() as records:
        layer(u)
    total_aux_loss(records).backward()  # the aux loss alone: only the router
    assert layer.router.weight.grad.abs().sum() > 0
    assert all(e.up.weight.grad is None or e.up.weight.grad.abs().sum() == 0 for e in layer.experts)


# ---- config -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "moe, model, num_stages, field",
    [
        ({"every": 1}, {}, 2, "model.moe.every"),  # block 0 is not the last block of stage 0
        ({"every": 3}, {"n_layer": 8}, 4, "model.moe.every"),  # block 2 is the first block of stage 1 of 4
        ({"every": 5}, {}, 2, "model.moe.every"),  # no block at all
        ({"every": 0}, {}, 2, "model.moe.every"),
        ({"num_experts": 1, "top_k": 1}, {}, 2, "model.moe.num_experts"),
        ({"top_k": 0}, {}, 2, "model.moe.top_k"),
        ({"top_k": 9}, {}, 2, "model.moe.top_k"),
        ({"capacity_factor": -0.5}, {}, 2, "model.moe.capacity_factor"),
        ({"aux_loss_weight": -0.01}, {}, 2, "model.moe.aux_loss_weight"),
        ({"expert_hidden": -1}, {}, 2, "model.moe.expert_hidden"),
        ({"top_k": "2"}, {}, 2, "model.moe.top_k"),
        ({"experts": 8}, {}, 2, "model.moe.experts"),
    ],
)
def test_bad_moe_configs_name_the_field(moe, model, num_stages, field):
    data = {"model": {**model, "moe": moe}, "stages": {"num_stages": num_stages}}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        RunConfig.from_dict(data)


@pytest.mark.parametrize("every, n_layer, num_stages, layers", [
    (2, 4, 2, [1, 3]), (2, 8, 4, [1, 3, 5, 7]), (3, 4, 2, [2]), (1, 4, 1, [0, 1, 2, 3]), (4, 8, 2, [3, 7]),
])
def test_placement_rule_accepts_the_last_block_of_a_stage_or_the_last_stage(every, n_layer, num_stages, layers):
    config = RunConfig.from_dict({"model": {"n_layer": n_layer, "moe": {"every": every}},
                                  "stages": {"num_stages": num_stages}})
    assert config.model.moe_layers() == layers


def test_an_unchecked_config_with_a_misplaced_moe_block_cannot_build_its_stages():
    config = RunConfig(model=moe_model(every=1), stages=StagesConfig(num_stages=2))  # not validated
    with pytest.raises(ConfigError, match=r"model\.moe\.every"):
        build_stage(config, 0)


def test_moe_config_round_trips_exactly(tmp_path):
    config = RunConfig.load(CONFIGS / "moe.yaml")
    assert config.model.moe == MoEConfig(every=2, num_experts=8, top_k=2, capacity_factor=1.25,
                                         aux_loss_weight=0.01, expert_hidden=256, expert_servers=True, k_min=1)
    config.save(tmp_path / "again.yaml")
    again = RunConfig.load(tmp_path / "again.yaml")
    assert again == config and again.to_yaml() == config.to_yaml()
    assert config.state_hash() != RunConfig.load(CONFIGS / "tiny.yaml").state_hash()
    assert RunConfig.from_dict({"model": {"moe": None}}) == RunConfig()


def test_dense_configs_are_unchanged():
    # Values computed at the commit before MoE existed (854b240).
    tiny = RunConfig.load(CONFIGS / "tiny.yaml")
    assert tiny.state_hash() == "b62b8ae4fca273359ec111a97b773524ac12719d064134adc6776823ecf5809b"
    assert RunConfig.load(CONFIGS / "small.yaml").state_hash() == (
        "3de8038a8902bd78c13ee8832e9931c53c72af41e868874884892dd30d4d3f30")
    assert RunConfig().state_hash() == "78bfbed634bcb560bd23e090b45440bfb14cc5599dd432498e97d820a04c5246"
    assert "moe" not in tiny.to_yaml() and "moe" not in tiny.to_dict()["model"]
    model = GPT(tiny.model)
    assert sum(p.numel() for p in model.parameters()) == 867072
    with torch.no_grad():
        fingerprint = sum(float(p.double().abs().sum()) for p in model.parameters())
    assert fingerprint == pytest.approx(11515.824567933027, rel=1e-9)
    assert tiny.model.moe_layers() == [] and all(type(b.mlp).__name__ == "MLP" for b in model.blocks)


# ---- model and stages -------------------------------------------------------------------------------


def test_moe_blocks_are_the_selected_ones_and_experts_are_parts_of_their_own():
    cfg = moe_model(expert_hidden=24)
    model = GPT(cfg)
    assert [isinstance(b.mlp, MoEFeedForward) for b in model.blocks] == [False, True, False, True]
    moe = model.blocks[3].mlp
    assert moe.router.bias is None and moe.router.weight.shape == (4, 16) and moe.experts[0].up.weight.shape == (24, 16)
    for e in range(4):  # built alone (as an expert host would) equals built inside its block
        alone = make_expert(cfg, 3, e).state_dict()
        for name, tensor in moe.experts[e].state_dict().items():
            assert torch.equal(alone[name], tensor), (e, name)
    assert not torch.equal(moe.experts[0].up.weight, moe.experts[1].up.weight)
    assert not torch.equal(moe.experts[0].up.weight, model.blocks[1].mlp.experts[0].up.weight)
    # the attention of an MoE block and a dense block draws as it did without MoE
    dense = make_block(dataclasses.replace(cfg, moe=None), 3)
    assert torch.equal(dense.attn.qkv.weight, model.blocks[3].attn.qkv.weight)
    with pytest.raises(ValueError, match="not a mixture"):
        make_expert(cfg, 2, 0)


def run_stages_with_aux(stages, idx, targets, alpha):
    """The pipeline as a swarm would run it, each stage adding its own layers' aux term to its backward:
    last stage ((CE + alpha * aux) * n).backward(); others backward([out, aux], [grad, alpha * n])."""
    n = idx.shape[0]
    saved = []
    x = idx
    for stage in stages[:-1]:
        if not stage.is_first:
            x = x.detach().requires_grad_()
        with record_moe() as records:
            out = stage(x)
        saved.append((x, out, total_aux_loss(records)))
        x = out
    last_input = x.detach().requires_grad_()
    with record_moe() as records:
        loss = stages[-1](last_input, targets)
    aux = total_aux_loss(records)
    ((loss + alpha * aux) * n).backward()
    grad = last_input.grad
    for stage_input, out, stage_aux in reversed(saved):
        roots, grads = [out], [grad]
        if stage_aux is not None:
            roots.append(stage_aux)
            grads.append(torch.tensor(alpha * n))
        torch.autograd.backward(roots, grads)
        grad = stage_input.grad if stage_input.is_floating_point() else None
    return loss


def test_build_stage_splits_an_moe_model_and_per_stage_aux_backward_equals_the_full_objective():
    config = moe_run(num_stages=2, capacity_factor=0.75)
    model = GPT(config.model)
    stages = build_stages(config)
    assert [s.moe_layers for s in stages] == [[1], [3]]
    for alone, sliced in zip(stages, split_model(copy.deepcopy(model), 2)):
        a, b = alone.state_dict(), sliced.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert "blocks.1.mlp.experts.3.down.weight" in stages[0].state_dict()
    assert stages[1].full_model_name("blocks.1.mlp.router.weight") == "blocks.3.mlp.router.weight"

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (3, 17), generator=gen)
    idx, targets = tokens[:, :-1], tokens[:, 1:]
    alpha = 0.5  # large, so the aux term shows in the gradients
    with record_moe() as records:
        full_loss = model(idx, targets)
    assert [r.layer for r in records] == [1, 3]
    ((full_loss + alpha * total_aux_loss(records)) * 3).backward()
    split_loss = run_stages_with_aux(stages, idx, targets, alpha)
    assert torch.allclose(split_loss, full_loss, atol=1e-6)
    full = dict(model.named_parameters())
    for stage in stages:
        for name, param in stage.named_parameters():
            reference = full[stage.full_model_name(name)].grad
            assert param.grad is not None and torch.allclose(param.grad, reference, atol=1e-6), name


# ---- reference trainer ------------------------------------------------------------------------------


def tiny_moe_config() -> RunConfig:
    config = RunConfig.load(CONFIGS / "moe.yaml")  # configs/moe.yaml's model at a tiny size
    config.model.d_model, config.model.n_head, config.model.seq_len = 32, 4, 32
    config.model.moe.expert_hidden = 32
    config.optimizer.batch_size, config.optimizer.micro_batch_size = 8, 4
    config.optimizer.warmup_steps, config.optimizer.total_steps = 5, 30
    config.data.max_bytes = 200_000
    return config.validate()


def test_reference_trains_an_moe_model_and_reports_the_aux_loss():
    trainer = ReferenceTrainer(tiny_moe_config())
    progress = []
    summary = trainer.run(20, on_progress=progress.append, eval_max_batches=2)
    assert all("aux_loss" in p and 0 <= p["dropped"] < 1 and not p["skipped"] for p in progress)
    assert summary["final_loss"] < 0.8 * summary["initial_loss"]
    assert 1.0 < summary["final_aux_loss"] < 3.0  # two MoE layers, each near 1 when balanced
    assert all(opt.step_count == 20 for opt in trainer.optimizers)
    router = trainer.stages[0].blocks[1].mlp.router.weight
    assert not torch.equal(router, build_stage(trainer.config, 0).blocks[1].mlp.router.weight)


def test_reference_of_a_dense_config_reports_no_aux_loss():
    config = tiny_moe_config()
    config.model.moe = None
    stats = ReferenceTrainer(config.validate()).train_step()
    assert "aux_loss" not in stats and "dropped" not in stats
