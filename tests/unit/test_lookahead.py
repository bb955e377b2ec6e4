"""Look-ahead (optimizer.lookahead) and NAdamW (optimizer.name: nadamw).

StageOptimizer.preview is the step the optimizer would take, computed without taking it: when the
round's averaged gradient equals the server's own, the look-ahead parameters are exactly the ones the
step then makes. A snapshot taken while a server runs on look-ahead parameters holds the parameters
its state is really at. NAdamW's state carries its momentum product, and a state of the other
optimizer is refused, saying so.
"""

from __future__ import annotations

import pytest
import torch

from swarm.config import ConfigError, OptimizerConfig, RunConfig
from swarm.optim import StageOptimizer
from swarm.state import StageState, StateRejected
from tests.unit.test_averaging_logic import tiny_config, trained_replica


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))


@pytest.mark.parametrize("name", ["adamw", "nadamw"])
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_the_look_ahead_parameters_are_those_the_step_makes_when_the_average_is_the_own_gradient(name, clip):
    torch.manual_seed(0)
    cfg = OptimizerConfig(name=name, lr=3e-3, warmup_steps=2, total_steps=20, batch_size=4, micro_batch_size=4,
                          grad_clip=clip, weight_decay=0.1)
    opt = StageOptimizer(model(), cfg)
    for step in range(5):  # from empty moments on, through warm-up, with and without clipping
        sums = [torch.randn_like(p) * (40.0 if step == 2 else 0.4) for p in opt.params]
        given = [g.clone() for g in sums]
        ahead = opt.preview(sums, 4)
        assert all(torch.equal(a, b) for a, b in zip(sums, given))  # the gradients are left as they were
        opt.step_with([g / 4 for g in sums], 4)
        for a, p in zip(ahead, opt.params):
            torch.testing.assert_close(a, p.detach(), atol=1e-7, rtol=1e-6)


def test_a_non_finite_gradient_looks_ahead_to_no_move():
    opt = StageOptimizer(model(), OptimizerConfig(batch_size=4, micro_batch_size=4))
    sums = [torch.full_like(p, float("nan")) for p in opt.params]
    assert all(torch.equal(a, p.detach()) for a, p in zip(opt.preview(sums, 4), opt.params))


def test_a_snapshot_during_look_ahead_holds_the_parameters_the_state_is_at():
    config = tiny_config()
    opt = trained_replica(config, 1, steps=1)
    state = StageState(opt.module, opt, 1, "r")
    _, before = state.state_dict()
    state.lookahead_base = [p.detach().clone() for p in opt.params]
    with torch.no_grad():
        for p in opt.params:
            p.add_(1.0)
    _, during = state.state_dict()
    assert before.keys() == during.keys()
    assert all(torch.equal(before[k], during[k]) for k in before)


def test_adamw_with_lookahead_is_the_default_and_nadamw_state_carries_its_momentum_product():
    assert (OptimizerConfig().name, OptimizerConfig().beta1, OptimizerConfig().lookahead) == ("adamw", 0.9, True)
    assert OptimizerConfig(name="nadamw").beta1 == 0.99
    config = tiny_config()
    config.optimizer.name, config.optimizer.beta1 = "nadamw", 0.99
    opt = trained_replica(config, 1, steps=2)
    assert isinstance(opt.optimizer, torch.optim.NAdam)
    moments = opt.moments()
    assert {key.split("/")[1] for key in moments} == {"exp_avg", "exp_avg_sq", "step", "mu_product"}
    twin = trained_replica(config, 2, steps=0)
    StageState(twin.module, twin, 1, "r").load_state_dict(*StageState(opt.module, opt, 1, "r").state_dict())
    assert all(torch.equal(a, b) for a, b in zip(twin.params, opt.params))
    assert twin.moments().keys() == moments.keys()


@pytest.mark.parametrize("source, target", [("adamw", "nadamw"), ("nadamw", "adamw")])
def test_a_state_of_the_other_optimizer_is_refused_saying_so_and_changes_nothing(source, target):
    def config(name: str) -> RunConfig:
        c = tiny_config()
        c.optimizer.name, c.optimizer.beta1 = name, 0.9
        return c

    theirs = trained_replica(config(source), 1, steps=2)
    ours = trained_replica(config(target), 2, steps=1)
    before = [p.detach().clone() for p in ours.params]
    with pytest.raises(StateRejected, match="another optimizer"):
        StageState(ours.module, ours, 1, "r").load_state_dict(*StageState(theirs.module, theirs, 1, "r").state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, ours.params))


def test_unknown_optimizers_and_sharded_nadamw_are_config_errors():
    with pytest.raises(ConfigError, match="optimizer.name"):
        RunConfig.from_dict({"optimizer": {"name": "sgd"}})
    with pytest.raises(ConfigError, match="averaging.zero shards AdamW"):
        RunConfig.from_dict({"optimizer": {"name": "nadamw"}, "averaging": {"zero": {"enabled": True}}})
    RunConfig.from_dict({"optimizer": {"name": "adamw"}, "averaging": {"zero": {"enabled": True}}})


def test_nadams_momentum_product_is_computed_from_the_step_never_taken_as_sent():
    config = tiny_config()
    config.optimizer.name, config.optimizer.beta1 = "nadamw", 0.99
    theirs = trained_replica(config, 1, steps=3)
    info, tensors = StageState(theirs.module, theirs, 1, "r").state_dict()
    honest = {k: v.clone() for k, v in tensors.items() if k.endswith("/mu_product")}
    assert honest
    for key in honest:  # 1 - 0.9999999 in NAdam's denominators: updates ten million times too large
        tensors[key] = torch.tensor(0.9999999)
    ours = trained_replica(config, 2, steps=0)
    StageState(ours.module, ours, 1, "r").load_state_dict(info, tensors)
    loaded = {"optim/" + key: value for key, value in ours.moments().items() if key.endswith("/mu_product")}
    assert loaded.keys() == honest.keys()
    for key, value in loaded.items():
        torch.testing.assert_close(value, honest[key])
