"""Spot checks of replies that are well formed but wrong (issue 26): a server answering with zeros, noise, a
flipped or scaled gradient or a made-up loss is caught by witnesses and banned; honest servers, on real
stages of the model in float32 and bfloat16, never are. The routing runs without a network (FakePipeline)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from swarm.config import ModelConfig, OptimizerConfig, RunConfig, StagesConfig
from swarm.model.stages import build_stage
from swarm.protocol import BACKWARD, FORWARD, StageReply, StageRequest
from swarm.routing.spot_checks import (
    OUTPUT_TOLERANCE,
    SLOPE_RATIO,
    STRIKES,
    Finding,
    SpotCheck,
    Witnesses,
    agree,
    minority,
    relative_distance,
    slopes_agree,
)
from tests.unit.test_routing_pipeline import CALL_TIMEOUT, FakePipeline

pytestmark = pytest.mark.timeout(60)



def run_config(num_stages: int) -> RunConfig:
    """A model a few milliseconds a call on a CPU: 3 blocks of width 32, sequences of 16, micro-batches of 4."""
    model = ModelConfig(vocab_size=256, seq_len=16, n_layer=3, n_head=2, d_model=32)
    return RunConfig(run_id="spot-checks", model=model, stages=StagesConfig(num_stages=num_stages),
                     optimizer=OptimizerConfig(batch_size=8, micro_batch_size=4)).validate()


CONFIG = run_config(3)
STEP = 3  # every server's optimizer step, unless a test says otherwise


class Stages:
    """The run's real stages (the same weights on every server); a server computes like a StageBackend."""

    def __init__(self, num_stages: int):
        torch.manual_seed(0)
        self.modules = [build_stage(run_config(num_stages), i) for i in range(num_stages)]
        self.last = num_stages - 1

    def answer(self, stage: int, request: StageRequest, bf16: bool = False) -> StageReply:
        module = self.modules[stage]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if request.kind == FORWARD:
                with torch.no_grad():
                    out = module(request.inputs, request.targets)
                return StageReply([out.float()], server_step=STEP)
            x = request.inputs if stage == 0 else request.inputs.detach().float().requires_grad_(True)
            out = module(x, request.targets)
            if stage == self.last:
                (out * x.shape[0]).backward()  # the gradient of the loss summed over the micro-batch
            else:
                out.backward(request.grad_outputs.to(out.dtype))
        for p in module.parameters():
            p.grad = None
        info = {"loss": float(out.detach())} if stage == self.last else {}
        return StageReply([] if stage == 0 else [x.grad.float()], server_step=STEP, info=info)


def micro_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (CONFIG.optimizer.micro_batch_size, CONFIG.model.seq_len)
    return (torch.randint(0, CONFIG.model.vocab_size, shape, generator=g),
            torch.randint(0, CONFIG.model.vocab_size, shape, generator=g))


def lie_on(kind: str, lie: Callable[[StageReply], StageReply]) -> Callable[[StageRequest, StageReply], StageReply]:
    return lambda request, reply: lie(reply) if request.kind == kind else reply


def tensors(reply: StageReply, change: Callable[[torch.Tensor], torch.Tensor]) -> StageReply:
    return StageReply([change(t) for t in reply.tensors], reply.server_step, reply.info)


LIES: dict[str, Callable[[StageRequest, StageReply], StageReply]] = {  # what a liar does to its honest reply
    "zero output": lie_on(FORWARD, lambda r: tensors(r, torch.zeros_like)),
    "noise output": lie_on(FORWARD, lambda r: tensors(r, torch.randn_like)),
    "zero gradient": lie_on(BACKWARD, lambda r: tensors(r, torch.zeros_like)),
    "flipped gradient": lie_on(BACKWARD, lambda r: tensors(r, torch.neg)),
    "gradient x 10": lie_on(BACKWARD, lambda r: tensors(r, lambda t: 10 * t)),
    "noise gradient": lie_on(BACKWARD, lambda r: tensors(r, lambda t: torch.randn_like(t) * t.std())),
    # a step of its own, so that no witness is ever at the step it claims
    "noise output, another step": lie_on(FORWARD, lambda r: StageReply([torch.randn_like(r.tensors[0])],
                                                                      r.server_step + 1, r.info)),
    "flipped gradient, another step": lie_on(BACKWARD, lambda r: StageReply([-t for t in r.tensors],
                                                                            r.server_step + 5, r.info)),
    # "on a prediction" every time, so that no witness is ever at the moment it claims
    "noise output, always ahead": lie_on(FORWARD, lambda r: StageReply([torch.randn_like(r.tensors[0])],
                                                                        r.server_step, {**r.info, "ahead": True})),
    "made-up loss": lie_on(BACKWARD, lambda r: StageReply(r.tensors, r.server_step, {**r.info, "loss": 3.0})
                           if "loss" in r.info else r),
}


