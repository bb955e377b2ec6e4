"""A swarm computing in bfloat16 trains as well as the float32 reference: same validation loss at equal steps."""

from __future__ import annotations

import copy

import pytest

from swarm.reference import ReferenceTrainer
from swarm.trainer import Trainer, TrainerOptions
from tests.helpers import wait_until
from tests.integration.inproc import (
    running_peers,
    stage_servers,
    stage_state,
    tiny_config,
    train_bounded,
    wait_until_online,
)

pytestmark = pytest.mark.timeout(240)

STEPS = 40
TRAIN_TIMEOUT = 150.0  # STEPS batches, one micro-batch in flight, on 2 shared CPU cores
STEP_TIMEOUT = 15.0
TOLERANCE = 0.02  # the bound on |bf16 swarm - fp32 reference| / fp32 reference


def test_a_bfloat16_swarm_reaches_the_float32_references_validation_loss():
    config = tiny_config("bf16conv", 2, batch_size=8, micro_batch_size=4, lr=3e-3, warmup_steps=5,
                         total_steps=STEPS)
    config.stages.compute_dtype = "bfloat16"
    with running_peers(config.run_id, 3) as (trainer_peer, *server_peers), \
            stage_servers(config, server_peers, [0, 1]) as servers:
        wait_until_online(trainer_peer.records, [0, 1])
        # One micro-batch in flight: no gradient is stale, so the two runs differ by precision alone.
        trainer = Trainer(config, trainer_peer.dht, trainer_peer.records, trainer_peer.loop,
                          TrainerOptions(trainer_index=0, max_samples=STEPS * config.optimizer.batch_size,
                                         in_flight=1))
        train_bounded(trainer, TRAIN_TIMEOUT)
        wait_until(lambda: all(s.backend.step == STEPS for s in servers), STEP_TIMEOUT, what=f"step {STEPS}")
        assert all(s.backend.cache.hits > 0 for s in servers[:-1])
        trained = [stage_state(s) for s in servers]

    swarm = ReferenceTrainer(config)  # evaluates the swarm's weights the way the swarm computes: bfloat16
    for module, state in zip(swarm.stages, trained):
        module.load_state_dict(state)
    swarm_loss = swarm.evaluate()

    fp32 = copy.deepcopy(config)
    fp32.stages.compute_dtype = "float32"
    reference = ReferenceTrainer(fp32)
    initial = reference.evaluate()
    reference.run(STEPS)
    reference_loss = reference.evaluate()
    assert reference_loss < 0.8 * initial, "the reference did not learn enough for the comparison to mean much"
    assert abs(swarm_loss - reference_loss) <= TOLERANCE * reference_loss, (swarm_loss, reference_loss)
