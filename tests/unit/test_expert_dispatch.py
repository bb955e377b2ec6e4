"""ExpertDispatcher and RemoteExperts against simulated expert servers, without any network.

Only the transport is fake: swarm.routing.experts.StageClient is replaced by a client whose call
sends the request through the wire codec to an in-process ExpertHost (real experts, real
gradients) of the peer it was made for, or fails as that peer is told to. Everything else, the
dispatcher's `_call` with its ticket contract included, is the code a stage server runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest
import torch
from hivemind.utils.asyncio import iter_as_aiter

import swarm.routing.experts as routing_experts
from swarm.config import ModelConfig, MoEConfig, OptimizerConfig, RunConfig
from swarm.experts import ExpertHost
from swarm.model import make_expert
from swarm.model.moe import (
    DROPPED,
    PROCESSED,
    UNAVAILABLE,
    Dispatch,
    LocalExperts,
    MoEFeedForward,
    RoutingPlan,
    combine,
    gates,
)
from swarm.protocol import (
    BACKWARD,
    BAD_REQUEST,
    FORWARD,
    NOT_READY,
    RemoteStageError,
    StageReply,
    StageRequest,
    StageUnavailable,
    experts_namespace,
    receive_request,
    request_frames,
)
from swarm.routing.balancer import StageBalancer
from swarm.routing.experts import ExpertDispatcher, ExpertsUnavailable, RemoteExperts, expert_call

pytestmark = pytest.mark.timeout(30)

RUN = "dispatch-run"
D, E, K, LAYER = 16, 4, 2, 0
CONFIG = RunConfig(
    run_id=RUN,
    model=ModelConfig(vocab_size=256, seq_len=8, n_layer=2, n_head=2, d_model=D,
                      moe=MoEConfig(every=1, num_experts=E, top_k=K, expert_servers=True)),
    optimizer=OptimizerConfig(batch_size=1000, micro_batch_size=4),  # nothing steps in these tests
).validate()
CLOSE = dict(rtol=1e-6, atol=1e-6)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Network:
    """Simulated expert servers: peer id -> ExpertHost; `failing` peers fail at once, `hanging` ones never
    answer, `corrupt` ones answer NaN."""

    def __init__(self, hosts: dict[str, list[int]]):
        self.hosts = {peer: ExpertHost(CONFIG, experts) for peer, experts in hosts.items()}
        self.failing: set[str] = set()
        self.corrupt: set[str] = set()
        self.hanging: set[str] = set()  # never answer (until the call is cancelled)
        self.full: set[str] = set()  # answer not_ready, as a host whose queue is full does
        self.entered: asyncio.Event | None = None  # set when a hanging peer got a call
        self.requests: list[tuple[str, StageRequest]] = []  # (peer, request as received), in arrival order

    def client(self, p2p, peer_id, namespace, *, limits, timeout):
        assert namespace == experts_namespace(RUN) and timeout > 0
        return FakeClient(self, peer_id.to_base58())

    def sent(self, kind: str) -> list[tuple[str, list[tuple[int, int]]]]:
        """(peer, experts) of the requests of `kind` received, sorted."""
        return sorted((peer, r.experts) for peer, r in self.requests if r.kind == kind)

    def shutdown(self) -> None:
        for host in self.hosts.values():
            host.shutdown()


class FakeClient:
    def __init__(self, network: Network, peer: str):
        self.network, self.peer = network, peer

    async def call(self, request: StageRequest, timeout: float | None = None) -> StageReply:
        frames = [type(f).FromString(f.SerializeToString()) for f in request_frames(request)]  # as if sent
        received = await receive_request(iter_as_aiter(frames))
        self.network.requests.append((self.peer, received))
        if self.peer in self.network.failing:
            raise StageUnavailable(f"{self.peer} did not answer")
        if self.peer in self.network.full:
            raise RemoteStageError(NOT_READY, f"{self.peer} has its queue full; try later")
        if self.peer in self.network.hanging:
            self.network.entered.set()
            await asyncio.Event().wait()
        host = self.network.hosts[self.peer]
        try:
            if received.kind == FORWARD:
                out = host.forward(received.stage, received.experts, received.inputs)
            else:
                out, _ = host.backward(received.stage, received.experts, received.inputs, received.grad_outputs,
                                       received.samples)
        except ValueError as e:
            raise RemoteStageError(BAD_REQUEST, str(e)) from None
        if self.peer in self.network.corrupt:
            out = torch.full_like(out, float("nan"))
        return StageReply([out], server_step=host.step)


@pytest.fixture
def make_swarm(monkeypatch):
    """make_swarm({peer: experts}) -> (dispatcher, network), the dispatcher knowing those hosts."""
    networks: list[Network] = []

    def make(hosts: dict[str, list[int]]) -> tuple[ExpertDispatcher, Network]:
        network = Network(hosts)
        networks.append(network)
        monkeypatch.setattr(routing_experts, "StageClient", network.client)
        clock = FakeClock()
        dispatcher = ExpertDispatcher(None, RUN, E, balancer_factory=lambda: StageBalancer(clock=clock))
        dispatcher.update_hosts(hosts)
        return dispatcher, network

    yield make
    for network in networks:
        network.shutdown()


def rows_of(counts: Iterable[int], seed: int = 0) -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {e: torch.randn(count, D, generator=generator) for e, count in enumerate(counts)}


def expert(e: int, layer: int = LAYER) -> torch.nn.Module:
    return make_expert(CONFIG.model, layer, e)


def open_tickets(dispatcher: ExpertDispatcher) -> int:
    return sum(len(state.open) for b in dispatcher.balancers for state in b.servers.values())


# ---- the dispatcher ---------------------------------------------------------------------------------


def test_forward_sends_each_host_one_request_for_all_its_experts_and_skips_experts_with_no_rows(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [2, 3]})
    inputs = rows_of([2, 3, 0, 1])
    outputs = asyncio.run(dispatcher.forward(LAYER, inputs))
    assert network.sent(FORWARD) == [("hostA", [(0, 2), (1, 3)]), ("hostB", [(3, 1)])]
    assert sorted(outputs) == [0, 1, 3]  # expert 2 had no token: not sent, not in the result
    for e in (0, 1, 3):
        torch.testing.assert_close(outputs[e], expert(e)(inputs[e]).detach(), **CLOSE)
    assert dispatcher.stats.calls[LAYER, FORWARD] == 2 and not dispatcher.stats.failures
    assert open_tickets(dispatcher) == 0
    assert all(not host.samples for host in network.hosts.values())


def test_an_expert_whose_host_fails_is_retried_on_its_other_host_and_one_with_none_left_is_lost(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [1, 2]})
    network.failing.add("hostA")
    inputs = rows_of([2, 3, 1, 0])
    outputs = asyncio.run(dispatcher.forward(LAYER, inputs))
    # first hostA (ties go to the lower id) for 0 and 1, hostB for 2; then 1 again, on hostB
    assert network.sent(FORWARD) == [("hostA", [(0, 2), (1, 3)]), ("hostB", [(1, 3)]), ("hostB", [(2, 1)])]
    assert sorted(outputs) == [1, 2]  # expert 0, on hostA only, is lost
    for e in (1, 2):
        torch.testing.assert_close(outputs[e], expert(e)(inputs[e]).detach(), **CLOSE)
    assert dispatcher.stats.failures[LAYER, FORWARD] == 1 and dispatcher.stats.calls[LAYER, FORWARD] == 3
    # hostA is banned for the experts it failed, listed still; hostB is not
    assert dispatcher.balancers[0].available() == [] and dispatcher.hosts_of(0) == ["hostA"]
    assert dispatcher.balancers[1].available() == ["hostB"]
    assert dispatcher.balancers[2].available() == ["hostB"]
    assert open_tickets(dispatcher) == 0


def test_an_expert_all_of_whose_hosts_fail_is_lost_and_each_host_is_banned(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0], "hostB": [0], "hostC": [1]})
    network.failing.update({"hostA", "hostB"})
    outputs = asyncio.run(dispatcher.forward(LAYER, rows_of([2, 1, 0, 3])))
    assert sorted(outputs) == [1]  # 0 lost on both hosts; 3 has no host at all: lost without a call
    assert network.sent(FORWARD) == [("hostA", [(0, 2)]), ("hostB", [(0, 2)]), ("hostC", [(1, 1)])]
    assert dispatcher.balancers[0].available() == [] and dispatcher.hosts_of(0) == ["hostA", "hostB"]
    assert dispatcher.balancers[1].available() == ["hostC"]
    assert dispatcher.stats.failures[LAYER, FORWARD] == 2 and open_tickets(dispatcher) == 0


def test_a_reply_that_does_not_fit_is_a_failure_and_the_expert_is_retried(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [0]})
    network.corrupt.add("hostA")  # answers NaN
    inputs = rows_of([2, 1, 0, 0])
    outputs = asyncio.run(dispatcher.forward(LAYER, inputs))
    assert sorted(outputs) == [0]
    torch.testing.assert_close(outputs[0], expert(0)(inputs[0]).detach(), **CLOSE)
    assert dispatcher.balancers[0].available() == ["hostB"] and dispatcher.balancers[1].available() == []
    assert dispatcher.stats.failures[LAYER, FORWARD] == 1


def test_backward_goes_to_every_host_with_every_expert_it_hosts_and_the_samples(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [1, 2, 3]})  # expert 1 on both
    inputs, grads = rows_of([2, 0, 3, 0], seed=1), rows_of([2, 0, 3, 0], seed=2)
    result = asyncio.run(dispatcher.backward(LAYER, inputs, grads, samples=3))
    assert network.sent(BACKWARD) == [("hostA", [(0, 2), (1, 0)]), ("hostB", [(1, 0), (2, 3), (3, 0)])]
    assert all(r.samples == 3 for _, r in network.requests)
    for _, request in network.requests:
        torch.testing.assert_close(request.grad_outputs, torch.cat([grads[e] for e, _ in request.experts]),
                                   rtol=0, atol=0)
    assert sorted(result) == [0, 1, 2, 3] and result[1].shape == (0, D) and result[3].shape == (0, D)
    for e in (0, 2):
        leaf = inputs[e].clone().requires_grad_(True)
        expert(e)(leaf).backward(grads[e])
        torch.testing.assert_close(result[e], leaf.grad, **CLOSE)
    # every hosted expert counts the samples, those given no row included; the other block none
    for peer, host in network.hosts.items():
        assert host.samples == 3
        assert [host.optimizers[LAYER, e].samples for e in host.experts] == [3] * len(host.experts), peer
        assert all(host.optimizers[1, e].samples == 0 for e in host.experts)
    assert open_tickets(dispatcher) == 0


def test_backward_waits_for_a_banned_host_only_when_an_expert_has_no_other_and_reports_what_nobody_answered(
        make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [1, 2], "hostC": [3]})
    network.failing.add("hostA")
    inputs = rows_of([1, 2, 1, 1])
    asyncio.run(dispatcher.forward(LAYER, inputs))  # bans hostA for experts 0 and 1
    assert dispatcher.balancers[0].available() == [] and "hostA" not in dispatcher.balancers[1].available()
    network.requests.clear()
    network.failing = {"hostC"}  # now hostC fails the backward
    result = asyncio.run(dispatcher.backward(LAYER, inputs, rows_of([1, 2, 1, 1], seed=3), samples=2))
    # hostA is banned, but expert 0 has rows and no other host: it is asked, and answers
    assert network.sent(BACKWARD) == [("hostA", [(0, 1), (1, 2)]), ("hostB", [(1, 2), (2, 1)]), ("hostC", [(3, 1)])]
    assert sorted(result) == [0, 1, 2]  # 3: its host failed
    assert dispatcher.balancers[3].available() == [] and dispatcher.stats.failures[LAYER, BACKWARD] == 1
    assert network.hosts["hostA"].samples == 2 and network.hosts["hostB"].samples == 2
    assert dispatcher.balancers[0].available() == ["hostA"]  # its success ended its ban
    assert open_tickets(dispatcher) == 0


def test_a_banned_replica_gets_the_backward_in_the_background_and_stays_in_step(make_swarm):
    """A host banned after one failed forward still gets every backward (so it counts the same samples as
    its peers), but the stage does not wait for it when another host of its experts answers."""
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [0, 1]})
    network.failing.add("hostA")
    inputs = rows_of([2, 1, 0, 0])

    async def step() -> dict[int, torch.Tensor]:
        await dispatcher.forward(LAYER, inputs)  # hostA fails once: banned for both experts
        network.failing.clear()
        network.hanging.add("hostA")  # and is slow now: the backward must not wait for it
        network.entered = asyncio.Event()
        result = await asyncio.wait_for(dispatcher.backward(LAYER, inputs, rows_of([2, 1, 0, 0], seed=2), 2), 10)
        assert len(dispatcher._background) == 1
        network.hanging.clear()
        for task in list(dispatcher._background):
            task.cancel()  # a hanging call stays in flight; what matters is that nobody waited for it
        await asyncio.gather(*dispatcher._background, return_exceptions=True)
        return result

    result = asyncio.run(step())
    assert sorted(result) == [0, 1] and network.hosts["hostB"].samples == 2
    assert ("hostA", [(0, 2), (1, 1)]) in network.sent(BACKWARD)


def test_a_host_missing_from_one_lookup_still_gets_backwards_until_forgotten(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [2, 3]})
    dispatcher.update_hosts({"hostB": [2, 3]})  # a lookup that came back without hostA
    assert dispatcher.hosts_of(0) == [] and "hostA" in dispatcher.hosted
    inputs = rows_of([1, 1, 1, 1])
    result = asyncio.run(dispatcher.backward(LAYER, inputs, rows_of([1, 1, 1, 1], seed=1), samples=2))
    assert sorted(result) == [0, 1, 2, 3] and network.hosts["hostA"].samples == 2
    clock = dispatcher.balancers[0].clock
    clock.now += dispatcher.balancers[0].forget_after
    dispatcher.update_hosts({"hostB": [2, 3]})
    assert "hostA" not in dispatcher.hosted


@pytest.mark.parametrize("kind", [FORWARD, BACKWARD])
def test_a_cancelled_call_hands_its_tickets_back(make_swarm, kind):
    """RemoteExperts runs the dispatcher under BackgroundLoop.run, which cancels it after its timeout: the
    tickets of the calls then in flight must be handed back, or the balancer counts their work on those hosts
    forever (swarm.routing.balancer: "outstanding work cannot leak"; RemotePipeline releases in a finally)."""
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [2]})
    network.hanging.add("hostA")
    inputs = rows_of([2, 1, 1, 0])

    async def cancelled():
        network.entered = asyncio.Event()
        if kind == FORWARD:
            task = asyncio.ensure_future(dispatcher.forward(LAYER, inputs))
        else:
            task = asyncio.ensure_future(dispatcher.backward(LAYER, inputs, rows_of([2, 1, 1, 0], seed=1), 2))
        await asyncio.wait_for(network.entered.wait(), 10)  # hostA holds the call
        task.cancel()  # what BackgroundLoop.run does when its timeout passes
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert "hostA" in [peer for peer, _ in network.requests]
    assert open_tickets(dispatcher) == 0, "a cancelled expert call left its tickets open"


def test_update_hosts_ignores_experts_out_of_range(make_swarm):
    dispatcher, _ = make_swarm({})
    dispatcher.update_hosts({"hostA": [1, 4, -1, 0, 1], "hostB": [7], "hostC": [3]})
    assert dispatcher.hosted == {"hostA": [0, 1], "hostB": [], "hostC": [3]}
    assert [dispatcher.hosts_of(e) for e in range(E)] == [["hostA"], ["hostA"], [], ["hostC"]]
    dispatcher.update_hosts({"hostB": [2, 99]})  # the latest lookup lists who is chosen...
    assert [dispatcher.hosts_of(e) for e in range(E)] == [[], [], ["hostB"], []]
    assert dispatcher.hosted == {"hostA": [0, 1], "hostB": [2], "hostC": [3]}  # ...the others are not forgotten yet


# ---- RemoteExperts: the runner of an MoE block ------------------------------------------------------

# tokens' top-2 experts: (0, 1), (1, 2), (2, 3), (0, 3)
PLAN = RoutingPlan(torch.tensor([[0, 1], [1, 2], [2, 3], [0, 3]]), torch.full((4, K), PROCESSED), 0)


def runner_of(dispatcher: ExpertDispatcher, k_min: int = 1) -> RemoteExperts:
    return RemoteExperts(dispatcher, run=lambda coro, timeout: asyncio.run(coro), k_min=k_min, timeout=10.0)


def local_experts(layer: int = LAYER) -> LocalExperts:
    return LocalExperts({layer: [expert(e, layer) for e in range(E)]})


def hidden(n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def probabilities(n: int = 4, seed: int = 1) -> torch.Tensor:
    return torch.softmax(torch.randn(n, E, generator=torch.Generator().manual_seed(seed)), dim=-1)


def test_remote_experts_give_what_local_experts_give(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [2, 3]})
    u = hidden()
    with expert_call() as call:
        y, plan = runner_of(dispatcher)(LAYER, u, PLAN)
    expected, _ = local_experts()(LAYER, u, PLAN)
    torch.testing.assert_close(y, expected.detach(), **CLOSE)
    assert torch.equal(plan.status, PLAN.status) and call.lost_out == {}
    assert network.sent(FORWARD) == [("hostA", [(0, 2), (1, 2)]), ("hostB", [(2, 2), (3, 2)])]


def test_a_lost_expert_s_slots_become_unavailable_and_the_gates_renormalize_over_the_rest(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0], "hostB": [1], "hostC": [2, 3]})
    network.failing.add("hostB")
    u, probs = hidden(), probabilities()
    with expert_call() as call:
        y, plan = runner_of(dispatcher)(LAYER, u, PLAN)
    assert call.lost_out == {LAYER: [1]}
    assert plan.status.tolist() == [[PROCESSED, UNAVAILABLE], [UNAVAILABLE, PROCESSED],
                                    [PROCESSED, PROCESSED], [PROCESSED, PROCESSED]]
    assert plan.unavailable() == 2 and dispatcher.stats.lost_slots[LAYER] == 2
    expected, _ = local_experts()(LAYER, u, PLAN)
    keep = plan.processed.unsqueeze(-1)
    torch.testing.assert_close(y, torch.where(keep, expected, torch.zeros_like(expected)).detach(), **CLOSE)
    assert not y[0, 1].any() and not y[1, 0].any()
    w = gates(probs, plan)
    torch.testing.assert_close(w[:2], torch.tensor([[1.0, 0.0], [0.0, 1.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(w[2:], gates(probs, PLAN)[2:], rtol=0, atol=0)  # untouched tokens
    torch.testing.assert_close(w.sum(dim=1), torch.ones(4), **CLOSE)


def test_k_min_refuses_a_token_left_with_too_few_experts(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 3], "hostB": [1, 2]})
    network.failing.add("hostB")  # token 1 loses both of its experts, 1 and 2; token 0 and 2 one each
    with expert_call(), pytest.raises(ExpertsUnavailable, match="k_min 1"):
        runner_of(dispatcher, k_min=1)(LAYER, hidden(), PLAN)

    dispatcher, network = make_swarm({"hostA": [0, 3], "hostB": [1], "hostC": [2]})
    network.failing.add("hostB")  # every token keeps one expert at least: k_min 1 goes on, k_min 2 does not
    with expert_call() as call:
        _, plan = runner_of(dispatcher, k_min=1)(LAYER, hidden(), PLAN)
    assert call.lost_out == {LAYER: [1]} and plan.unavailable() == 2
    with expert_call(), pytest.raises(ExpertsUnavailable, match="k_min 2"):
        runner_of(dispatcher, k_min=2)(LAYER, hidden(), PLAN)


def test_k_min_counts_only_experts_lost_to_failures_not_slots_dropped_for_capacity(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0], "hostB": [1, 2, 3]})
    dropped = RoutingPlan(PLAN.experts, torch.tensor([[PROCESSED, DROPPED]] * 4), 1)  # first choices only
    with expert_call() as call:
        y, plan = runner_of(dispatcher, k_min=2)(LAYER, hidden(), dropped)  # nothing lost: goes on
    assert torch.equal(plan.status, dropped.status) and call.lost_out == {}
    assert not y[:, 1].any() and y[:, 0].abs().sum(dim=1).gt(0).all()

    network.failing.add("hostA")  # tokens 0 and 3 lose expert 0, their one processed slot: one loss each
    with expert_call() as call:
        y, plan = runner_of(dispatcher, k_min=1)(LAYER, hidden(), dropped)
    assert call.lost_out == {LAYER: [0]}
    assert plan.status.tolist() == [[UNAVAILABLE, DROPPED], [PROCESSED, DROPPED], [PROCESSED, DROPPED],
                                    [UNAVAILABLE, DROPPED]]
    assert not y[0].any() and not y[3].any() and y[1, 0].abs().sum() > 0


def test_with_k_min_0_a_token_with_no_expert_goes_on_with_output_0(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 3], "hostB": [1, 2]})
    network.failing.add("hostB")
    ffn = MoEFeedForward(D, E, K, capacity_factor=0.0, layer=LAYER)
    ffn.runner = runner_of(dispatcher, k_min=0)
    u = hidden()
    with torch.no_grad(), expert_call() as call:
        out = ffn(u, plan=PLAN)
    assert call.lost_out == {LAYER: [1, 2]}
    assert torch.isfinite(out).all() and not out[1].any()  # lost both: nothing but its residual
    torch.testing.assert_close(out[0], expert(0)(u[0]).detach(), **CLOSE)  # expert 0 alone, gate 1
    torch.testing.assert_close(out[2], expert(3)(u[2]).detach(), **CLOSE)  # expert 3 alone, gate 1
    assert out[3].abs().sum() > 0


def test_experts_the_forward_went_without_are_never_sent(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [2, 3]})
    u = hidden()
    with expert_call(lost_in=[(LAYER, [1]), (LAYER + 1, [0, 2])]) as call:
        y, plan = runner_of(dispatcher)(LAYER, u, PLAN)
    assert network.sent(FORWARD) == [("hostA", [(0, 2)]), ("hostB", [(2, 2), (3, 2)])]  # no expert 1
    assert plan.status.tolist() == PLAN.without([1]).status.tolist() and plan.unavailable() == 2
    assert call.lost_out == {}  # not lost by this request
    expected, _ = local_experts()(LAYER, u, PLAN.without([1]))
    torch.testing.assert_close(y, expected.detach(), **CLOSE)


def test_under_gradients_the_backward_asks_the_hosts_and_matches_local_experts(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [2, 3]})
    u0, weights, probs = hidden(seed=3), hidden(seed=4), probabilities()
    w = gates(probs, PLAN)

    u = u0.clone().requires_grad_(True)
    with expert_call(samples=4) as call:
        y, plan = runner_of(dispatcher)(LAYER, u, PLAN)
    assert y.requires_grad and call.lost_out == {}
    (combine(w, y) * weights).sum().backward()

    local = local_experts()
    u_local = u0.clone().requires_grad_(True)
    y_local, _ = local(LAYER, u_local, PLAN)
    y_local.retain_grad()
    (combine(w, y_local) * weights).sum().backward()

    torch.testing.assert_close(y, y_local, **CLOSE)
    torch.testing.assert_close(u.grad, u_local.grad, **CLOSE)
    # the backward went to both hosts, once, with the micro-batch's samples and each slot output's gradient
    backwards = {peer: r for peer, r in network.requests if r.kind == BACKWARD}
    assert sorted(backwards) == ["hostA", "hostB"] and all(r.samples == 4 for r in backwards.values())
    dispatch = Dispatch.of(PLAN, E)
    slot_grads = dict(enumerate(torch.split(y_local.grad.reshape(-1, D)[dispatch.slots], dispatch.counts)))
    for request in backwards.values():
        torch.testing.assert_close(request.grad_outputs, torch.cat([slot_grads[e] for e, _ in request.experts]),
                                   **CLOSE)
    # and the hosts' experts hold the gradient the local ones got
    for host in network.hosts.values():
        for e in host.experts:
            for p, p_local in zip(host.modules[LAYER, e].parameters(), local.experts[LAYER][e].parameters()):
                torch.testing.assert_close(p.grad, p_local.grad, **CLOSE)


def test_a_block_that_lost_an_expert_trains_as_if_routed_without_it(make_swarm):
    """The whole layer, router included: remote with expert 1 lost equals local with expert 1's slots forced off."""
    dispatcher, network = make_swarm({"hostA": [0, 3], "hostB": [1], "hostC": [2]})
    network.failing.add("hostB")
    torch.manual_seed(0)
    remote = MoEFeedForward(D, E, K, capacity_factor=0.0, layer=LAYER)
    remote.runner = runner_of(dispatcher)
    local = MoEFeedForward(D, [expert(e) for e in range(E)], K, capacity_factor=0.0, layer=LAYER)
    local.router.load_state_dict(remote.router.state_dict())
    u0, weights = hidden(seed=5), hidden(seed=6)

    u = u0.clone().requires_grad_(True)
    with expert_call(samples=2) as call:
        out = remote(u, plan=PLAN)
    (out * weights).sum().backward()
    assert call.lost_out == {LAYER: [1]}
    # hostB is banned: it is sent the backward too (its experts got no rows), and nobody waits for it
    assert sorted(peer for peer, r in network.requests if r.kind == BACKWARD) == ["hostA", "hostB", "hostC"]

    u_local = u0.clone().requires_grad_(True)
    out_local = local(u_local, plan=PLAN.without([1]))
    (out_local * weights).sum().backward()
    torch.testing.assert_close(out, out_local, **CLOSE)
    torch.testing.assert_close(u.grad, u_local.grad, **CLOSE)
    torch.testing.assert_close(remote.router.weight.grad, local.router.weight.grad, **CLOSE)
    assert network.hosts["hostB"].samples == 0 and network.hosts["hostA"].samples == 2