class Swarm:
    """A FakePipeline over real stages: servers named 'liar*' answer with `lie`, the others honestly."""

    def __init__(self, servers: dict[int, list[str]], lie: str | None = None, rate: float = 1.0,
                 bf16: frozenset[str] = frozenset()):
        self.stages = Stages(len(servers))
        self.lie, self.bf16 = lie, bf16
        self.calls: Counter = Counter()  # (peer, kind) -> calls answered
        self.once: dict[str, Callable[[StageReply], StageReply]] = {}  # peer -> what it does to its next reply
        self.sent_to_first: list[torch.Tensor] = []  # the gradients stage 0's backwards were given
        self.pipeline = FakePipeline(servers, self.behaviour, spot_check_rate=rate)

    async def behaviour(self, stage: int, peer: str, request: StageRequest) -> StageReply:
        self.pipeline.clock.now += 0.001 if peer.startswith("liar") else 0.01  # a liar is the fastest
        self.calls[peer, request.kind] += 1
        if stage == 0 and request.kind == BACKWARD:
            self.sent_to_first.append(request.grad_outputs)
        reply = self.stages.answer(stage, request, bf16=peer in self.bf16)
        if peer in self.once:
            reply = self.once.pop(peer)(reply)
        return LIES[self.lie](request, reply) if peer.startswith("liar") and self.lie else reply

    def trip(self, seed: int) -> float:
        x, y = micro_batch(seed)
        return asyncio.run(asyncio.wait_for(self.pipeline.train(x, y, f"t:0:{seed}"), CALL_TIMEOUT))

    def honest_trip(self, seed: int) -> tuple[float, torch.Tensor]:
        """The loss of micro-batch `seed`, and the gradient stage 0 gets, as honest servers compute them."""
        x, y = micro_batch(seed)
        stages, inputs = self.stages, [x]
        for stage in range(stages.last):
            inputs.append(stages.answer(stage, StageRequest(FORWARD, stage, "h", inputs[-1])).tensors[0])
        reply = stages.answer(stages.last, StageRequest(BACKWARD, stages.last, "h", inputs[-1], targets=y))
        loss = reply.info["loss"]
        for stage in range(stages.last - 1, 0, -1):
            reply = stages.answer(stage, StageRequest(BACKWARD, stage, "h", inputs[stage],
                                                      grad_outputs=reply.tensors[0]))
        return loss, reply.tensors[0]


def answered_before(swarm: Swarm, stage: int, *peers: str) -> None:
    """Take the servers off probation: each answered the trainer well once."""
    balancer = swarm.pipeline.balancers[stage]
    for peer in peers:
        balancer.report_success(balancer.charge(peer, 4, FORWARD))


# --- the comparisons --------------------------------------------------------------------------------

def test_relative_distance_and_slopes():
    a = torch.randn(4, 16, 32)
    assert relative_distance(a, a) == 0.0
    assert relative_distance(a, torch.zeros_like(a)) == pytest.approx(1.0)
    assert relative_distance(a, a * (1 + OUTPUT_TOLERANCE / 2)) < OUTPUT_TOLERANCE
    assert relative_distance(a, -a) == pytest.approx(2.0)
    assert slopes_agree(1.0, 1.0) and slopes_agree(1.0, SLOPE_RATIO) and slopes_agree(0.0, 0.0)
    assert not slopes_agree(1.0, -1.0) and not slopes_agree(1.0, SLOPE_RATIO * 1.01) and not slopes_agree(1.0, 0.0)


def test_the_minority_is_the_one_the_other_two_agree_against():
    a, b, c = Finding("a", loss=2.0, slope=1.0), Finding("b", loss=2.01, slope=1.1), Finding("c", loss=2.0, slope=-1.0)
    assert agree(a, b) and not agree(a, c)
    assert minority(c, a, b) is c and minority(a, c, b) is c and minority(a, b, c) is c
    assert minority(a, b, Finding("d", loss=2.0, slope=1.0)) is None  # all agree
    assert minority(a, c, Finding("e", loss=9.0, slope=1.0)) is None  # no two agree


