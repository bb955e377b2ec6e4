"""One optimizer step of a real swarm (one server per stage, one trainer) equals one ReferenceTrainer step.

Same config, same data (trainer_index 0 on both sides: the same sampler seed), same stage init:
after exactly one batch the servers' stage parameters and AdamW state must match the reference's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from swarm.config import MoEConfig
from swarm.reference import ReferenceTrainer
from swarm.serving import StageServer
from swarm.trainer import Trainer, TrainerOptions
from tests.helpers import wait_until
from tests.integration.inproc import (
    BACKEND_CALL_TIMEOUT,
    record_steps,
    running_peers,
    stage_servers,
    stage_state,
    tiny_config,
    train_bounded,
    wait_until_online,
)

pytestmark = pytest.mark.timeout(150)

TRAIN_TIMEOUT = 60.0  # the trainer's whole budget (three micro-batches) on 2 shared CPU cores
STEP_TIMEOUT = 10.0  # after the trainer returns, every server has taken its step
# Not bit-exact in general: a server sums micro-batch gradients in the order their backwards
# arrive, which with two micro-batches in flight need not be the reference's order, and float
# addition of three or more terms depends on the order. Everything else is the same arithmetic.
EXACT = dict(atol=1e-5, rtol=1e-4)
# AdamW's first moment after one step is 0.1 * gradient (values ~1e-4..1e-2): a tighter atol
MOMENTS = dict(atol=1e-8, rtol=1e-4)
# bfloat16 keeps 8 bits of mantissa (relative rounding 2**-9 per operation). Measured: loss and
# gradient norms agree to 1e-4. An element whose gradient is near 0 may take Adam's first step (about
# +-lr whatever the gradient's size) the other way: the update's relative error measured 0.055-0.06,
# where a wrong gradient would give about 1.
BF16 = 0.01
BF16_UPDATE = 0.15



def optimizer_state(server: StageServer) -> dict:
    backend = server.backend
    return backend.call(lambda: copy.deepcopy(backend.optimizer.state_dict()), BACKEND_CALL_TIMEOUT)


def one_step(config, num_stages: int, pieces: int = 1):
    """Train exactly one batch on a swarm of one server per stage; yield (servers, their steps, their
    initial parameters, trainer, reference that took the same step, its stats) with the servers still up.
    With `pieces`, the trainer sends each micro-batch in that many pieces at once (as its window does when
    latency bounds it: swarm.routing.inflight)."""
    batch = config.optimizer.batch_size
    stages = list(range(num_stages))
    with running_peers(config.run_id, num_stages + 1) as (trainer_peer, *server_peers), \
            stage_servers(config, server_peers, stages) as servers:
        steps = [record_steps(server) for server in servers]
        initial = [stage_state(server) for server in servers]
        wait_until_online(trainer_peer.records, stages)
        trainer = Trainer(config, trainer_peer.dht, trainer_peer.records, trainer_peer.loop,
                          TrainerOptions(trainer_index=0, max_samples=batch, in_flight=2))
        trainer.window.split = pieces  # (test seam: a fixed window never splits by itself)
        train_bounded(trainer, TRAIN_TIMEOUT)
        # (on the stats, which reach the hook just after the step count moves)
        wait_until(lambda: all(steps), STEP_TIMEOUT, what="every server's first optimizer step")
        reference = ReferenceTrainer(config, trainer_index=0)
        expected = reference.train_step()
        assert expected["samples"] == batch and not expected["skipped"]
        micro_batches = batch // config.optimizer.micro_batch_size
        assert trainer.samples == batch
        assert [n for *_, n in trainer.recent] == [config.optimizer.micro_batch_size] * micro_batches
        for stage, server in enumerate(servers):
            # exactly one step, on exactly one batch, and nothing counted towards a second one
            assert server.backend.step == 1
            assert [s["samples"] for s in steps[stage]] == [batch]
            assert server.backend.optimizer.samples == 0
        yield servers, steps, initial, trainer, reference, expected


@pytest.mark.parametrize("num_stages", [1, 2])
def test_one_swarm_step_equals_one_reference_step(num_stages):
    # warmup_steps=1: the first step runs at the full lr, so every parameter moves ~1e-2, far beyond EXACT
    config = tiny_config(f"exact{num_stages}", num_stages, batch_size=12, micro_batch_size=4, lr=1e-2,
                         warmup_steps=1)
    for servers, steps, initial, trainer, reference, expected in one_step(config, num_stages):
        micro_batches = config.optimizer.batch_size // config.optimizer.micro_batch_size
        swarm_loss = sum(loss for _, loss, _ in trainer.recent) / micro_batches
        assert swarm_loss == pytest.approx(expected["loss"], rel=1e-5)
        for stage, server in enumerate(servers):
            assert server.backend.cache is None or server.backend.cache.hits > 0  # kept graphs were used
            assert steps[stage][0]["grad_norm"] == pytest.approx(expected["grad_norms"][stage], rel=1e-4)
            swarm_params = stage_state(server)
            reference_params = reference.stages[stage].state_dict()
            assert any(not torch.equal(initial[stage][k], swarm_params[k]) for k in swarm_params)
            torch.testing.assert_close(swarm_params, reference_params, **EXACT)
            swarm_moments = optimizer_state(server)["optimizer"]["state"]
            reference_moments = reference.optimizers[stage].state_dict()["optimizer"]["state"]
            torch.testing.assert_close(swarm_moments, reference_moments, **MOMENTS)


def test_micro_batches_sent_in_pieces_make_the_same_step():
    # the sum of per-sample gradients does not care how the samples travel: pieces of 2 of each micro-batch
    # of 4, two micro-batches in flight, give the reference's step (to float summation order)
    config = tiny_config("exactpieces", 2, batch_size=12, micro_batch_size=4, lr=1e-2, warmup_steps=1)
    for servers, steps, _, trainer, reference, expected in one_step(config, 2, pieces=2):
        swarm_loss = sum(loss * n for _, loss, n in trainer.recent) / config.optimizer.batch_size
        assert swarm_loss == pytest.approx(expected["loss"], rel=1e-5)
        # stage 0 answered a backward per piece (more only if a reply was lost and the call retried)
        ok_backwards = {"kind": "backward", "status": "ok"}
        served = servers[0].registry.get_sample_value("swarm_server_requests_total", ok_backwards)
        assert served >= 2 * config.optimizer.batch_size // config.optimizer.micro_batch_size, served
        for stage, server in enumerate(servers):
            assert steps[stage][0]["grad_norm"] == pytest.approx(expected["grad_norms"][stage], rel=1e-4)
            torch.testing.assert_close(stage_state(server), reference.stages[stage].state_dict(), **EXACT)
            torch.testing.assert_close(optimizer_state(server)["optimizer"]["state"],
                                       reference.optimizers[stage].state_dict()["optimizer"]["state"], **MOMENTS)


def test_one_moe_swarm_step_equals_one_reference_step():
    """MoE blocks on both stages (experts inside the stage servers): routing with capacity drops, and the
    load-balancing loss each stage adds to its backward, give the reference's step."""
    config = tiny_config("exactmoe", 2, batch_size=12, micro_batch_size=4, lr=1e-2, warmup_steps=1)
    # 4 experts, top 2, capacity 1.0: some tokens go over an expert's capacity; a weight of 0.5 makes
    # the aux loss's share of the router's gradient large enough that leaving it out would show.
    config.model.moe = MoEConfig(every=1, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_weight=0.5)
    config.validate()
    for servers, steps, initial, trainer, reference, expected in one_step(config, 2):
        assert expected["dropped"] > 0 and expected["aux_loss"] > 0, expected
        micro_batches = config.optimizer.batch_size // config.optimizer.micro_batch_size
        swarm_loss = sum(loss for _, loss, _ in trainer.recent) / micro_batches
        assert swarm_loss == pytest.approx(expected["loss"], rel=1e-5)
        for stage, server in enumerate(servers):
            assert server.backend.module.moe_layers == [stage] and server.backend.cache is None
            assert steps[stage][0]["grad_norm"] == pytest.approx(expected["grad_norms"][stage], rel=1e-4)
            swarm_params = stage_state(server)
            assert any(not torch.equal(initial[stage][k], swarm_params[k]) for k in swarm_params)
            torch.testing.assert_close(swarm_params, reference.stages[stage].state_dict(), **EXACT)
            # every top-k slot of the batch's tokens was either processed by an expert or dropped, once
            backend, slots = server.backend, config.optimizer.batch_size * config.model.seq_len * 2
            assert sum(backend.expert_tokens[stage]) + backend.dropped_slots[stage] == slots
            exported = {s.labels["expert"]: s.value for family in server.registry.collect() for s in family.samples
                        if s.name == "swarm_moe_expert_tokens_total"}
            assert exported == {str(e): float(n) for e, n in enumerate(backend.expert_tokens[stage])}


