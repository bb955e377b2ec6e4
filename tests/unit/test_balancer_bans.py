"""StageBalancer: tickets, timeouts and bans, lookups that miss a server, and probation."""

from __future__ import annotations

import heapq
import random
from collections import Counter

import pytest

from swarm.protocol import BACKWARD, FORWARD
from tests.unit.balancer_sim import SIZE, FakeClock, balancer, measured, simulate, speeds

pytestmark = pytest.mark.timeout(30)


# --- tickets, timeouts and bans -------------------------------------------------------------------

def test_outstanding_work_is_released_exactly_once_however_calls_end():
    clock, rng = FakeClock(), random.Random(0)
    b = balancer(clock, "a", "b", "c", ban_base=0.001, ban_max=0.001)
    for _ in range(2000):
        ticket = b.choose(SIZE, rng.choice([FORWARD, BACKWARD]))
        clock.now += rng.random()
        ending = rng.choice(["success", "failure", "cancelled"])
        if ending == "success":
            b.report_success(ticket)
        elif ending == "failure":
            b.report_failure(ticket)
        b.release(ticket)  # what the pipeline's `finally` does, whatever happened before
        assert b.report_failure(ticket) == 0.0  # a closed ticket neither bans...
        b.report_success(ticket)  # ...nor counts again
    assert all(not s.open for s in b.servers.values())
    assert all(b.outstanding_seconds(p) == 0.0 for p in b.servers)


def test_timeouts_scale_with_the_expected_finish_within_floor_and_ceiling():
    clock = FakeClock()
    b = balancer(clock, "a", "b")
    limits = dict(multiplier=5, floor=1, ceiling=60)
    ticket = b.charge("a", SIZE, FORWARD)
    assert b.timeout(ticket, **limits) == 60  # never timed: the ceiling
    clock.now += SIZE * 0.5
    b.report_success(ticket)
    queue = [b.charge("a", SIZE, FORWARD) for _ in range(3)]  # 4 s each by the estimate
    assert [b.timeout(t, **limits) for t in queue] == [pytest.approx(20.0), pytest.approx(40.0), 60]
    ticket = b.charge("b", SIZE, FORWARD)
    clock.now += SIZE * 0.001
    b.report_success(ticket)
    assert b.timeout(b.charge("b", SIZE, FORWARD), **limits) == 1


def test_failures_ban_with_exponential_backoff_reset_on_success():
    clock = FakeClock()
    b = balancer(clock, "a", "b", ban_base=15, ban_max=60)
    assert [b.report_failure(b.charge("a", 1, FORWARD)) for _ in range(4)] == [15, 30, 60, 60]
    assert {b.choose(1, FORWARD).peer_id for _ in range(5)} == {"b"}
    assert b.soonest_unbanned(exclude=["b"]) == "a"
    clock.now += 61
    assert "a" in b.available()
    b.report_success(b.charge("a", 1, FORWARD))
    assert b.report_failure(b.charge("a", 1, FORWARD)) == 15


# --- lookups that miss a server -------------------------------------------------------------------

def test_a_server_missing_from_one_lookup_keeps_its_estimate_and_ban():
    clock = FakeClock()
    b = balancer(clock, "fast", "slow", "failing", forget_after=60)
    for peer, seconds_per_sample in (("fast", 0.01), ("slow", 0.1)):
        ticket = b.charge(peer, SIZE, FORWARD)
        clock.now += SIZE * seconds_per_sample
        b.report_success(ticket)
    b.report_failure(b.charge("failing", SIZE, FORWARD))
    banned_until = b.servers["failing"].banned_until

    b.update_servers(["slow"])
    assert b.listed() == ["slow"] and b.soonest_unbanned() == "slow"
    assert {b.choose(SIZE, FORWARD).peer_id for _ in range(3)} == {"slow"}  # never a missing one
    clock.now += 2.0
    b.update_servers(["fast", "slow", "failing"])
    assert b.servers["fast"].service == {FORWARD: pytest.approx(0.01)}
    assert b.servers["failing"].banned_until == banned_until and b.servers["failing"].failures == 1
    assert b.servers["slow"].service == {FORWARD: pytest.approx(0.1)}  # not a newcomer "as fast as the fastest"