def test_nothing_checkable_is_not_checked():
    x, y = micro_batch(0)
    h = torch.ones(4, 16, 32)
    assert SpotCheck.of(StageRequest(BACKWARD, 0, "r", x, grad_outputs=h), last=False) is None  # no gradient back
    assert SpotCheck.of(StageRequest(FORWARD, 2, "r", h, targets=y), last=True) is None  # an evaluation
    assert SpotCheck.of(StageRequest(BACKWARD, 1, "r", h, grad_outputs=h, moe_lost=[(1, [0])]), last=False) is None
    check = SpotCheck.of(StageRequest(FORWARD, 0, "r", x), last=False)
    assert check.claim("a", StageReply([h], info={"moe_lost": [(1, [0])]})) is None  # went without an expert


# --- liars are caught, honest servers never are -------------------------------------------------------

@pytest.mark.parametrize("lie", list(LIES))
@pytest.mark.parametrize("stage", [0, 1, 2], ids=["first stage", "middle stage", "last stage"])
def test_a_wrong_reply_is_caught_banned_and_never_used(lie: str, stage: int):
    servers = {s: ["h1", "h2"] for s in range(3)}
    servers[stage] = ["h1", "h2", "liar"]
    swarm = Swarm(servers, lie)
    for seed in range(6):
        loss, grad = swarm.honest_trip(seed)
        assert swarm.trip(seed) == pytest.approx(loss, rel=1e-5)  # the liar's answer was never used...
        torch.testing.assert_close(swarm.sent_to_first[-1], grad, rtol=1e-4, atol=1e-6)  # ...not even upstream
    stats, balancer = swarm.pipeline.stats, swarm.pipeline.balancers[stage]
    harmless = (stage == 0 and "gradient" in lie) or (stage == 2 and "output" in lie) or \
        (stage < 2 and lie == "made-up loss")  # nothing of the lie reaches the trainer there
    if harmless:
        assert not stats.caught
    else:
        assert stats.caught == {stage: 1}
        state = balancer.servers["liar"]
        assert state.banned_until - swarm.pipeline.clock.now >= balancer.ban_max - 1 and not state.measured


def test_honest_servers_in_float32_and_bfloat16_never_disagree():
    servers = {s: ["a", "b", "c-bf16"] for s in range(3)}  # one replica computes in bfloat16 (another device)
    swarm = Swarm(servers, bf16=frozenset({"c-bf16"}))
    for seed in range(40):
        swarm.trip(seed)
    stats = swarm.pipeline.stats
    assert stats.spot_checks >= 100 and stats.disputes == 0 and not stats.caught, stats


def three_replicas_of_stage_0() -> tuple[Swarm, FakePipeline, Witnesses]:
    """Servers a, b and c of stage 0, all off probation, after one trip; witnesses drawn with a fixed seed."""
    swarm = Swarm({0: ["a", "b", "c"], 1: ["h"], 2: ["h"]})
    answered_before(swarm, 0, "a", "b", "c")
    swarm.trip(0)
    swarm.pipeline.rng = random.Random(1)
    return swarm, swarm.pipeline, swarm.pipeline.witnesses[0]


def test_a_witness_a_step_apart_gets_a_strike_not_a_ban():
    """Replicas apply a step milliseconds apart: a witness that answered just before (its output one step
    behind, so unlike the others') is not banned for it; an agreeing check clears its strike."""
    swarm, pipeline, witnesses = three_replicas_of_stage_0()
    swarm.once["c"] = lambda r: StageReply([r.tensors[0] * 3], STEP - 1, r.info)  # answered before its step
    seed = 1
    while "c" in swarm.once and seed < 30:  # until c was a witness (or answered a call), and lost
        loss, _ = swarm.honest_trip(seed)
        assert swarm.trip(seed) == pytest.approx(loss, rel=1e-5)
        seed += 1
    assert witnesses.strikes("c", FORWARD) == 1 and pipeline.stats.disputes == 1
    assert "c" in pipeline.balancers[0].available()
    for later in range(seed, seed + 40):  # honest from now on: never banned
        swarm.trip(later)
    assert not pipeline.stats.caught and witnesses.strikes("c", FORWARD) <= 1