def test_a_backward_no_host_answers_leaves_those_tokens_without_expert_gradient(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [2, 3]})
    u = hidden().requires_grad_(True)
    with expert_call(samples=4):
        y, _ = runner_of(dispatcher)(LAYER, u, PLAN)
    network.failing.add("hostB")  # answered the forward, fails the backward
    y.sum().backward()
    assert dispatcher.stats.backward_lost[LAYER] == 2  # experts 2 and 3
    assert torch.isfinite(u.grad).all()
    # token 2 was routed to experts 2 and 3 only: no gradient through them
    assert not u.grad[2].any() and u.grad[0].abs().sum() > 0
    assert dispatcher.stats.failures[LAYER, BACKWARD] == 1 and open_tickets(dispatcher) == 0


def test_without_samples_or_gradients_nothing_is_recorded_for_a_backward(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1, 2, 3]})
    u = hidden().requires_grad_(True)
    with expert_call():  # a forward only (samples None): the outputs are constants
        y, _ = runner_of(dispatcher)(LAYER, u, PLAN)
    assert not y.requires_grad
    with expert_call(samples=4), torch.no_grad():
        y, _ = runner_of(dispatcher)(LAYER, u, PLAN)
    assert not y.requires_grad
    assert [r.kind for _, r in network.requests] == [FORWARD, FORWARD]