def test_a_missing_server_is_forgotten_after_forget_after_seconds():
    clock = FakeClock()
    b = balancer(clock, "a", "b", forget_after=60)
    b.update_servers(["b"])
    clock.now += 59
    b.update_servers(["b"])
    assert "a" in b.servers
    b.update_servers(["a", "b"])  # back in time: the count starts again when it next goes missing
    clock.now += 30
    b.update_servers(["b"])
    clock.now += 59
    b.update_servers(["b"])
    assert "a" in b.servers
    clock.now += 1
    b.update_servers(["b"])
    assert list(b.servers) == ["b"]


def test_a_forgotten_servers_tickets_are_harmless():
    clock = FakeClock()
    b = balancer(clock, "a", forget_after=0)
    ticket = b.choose(1, FORWARD)
    b.update_servers([])
    assert b.servers == {} and b.choose(1, FORWARD) is None
    b.report_success(ticket)
    assert b.report_failure(ticket) == 0.0


# --- probation: one task at a time until a server has answered ------------------------------------

def test_a_newcomer_takes_one_task_at_a_time_until_it_answers():
    clock = FakeClock()
    b = balancer(clock, "a")
    simulate(b, clock, speeds(a=0.01), in_flight=1, tasks=5)
    b.update_servers(["a", "new"])
    probe = b.choose(SIZE, FORWARD)
    assert probe.peer_id == "new"  # tried at once...
    assert {b.choose(SIZE, FORWARD).peer_id for _ in range(6)} == {"a"}  # ...but only once while it is out
    clock.now += SIZE * 0.01
    b.report_success(probe)
    assert not b.on_probation("new")
    b.charge("new", SIZE, FORWARD)
    assert b.choose(SIZE, FORWARD).peer_id == "new"  # measured as fast as a, and a is loaded: no longer one at a time


def test_a_witness_answer_times_a_newcomer_but_does_not_end_its_probation():
    """Spot checks ask a witness's forwards (swarm.routing.spot_checks): they measure its speed, so a slow newcomer
    is not sent work as if untried, but only a reply of its own ends its probation (so it is checked); a server
    caught answering wrongly is a newcomer again after its ban."""
    clock = FakeClock()
    b = balancer(clock, "a", "new")
    witness = b.charge("new", SIZE, FORWARD)
    clock.now += SIZE * 0.5
    b.report_success(witness, vouch=False)
    assert b.servers["new"].measured and not b.untried("new") and b.on_probation("new")
    own = b.charge("new", SIZE, FORWARD)
    b.report_success(own)
    assert not b.on_probation("new")
    b.ban("new", 1.0)
    clock.now += 2
    assert b.on_probation("new")


def test_with_no_other_server_a_newcomer_still_takes_every_task():
    b = balancer(FakeClock(), "only")  # a run's start: every server unmeasured
    assert [b.choose(SIZE, FORWARD).peer_id for _ in range(4)] == ["only"] * 4


def test_a_server_that_failed_is_on_probation_again_until_it_answers():
    clock = FakeClock()
    b = balancer(clock, "a", "b", ban_base=1)
    for peer in ("a", "b"):
        measured(b, clock, peer, 0.01)
    b.report_failure(b.charge("b", SIZE, FORWARD))
    clock.now += 2  # its ban is over
    assert b.on_probation("b") and not b.on_probation("a")
    for _ in range(3):
        b.charge("a", SIZE, FORWARD)  # a loaded: b, idle and as fast, wins the next task...
    probe = b.choose(SIZE, FORWARD)
    assert probe.peer_id == "b"
    assert {b.choose(SIZE, FORWARD).peer_id for _ in range(4)} == {"a"}  # ...and only that one
    b.report_success(probe)
    assert not b.on_probation("b")


