"""Two servers per stage, two trainers: the replicas of each stage stay equal and learn like one model.

A real swarm in this process (2 stages x 2 StageServers, each with its own DHT peer, loop and
averaging process; 2 Trainers on threads) trains a tiny model for a handful of optimizer steps.
Then every replica of a stage must hold the same parameters, AdamW moments and step, and the
swarm's validation loss (the stage modules of one replica per stage, chained here) must be close to
a ReferenceTrainer's after as many steps of the same size.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.config import AveragingConfig, RunConfig
from swarm.dht import ServerState
from swarm.reference import ReferenceTrainer
from swarm.serving import StageServer
from swarm.trainer import Trainer, TrainerOptions
from tests.helpers import wait_until
from tests.integration.inproc import (
    BACKEND_CALL_TIMEOUT,
    TEST_MIN_TENURE,
    record_steps,
    running_peers,
    stage_servers,
    tiny_config,
)

pytestmark = pytest.mark.timeout(180)

STAGES = [0, 0, 1, 1]  # the stage of each server
TRAINERS = 2
# Batches' worth of samples the trainers train in all. A server holds the samples that come after
# its stage's batch is full for the next step, but two servers adding their last micro-batches at
# the same moment (before either hears of the other) make a step of a micro-batch or two more. And while
# a round runs beside compute, every sample counts towards the step after it (reported as `late`),
# so a step after a round slower than a batch's compute is larger by the samples that came meanwhile.
STEPS = 10
BATCH, MICRO = 16, 4
TRAIN_TIMEOUT = 90.0  # both trainers' whole budget on 2 shared CPU cores (~10-20 s here)
ONLINE_TIMEOUT = 30.0  # every trainer sees every server ONLINE
SETTLE_TIMEOUT = 30.0  # after the trainers end, every replica has taken its last step (or caught up)
# Replicas step on the same averaged gradient, equal up to rounding: hivemind hands each member
# its own values plus (mean - own), and AdamW scales a rounding difference up where its second
# moment is tiny (seen: 2.9e-6 in 1 of 8192 weights, in 1 of 10 runs; 2.8e-5 in one CI run). So a
# few weights of a tensor (ROUNDED_OFF of its elements, at least one) may be apart by up to AMPLIFIED;
# a replica a step apart, or one whose round was not applied, differs in most weights by ~lr (1e-2).
EXACT = dict(atol=1e-5, rtol=1e-4)
ROUNDED_OFF = 1e-3
AMPLIFIED = 1e-3
MOMENTS = dict(atol=1e-8, rtol=1e-5)  # AdamW moments are ~1e-4..1e-2: a tighter atol
# The reference takes the swarm's steps (as many, each of as many samples) but not its samples: the
# two trainers draw with their own sampler seeds, the reference with one. On this config, after 6
# such steps (val loss 5.56 -> ~3.8) the reference's val loss spreads over 3.78..3.84 across five
# sampler seeds (~1%), while 10 steps instead of 6 bring it to ~3.3 (-13%, ~3% a step). The
# reference does not model everything the swarm does: backwards two or more steps stale, and on
# stage 0 which parameters a late micro-batch's forward used. On loaded cores that alone moved it by
# 6.4% in one of 10 runs, so 8%: a swarm that loses three steps' worth of learning still falls outside.
LOSS_REL = 0.08
LEARNED = 0.85  # both val losses must fall below this fraction of the initial one (ln 256 = 5.55)


def averaging_config() -> AveragingConfig:
    """Short matchmaking timeouts, so a failed round costs seconds; a round starts as soon as both replicas join.

    The progress period stays at the default 1 s: at 0.3 s (records living 1.5 s), DHT stores on two
    loaded cores came late, records expired mid-round and rounds failed ("nobody left to average with").
    A member silent for next_chunk_timeout is dropped from the all-reduce: at 3 s, one round in a CI
    run lost its peer's part (4 servers, 2 trainers and 4 averaging processes on 2 loaded cores), so 8 s.
    """
    return AveragingConfig(target_group_size=4, min_matchmaking_time=4.0, request_timeout=3.0,
                           matchmaking_timeout=8.0, allreduce_timeout=20.0, next_chunk_timeout=8.0,
                           state_download_timeout=20.0, shutdown_timeout=3.0, progress_period=1.0,
                           min_tenure=TEST_MIN_TENURE)


def make_config() -> RunConfig:
    config = tiny_config("stage-sync", 2, batch_size=BATCH, micro_batch_size=MICRO, lr=1e-2, warmup_steps=2,
                         total_steps=100)
    config.averaging = averaging_config()
    return config.validate()


def wait_until_all_online(trainer_peers, count: int) -> None:
    """Every trainer peer sees all `count` servers ONLINE, so both replicas of each stage get work."""

    def online() -> bool:
        return all(sum(r.state == ServerState.ONLINE.value for records in peer.records.lookup_all_servers(2).values()
                       for r in records) == count for peer in trainer_peers)

    wait_until(online, ONLINE_TIMEOUT, interval=0.2, what=f"trainers seeing {count} ONLINE servers")


def train(trainers: list[Trainer]) -> None:
    """Run the trainers to their max_samples on threads; fail (and stop them) past TRAIN_TIMEOUT."""
    stop = threading.Event()
    deadline = threading.Timer(TRAIN_TIMEOUT, stop.set)
    deadline.start()
    try:
        with ThreadPoolExecutor(len(trainers), thread_name_prefix="trainer") as pool:
            runs = [pool.submit(trainer.run, stop) for trainer in trainers]
            try:
                for run in runs:
                    run.result()  # bounded: stop is set at TRAIN_TIMEOUT and run() returns within 0.2 s
            finally:
                stop.set()  # a trainer that raised must not leave the other running
    finally:
        deadline.cancel()
    assert all(t.samples_done == t.options.max_samples for t in trainers), \
        f"trainers did not finish their samples within {TRAIN_TIMEOUT:g}s: {[t.samples_done for t in trainers]}"


def settled(servers: list[StageServer]) -> bool:
    """Replicas of each stage at one step, with less than a batch left and no catch-up pending."""
    for stage in set(STAGES):
        replicas = [s for s in servers if s.stage == stage]
        if len({s.backend.step for s in replicas}) != 1 or any(s.averager.busy or s.averager.view().needs_state
                                                               for s in replicas):
            return False
        left = sum(s.backend.call(lambda b=s.backend: b.optimizer.samples, BACKEND_CALL_TIMEOUT) for s in replicas)
        if left >= BATCH:
            return False
    return True


def snapshot(server: StageServer) -> dict:
    """Parameters, AdamW state and step of a replica, copied on its worker thread (between tasks)."""
    backend = server.backend

    def read() -> dict:
        return {"params": copy.deepcopy(backend.module.state_dict()),
                "optimizer": copy.deepcopy(backend.optimizer.state_dict()["optimizer"]["state"]),
                "step": backend.step}

    return backend.call(read, BACKEND_CALL_TIMEOUT)


def assert_equal_but_for_rounding(b: dict[str, torch.Tensor], a: dict[str, torch.Tensor]) -> None:
    """Every tensor within EXACT, but for at most ROUNDED_OFF of its elements (one at least), within AMPLIFIED."""
    assert b.keys() == a.keys()
    for name, x in a.items():
        y = b[name]
        assert y.shape == x.shape and y.dtype == x.dtype, name
        apart = (y - x).abs()
        off = apart > EXACT["atol"] + EXACT["rtol"] * x.abs()
        allowed = max(1, int(ROUNDED_OFF * x.numel()))
        assert int(off.sum()) <= allowed and float(apart.max()) <= AMPLIFIED, \
            (name, int(off.sum()), allowed, float(apart.max()))


def samples_served(server: StageServer) -> float:
    return server.registry.get_sample_value("swarm_server_samples_total") or 0.0



def stage_steps(*replicas: Iterable[dict]) -> list[dict]:
    """Each step of a stage: its samples, and how many of them came one step late (what its replicas'
    own samples that came late add up to; a replica knows only its own). A step that a replica took
    by catching up (downloading the stage's state) has no record of that replica: its late samples
    are not known and count as on time."""
    by_step: dict[int, list[dict]] = {}
    for steps in replicas:
        for x in steps:
            by_step.setdefault(x["step"], []).append(x)
    return [{"samples": records[0]["samples"], "late": sum(x["own_late"] for x in records),
             "records": len(records)} for _, records in sorted(by_step.items())]


def by_step(steps: list[dict]) -> dict[int, dict]:
    """A replica's step records by step, the last one of each (a catch-up may go back a step)."""
    return {x["step"]: x for x in steps}


def downloads(server: StageServer) -> float:
    """The replica's successful state downloads so far (joining, or catching up with its stage)."""
    return server.registry.get_sample_value("swarm_averaging_state_downloads_total",
                                            {"stage": str(server.stage), "outcome": "succeeded"}) or 0.0


def reference_val_loss(config: RunConfig, stage_steps: list[list[dict]]) -> float:
    """Val loss of a ReferenceTrainer whose every stage took the steps its swarm replicas took: as many,
    each of as many samples, of which as many came one step late (their gradient taken on the stage's
    parameters from before its last step, as a server computes those that come while a round runs
    beside compute). The stages step on their own schedules, over the same micro-batches."""
    reference = ReferenceTrainer(config)
    stages, optimizers = reference.stages, reference.optimizers
    previous = [_without_grads(copy.deepcopy(stage)) for stage in stages]  # each stage before its last step
    position, done = [0] * len(stages), [0] * len(stages)  # the step each stage accumulates, and its samples
    while any(at < len(steps) for at, steps in zip(position, stage_steps)):
        used = [old if at < len(steps) and done_k < steps[at]["late"] else stage
                for stage, old, at, steps, done_k in zip(stages, previous, position, stage_steps, done)]
        x, y = reference.sampler.next_batch()
        hidden = x
        for stage in used[:-1]:
            hidden = stage(hidden)
        (used[-1](hidden, targets=y) * x.shape[0]).backward()  # sums over samples, as servers take
        for k, steps in enumerate(stage_steps):
            if position[k] >= len(steps):  # this stage took all its steps: the rest is not learned from
                stages[k].zero_grad(set_to_none=True)
                continue
            done[k] += x.shape[0]
            stats = steps[position[k]]
            if done[k] < stats["samples"]:
                continue
            before = _without_grads(copy.deepcopy(stages[k]))
            if stats["late"]:
                optimizers[k].accumulate([p.grad for p in previous[k].parameters()], stats["late"])
            if stats["samples"] > stats["late"]:
                optimizers[k].add_samples(stats["samples"] - stats["late"])
            optimizers[k].step()
            previous[k], position[k], done[k] = before, position[k] + 1, 0
    return reference.evaluate()


def _without_grads(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        p.grad = None
    return module


def test_replicas_stay_equal_and_swarm_learns_like_the_reference():
    config = make_config()
    budget = STEPS * BATCH // TRAINERS
    with running_peers(config.run_id, TRAINERS + len(STAGES)) as peers:
        trainer_peers, server_peers = peers[:TRAINERS], peers[TRAINERS:]
        with stage_servers(config, server_peers, STAGES) as servers:  # started here, on the main thread
            steps = [record_steps(s) for s in servers]
            downloads_before = [downloads(s) for s in servers]
            wait_until_all_online(trainer_peers, len(STAGES))
            # replicas count each other's samples only once they know each other from the DHT
            wait_until(lambda: all(s.averager.view().group_size == STAGES.count(s.stage) for s in servers),
                       ONLINE_TIMEOUT, interval=0.1, what="each stage's replicas seeing each other")
            trainers = [Trainer(config, p.dht, p.records, p.loop,
                                TrainerOptions(trainer_index=i, max_samples=budget, in_flight=2))
                        for i, p in enumerate(trainer_peers)]
            train(trainers)
            # failed calls, and replies a spot check did not use (both retried on the other replica)
            failed_calls = sum(t.pipeline.stats.failures + t.pipeline.stats.rejected for t in trainers)
            wait_until(lambda: settled(servers), SETTLE_TIMEOUT, interval=0.2,
                       what="every stage's replicas at one final step")
            states = [snapshot(s) for s in servers]
            left = [s.backend.call(lambda s=s: s.backend.optimizer.samples + s.averager.held_samples,
                                   BACKEND_CALL_TIMEOUT) for s in servers]
            # samples a downloaded state replaced before they were stepped on (a replica apart at one step)
            dropped = [s.registry.get_sample_value("swarm_averaging_dropped_samples_total",
                                                   {"stage": str(s.stage)}) or 0.0 for s in servers]
            caught_up = [downloads(s) - before for s, before in zip(servers, downloads_before)]
    served = [samples_served(s) for s in servers]
    assert all(n > 0 for n in served), f"a server got no samples, so nothing was averaged: {served}"

    for stage in set(STAGES):
        (a, b), (steps_a, steps_b), (caught_a, caught_b) = [
            [x for x, s in zip(xs, STAGES) if s == stage] for xs in (states, steps, caught_up)]
        assert a["step"] == b["step"]
        assert_equal_but_for_rounding(b["params"], a["params"])
        torch.testing.assert_close(b["optimizer"], a["optimizer"], **MOMENTS)
        # Every step is recorded by the replicas that took it, in order, once. A replica whose round came
        # back incomplete (a lost last part, on loaded cores) retries it while the other steps, then
        # catches up by downloading the stage's state: it lacks that step's record. A replica ahead of
        # its stage's elder out of any round takes the elder's state (a stage of two follows its elder)
        # and takes the step again: its later record is the one its state holds. Only after a catch-up.
        for own, caught in ((steps_a, caught_a), (steps_b, caught_b)):
            numbers = [x["step"] for x in own]
            assert numbers == list(range(1, a["step"] + 1)) or caught > 0, (numbers, a["step"], caught)
        a_at, b_at = by_step(steps_a), by_step(steps_b)
        kept = [*a_at.values(), *b_at.values()]
        # own samples of steps a catch-up took back (the replica's state went back to the elder's)
        undone = sum(x["own_samples"] for x in steps_a + steps_b) - sum(x["own_samples"] for x in kept)
        merged = stage_steps(a_at.values(), b_at.values())
        assert len(merged) == a["step"], "a step neither replica took itself"
        # every step a round of both replicas over at least a batch
        assert [(x["averaging"], x["group_size"]) for x in kept] == [("succeeded", 2)] * len(kept)
        samples_per_step = [x["samples"] for x in merged]
        assert min(samples_per_step) >= BATCH
        # a step both recorded: of as many samples on each, which what each brought adds up to
        assert all(a_at[n]["samples"] == b_at[n]["samples"] == a_at[n]["own_samples"] + b_at[n]["own_samples"]
                   for n in a_at.keys() & b_at.keys())
        on_time = [x["samples"] - x["late"] for x in merged if x["records"] == STAGES.count(stage)]
        # a push takes milliseconds, but on two loaded cores a replica has been seen to add two
        # micro-batches before the other's arrived
        assert max(on_time) <= BATCH + 2 * MICRO * (STAGES.count(stage) - 1), (samples_per_step, on_time)
        stage_left = sum(n for n, s in zip(left, STAGES) if s == stage)
        # none lost but those a downloaded state replaced (swarm_averaging_dropped_samples_total; seen once,
        # 4 samples) or took back (`undone`); a backward whose reply was lost (a broken stream on loaded
        # cores) or not used (a spot check's dispute) and that was retried on the other replica counts
        # twice, so at most a micro-batch per failed or unused call more
        counted = sum(samples_per_step) + stage_left
        stage_dropped = sum(n for n, s in zip(dropped, STAGES) if s == stage)
        assert STEPS * BATCH <= counted + stage_dropped + undone and counted <= STEPS * BATCH + MICRO * failed_calls, \
            (counted, stage_dropped, undone, failed_calls)

    swarm_model = ReferenceTrainer(config)  # to chain the stages and evaluate them as the reference does
    initial_loss = swarm_model.evaluate()
    for module, stage in zip(swarm_model.stages, (0, 1)):
        module.load_state_dict(states[STAGES.index(stage)]["params"])
    swarm_loss = swarm_model.evaluate()
    # each stage as its replicas stepped (the stages' rounds may split the same samples differently)
    reference_loss = reference_val_loss(copy.deepcopy(config), [
        stage_steps(*[by_step(x).values() for x, s in zip(steps, STAGES) if s == stage]) for stage in (0, 1)])

    assert swarm_loss < LEARNED * initial_loss and reference_loss < LEARNED * initial_loss, \
        (initial_loss, swarm_loss, reference_loss)
    assert swarm_loss == pytest.approx(reference_loss, rel=LOSS_REL)