def test_a_refused_request_bans_the_host_like_a_failure(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0], "hostB": [0]})
    network.hosts["hostA"].max_rows = 1  # hostA refuses what hostB takes
    inputs = rows_of([3, 0, 0, 0])
    outputs = asyncio.run(dispatcher.forward(LAYER, inputs))
    assert sorted(outputs) == [0] and dispatcher.balancers[0].available() == ["hostB"]
    assert dispatcher.stats.failures[LAYER, FORWARD] == 1
    assert [peer for peer, _ in network.requests] == ["hostA", "hostB"]


def test_a_host_with_its_queue_full_is_held_off_briefly_and_counted_as_a_refusal(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0], "hostB": [0], "hostC": [0]})
    network.full.add("hostA")
    network.failing.add("hostB")
    assert sorted(asyncio.run(dispatcher.forward(LAYER, rows_of([2, 0, 0, 0])))) == [0]
    balancer = dispatcher.balancers[0]
    bans = {peer: balancer.servers[peer].banned_until - balancer.clock() for peer in ("hostA", "hostB")}
    assert bans == {"hostA": balancer.brief_ban_base, "hostB": balancer.ban_base}  # 1 s, as a stage's; 15 s
    assert balancer.servers["hostA"].refusals.refused == 1 and balancer.servers["hostB"].refusals.refused == 0


