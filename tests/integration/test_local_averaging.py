"""The low-communication mode (averaging.mode local): inner steps, one outer step, newcomers, a member gone.

Real servers of stage 1 (DHT, averaging process, P2P) on 127.0.0.1, in this process; micro-batches go straight
into their backends. The tests share one pair of servers and run in order: the last shuts a member down.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.config import AveragingConfig
from swarm.dht import visible_maddrs
from swarm.model import build_stage
from swarm.optim import StageOptimizer
from swarm.protocol import StageClient, stage_namespace
from swarm.serving import StageServer
from tests.helpers import wait_until
from tests.integration.inproc import BACKEND_CALL_TIMEOUT, TEST_MIN_TENURE, running_peers, stage_servers, tiny_config

pytestmark = pytest.mark.timeout(180)

STAGE = 1  # the last stage: its input is hidden states, and it takes targets
MICRO = 4  # samples per micro-batch: with 2 servers and batch 8, one micro-batch is a server's inner step
H = 2  # inner steps between outer steps
ROUND_TIMEOUT = 60.0  # an outer round, retries after a failed all-reduce included


def make_config(run_id: str):
    config = tiny_config(run_id, num_stages=2, batch_size=2 * MICRO, micro_batch_size=MICRO)
    config.averaging = AveragingConfig(
        mode="local", local_steps=H, pseudo_gradient_compression="none", target_group_size=4,
        min_matchmaking_time=2.0, request_timeout=1.0, matchmaking_timeout=5.0, allreduce_timeout=10.0,
        next_chunk_timeout=3.0, state_download_timeout=20.0, shutdown_timeout=3.0, progress_period=0.3,
        min_tenure=TEST_MIN_TENURE)
    return config.validate()


def micro_batch(config, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(MICRO, config.model.seq_len, config.model.d_model, generator=g)
    return x, torch.randint(0, config.model.vocab_size, (MICRO, config.model.seq_len), generator=g)


def feed(server: StageServer, batch) -> None:
    x, y = batch
    server.backend.submit(server.backend.backward, x, None, y).result(BACKEND_CALL_TIMEOUT)


def replica(server: StageServer) -> dict:
    """The replica's current weights, its state (slow weights, outer momentum, inner moments) and steps, copied
    on its worker thread."""
    backend, state = server.backend, server.stage_state

    def read() -> dict:
        info, tensors = state.state_dict()
        return {"current": copy.deepcopy(backend.module.state_dict()), "state": tensors, "outer_step": info.step,
                "optimizer": copy.deepcopy(backend.optimizer.state_dict()), "inner_step": backend.step}

    return backend.call(read, BACKEND_CALL_TIMEOUT)


def outer_steps(server: StageServer, outcome: str = "succeeded") -> float:
    labels = {"stage": str(STAGE), "outcome": outcome}
    return server.registry.get_sample_value("swarm_averaging_rounds_total", labels) or 0.0


def wait_for_outer_step(servers: list[StageServer], before: list[float]) -> None:
    wait_until(lambda: all(outer_steps(s) > n for s, n in zip(servers, before))
               and len({s.stage_state.round_id for s in servers}) == 1 and not any(s.averager.busy for s in servers),
               ROUND_TIMEOUT, interval=0.1, what="an outer round that every server took part in",
               explain=lambda: "; ".join(f"{s.averager.view()} rounds {outer_steps(s)}, failed "
                                         f"{outer_steps(s, 'failed')}" for s in servers))


def wait_to_see_each_other(servers: list[StageServer]) -> None:
    wait_until(lambda: all(s.averager.view().group_size == len(servers) and not s.averager.view().needs_state
                           and not s.averager.busy for s in servers), ROUND_TIMEOUT, interval=0.1,
               what="the servers seeing each other")


def inner_steps(config, start: dict, batches: list) -> dict[str, torch.Tensor]:
    """The weights one server makes from `start` by one optimizer step on each of `batches`."""
    module = build_stage(config, STAGE)
    module.load_state_dict(start["current"])
    optimizer = StageOptimizer(module, config.optimizer)
    optimizer.load_state_dict(start["optimizer"])
    for x, y in batches:
        (module(x, y) * x.shape[0]).backward()
        optimizer.add_samples(x.shape[0])
        optimizer.step()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def slow(snapshot: dict) -> dict[str, torch.Tensor]:
    return {k.removeprefix("param/"): v for k, v in snapshot["state"].items() if k.startswith("param/")}


def momentum(server: StageServer, snapshot: dict) -> dict[str, torch.Tensor]:
    names = [name for name, p in server.backend.module.named_parameters() if p.requires_grad]
    return {names[int(k.split("/")[1])]: v for k, v in snapshot["state"].items()
            if k.startswith("outer/") and k.endswith("/momentum")}


@pytest.fixture(scope="module")
def pair():
    config = make_config("local-pair")
    with running_peers(config.run_id, 2) as peers, stage_servers(config, peers, [STAGE, STAGE]) as servers:
        yield config, peers, servers


def test_two_servers_with_two_local_steps_take_a_hand_computed_diloco_outer_step(pair):
    config, _, (a, b) = pair
    wait_to_see_each_other([a, b])
    before_a, before_b = replica(a), replica(b)
    for name, tensor in slow(before_a).items():  # the joiner took the first server's slow weights
        torch.testing.assert_close(slow(before_b)[name], tensor)
    rounds = [outer_steps(a), outer_steps(b)]
    batches_a = [micro_batch(config, 1), micro_batch(config, 2)]
    batches_b = [micro_batch(config, 3), micro_batch(config, 4)]
    for batch in batches_a:
        feed(a, batch)
    assert outer_steps(a) == rounds[0]  # (8 samples of the 16 that make a round: each server took inner steps)
    for batch in batches_b:
        feed(b, batch)
    wait_for_outer_step([a, b], rounds)

    after_a, after_b = replica(a), replica(b)
    # by hand: each server's two AdamW steps, the mean pseudo-gradient (both brought 8 samples), Nesterov
    start = slow(before_a)
    theta_a, theta_b = inner_steps(config, before_a, batches_a), inner_steps(config, before_b, batches_b)
    old_momentum = momentum(a, before_a)
    lr, mu = config.averaging.outer_lr, config.averaging.outer_momentum
    for name in theta_a:
        delta = ((start[name] - theta_a[name]) + (start[name] - theta_b[name])) / 2
        m = mu * old_momentum[name] + delta
        expected = start[name] - lr * (delta + mu * m)
        for after in (after_a, after_b):
            torch.testing.assert_close(slow(after)[name], expected, atol=1e-6, rtol=1e-5, msg=name)
            torch.testing.assert_close(after["current"][name], expected, atol=1e-6, rtol=1e-5, msg=name)
            torch.testing.assert_close(momentum(a, after)[name], m, atol=1e-6, rtol=1e-5, msg=name)
    assert after_a["outer_step"] == after_b["outer_step"] == before_a["outer_step"] + 1
    assert after_a["inner_step"] == after_b["inner_step"] == before_a["inner_step"] + H
    assert a.registry.get_sample_value("swarm_averaging_inner_steps_total", {"stage": str(STAGE)}) >= H
    # how far a's two inner steps took it from the slow weights, relative to them, as it handed them to the round
    start_norm = sum(float(t.pow(2).sum()) for t in start.values()) ** 0.5
    drift = sum(float((start[n] - theta_a[n]).pow(2).sum()) for n in theta_a) ** 0.5 / start_norm
    assert a.registry.get_sample_value("swarm_averaging_replica_drift", {"stage": str(STAGE)}) == \
        pytest.approx(drift, rel=1e-4)


def test_a_newcomer_starts_from_the_slow_weights_and_outer_momentum_not_a_drifted_replica(pair):
    config, peers, (a, b) = pair
    wait_to_see_each_other([a, b])
    feed(a, micro_batch(config, 5))  # an inner step: a's weights drift from the slow weights
    drifted = replica(a)
    assert any(not torch.equal(drifted["current"][name], value) for name, value in slow(drifted).items())

    with running_peers(config.run_id, 1, visible_maddrs(peers[0].dht)) as (peer_c,), \
            stage_servers(config, [peer_c], [STAGE]) as (c,):
        joined = replica(c)
        assert joined["outer_step"] == drifted["outer_step"]
        for name, value in slow(drifted).items():
            torch.testing.assert_close(joined["current"][name], value, msg=name)
            torch.testing.assert_close(slow(joined)[name], value, msg=name)
        for name, value in momentum(a, drifted).items():
            torch.testing.assert_close(momentum(c, joined)[name], value, msg=name)
        assert any(float(v.abs().sum()) > 0 for v in momentum(c, joined).values())  # (a real momentum was taken)


def test_a_member_shut_down_between_outer_steps_leaves_the_other_stepping(pair):
    config, _, (a, b) = pair
    b.shutdown()
    def alone() -> float:  # outer steps on a's pseudo-gradient alone: nobody else there, or its round failed for good
        return outer_steps(a, "local") + outer_steps(a, "failed")

    before = alone()
    step = replica(a)["outer_step"]
    seeds = iter(range(100, 10_000))

    def stepped_alone() -> bool:  # (one more micro-batch each time it has not yet)
        if alone() > before:
            return True
        feed(a, micro_batch(config, next(seeds)))
        return False

    # alone, a takes an outer step of its own once it has brought local_steps batches since the slow weights'
    # (a round it began with b just before b left fails, and is tried again after a pause)
    wait_until(stepped_alone, ROUND_TIMEOUT, interval=0.05, what="an outer step of the survivor alone",
               explain=lambda: f"{a.averager.view()}, failed rounds {outer_steps(a, 'failed')}")
    assert replica(a)["outer_step"] >= step + 1


@pytest.fixture(scope="module")
def first_stage_pair():
    """Two servers of stage 0 (not the last: its backwards can go to a replica that did not run the forward),
    and a peer calling them as a trainer does."""
    config = make_config("local-first")
    with running_peers(config.run_id, 3) as peers, stage_servers(config, peers[:2], [0, 0]) as servers:
        yield config, peers[2], servers


def test_a_backward_whose_forward_another_replica_ran_gives_its_input_gradient_and_counts_as_configured(
        first_stage_pair):
    config, caller, (a, b) = first_stage_pair
    p2p = caller.p2p()
    namespace = stage_namespace(config.run_id, 0)
    stub_a, stub_b = (StageClient(p2p, PeerID.from_base58(s.peer_id), namespace) for s in (a, b))
    tokens = torch.randint(0, config.model.vocab_size, (MICRO, config.model.seq_len))
    grad = torch.randn(MICRO, config.model.seq_len, config.model.d_model)

    def samples(server: StageServer) -> int:
        return server.backend.call(lambda: server.backend.optimizer.samples, BACKEND_CALL_TIMEOUT)

    def recomputed(server: StageServer) -> float:
        return server.registry.get_sample_value("swarm_server_recomputed_elsewhere_total") or 0.0

    assert config.averaging.recomputed_weight == 0.5
    caller.loop.run(stub_a.forward(0, "m1", tokens, backward_follows=True), BACKEND_CALL_TIMEOUT)
    before = samples(b)
    reply = caller.loop.run(stub_b.backward(0, "m1", tokens, grad_outputs=grad), BACKEND_CALL_TIMEOUT)
    # (averaging.recomputed_weight 0.5: half the micro-batch's samples, not enough for b's share of the batch, 4)
    assert samples(b) == before + MICRO // 2 and recomputed(b) == 1
    assert reply.tensors == []  # (stage 0's input is tokens: no gradient to send back, but the call succeeded)
    b.config.averaging.recomputed_weight = 0.0  # (read at each call)
    caller.loop.run(stub_a.forward(0, "m0", tokens, backward_follows=True), BACKEND_CALL_TIMEOUT)
    caller.loop.run(stub_b.backward(0, "m0", tokens, grad_outputs=grad), BACKEND_CALL_TIMEOUT)
    assert samples(b) == before + MICRO // 2 and recomputed(b) == 2  # (0: dropped)

    before = samples(a)
    caller.loop.run(stub_a.forward(0, "m2", tokens, backward_follows=True), BACKEND_CALL_TIMEOUT)
    caller.loop.run(stub_a.backward(0, "m2", tokens, grad_outputs=grad), BACKEND_CALL_TIMEOUT)
    assert samples(a) in (before + MICRO, 0) and recomputed(a) == 0  # (0: it made an inner step of them)
    assert a.registry.get_sample_value("swarm_server_samples_total") >= MICRO