def relative_error(actual: dict, expected: dict) -> float:
    """|actual - expected| / |expected| over all tensors of two dicts (norms of the concatenation)."""
    diff = sum(float((actual[k].float() - expected[k].float()).pow(2).sum()) for k in expected)
    size = sum(float(expected[k].float().pow(2).sum()) for k in expected)
    return (diff / size) ** 0.5


def test_one_bfloat16_swarm_step_equals_one_bfloat16_reference_step():
    """Under bfloat16 compute (and so a bfloat16 wire) the swarm's step is the reference's to bf16 precision;
    the weights, gradients and moments themselves stay float32."""
    config = tiny_config("exactbf16", 2, batch_size=12, micro_batch_size=4, lr=1e-2, warmup_steps=1)
    config.stages.compute_dtype = "bfloat16"
    assert config.stages.wire == "bfloat16"
    for servers, steps, initial, trainer, reference, expected in one_step(config, 2):
        micro_batches = config.optimizer.batch_size // config.optimizer.micro_batch_size
        swarm_loss = sum(loss for _, loss, _ in trainer.recent) / micro_batches
        assert swarm_loss == pytest.approx(expected["loss"], rel=BF16)
        for stage, server in enumerate(servers):
            assert server.backend.compute_dtype == torch.bfloat16
            assert steps[stage][0]["grad_norm"] == pytest.approx(expected["grad_norms"][stage], rel=BF16)
            swarm_params = stage_state(server)
            assert all(v.dtype == torch.float32 for v in swarm_params.values())
            reference_params = reference.stages[stage].state_dict()
            update = {k: swarm_params[k] - initial[stage][k] for k in swarm_params}
            expected_update = {k: reference_params[k] - initial[stage][k] for k in swarm_params}
            assert relative_error(update, expected_update) < BF16_UPDATE
            swarm_moments = optimizer_state(server)["optimizer"]["state"]
            reference_moments = reference.optimizers[stage].state_dict()["optimizer"]["state"]
            for key, moments in swarm_moments.items():
                assert moments["exp_avg"].dtype == torch.float32
                assert relative_error(moments, {k: v for k, v in reference_moments[key].items()
                                                if k in ("exp_avg", "exp_avg_sq")}) < BF16
