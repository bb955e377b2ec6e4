"""RemotePipeline's routing without a network: every call's ticket goes back, however the call ends."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
import torch
from hivemind.p2p import P2PHandlerError
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from swarm.protocol import (
    BACKWARD,
    BAD_REQUEST,
    BUSY,
    FORWARD,
    INTERNAL,
    NOT_READY,
    WRONG_STAGE,
    DialHeldOff,
    RemoteStageError,
    StageReply,
    StageRequest,
    StageUnavailable,
)
from swarm.protocol.client import dial_held_off
from swarm.routing import PipelineError, RemotePipeline, StageBalancer
from swarm.routing.pipeline import DIAL_HOLD_OFF

pytestmark = pytest.mark.timeout(30)

CALL_TIMEOUT = 10.0  # bounds every awaited trip; nothing here waits on a network

Behaviour = Callable[[int, str, StageRequest], Awaitable[StageReply]]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def answer(stage: int, request: StageRequest, num_stages: int) -> StageReply:
    """What a healthy server of `stage` replies."""
    if request.kind == FORWARD:
        return StageReply([torch.zeros(*request.inputs.shape[:2], 4)], server_step=3)  # hidden size 4
    info = {"loss": 2.5} if stage == num_stages - 1 else {}
    return StageReply([] if stage == 0 else [torch.zeros(request.inputs.shape)], server_step=3, info=info)


class FakePipeline(RemotePipeline):
    """A pipeline whose one RPC seam, `_send`, runs `behaviour` instead of the network."""

    def __init__(self, servers: dict[int, list[str]], behaviour: Behaviour | None = None, spot_check_rate: float = 0.0):
        self.clock = FakeClock()
        super().__init__(None, "test-run", len(servers), balancer_factory=lambda: StageBalancer(clock=self.clock),
                         spot_check_rate=spot_check_rate, rng=random.Random(0))
        self.behaviour = behaviour or self.healthy
        self.sent: list[tuple[int, str, str]] = []
        self.update_servers(servers)

    async def healthy(self, stage: int, peer: str, request: StageRequest) -> StageReply:
        self.clock.now += 0.01
        return answer(stage, request, self.num_stages)

    async def _send(self, stage: int, peer: str, request: StageRequest, timeout: float) -> StageReply:
        self.sent.append((stage, peer, request.kind))
        return await self.behaviour(stage, peer, request)

    def open_tickets(self) -> int:
        return sum(len(s.open) for b in self.balancers for s in b.servers.values())

    def trip(self, request_id: str = "t:0:1") -> float:
        x, y = torch.zeros(8, 16, dtype=torch.long), torch.zeros(8, 16, dtype=torch.long)
        return asyncio.run(asyncio.wait_for(self.train(x, y, request_id), CALL_TIMEOUT))


def test_successful_trips_leave_nothing_outstanding():
    pipeline = FakePipeline({0: ["a0", "b0"], 1: ["a1", "b1"]})
    for i in range(50):
        assert pipeline.trip(f"t:0:{i}") == 2.5
    assert pipeline.open_tickets() == 0
    assert pipeline.stats.calls == 150 and pipeline.stats.failures == 0
    assert pipeline.stage_steps == {0: 3, 1: 3}
    assert all(s.measured for b in pipeline.balancers for s in b.servers.values())


def test_a_failed_call_bans_its_server_and_is_retried_on_another():
    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        if peer == "a0":
            raise StageUnavailable("a0 did not answer")
        return answer(stage, request, 1)

    pipeline = FakePipeline({0: ["a0", "b0"]}, behaviour)
    assert pipeline.trip() == 2.5
    assert [peer for _, peer, _ in pipeline.sent] == ["a0", "b0"]  # equal and unmeasured: a0 first, by id
    assert pipeline.stats.failures == 1 and pipeline.balancers[0].servers["a0"].failures == 1
    assert pipeline.open_tickets() == 0


# p2pd's words (go-libp2p 0.32, through hivemind's ControlFailure), as a trainer 100 ms from its servers got them
HELD_OFF = ("Connect failed. msg=failed to dial: failed to dial QmNwVpyx6AKNpKSQLgqSJNEG4GkivUh2o9Sdjxw33g3v2D: "
            "all dials failed\n  * [/ip4/11.77.3.2/tcp/38415] dial backoff")


def test_the_daemon_s_hold_off_is_told_apart_from_a_dial_that_failed():
    assert dial_held_off(ControlFailure(HELD_OFF))
    assert dial_held_off(ControlFailure(HELD_OFF + "\n  * [/ip4/127.0.0.1/tcp/38415] dial backoff"))
    # one address tried and refused: the server's own word (it is down), a failure as before
    assert not dial_held_off(ControlFailure(HELD_OFF + "\n  * [/ip4/127.0.0.1/tcp/38415] dial tcp4 127.0.0.1:38415: "
                                                       "connect: connection refused"))
    assert not dial_held_off(ControlFailure("failed to dial Qm: all dials failed\n  * [/ip4/1.2.3.4/tcp/1] i/o "
                                            "timeout"))
    assert not dial_held_off(ControlFailure("stream reset"))
    # connected, and the security handshake cut short (CI, 100 ms one way): no word on the server either
    cut = ("Connect failed. msg=failed to dial: failed to dial QmYZKdrZ6sHx6srtgDXHjFzRvjVX9v2U4Q3WvojNUbcPa4:\n"
           "  * [/ip4/11.77.3.2/tcp/42355] failed to negotiate security protocol: error reading handshake message: "
           "noise: message is too short")
    assert dial_held_off(ControlFailure(cut))
    assert not dial_held_off(ControlFailure(cut + "\n  * [/ip4/10.0.0.1/tcp/1] i/o timeout"))  # one truly failed
    # a server that answers with the daemon's words is still failing (else it would dodge every ban)
    assert not dial_held_off(P2PHandlerError(HELD_OFF))


def test_a_call_our_daemon_held_off_bans_nobody_and_goes_to_another_server():
    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        if peer == "a0":
            raise DialHeldOff(f"stage 0 forward on a0 failed: ControlFailure: {HELD_OFF}")
        return answer(stage, request, 1)

    pipeline = FakePipeline({0: ["a0", "b0"]}, behaviour)
    assert pipeline.trip() == 2.5
    assert [peer for _, peer, _ in pipeline.sent] == ["a0", "b0"]
    a0 = pipeline.balancers[0].servers["a0"]
    assert a0.failures == 0 and pipeline.stats.failures == 0 and pipeline.stats.held_off[0] == 1
    assert pipeline.open_tickets() == 0
    # left out while libp2p holds off, back once it ends
    assert pipeline.balancers[0].available() == ["b0"]
    pipeline.clock.now += DIAL_HOLD_OFF
    assert sorted(pipeline.balancers[0].available()) == ["a0", "b0"]


def test_a_reply_with_the_wrong_tensors_counts_as_a_failure():
    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        reply = answer(stage, request, 1)
        if peer == "a0":
            reply.tensors.append(torch.zeros(1))
        return reply

    pipeline = FakePipeline({0: ["a0", "b0"]}, behaviour)
    assert pipeline.trip() == 2.5
    assert pipeline.stats.failures == 1 and pipeline.open_tickets() == 0


def _lie(stage: int, request: StageRequest, lie: str) -> StageReply:
    """A reply of a server that means harm (or is broken) in one of the ways a trainer checks."""
    reply = answer(stage, request, 2)
    if lie == "no loss" and "loss" in reply.info:
        del reply.info["loss"]
    elif lie in ("nan loss", "string loss", "bool loss") and "loss" in reply.info:
        reply.info["loss"] = {"nan loss": float("nan"), "string loss": "2.5", "bool loss": True}[lie]
    elif lie == "inf output" and reply.tensors:
        reply.tensors[0].view(-1)[0] = float("inf")
    elif lie == "wrong shape" and reply.tensors:
        reply.tensors[0] = torch.zeros(reply.tensors[0].shape[0] + 1, *reply.tensors[0].shape[1:])
    elif lie == "integers" and reply.tensors:
        reply.tensors[0] = reply.tensors[0].long()
    return reply


@pytest.mark.parametrize("lie", ["no loss", "nan loss", "string loss", "bool loss", "inf output", "wrong shape",
                                 "integers"])
def test_a_bad_reply_bans_its_server_and_the_call_is_retried_on_another(lie):
    calls: list[tuple[str, bool]] = []  # (peer, whether its reply was a lie)

    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        honest = answer(stage, request, 2)
        if not peer.startswith("liar"):
            return honest
        reply = _lie(stage, request, lie)
        same = [a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
                for a, b in zip(reply.tensors, honest.tensors)]
        lied = reply.info != honest.info or not all(same)
        calls.append((peer, lied))
        return reply

    pipeline = FakePipeline({0: ["liar0", "b0"], 1: ["liar1", "b1"]}, behaviour)
    for i in range(5):
        assert pipeline.trip(f"t:0:{i}") == 2.5
    assert pipeline.stats.bad_replies == sum(lied for _, lied in calls) >= 1
    assert pipeline.stats.failures == pipeline.stats.bad_replies and pipeline.open_tickets() == 0
    for liar in ("liar0", "liar1"):  # banned: no work after its first lie while the ban lasts
        replies = [lied for peer, lied in calls if peer == liar]
        assert True not in replies[:-1]


def test_a_forward_output_of_the_wrong_hidden_size_is_a_bad_reply():
    pipeline = FakePipeline({0: ["a0", "b0"], 1: ["a1"]})
    pipeline.hidden_size = 4
    assert pipeline.trip() == 2.5 and pipeline.stats.bad_replies == 0
    pipeline.hidden_size = 5
    with pytest.raises(asyncio.TimeoutError):  # every server of stage 0 is "wrong": the trip waits on
        asyncio.run(asyncio.wait_for(pipeline.train(torch.zeros(8, 16, dtype=torch.long),
                                                    torch.zeros(8, 16, dtype=torch.long), "t:0:2"), 0.5))
    assert pipeline.stats.bad_replies >= 2


@pytest.mark.parametrize("code", [BAD_REQUEST, INTERNAL, WRONG_STAGE, NOT_READY, BUSY, "teapot"])
def test_an_error_reply_bans_its_server_and_the_call_is_retried_on_another(code):
    """Whatever a server answers with, its error is its failure: a stranger's `bad_request` is a claim."""
    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        if peer == "a0":
            raise RemoteStageError(code, "no")
        return answer(stage, request, 1)

    pipeline = FakePipeline({0: ["a0", "b0"]}, behaviour)
    assert pipeline.trip() == 2.5
    assert [peer for _, peer, _ in pipeline.sent] == ["a0", "b0"]
    a0 = pipeline.balancers[0].servers["a0"]
    assert a0.failures == 1 and "a0" not in pipeline.balancers[0].available()
    full = code in (BUSY, NOT_READY)  # the server says it is full: back soon
    assert a0.banned_until - pipeline.clock.now == (1.0 if full else 15.0)
    assert pipeline.stats.failures == 1 and pipeline.open_tickets() == 0
    assert pipeline.stats.error_replies == {code if code != "teapot" else "other": 1}


