"""The GPT, its split into stages, per-part deterministic init, and request validation."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from swarm.config import ModelConfig, RunConfig, StagesConfig
from swarm.model import GPT, StageModule, build_stage, build_stages, make_block, split_model

pytestmark = pytest.mark.timeout(60)

TINY = ModelConfig(vocab_size=256, seq_len=16, n_layer=4, n_head=4, d_model=32, mlp_ratio=4, seed=7)


def run_config(num_stages: int, **model_overrides) -> RunConfig:
    model = dataclasses.replace(TINY, **model_overrides)
    return RunConfig(model=model, stages=StagesConfig(num_stages=num_stages)).validate()


def batch(batch_size: int = 3, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (batch_size, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def run_pipeline(stages: list[StageModule], idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward and backward as the swarm does: activations detached between stages, grads sent back."""
    inputs, outputs = [], []
    x = idx
    for stage in stages[:-1]:
        if not stage.is_first:
            x = x.detach().requires_grad_()
        inputs.append(x)
        x = stage(x)
        outputs.append(x)
    last_input = x if stages[-1].is_first else x.detach().requires_grad_()
    loss = stages[-1](last_input, targets)
    loss.backward()
    grad = last_input.grad
    for stage_input, stage_output in zip(reversed(inputs), reversed(outputs), strict=True):
        stage_output.backward(grad)
        grad = stage_input.grad
    return loss


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_split_stages_match_full_model_loss_and_every_gradient(num_stages):
    model = GPT(TINY)
    stages = split_model(copy.deepcopy(model), num_stages)
    idx, targets = batch()

    full_loss = model(idx, targets)
    full_loss.backward()
    split_loss = run_pipeline(stages, idx, targets)

    assert torch.allclose(split_loss, full_loss, atol=1e-6)
    full_params = dict(model.named_parameters())
    seen = set()
    for stage in stages:
        for name, param in stage.named_parameters():
            full_name = stage.full_model_name(name)
            seen.add(full_name)
            assert param.grad is not None, full_name
            assert torch.allclose(param.grad, full_params[full_name].grad, atol=1e-6), full_name
    assert seen == set(full_params), "stages must cover every parameter exactly"


def test_split_shares_modules_and_rejects_uneven_split():
    model = GPT(TINY)
    stages = split_model(model, 2)
    assert stages[0].embed is model.embed and stages[1].head is model.head
    assert stages[1].blocks[0] is model.blocks[2]
    assert [s.is_first for s in stages] == [True, False] and [s.is_last for s in stages] == [False, True]
    with pytest.raises(ValueError, match="divisor of n_layer"):
        split_model(model, 3)


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_build_stage_equals_slice_of_full_model(num_stages):
    config = run_config(num_stages)
    full = split_model(GPT(config.model), num_stages)
    for index in range(num_stages):
        alone = build_stage(config, index).state_dict()
        sliced = full[index].state_dict()
        assert list(alone) == list(sliced)
        for name in sliced:
            assert torch.equal(alone[name], sliced[name]), f"stage {index}: {name}"


def test_state_dict_names_are_stable():
    first, last = build_stages(run_config(2))
    assert "embed.tok.weight" in first.state_dict() and "embed.pos.weight" in first.state_dict()
    assert "blocks.1.attn.qkv.weight" in first.state_dict() and "head.proj.weight" in last.state_dict()
    assert not any(name.startswith("head.") for name in first.state_dict())
    assert last.full_model_name("blocks.0.mlp.down.weight") == "blocks.2.mlp.down.weight"


def test_init_is_deterministic_per_seed_and_leaves_global_rng_alone():
    rng_before = torch.get_rng_state()
    once = build_stage(run_config(4), 1).state_dict()
    twice = build_stage(run_config(4), 1).state_dict()
    other_seed = build_stage(run_config(4, seed=8), 1).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before)
    for name in once:
        assert torch.equal(once[name], twice[name]), name
    weight = "blocks.0.attn.qkv.weight"
    assert not torch.equal(once[weight], other_seed[weight])
    # different blocks of one model must not share a generator stream
    assert not torch.equal(make_block(TINY, 0).attn.qkv.weight, make_block(TINY, 1).attn.qkv.weight)


def test_residual_projections_have_scaled_init_std():
    cfg = dataclasses.replace(TINY, d_model=256, n_layer=8, n_head=8)
    block = make_block(cfg, 3)
    expected = 0.02 / math.sqrt(2 * cfg.n_layer)
    for layer in block.residual_projections():
        assert layer.weight.std().item() == pytest.approx(expected, rel=0.05)
        assert torch.count_nonzero(layer.bias) == 0
    assert block.mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(block.ln1.weight == 1) and torch.count_nonzero(block.ln1.bias) == 0


def test_stage_zero_is_causal():
    first = build_stage(run_config(2), 0)
    idx, _ = batch(batch_size=2)
    t = 6
    changed = idx.clone()
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = first(idx), first(changed)
    assert torch.equal(before[:, : t + 1], after[:, : t + 1])
    assert not torch.allclose(before[:, t + 1 :], after[:, t + 1 :])


def test_gpt_forward_returns_logits_and_validates_tokens():
    model = GPT(TINY)
    idx, _ = batch(batch_size=2, seq=5)
    assert model(idx).shape == (2, 5, TINY.vocab_size)
    with pytest.raises(ValueError, match="2-D"):
        model(idx[0])
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        model(idx.float())


def test_stages_reject_malformed_requests_with_clear_messages():
    first, middle, last = (build_stage(run_config(4), i) for i in (0, 1, 3))
    idx, targets = batch(batch_size=2, seq=8)
    hidden = torch.zeros(2, 8, TINY.d_model)
    assert first.expects_tokens and not middle.expects_tokens and last.needs_targets

    with pytest.raises(ValueError, match="token ids must have dtype torch.int64"):
        first(idx.float())
    with pytest.raises(ValueError, match=r"must lie in \[0, 256\)"):
        first(idx + TINY.vocab_size)
    with pytest.raises(ValueError, match="needs targets"):
        last(hidden)
    with pytest.raises(ValueError, match="last dimension d_model=32, got 31"):
        middle(torch.zeros(2, 8, 31))
    with pytest.raises(ValueError, match="NaN"):
        middle(hidden.index_fill(1, torch.tensor([3]), float("nan")))
    with pytest.raises(ValueError, match="floating-point"):
        middle(idx.unsqueeze(-1).expand(2, 8, TINY.d_model))
    with pytest.raises(ValueError, match="batch size of at least 1"):
        middle(torch.zeros(0, 8, TINY.d_model))
    with pytest.raises(ValueError, match="input's shape"):
        last(hidden, targets[:, :4])
    with pytest.raises(ValueError, match="takes no targets"):
        middle(hidden, targets)
    assert last(hidden, targets).dim() == 0