def test_a_reply_on_predicted_parameters_is_a_moment_of_its_own_and_gets_a_strike_not_a_ban():
    """A server whose round runs on look-ahead parameters answers at its step but on a prediction of the next
    one (its reply says `ahead`): its output differs from its replicas' at the same step, early in a run by more
    than the tolerance. Compared as an answer of another moment, it is struck, not banned as a liar; the same
    output without `ahead` is a lie at their step and banned."""
    for ahead, banned in ((True, False), (False, True)):
        swarm, pipeline, witnesses = three_replicas_of_stage_0()
        info = {"ahead": True} if ahead else {}
        swarm.once["c"] = lambda r, info=info: StageReply([r.tensors[0] * 3], STEP, {**r.info, **info})
        seed = 1
        while "c" in swarm.once and seed < 30:  # until c was a witness (or answered a call), and lost
            swarm.trip(seed)
            seed += 1
        assert pipeline.stats.disputes == 1
        assert (pipeline.stats.caught == {0: 1}) == banned, pipeline.stats.caught
        assert ("c" in pipeline.balancers[0].available()) != banned
        assert witnesses.strikes("c", FORWARD) == (0 if banned else 1)


def test_two_servers_alone_cannot_settle_a_dispute(caplog):
    swarm = Swarm({0: ["h"], 1: ["h1", "liar"], 2: ["h"]}, "flipped gradient")
    answered_before(swarm, 1, "h1", "liar")  # the liar lies only once past its probes
    with caplog.at_level(logging.INFO, "swarm.routing.spot_checks"):
        for seed in range(4):
            swarm.trip(seed)
    stats = swarm.pipeline.stats
    assert stats.disputes >= 1 and not stats.caught  # which of the two lies, nothing says
    assert all(s.banned_until == 0 for s in swarm.pipeline.balancers[1].servers.values())
    assert {r.levelno for r in caplog.records if "no third server" in r.message} == {logging.WARNING}


def test_a_newcomer_disputed_by_a_server_that_answered_before_is_not_used_and_struck_out(caplog):
    """No third server settles it (a stage of two, or its others banned): the newcomer's probe is not used,
    it stays on probation, and STRIKES such probes ban it. The stranger of the CI run on 12-05, whose
    zero gradients were used 77 times while the stage's third server was banned for a failed call."""
    swarm = Swarm({0: ["h"], 1: ["h"], 2: ["h1"]}, "zero gradient")  # the last stage: its probe is a backward
    swarm.trip(0)  # h1 answers: no longer on probation
    swarm.pipeline.update_servers({0: ["h"], 1: ["h"], 2: ["h1", "liar"]})
    with caplog.at_level(logging.INFO, "swarm.routing.spot_checks"):
        for seed in range(1, 12):
            loss, grad = swarm.honest_trip(seed)
            assert swarm.trip(seed) == pytest.approx(loss, rel=1e-5)
            torch.testing.assert_close(swarm.sent_to_first[-1], grad, rtol=1e-4, atol=1e-6)  # no lie used
    assert swarm.calls["liar", BACKWARD] == STRIKES and swarm.pipeline.stats.caught == {2: 1}
    assert "liar" not in swarm.pipeline.balancers[2].available()
    struck = [r for r in caplog.records if "newcomer liar disagrees with h1" in r.message]
    assert [f"{n} of {STRIKES} strikes" in r.message for n, r in enumerate(struck, 1)] == [True] * STRIKES