def test_a_server_refusing_everything_gets_its_probes_and_no_micro_batch_is_lost():
    """The issue's attack at the last stage: one server answers `bad_request` to every call, at once."""
    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        if peer == "0-refuses":  # sorts first: an untried newcomer wins every tie
            raise RemoteStageError(BAD_REQUEST, "every request is bad here")
        pipeline.clock.now += 0.01
        return answer(stage, request, 2)

    pipeline = FakePipeline({0: ["a0"], 1: ["a1"]}, behaviour)
    pipeline.trip()
    pipeline.update_servers({0: ["a0"], 1: ["a1", "0-refuses"]})
    for i in range(200):  # 200 trips, 4 s of the balancers' clock: the ban (15 s) never ends
        assert pipeline.trip(f"t:0:{i}") == 2.5
    to = Counter(peer for _, peer, _ in pipeline.sent)
    assert to["0-refuses"] == 1 and to["a1"] == 201
    pipeline.clock.now += 15  # its ban is over: one more probe, then a ban of 30 s
    for i in range(50):
        pipeline.trip(f"t:1:{i}")
    assert Counter(peer for _, peer, _ in pipeline.sent)["0-refuses"] == 2
    assert pipeline.balancers[1].servers["0-refuses"].failures == 2 and pipeline.stats.refused == 0


