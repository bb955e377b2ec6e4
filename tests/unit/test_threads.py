"""A stage replica's state is changed only on its owner's thread once handed over (swarm.threads)."""

from __future__ import annotations

import pytest
import torch

from swarm.config import ModelConfig, OptimizerConfig, RunConfig
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.state import StageState
from swarm.threads import CHECK_ENV, WrongThread, checks_on
from swarm.worker import Worker

CONFIG = RunConfig(model=ModelConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16),
                   optimizer=OptimizerConfig(batch_size=2, micro_batch_size=1)).validate()


def test_the_suite_runs_with_thread_checks_on():
    assert checks_on(), f"tests/conftest.py sets {CHECK_ENV}=1"


@pytest.fixture
def handed_over():
    module = build_stage(CONFIG, 0)
    state = StageState(module, StageOptimizer(module, CONFIG.optimizer), 0, "initial")
    state.set_round("before", 1)  # not handed over yet: any thread may (a server loading its state)
    worker = Worker("compute", 4)
    worker.hand_over(state.owner, timeout=10)
    yield state, worker
    worker.shutdown()


def test_a_mutator_on_another_thread_fails_and_changes_nothing(handed_over):
    state, worker = handed_over
    grads = [torch.ones_like(p) for p in state.optimizer.params]
    with pytest.raises(WrongThread, match="set_round of the stage 0 state ran on thread 'MainThread'"):
        state.set_round("r1", 2)
    with pytest.raises(WrongThread, match="accumulate"):
        state.optimizer.accumulate(grads, 1)
    with pytest.raises(WrongThread, match="enter_look_ahead"):
        state.enter_look_ahead([p + 1 for p in state.optimizer.params])
    info, tensors = state.state_dict()
    with pytest.raises(WrongThread, match="load_state_dict"):
        state.load_state_dict(info, tensors)
    assert (state.round_id, state.group, state.optimizer.samples) == ("before", 1, 0)


def test_the_same_mutators_run_on_the_owner(handed_over):
    state, worker = handed_over
    grads = [torch.ones_like(p) for p in state.optimizer.params]
    worker.call(lambda: state.set_round("r1", 2), timeout=10)
    worker.call(lambda: state.optimizer.accumulate(grads, 2), timeout=10)
    stats = worker.call(state.optimizer.step, timeout=10)
    assert (state.round_id, state.group, stats["step"]) == ("r1", 2, 1)
    info, tensors = worker.call(state.state_dict, timeout=10)
    worker.call(lambda: state.load_state_dict(info, tensors), timeout=10)
