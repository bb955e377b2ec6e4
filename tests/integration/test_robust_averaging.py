"""One of three servers of a stage lies in its rounds; the other two step on (close to) their own average.

Real servers of stage 1 (DHT, averaging process, P2P) on 127.0.0.1, in this process, as in
test_averaging. The liar is an ordinary server whose averager is patched on its side of the pipe to
its averaging process: it claims 10**9 samples (hivemind's round weight and the round's gather
data) and puts its gradient times 10**6 into the all-reduce, then NaN in the next round. The
honest servers' reducers cap its weight, clip its contribution (robust.py) and drop the NaN one.
"""

from __future__ import annotations

import pytest
import torch

from swarm.averaging.process import AveragingProcess
from tests.helpers import wait_until
from tests.integration.inproc import running_peers, stage_servers
from tests.integration.test_averaging import (
    ROUND_TIMEOUT,
    STAGE,
    feed,
    make_config,
    micro_batch,
    wait_until_peers_see_each_other,
)

pytestmark = pytest.mark.timeout(150)

CLAIMED_SAMPLES = 10**9
SCALE = 1e6
# The liar's weight is capped at 4 batches (48 samples) against the honest 4 + 4, a share of 6/7, and its
# contribution is clipped to 4 times the members' median distance from their median (at most the
# honest members' distance from each other): the result moves from the honest mean by at most about
# 6/7 x 4 = 3.4 times the honest members' distance from each other (seen: 2.6).
BOUND = 4.0


class Recorder:
    """What an honest server put into the all-reduce (its mean gradient, its samples) and stepped on."""

    def __init__(self, averager):
        self.loaded: list[tuple[list[torch.Tensor], int]] = []
        self.applied: list[tuple[list[torch.Tensor], dict]] = []
        load, apply = averager.round.load_buffers, averager.round.apply

        def recording_load(grads, samples):
            load(grads, samples)
            with averager.process.buffers() as buffers:
                self.loaded.append(([b.clone() for b in buffers], samples))

        def recording_apply(mean, *args, **kwargs):
            received = [m.clone() for m in mean]  # before the step clips it in place
            stats = apply(mean, *args, **kwargs)
            self.applied.append((received, stats))
            return stats

        averager.round.load_buffers, averager.round.apply = recording_load, recording_apply


def make_liar(averager, poison) -> None:
    """The averager claims CLAIMED_SAMPLES and puts `poison(buffer)` into each of its rounds."""
    load = averager.round.load_buffers
    process: AveragingProcess = averager.process
    run_round = process.run_round

    def poisoned_load(grads, samples):
        load(grads, samples)
        with process.buffers() as buffers, torch.no_grad():
            for buffer in buffers:
                poison[0](buffer)

    def lying_round(control, weight, *args, **kwargs):  # (the weight is what the others count as its samples)
        return run_round(control, float(CLAIMED_SAMPLES), *args, **kwargs)

    averager.round.load_buffers, process.run_round = poisoned_load, lying_round


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def honest_mean(recorders: list[Recorder]) -> tuple[torch.Tensor, float]:
    """The honest servers' weighted mean gradient in their last round, and their distance from each other."""
    (a, n_a), (b, n_b) = (r.loaded[-1] for r in recorders)
    a, b = flat(a), flat(b)
    return (a * n_a + b * n_b) / (n_a + n_b), float((a - b).norm())


ATTEMPTS = 3  # rounds per attack until one is whole on both honest servers (hivemind can lose a member partway)


def attacked_round(servers, recorders, config, seed: int) -> tuple[list[torch.Tensor], dict] | None:
    """Feed each server a micro-batch (a batch in all); the honest servers' (mean, stats) once both applied
    a round of all three, or None if that round was not whole (then both stepped some other way)."""
    wait_until_peers_see_each_other(servers)
    done = [len(r.applied) for r in recorders]
    for i, server in enumerate(servers):
        feed(server, micro_batch(config, seed + i))
    # applied, not only stepped: the step count moves inside _apply, before the recorder sees its return
    wait_until(lambda: all(len(r.applied) > n for r, n in zip(recorders, done)), ROUND_TIMEOUT, interval=0.1,
               what="the honest servers' step")
    applied = [r.applied[n] for r, n in zip(recorders, done)]
    if any(stats["averaging"] != "succeeded" or stats["group_size"] != 3 for _, stats in applied):
        return None
    return applied


def test_a_liar_cannot_steer_or_stop_the_stage():
    config = make_config("robust-avg")
    with running_peers(config.run_id, 3) as peers, stage_servers(config, peers, [STAGE] * 3) as servers:
        honest, liar = servers[:2], servers[2]
        recorders = [Recorder(s.averager) for s in honest]
        poison = [lambda buffer: buffer.mul_(SCALE)]
        make_liar(liar.averager, poison)

        for attack in ("times 10**6", "NaN"):
            for attempt in range(ATTEMPTS):
                applied = attacked_round(servers, recorders, config, seed=100 * len(attack) + 10 * attempt)
                if applied is not None:
                    break
            else:
                pytest.fail(f"{ATTEMPTS} rounds in a row lost a member partway")
            expected, spread = honest_mean(recorders)
            for mean, stats in applied:
                assert not stats["skipped"], "the stage skipped its step"
                assert stats["samples"] <= 4 + 4 + liar.averager.max_member_samples
                deviation = float((flat(mean) - expected).norm())
                if attack == "times 10**6":  # with weight 10**9: clipped, and its weight capped
                    assert deviation <= BOUND * spread, (deviation, spread)
                else:  # dropped: the two honest members average as if alone
                    assert deviation <= 1e-5 * float(expected.norm()), (deviation, float(expected.norm()))
            poison[0] = lambda buffer: buffer.fill_(float("nan"))