def test_a_newcomer_disputed_at_a_moment_that_does_not_compare_is_held_off_briefly_not_struck(caplog):
    """An honest replica early in a run answers at its step while the one that answered before answers on a
    prediction of its next parameters (or both on their own predictions, or a step apart): their outputs
    differ, and nothing says which lies. The newcomer's answer is not used and it is held off as a busy
    server is (from the balancer's brief base), with no strike: three in a second banned such a replica for
    300 s in a 2 x 2 swarm. Once it agrees at a like moment it is used. A liar always answering at such a
    moment is never used, and held off ever longer."""
    for moment in ({"step": STEP + 1}, {"ahead": True}, {"both ahead": True}):
        swarm = Swarm({0: ["h"], 1: ["c"], 2: ["h"]})  # (the newcomer "b" wins ties with "c")
        swarm.trip(0)
        swarm.pipeline.update_servers({0: ["h"], 1: ["c", "b"], 2: ["h"]})
        balancer, clock = swarm.pipeline.balancers[1], swarm.pipeline.clock
        step = moment.get("step", STEP)
        ahead = {"ahead": True} if moment.keys() & {"ahead", "both ahead"} else {}
        swarm.once["b"] = lambda r, step=step, ahead=ahead: StageReply([r.tensors[0] * 3], step, {**r.info, **ahead})
        if "both ahead" in moment:
            swarm.once["c"] = lambda r: StageReply(r.tensors, STEP, {**r.info, "ahead": True})
        with caplog.at_level(logging.INFO, "swarm.routing.spot_checks"):
            loss, _ = swarm.honest_trip(1)
            assert swarm.trip(1) == pytest.approx(loss, rel=1e-5)  # its answer was not used
        assert "b" not in swarm.once and any("which do not compare" in r.message for r in caplog.records)
        state = balancer.servers["b"]
        assert state.failures == 1 and 0 < state.banned_until - clock.now <= balancer.brief_ban_base
        assert not swarm.pipeline.witnesses[1].strikes("b", FORWARD) and not swarm.pipeline.stats.caught
        clock.now = state.banned_until  # its brief ban over, it answers like for like: used, off probation
        calls = swarm.calls["b", FORWARD]
        swarm.trip(2)
        assert swarm.calls["b", FORWARD] > calls and not balancer.on_probation("b") and not swarm.pipeline.stats.caught
        caplog.clear()

    liar = Swarm({0: ["h"], 1: ["h1"], 2: ["h"]}, "noise output, always ahead")
    liar.trip(0)
    liar.pipeline.update_servers({0: ["h"], 1: ["h1", "liar"], 2: ["h"]})
    balancer, clock = liar.pipeline.balancers[1], liar.pipeline.clock
    bans = []
    for seed in range(1, 6):
        loss, _ = liar.honest_trip(seed)
        assert liar.trip(seed) == pytest.approx(loss, rel=1e-5)  # never used
        state = balancer.servers["liar"]
        bans.append(state.banned_until - clock.now)
        clock.now = max(clock.now, state.banned_until)  # (the next trip may pick it again)
    assert bans == sorted(bans) and bans[-1] >= 8 * bans[0] and balancer.on_probation("liar")
    assert not liar.pipeline.witnesses[1].strikes("liar", FORWARD)


def test_an_honest_newcomer_agrees_and_is_used():
    swarm = Swarm({0: ["h"], 1: ["h1"], 2: ["h"]})
    swarm.trip(0)
    swarm.pipeline.update_servers({0: ["h"], 1: ["h1", "new"], 2: ["h"]})
    for seed in range(1, 6):
        swarm.trip(seed)
    stats = swarm.pipeline.stats
    assert swarm.calls["new", BACKWARD] >= 1 and stats.disputes == 0 and not stats.caught
    assert not swarm.pipeline.balancers[1].on_probation("new")


def test_two_servers_steps_apart_disagree_without_a_warning(caplog):
    # one of a stage of two still catching up: its outputs are another step's, a dispute the log need not shout
    swarm = Swarm({0: ["a", "b"], 1: ["h"], 2: ["h"]})
    answered_before(swarm, 0, "a", "b")
    swarm.trip(0)
    with caplog.at_level(logging.INFO, "swarm.routing.spot_checks"):
        for seed in range(1, 8):
            swarm.once["b"] = lambda r: StageReply([r.tensors[0] * 3], STEP - 5, r.info)
            swarm.trip(seed)
    disputes = [r for r in caplog.records if "no third server" in r.message]
    apart = (f"at steps {STEP} and {STEP - 5}", f"at steps {STEP - 5} and {STEP}")
    assert disputes and all(r.levelno == logging.INFO and any(a in r.message for a in apart) for r in disputes)
    assert not swarm.pipeline.stats.caught