def test_a_request_every_server_refuses_is_dropped_and_their_bans_taken_back():
    """Our own bad request (a bug of this trainer): every server refuses it. The micro-batch is dropped
    after one refusal from each, and no server keeps a ban for our fault."""
    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        raise RemoteStageError(BAD_REQUEST, "inputs of the wrong shape")

    pipeline = FakePipeline({0: ["a0", "b0", "c0"]}, behaviour)
    with pytest.raises(PipelineError, match=r"every server of stage 0 \(3\) refused the backward request as bad"):
        pipeline.trip()
    assert sorted(peer for _, peer, _ in pipeline.sent) == ["a0", "b0", "c0"]  # one call each, no pause
    balancer = pipeline.balancers[0]
    assert all(s.failures == 0 for s in balancer.servers.values()) and len(balancer.available()) == 3
    assert pipeline.stats.refused == 1 and pipeline.open_tickets() == 0


def test_a_lone_refusal_does_not_drop_a_micro_batch_while_another_server_may_take_it():
    """One server refuses, the other fails for a while (down, restarting): the trip waits for the other."""
    attempts = Counter()

    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        attempts[peer] += 1
        if peer == "a0":
            raise RemoteStageError(BAD_REQUEST, "no")
        if attempts[peer] < 3:
            raise StageUnavailable("restarting")
        return answer(stage, request, 1)

    pipeline = FakePipeline({0: ["a0", "b0"]}, behaviour)
    pipeline.settings.retry_pause = 0.01
    assert pipeline.trip() == 2.5
    assert attempts == {"a0": 1, "b0": 3}  # the refuser is not asked again within the trip
    assert pipeline.stats.refused == 0