def test_an_expert_whose_only_host_is_banned_still_tries_it_once_per_forward(make_swarm):
    """One failed call must not cost a sole host's experts every micro-batch of its ban (as stages are retried)."""
    dispatcher, network = make_swarm({"hostA": [0, 1]})
    network.failing.add("hostA")
    inputs = rows_of([1, 1, 0, 0])
    assert asyncio.run(dispatcher.forward(LAYER, inputs)) == {}
    assert dispatcher.balancers[0].available() == []  # banned
    network.failing.clear()
    network.requests.clear()
    assert sorted(asyncio.run(dispatcher.forward(LAYER, inputs))) == [0, 1]
    assert network.sent(FORWARD) == [("hostA", [(0, 1), (1, 1)])]  # one try, not one per expert
    assert dispatcher.balancers[0].available() == ["hostA"] and open_tickets(dispatcher) == 0


def test_a_host_banned_and_gone_from_the_lookup_gets_no_backward(make_swarm):
    dispatcher, network = make_swarm({"hostA": [0, 1], "hostB": [0, 1]})
    network.failing.add("hostA")
    asyncio.run(dispatcher.forward(LAYER, rows_of([3, 0, 0, 0])))  # hostA fails: banned for expert 0
    asyncio.run(dispatcher.forward(LAYER, rows_of([0, 3, 0, 0])))  # ... and for expert 1
    dispatcher.update_hosts({"hostB": [0, 1]})  # its record expired
    network.requests.clear()
    result = asyncio.run(dispatcher.backward(LAYER, rows_of([1, 1, 0, 0]), rows_of([1, 1, 0, 0], seed=1), 2))
    assert sorted(result) == [0, 1] and [peer for peer, _ in network.requests] == ["hostB"]