@pytest.mark.parametrize("in_flight", [1, 4, 8])
@pytest.mark.parametrize("hold", [0.0, 5.0], ids=["fails at once", "fails after 5 s"])
def test_a_server_that_fails_every_call_gets_one_call_per_ban(in_flight: int, hold: float):
    """A server that answers every call with an error (a `bad_request` to everything), at once or after
    holding it: assumed as fast as the fastest, it would win every choice; on probation it gets its
    probe once per ban, and the others do the work."""
    clock = FakeClock()
    b = balancer(clock, "a", "b", ban_base=15, ban_max=300)
    good = speeds(a=0.01, b=0.01)
    simulate(b, clock, good, in_flight, tasks=20)
    b.update_servers(["a", "b", "0-fails"])  # sorts first: wins every tie
    calls, done, events, started = Counter(), 0, [], clock.now

    def send() -> None:
        ticket = b.choose(SIZE, FORWARD)
        calls[ticket.peer_id] += 1
        if ticket.peer_id == "0-fails":
            finish = clock.now + hold
        else:
            server = good[ticket.peer_id]
            finish = server.busy_until = max(clock.now, server.busy_until) + SIZE * server.seconds_per_sample
        heapq.heappush(events, (finish, ticket.seq, ticket))

    for _ in range(in_flight):
        send()
    while clock.now - started < 600:  # ten minutes
        clock.now, _, ticket = heapq.heappop(events)
        if ticket.peer_id == "0-fails":
            b.report_failure(ticket)  # banned; the task is sent again, elsewhere
        else:
            b.report_success(ticket)
            done += 1
        send()
    # bans of 15, 30, 60, 120, 240, 300 s: 6 calls in 10 minutes (a 7th as the last ban ends)
    assert calls["0-fails"] <= 7
    capacity = min(in_flight, 2) * 600 / (SIZE * 0.01)  # what a and b do in 10 minutes
    assert done >= 0.95 * capacity - calls["0-fails"] * hold / (SIZE * 0.01)  # a held task waits its hold out