def test_a_cancelled_trip_releases_its_call():
    async def scenario() -> FakePipeline:
        all_called, never, calls = asyncio.Event(), asyncio.Event(), []

        async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
            calls.append(peer)
            if len(calls) == 4:
                all_called.set()
            await never.wait()
            raise AssertionError("unreachable")

        pipeline = FakePipeline({0: ["a0"], 1: ["a1"]}, behaviour)
        x = torch.zeros(8, 16, dtype=torch.long)
        trips = [asyncio.create_task(pipeline.train(x, x, f"t:{i}:1")) for i in range(4)]
        await asyncio.wait_for(all_called.wait(), CALL_TIMEOUT)
        assert pipeline.open_tickets() == 4
        for trip in trips:
            trip.cancel()
        await asyncio.wait_for(asyncio.gather(*trips, return_exceptions=True), CALL_TIMEOUT)
        return pipeline

    pipeline = asyncio.run(scenario())
    assert pipeline.open_tickets() == 0
    assert pipeline.balancers[0].servers["a0"].failures == 0  # a cancellation says nothing about the server


def test_backward_and_forward_are_timed_separately():
    pipeline = FakePipeline({0: ["a0"], 1: ["a1"]})
    pipeline.trip()
    assert set(pipeline.balancers[0].servers["a0"].service) == {FORWARD, BACKWARD}
    assert set(pipeline.balancers[1].servers["a1"].service) == {BACKWARD}  # the fused last stage


def test_a_backward_is_pinned_to_the_server_whose_forward_ran_on_look_ahead_parameters():
    """Only the server that ran a forward on its own prediction of the step (its reply says `ahead`) can give that
    forward's gradient: the backward goes there whenever it can take it, not merely when it is about as fast."""
    ahead = {"t:0:1": True, "t:0:2": False}

    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        reply = answer(stage, request, 2)
        if stage == 0 and request.kind == FORWARD and ahead[request.request_id]:
            reply.info["ahead"] = True
        return reply

    p = FakePipeline({0: ["a", "b"], 1: ["c"]}, behaviour)
    pins = []
    choose = p.balancers[0].choose

    def spy(size, kind, exclude=(), prefer=None, pin=False):
        if kind == BACKWARD:
            pins.append(pin)
        return choose(size, kind, exclude=exclude, prefer=prefer, pin=pin)

    p.balancers[0].choose = spy
    p.trip("t:0:1")
    p.trip("t:0:2")
    assert pins == [True, False]
    assert p.open_tickets() == 0


def test_a_call_with_no_other_server_to_go_to_says_so():
    """`patient`: a server refusing by time (max_wait) takes the call anyway when the trainer has no other server of
    the stage to send it to (the only one listed) or when it is a pinned backward's; not when it is merely the last
    one of several left unbanned (bench/sim: committed to a long queue there, the micro-batch waited longer)."""
    said = []

    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        said.append((stage, peer, request.kind, request.patient))
        if peer == "a0" and not request.patient and request.request_id == "t:0:1":
            raise RemoteStageError(NOT_READY, "2.00s of work queued ahead, past its limit (max_wait 0.5s)")
        reply = answer(stage, request, 2)
        if stage == 0 and request.kind == FORWARD and request.request_id == "t:0:2":
            reply.info["ahead"] = True  # its backward is pinned here
        return reply

    p = FakePipeline({0: ["a0", "b0"], 1: ["c1"]}, behaviour)
    p.trip("t:0:1")
    # a0 (first by id) refuses, and is banned: b0, the last one left, is asked as usual; c1 is alone in stage 1
    assert said == [(0, "a0", FORWARD, False), (0, "b0", FORWARD, False), (1, "c1", BACKWARD, True),
                    (0, "b0", BACKWARD, False)]
    p.clock.now += 60  # a0's ban is over, and it has room now
    said.clear()
    p.trip("t:0:2")
    forward, backward = said[0], said[-1]
    assert forward[2] == FORWARD and not forward[3]
    assert backward[2] == BACKWARD and backward[1] == forward[1] and backward[3]  # pinned to its forward's server
    assert p.open_tickets() == 0
