"""A stage's state with sharded moments (averaging.zero): checkpoints carry the chunks a replica holds,
and a state of either kind (full moments or chunks) loads into a replica of either kind."""

from __future__ import annotations

import logging

import pytest
import torch

from swarm.checkpoint.store import StageCheckpoints
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.state import StageState, StateRejected
from swarm.zero import ChunkMoments, Layout, ShardedMoments
from tests.unit.test_averaging_logic import tiny_config, trained_replica

CHUNK = 1000


def adamw_config():
    """tiny.yaml with AdamW, the optimizer sharded rounds run (averaging.zero)."""
    config = tiny_config()
    config.optimizer.name, config.optimizer.beta1 = "adamw", 0.9
    return config


def sharded(optimizer: StageOptimizer, chunk: int = CHUNK) -> ShardedMoments:
    optimizer.shards = ShardedMoments(Layout([p.shape for p in optimizer.params], chunk))
    return optimizer.shards


def full_moments(optimizer: StageOptimizer, layout: Layout) -> dict[str, torch.Tensor]:
    state = optimizer.optimizer.state
    return {slot: layout.flatten([state[p][slot] for p in optimizer.params]) for slot in ("exp_avg", "exp_avg_sq")}


def fresh_replica(config, seed: int) -> StageOptimizer:
    torch.manual_seed(seed)
    return StageOptimizer(build_stage(config, 1), config.optimizer)


def chunks_of(optimizer: StageOptimizer, keep) -> dict[int, ChunkMoments]:
    """Some chunks of an unsharded replica's moments, as a sharded replica would hold them."""
    layout = optimizer.shards.layout if optimizer.shards is not None else Layout(
        [p.shape for p in optimizer.params], CHUNK)
    flat = full_moments(optimizer, layout)
    return {c: ChunkMoments(flat["exp_avg"][slice(*layout.bounds(c))].clone(),
                            flat["exp_avg_sq"][slice(*layout.bounds(c))].clone(), optimizer.step_count)
            for c in range(layout.num_chunks) if keep(c)}


def test_full_moments_load_into_a_sharded_replica_as_every_chunk():
    config = adamw_config()
    source, target = trained_replica(config, 1, steps=2), fresh_replica(config, 2)
    shards = sharded(target)
    StageState(target.module, target, 1, "r").load_state_dict(*StageState(source.module, source, 1, "r").state_dict())

    assert target.step_count == 2 and not target.optimizer.state  # nothing in torch's AdamW: all in the chunks
    layout = shards.layout
    assert sorted(shards.chunks) == list(range(layout.num_chunks)) and shards.step == 2
    flat = full_moments(source, layout)
    for c, moments in shards.chunks.items():
        assert moments.steps == 2
        assert torch.equal(moments.exp_avg, flat["exp_avg"][slice(*layout.bounds(c))])
        assert torch.equal(moments.exp_avg_sq, flat["exp_avg_sq"][slice(*layout.bounds(c))])


def test_a_sharded_state_goes_through_a_checkpoint_and_back_with_only_its_chunks(tmp_path):
    config = adamw_config()
    trained = trained_replica(config, 1, steps=2)
    holder = fresh_replica(config, 3)
    shards = sharded(holder)
    StageState(holder.module, holder, 1, "r").load_state_dict(*StageState(trained.module, trained, 1, "r").state_dict())
    shards.replace({c: m for c, m in shards.chunks.items() if c % 3 == 0}, 2)  # it owns a third of them
    info, tensors = StageState(holder.module, holder, 1, "r").state_dict()
    assert not any(name.startswith("optim/") for name in tensors)
    assert {name for name in tensors if name.endswith("/steps")} == {f"zero/{c}/steps" for c in shards.chunks}
    # a joiner downloading the stage's state gets the parameters only
    assert not any(name.startswith("zero/") for name in StageState(holder.module, holder, 1, "r").state_dict(
        shards=False)[1])

    store = StageCheckpoints(tmp_path, "run", 1, keep=2)
    _, _, path = store.write(tensors, step=info.step, num_stages=2, state_hash=config.state_hash(), round_id="r",
                             group=1)
    _, _, loaded = store.load(path, state_hash=config.state_hash())
    restored = fresh_replica(config, 4)
    again = sharded(restored)
    StageState(restored.module, restored, 1, "x").load_state_dict(info, loaded)

    assert restored.step_count == 2 and again.step == 2 and sorted(again.chunks) == sorted(shards.chunks)
    for c, moments in shards.chunks.items():
        assert torch.equal(again.chunks[c].exp_avg, moments.exp_avg) and again.chunks[c].steps == moments.steps
    for mine, theirs in zip(restored.params, trained.params):
        assert torch.equal(mine, theirs)