def test_brief_failures_ban_from_the_brief_base_and_double():
    clock = FakeClock()
    b = balancer(clock, "a", ban_base=15, ban_max=60, brief_ban_base=1)
    assert [b.report_failure(b.charge("a", 1, FORWARD), brief=True) for _ in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert b.report_failure(b.charge("a", 1, FORWARD)) == 60  # the count is shared with other failures
    b.report_success(b.charge("a", 1, FORWARD))
    assert b.report_failure(b.charge("a", 1, FORWARD), brief=True) == 1


def test_a_brief_ban_never_shortens_a_longer_one():
    clock = FakeClock()
    b = balancer(clock, "a", ban_base=15, ban_max=300, brief_ban_base=1)
    b.report_failure(b.charge("a", 1, FORWARD))
    until = b.servers["a"].banned_until
    b.report_failure(b.charge("a", 1, FORWARD), brief=True)  # a call sent before the ban, answered after it
    assert b.servers["a"].banned_until == until


def test_a_pardon_takes_back_one_failure_and_its_ban():
    clock = FakeClock()
    b = balancer(clock, "a", "b", ban_base=15)
    b.report_failure(b.charge("a", 1, FORWARD))
    b.report_failure(b.charge("a", 1, FORWARD))
    b.pardon("a")
    assert b.servers["a"].failures == 1 and "a" in b.available()
    assert b.report_failure(b.charge("a", 1, FORWARD)) == 30  # the count goes on from the failure kept
    b.pardon("b")  # never failed: nothing to take back
    b.pardon("gone")
    assert b.servers["b"].failures == 0


def test_a_server_caught_answering_wrongly_is_banned_and_measured_anew():
    clock = FakeClock()
    b = balancer(clock, "z", "0-liar", ban_base=15, ban_max=300)  # the liar wins ties
    measured(b, clock, "z", 0.01)
    measured(b, clock, "0-liar", 0.0001)  # instant: the fastest
    late = b.charge("0-liar", SIZE, FORWARD)  # in flight when it is caught
    b.ban("0-liar", 300)
    assert "0-liar" not in b.available() and b.on_probation("0-liar") and not b.servers["0-liar"].measured
    clock.now += 1
    b.report_success(late)  # an answer sent before it was caught lifts nothing, measures nothing
    assert "0-liar" not in b.available() and not b.servers["0-liar"].measured and not b.servers["0-liar"].open
    clock.now += 300
    probe = b.choose(SIZE, FORWARD)
    assert probe.peer_id == "0-liar"  # back, on probation: one call...
    assert b.choose(SIZE, FORWARD).peer_id == "z"  # ...at a time
    b.report_success(probe)
    assert not b.on_probation("0-liar")
    b.ban("gone", 300)  # a server the balancer does not know: nothing to do


# --- refusals -------------------------------------------------------------------------------------

def _refuse(b, clock, peer: str, times: int, took: float, **kwargs) -> None:
    """`times` calls to `peer` refused `took` seconds after sending, each after its ban ended."""
    for _ in range(times):
        clock.now = max(clock.now, b.servers[peer].banned_until)
        ticket = b.charge(peer, SIZE, FORWARD)
        clock.now += took
        b.report_failure(ticket, brief=True, **kwargs)


def test_a_server_that_keeps_refusing_loses_choices_to_one_that_answers_and_gets_them_back_later():
    clock = FakeClock()
    b = balancer(clock, "a", "b")
    measured(b, clock, "a", 0.1)
    measured(b, clock, "b", 0.1)
    b.charge("a", SIZE, FORWARD)  # one task of ours outstanding on a: b, as fast, would finish first
    assert b.choose(SIZE, FORWARD, exclude=()).peer_id == "b" and b.refusal_cost("b") == 0.0
    b.release(next(iter(b.servers["b"].open.values())))
    _refuse(b, clock, "b", 3, took=1.0)  # full of others' work each time we asked
    clock.now = b.servers["b"].banned_until
    assert b.refusal_cost("b") > SIZE * 0.1  # more round trips wasted, by the odds, than a's queue costs
    assert b.refusal_cost("a") < 0.25 * b.refusal_cost("b")  # a answered: its odds stay far lower
    assert b.choose(SIZE, FORWARD).peer_id == "a"
    clock.now += 20 * 60.0  # twenty half-lives: what the refusals said of b's load has faded
    assert b.refusal_cost("b") < 0.01
    assert b.choose(SIZE, FORWARD).peer_id == "b"


def test_an_untried_server_is_weighed_by_the_stages_refusal_rate_and_its_round_trip():
    clock = FakeClock()
    b = balancer(clock, "a", "b", "new")
    measured(b, clock, "a", 0.1)
    assert b.refusal_cost("new") == 0.0  # no server of the stage refused lately
    _refuse(b, clock, "b", 4, took=0.5)
    b.measured_round_trip("new", 0.2)
    odds = b.refusal_cost("new") / 0.2  # by its own round trip: it never refused us
    assert 0.5 < odds < 4  # the stage's rate (4 refusals against a's 2 answers), as one call of its own
    assert b.refusal_cost("b") > b.refusal_cost("new")  # b's own refusals weigh more


def test_only_refusals_count_not_other_failures_or_an_unlike_verdict():
    clock = FakeClock()
    b = balancer(clock, "a", "b")
    measured(b, clock, "a", 0.1)
    ticket = b.charge("b", SIZE, FORWARD)
    clock.now += 1
    b.report_failure(ticket)  # silence, a broken reply: a ban, not a refusal
    _refuse(b, clock, "b", 2, took=1.0, refused=False)  # held off as busy (a spot check's unlike verdict)
    assert b.refusal_cost("a") == b.refusal_cost("b") == 0.0
    assert b.servers["b"].failures == 3


def test_one_server_refusing_everything_barely_moves_the_others_costs():
    clock = FakeClock()
    b = balancer(clock, "a", "b", "liar")
    b.measured_round_trip("a", 0.05)
    refusals = 0
    while clock.now < 1000.0 + 600:  # ten minutes of calls, one at a time; the liar gets one whenever it may
        if b.servers["liar"].banned_until <= clock.now:
            ticket = b.charge("liar", SIZE, FORWARD)
            clock.now += 0.05
            b.report_failure(ticket, brief=True)
            refusals += 1
        ticket = b.choose(SIZE, FORWARD, exclude=("liar",))
        clock.now += 0.3
        b.report_success(ticket)
    assert refusals <= 10  # one call a ban, the ban doubling each time: 1, 2, 4 ... 300 s
    assert b.refusal_cost("a") < 0.01 * b.expected_seconds("a", SIZE, FORWARD)