def test_a_lying_witness_is_banned_and_the_reply_it_disputed_kept():
    servers = {0: ["h"], 1: ["a", "b", "liar"], 2: ["h"]}
    swarm = Swarm(servers, "noise output")
    pipeline = swarm.pipeline
    for peer in ("a", "b"):  # a and b answered before; the liar is a newcomer, picked as a witness
        pipeline.balancers[1].report_success(pipeline.balancers[1].charge(peer, 4, FORWARD))
    pipeline.rng = random.Random(3)
    for seed in range(20):
        loss, _ = swarm.honest_trip(seed)
        assert swarm.trip(seed) == pytest.approx(loss, rel=1e-5)
    assert pipeline.stats.caught == {1: 1}
    assert "liar" not in pipeline.balancers[1].available()


def test_a_newcomers_probe_is_checked_at_any_rate():
    servers = {0: ["h"], 1: ["a", "b"], 2: ["h"]}
    swarm = Swarm(servers, "noise output", rate=1e-9)
    for seed in range(3):
        swarm.trip(seed)
    assert swarm.pipeline.stats.spot_checks <= 2  # a's probe (b, its witness, answered then); none since
    swarm.pipeline.update_servers({0: ["h"], 1: ["a", "b", "liar"], 2: ["h"]})
    for seed in range(3, 10):
        loss, _ = swarm.honest_trip(seed)
        assert swarm.trip(seed) == pytest.approx(loss, rel=1e-5)
    assert swarm.calls["liar", FORWARD] == 1 and swarm.pipeline.stats.caught == {1: 1}  # its first reply was its last


def test_no_checks_at_rate_zero():
    swarm = Swarm({0: ["h"], 1: ["a", "liar"], 2: ["h"]}, "noise output", rate=0.0)
    for seed in range(3):
        swarm.trip(seed)
    assert swarm.pipeline.stats.spot_checks == 0 and swarm.pipeline.stats.calls == 3 * 5


def test_what_spot_checks_cost_in_calls():
    """At the default rate, past the probes: about 1/32 of the checkable calls get a witness (one forward
    for a forward, two for a backward)."""
    servers = {s: ["a", "b"] for s in range(3)}
    swarm = Swarm(servers, rate=1 / 32)
    for seed in range(200):
        swarm.trip(seed)
    stats = swarm.pipeline.stats
    primary = 200 * 5  # forwards of stages 0 and 1, backwards of 2, 1 and 0
    extra = stats.calls - primary
    print(f"{extra} witness calls for {primary} calls ({extra / primary:.1%}), {stats.spot_checks} checks")
    assert stats.spot_checks <= 2 * 6 + 2 * 200 * 4 / 32  # the probes, and twice the expected random share
    assert extra <= 0.1 * primary


def test_a_checked_probe_is_timed_without_its_check():
    """The witness's time is not the checked server's: a newcomer is measured as fast as it answered."""
    servers = {0: ["h"], 1: ["a", "b"], 2: ["h"]}
    swarm = Swarm(servers)
    slow_witness = swarm.behaviour

    async def behaviour(stage: int, peer: str, request: StageRequest) -> StageReply:
        reply = await slow_witness(stage, peer, request)
        if stage == 1 and peer == "b":
            swarm.pipeline.clock.now += 5.0  # b answers in 5 s
        return reply

    swarm.pipeline.behaviour = behaviour
    swarm.pipeline.rng = random.Random(0)
    swarm.trip(0)  # a's probe (0.01 s), witnessed by b (5 s)
    balancer = swarm.pipeline.balancers[1]
    assert balancer.expected_seconds_per_sample("a", FORWARD) < 0.01


def test_a_witness_that_steps_between_its_forwards_is_asked_again():
    """A witness whose two forwards straddle its optimizer step says nothing comparable: the check asks again
    rather than letting the probe pass unchecked (under load, the liar's first answer was used this way)."""
    swarm = Swarm({0: ["h"], 1: ["h"], 2: ["h1", "h2"]}, "zero gradient")
    answered_before(swarm, 2, "h1", "h2")  # off probation
    swarm.trip(0)
    swarm.pipeline.update_servers({0: ["h"], 1: ["h"], 2: ["h1", "h2", "liar"]})
    for witness in ("h1", "h2"):  # the first forward each answers next is a step behind its second
        swarm.once[witness] = lambda r: StageReply(r.tensors, STEP - 1, r.info)
    loss, grad = swarm.honest_trip(1)
    assert swarm.trip(1) == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(swarm.sent_to_first[-1], grad, rtol=1e-4, atol=1e-6)  # the zeros were not used
    assert swarm.calls["liar", BACKWARD] == 1 and swarm.pipeline.stats.caught == {2: 1}
