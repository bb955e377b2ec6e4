"""The learning-rate schedule and the per-stage optimizer."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from torch import nn

from swarm.config import OptimizerConfig
from swarm.optim import OptimizerError, StageOptimizer, lr_at, param_groups

pytestmark = pytest.mark.timeout(120)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)


def accumulate(model: nn.Module, opt: StageOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    (loss * len(x)).backward()
    opt.add_samples(len(x))


def config(**overrides) -> OptimizerConfig:
    base = dict(lr=1e-2, min_lr=1e-3, warmup_steps=4, total_steps=20, batch_size=8, micro_batch_size=4)
    return OptimizerConfig(**{**base, **overrides})


def test_lr_warmup_and_cosine_endpoints():
    cfg = config()
    assert lr_at(0, cfg) == pytest.approx(cfg.lr / 4)
    assert lr_at(3, cfg) == pytest.approx(cfg.lr)
    assert lr_at(4, cfg) == pytest.approx(cfg.lr)  # cosine starts at the peak
    assert lr_at(12, cfg) == pytest.approx((cfg.lr + cfg.min_lr) / 2)
    assert lr_at(20, cfg) == pytest.approx(cfg.min_lr)
    assert lr_at(1000, cfg) == pytest.approx(cfg.min_lr)
    assert lr_at(0, config(warmup_steps=0)) == pytest.approx(cfg.lr)
    lrs = [lr_at(s, cfg) for s in range(4, 21)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_param_groups_decay_matrices_only():
    decay, no_decay = param_groups(small_model(), 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and len(decay["params"]) == 2  # embedding + linear
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 3


def test_two_micro_batches_equal_one_big_batch():
    x, y = batch(8, seed=1)
    split_model, whole_model = small_model(), small_model()
    split_opt, whole_opt = StageOptimizer(split_model, config()), StageOptimizer(whole_model, config())
    accumulate(split_model, split_opt, x[:4], y[:4])
    assert not split_opt.ready
    accumulate(split_model, split_opt, x[4:], y[4:])
    accumulate(whole_model, whole_opt, x, y)
    assert split_opt.ready and whole_opt.ready
    a, b = split_opt.step(), whole_opt.step()
    assert a["samples"] == b["samples"] == 8 and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    for p, q in zip(split_model.parameters(), whole_model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)
    assert split_opt.step_count == 1 and split_opt.samples == 0
    assert all(p.grad is None for p in split_model.parameters())


def test_clipping_caps_the_gradient_norm():
    model = small_model()
    opt = StageOptimizer(model, config(grad_clip=1e-3))
    accumulate(model, opt, *batch(8, seed=2))
    seen = {}
    # Catch the gradients AdamW actually receives, after averaging and clipping.
    original_step = opt.optimizer.step

    def spy_step(*args, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        seen["norm"] = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        return original_step(*args, **kwargs)

    opt.optimizer.step = spy_step
    stats = opt.step()
    assert stats["grad_norm"] > 1e-3  # the norm before clipping is reported
    assert seen["norm"] == pytest.approx(1e-3, rel=1e-3)


def test_non_finite_gradients_skip_the_step():
    model = small_model()
    opt = StageOptimizer(model, config())
    before = copy.deepcopy(model.state_dict())
    accumulate(model, opt, *batch(8, seed=3))
    next(model.parameters()).grad[0, 0] = float("nan")
    stats = opt.step()
    assert stats["skipped"] and not math.isfinite(stats["grad_norm"])
    assert opt.step_count == 0 and opt.samples == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    accumulate(model, opt, *batch(8, seed=3))
    assert not opt.step()["skipped"] and opt.step_count == 1


def test_step_without_samples_is_an_error():
    opt = StageOptimizer(small_model(), config())
    with pytest.raises(OptimizerError, match="no accumulated samples"):
        opt.step()


def test_state_dict_round_trip_continues_identically():
    model = small_model()
    opt = StageOptimizer(model, config())
    for seed in range(3):
        accumulate(model, opt, *batch(8, seed=seed))
        opt.step()
    clone = small_model()
    clone.load_state_dict(model.state_dict())
    clone_opt = StageOptimizer(clone, config())
    clone_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert clone_opt.step_count == 3
    for m, o in ((model, opt), (clone, clone_opt)):
        accumulate(m, o, *batch(8, seed=10))
        o.step()
    for p, q in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(p, q)
