"""The single-process reference trainer learns, deterministically."""

from __future__ import annotations

import pytest
import torch

from swarm.config import RunConfig
from swarm.reference import ReferenceTrainer

pytestmark = pytest.mark.timeout(120)


def tiny_config(**optimizer) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"n_layer": 2, "n_head": 4, "d_model": 32, "seq_len": 32},
            "stages": {"num_stages": 2},
            "optimizer": {
                "lr": 3e-3,
                "min_lr": 3e-4,
                "warmup_steps": 5,
                "total_steps": 30,
                "batch_size": 8,
                "micro_batch_size": 4,
                **optimizer,
            },
            "data": {"corpus": "stdlib", "max_bytes": 200_000},
        }
    )


def test_loss_falls_and_summary_is_complete():
    trainer = ReferenceTrainer(tiny_config())
    progress = []
    summary = trainer.run(30, on_progress=progress.append)
    assert [p["step"] for p in progress] == list(range(1, 31))
    assert all(p["samples"] == 8 and not p["skipped"] for p in progress)
    assert summary["steps"] == 30 and summary["samples"] == 240
    assert summary["final_loss"] < 0.8 * summary["initial_loss"]
    assert summary["val_loss"] < summary["initial_loss"]
    assert summary["samples_per_second"] > 0 and summary["wall_seconds"] >= summary["train_seconds"]
    assert all(opt.step_count == 30 for opt in trainer.optimizers)


def test_same_config_gives_identical_losses():
    a, b = (ReferenceTrainer(tiny_config()) for _ in range(2))
    for _ in range(3):
        assert a.train_step()["loss"] == b.train_step()["loss"]
    assert a.evaluate(max_batches=2) == b.evaluate(max_batches=2)


def test_trainers_with_different_indices_see_different_data():
    a, b = ReferenceTrainer(tiny_config(), trainer_index=0), ReferenceTrainer(tiny_config(), trainer_index=1)
    assert a.train_step()["loss"] != b.train_step()["loss"]


def test_a_reference_of_two_trainers_draws_their_micro_batches_in_turn():
    config = tiny_config()  # batch 8 of micro-batches of 4: one from each trainer a step
    both = ReferenceTrainer(config, trainers=2)
    drawn = []
    for sampler in both.samplers:  # (a spy: what each trainer's stream gives, in order)
        sampler.next_batch = (lambda original: lambda: drawn.append(original()) or drawn[-1])(sampler.next_batch)
    both.train_step()
    both.train_step()
    alone = [ReferenceTrainer(config, trainer_index=i).sampler for i in (0, 1)]
    expected = [alone[0].next_batch(), alone[1].next_batch(), alone[0].next_batch(), alone[1].next_batch()]
    assert len(drawn) == 4
    for (x, y), (ex, ey) in zip(drawn, expected):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    with pytest.raises(ValueError, match="at least 1"):
        ReferenceTrainer(config, trainers=0)


def _noting(draw, index: int, picked: list[int]):
    """`draw`, noting `index` in `picked` at each call (which trainer's stream a micro-batch came from)."""
    def noted():
        picked.append(index)
        return draw()
    return noted


def test_a_reference_of_two_trainers_in_a_seeded_order_draws_their_windows_in_that_order():
    config = tiny_config()
    runs = []
    for seed in (1, 1, 2):
        reference = ReferenceTrainer(config, trainers=2, order_seed=seed)
        picked: list[int] = []
        for i, sampler in enumerate(reference.samplers):
            sampler.next_batch = _noting(sampler.next_batch, i, picked)
        losses = [reference.train_step()["loss"] for _ in range(6)]
        runs.append((picked, losses))
    assert runs[0] == runs[1]  # the same seed: the same order, the same training
    assert runs[0][0] != runs[2][0] and runs[0][1] != runs[2][1]
    assert set(runs[0][0]) == {0, 1} and len(runs[0][0]) == 12


def test_uneven_micro_batches_still_fill_the_batch():
    stats = ReferenceTrainer(tiny_config(batch_size=6, micro_batch_size=4)).train_step()
    assert stats["samples"] == 8  # two full micro-batches: the stage steps once it has >= 6