def test_chunks_load_into_an_unsharded_replica_as_full_moments_zeros_where_missing(caplog):
    config = adamw_config()
    trained = trained_replica(config, 1, steps=2)
    holder = fresh_replica(config, 3)
    shards = sharded(holder)
    shards.replace(chunks_of(trained, lambda c: c != 1), 2)
    holder.step_count = 2
    info, tensors = StageState(holder.module, holder, 1, "r").state_dict()
    target = fresh_replica(config, 5)
    with caplog.at_level(logging.WARNING):
        StageState(target.module, target, 1, "x").load_state_dict(info, tensors)

    assert "start from zero" in caplog.text
    layout = shards.layout
    got, expected = full_moments(target, layout), full_moments(trained, layout)
    for c in range(layout.num_chunks):
        span = slice(*layout.bounds(c))
        for slot in got:
            if c == 1:
                assert not got[slot][span].any()
            else:
                assert torch.equal(got[slot][span], expected[slot][span]), (c, slot)


def test_chunks_of_another_size_become_the_chunks_they_wholly_cover():
    config = adamw_config()
    trained = trained_replica(config, 1, steps=1)
    holder = fresh_replica(config, 3)
    sharded(holder, chunk=500)
    holder.shards.replace(chunks_of_sized(trained, 500, lambda c: c < 4), 1)  # elements 0..2000
    holder.step_count = 1
    info, tensors = StageState(holder.module, holder, 1, "r").state_dict()
    target = fresh_replica(config, 4)
    shards = sharded(target, chunk=CHUNK)
    StageState(target.module, target, 1, "x").load_state_dict(info, tensors)
    assert sorted(shards.chunks) == [0, 1]


def chunks_of_sized(optimizer: StageOptimizer, chunk: int, keep) -> dict[int, ChunkMoments]:
    layout = Layout([p.shape for p in optimizer.params], chunk)
    flat = full_moments(optimizer, layout)
    return {c: ChunkMoments(flat["exp_avg"][slice(*layout.bounds(c))].clone(),
                            flat["exp_avg_sq"][slice(*layout.bounds(c))].clone(), optimizer.step_count)
            for c in range(layout.num_chunks) if keep(c)}


@pytest.mark.parametrize("damage", ["no-size", "size", "chunk-id", "slot", "length", "negative", "half", "nan"])
def test_damaged_sharded_moments_are_rejected_and_change_nothing(damage):
    config = adamw_config()
    trained = trained_replica(config, 1, steps=1)
    holder = fresh_replica(config, 3)
    sharded(holder).replace(chunks_of(trained, lambda c: c < 2), 1)
    holder.step_count = 1
    info, tensors = StageState(holder.module, holder, 1, "r").state_dict()
    if damage == "no-size":
        del tensors["zero/chunk_elements"]
    elif damage == "size":
        tensors["zero/chunk_elements"] = torch.tensor(2**30)
    elif damage == "chunk-id":
        tensors["zero/9999/steps"] = torch.tensor(1)
    elif damage == "slot":
        tensors["zero/0/other"] = torch.zeros(CHUNK)
    elif damage == "length":
        tensors["zero/0/exp_avg"] = torch.zeros(CHUNK + 1)
    elif damage == "negative":
        tensors["zero/0/exp_avg_sq"] = -torch.ones(CHUNK)
    elif damage == "half":
        del tensors["zero/1/exp_avg_sq"]
    elif damage == "nan":
        tensors["zero/0/exp_avg"] = torch.full((CHUNK,), float("nan"))
    target = fresh_replica(config, 4)
    shards = sharded(target)
    before = [p.detach().clone() for p in target.params]
    with pytest.raises(StateRejected):
        StageState(target.module, target, 1, "x").load_state_dict(info, tensors)
    assert not shards.chunks and target.step_count == 0
    assert all(torch.equal(p, b) for p, b in zip(target.params, before))


def test_sharded_moments_do_not_load_into_a_replica_of_another_optimizer():
    config = adamw_config()
    trained = trained_replica(config, 1, steps=2)
    holder = fresh_replica(config, 3)
    sharded(holder).replace(chunks_of(trained, lambda c: True), 2)
    holder.step_count = 2
    info, tensors = StageState(holder.module, holder, 1, "r").state_dict()
    nadamw = tiny_config()
    nadamw.optimizer.name, nadamw.optimizer.beta1 = "nadamw", 0.99
    target = fresh_replica(nadamw, 5)
    before = [p.detach().clone() for p in target.params]
    with pytest.raises(StateRejected, match="AdamW's.*nadamw"):
        StageState(target.module, target, 1, "r").load_state_dict(info, tensors)
    assert all(torch.equal(a, b) for a, b in zip(before, target.params))
