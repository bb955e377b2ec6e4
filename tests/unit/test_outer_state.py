"""The low-communication mode's state (swarm.state.OuterState): the outer step, what a state carries, checks."""

from __future__ import annotations

import pytest
import torch

from swarm.checkpoint.store import StageCheckpoints
from swarm.config import ConfigError, RunConfig
from swarm.state import StageState, StateRejected
from tests.unit.test_averaging_logic import tiny_config, trained_replica


def local_state(seed: int, steps: int = 0) -> StageState:
    optimizer = trained_replica(tiny_config(), seed, steps)
    return StageState(optimizer.module, optimizer, 1, "r", local_steps=3)


def drift(state: StageState, amount: float) -> None:
    with torch.no_grad():
        for p in state.optimizer.params:
            p.add_(amount)
    state.optimizer.step_count += 3  # as if three inner steps made it


def test_two_outer_steps_follow_nesterov_and_keep_the_steps_since_the_snapshot_on_top():
    state = local_state(1)
    slow0 = [s.clone() for s in state.outer.slow]
    drift(state, -0.5)
    delta, snapshot = state.pseudo_gradient()
    assert all(torch.allclose(d, torch.full_like(d, 0.5)) for d in delta)
    drift(state, -0.1)  # inner steps while the round ran
    state.outer_step(delta, snapshot, lr=0.7, momentum=0.9)
    # m = delta = 0.5; update = delta + 0.9 m = 0.95; slow = slow0 - 0.665
    for slow, start, param in zip(state.outer.slow, slow0, state.optimizer.params):
        torch.testing.assert_close(slow, start - 0.665)
        torch.testing.assert_close(param, start - 0.665 - 0.1)  # the steps since the snapshot stay on top
    assert state.step == 1 and state.outer.inner_step == 3 and state.optimizer.step_count == 6
    assert state.drift() > 0

    delta, snapshot = state.pseudo_gradient()  # = 0.1 everywhere
    state.outer_step(delta, snapshot, lr=0.7, momentum=0.9)
    # m = 0.9 * 0.5 + 0.1 = 0.55; update = 0.1 + 0.9 * 0.55 = 0.595
    for slow, start in zip(state.outer.slow, slow0):
        torch.testing.assert_close(slow, start - 0.665 - 0.7 * 0.595)
    assert all(torch.allclose(m, torch.full_like(m, 0.55)) for m in state.outer.momentum)
    assert state.step == 2 and state.optimizer.step_count == 6


def test_the_state_carries_the_slow_weights_not_the_drifted_ones_and_a_newcomer_starts_there():
    source = local_state(1, steps=1)
    drift(source, 0.25)
    with torch.no_grad():
        for m in source.outer.momentum:
            m.fill_(0.125)
    info, tensors = source.state_dict()
    assert info.step == 0 and int(tensors["outer/step"]) == 1  # (the one step before the mode began)
    newcomer = local_state(2)
    newcomer.load_state_dict(info, tensors)
    for param, slow, theirs in zip(newcomer.optimizer.params, newcomer.outer.slow, source.outer.slow):
        assert torch.equal(param, theirs) and torch.equal(slow, theirs)
    assert all(torch.equal(m, torch.full_like(m, 0.125)) for m in newcomer.outer.momentum)
    assert newcomer.drift() == 0.0


def test_an_outer_state_goes_through_a_checkpoint_and_back(tmp_path):
    config = tiny_config()
    source = local_state(1, steps=1)
    delta, snapshot = source.pseudo_gradient()
    drift(source, 0.1)
    source.outer_step([d + 0.01 for d in delta], snapshot, lr=0.7, momentum=0.9)
    info, tensors = source.state_dict()
    store = StageCheckpoints(tmp_path, "run", 1, keep=2)
    _, _, path = store.write(tensors, step=info.step, num_stages=2, state_hash=config.state_hash(), round_id="r",
                             group=1)
    _, _, loaded = store.load(path, state_hash=config.state_hash())
    restored = local_state(3)
    restored.load_state_dict(info, loaded)
    assert restored.step == 1 and restored.outer.inner_step == source.outer.inner_step == 4
    assert restored.optimizer.step_count == 4
    for mine, theirs in zip(restored.outer.momentum, source.outer.momentum):
        assert torch.equal(mine, theirs)


def test_modes_take_each_other_s_states():
    every_step = trained_replica(tiny_config(), 1, 2)
    plain = StageState(every_step.module, every_step, 1, "r")
    local = local_state(2)
    local.load_state_dict(*plain.state_dict())  # a run that averaged every step, resumed in the local mode
    assert local.step == 2 and local.outer.inner_step == 2
    assert all(float(m.abs().sum()) == 0 for m in local.outer.momentum)
    fresh = trained_replica(tiny_config(), 3, 0)
    back = StageState(fresh.module, fresh, 1, "r")
    source = local_state(4, steps=1)
    source.outer_step(*source.pseudo_gradient(), lr=0.7, momentum=0.9)
    back.load_state_dict(*source.state_dict())  # and back: the step is the state's (its outer steps; a peer's word
    assert back.optimizer.step_count == 1  # on the inner step is not taken where nothing bounds it)


@pytest.mark.parametrize("damage", ["nan-momentum", "shape", "index", "negative-step", "far-step", "slot"])
def test_a_damaged_outer_state_is_refused_and_changes_nothing(damage):
    info, tensors = local_state(1, steps=1).state_dict()
    if damage == "nan-momentum":
        tensors["outer/0/momentum"] = torch.full_like(tensors["outer/0/momentum"], float("nan"))
    elif damage == "shape":
        tensors["outer/0/momentum"] = torch.zeros(3)
    elif damage == "index":
        tensors["outer/999/momentum"] = torch.zeros(3)
    elif damage == "negative-step":
        tensors["outer/step"] = torch.tensor(-1)
    elif damage == "far-step":  # (outer step 0 of 3 local steps: at most 3 inner steps)
        tensors["outer/step"] = torch.tensor(4)
    else:
        tensors["outer/0/velocity"] = tensors["outer/0/momentum"]
    target = local_state(2)
    before = [p.clone() for p in target.optimizer.params]
    with pytest.raises(StateRejected):
        target.load_state_dict(info, tensors)
    assert all(torch.equal(p, b) for p, b in zip(target.optimizer.params, before))


@pytest.mark.parametrize("section, message", [
    ({"mode": "sometimes"}, "averaging.mode"),
    ({"mode": "local", "local_steps": 0}, "local_steps"),
    ({"mode": "local", "outer_lr": 0.0}, "outer_lr"),
    ({"mode": "local", "outer_momentum": 1.0}, "outer_momentum"),
    ({"mode": "local", "pseudo_gradient_compression": "zip"}, "pseudo_gradient_compression"),
    ({"mode": "local", "zero": {"enabled": True}}, "does not shard"),
])
def test_bad_local_mode_settings_are_refused_naming_the_field(section, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_dict({"averaging": section}).validate()
