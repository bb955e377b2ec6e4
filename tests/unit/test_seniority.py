"""A stage of two: the server that served first leads, and a stranger that joins a lone server cannot lead it.

progress.seniors decides who came first from each record's `since` claim, believed only as far back as the
reader cannot refute it (it was not watching yet); backs_state and stage_view use it where the stage has no
established server besides the sender and this one.
"""

from __future__ import annotations

from types import SimpleNamespace

from swarm.averaging.catchup import CatchUp
from swarm.averaging.progress import (
    DeferHold,
    ProgressRecord,
    backs_state,
    lone_elder,
    plausible,
    seniors,
    sharing_priority,
    stage_view,
)
from swarm.averaging.rounds import Phase
from swarm.state import StateInfo

FP = [1.0, 2.0]
LIE = [0.0, 0.0]
SLACK = 5.0


def record(peer: str, step: int, fingerprint=FP, round_id: str = "r", group: int = 2,
           since: float | None = None) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, step=step, samples=0, round_id=round_id, group=group,
                          priority=sharing_priority(step, group, round_id, peer), fingerprint=fingerprint,
                          since=since)


def test_a_server_first_seen_well_after_this_one_began_cannot_claim_to_be_older():
    # a began serving at 100; m first appeared at 200 and claims to have served since 0
    assert seniors(100.0, [record("m", 5, since=0.0)], {"m": 200.0}, SLACK) == set()
    # nor just before a: its claim counts back no further than SLACK before it was seen
    assert seniors(100.0, [record("m", 5, since=99.0)], {"m": 200.0}, SLACK) == set()


def test_a_server_already_there_when_this_one_came_is_believed_and_leads():
    # b began at 150 and first saw a at 151 (a was there): a's claim (100) stands
    assert seniors(150.0, [record("a", 5, since=100.0)], {"a": 151.0}, SLACK) == {"a"}
    # and a, which began at 100 and saw b at 152, credits b with no earlier than 147: b is younger
    assert seniors(100.0, [record("b", 5, since=150.0)], {"b": 152.0}, SLACK) == set()
    # a record of an older version (no claim) counts from when it was seen
    assert seniors(150.0, [record("a", 5)], {"a": 149.0}, SLACK) == {"a"}
    # a server that serves nothing yet (a joiner) counts everyone as its elder; one never seen counts not
    assert seniors(None, [record("a", 5), record("b", 5)], {"a": 1.0}, SLACK) == {"a", "b"}
    assert seniors(150.0, [record("a", 5, since=1.0)], {}, SLACK) == set()


def test_two_honest_servers_agree_on_who_came_first():
    for a_since, b_since in ((100.0, 103.0), (100.0, 160.0), (160.0, 100.0)):
        first_seen_by_a = max(b_since, a_since) + 0.5  # each reads the other's record within a period
        first_seen_by_b = max(a_since, b_since) + 0.5
        a_elders = seniors(a_since, [record("b", 5, since=b_since)], {"b": first_seen_by_a}, SLACK)
        b_elders = seniors(b_since, [record("a", 5, since=a_since)], {"a": first_seen_by_b}, SLACK)
        assert (a_elders, b_elders) == ((set(), {"a"}) if a_since < b_since else ({"b"}, set()))


def test_in_a_stage_of_two_the_newcomer_s_claim_a_step_ahead_moves_the_elder_not():
    own = record("a", 9, since=100.0)
    m = record("m", 10, LIE, since=0.0)
    problem = backs_state("m", 10, LIE, own, [m], {"m"}, elders=set())
    assert problem is not None and "the elder leads" in problem
    view = stage_view(own, [m], established={"m"}, elders=set())
    assert not view.behind and not view.diverged
    assert not view.closed  # an unbelieved step ahead closes no batch: the elder fills its own and steps
    # the same claim by an elder is followed (a stage of two has nothing else to go by), as before
    assert backs_state("m", 10, LIE, own, [m], {"m"}, elders={"m"}) is None
    assert stage_view(own, [m], established={"m"}, elders={"m"}).behind
    # a joiner (no state of its own yet) takes the state of the only server there is
    assert backs_state("m", 10, LIE, None, [m], {"m"}, elders={"m"}) is None



def test_a_server_far_behind_its_elder_in_a_stage_of_two_catches_up():
    # the elder stepped alone before it counted this one (lab: 7 steps to 0); no third server to bound it by
    own = record("a", 0, since=100.0)
    elder = record("m", 7, since=99.0)
    assert backs_state("m", 7, FP, own, [elder], {"m"}, elders={"m"}) is None
    assert stage_view(own, [elder], established={"m"}, elders={"m"}).behind
    # the same lead claimed by the younger moves nothing; with a third server, the bound holds as before
    assert backs_state("m", 7, FP, own, [elder], {"m"}, elders=set()) is not None
    third = record("c", 0)
    assert "beyond the stage's" in backs_state("m", 7, FP, own, [elder, third], {"m", "c"}, elders={"m", "c"})


def test_the_lone_elder_s_record_is_believed_at_any_step_and_nobody_else_s():
    own, elder = record("a", 0, since=100.0), record("m", 7, since=99.0)
    # the median of two steps is this server's own: bounded by it, the elder ahead would be dropped unseen
    assert plausible([elder], own.step) == []
    assert lone_elder([elder], {"m"}, {"m"}) == "m"
    assert plausible([elder], own.step, lone_elder([elder], {"m"}, {"m"})) == [elder]
    # not an elder, not established, or not alone: no leader, the bound holds
    assert lone_elder([elder], {"m"}, set()) is None
    assert lone_elder([elder], set(), {"m"}) is None
    third = record("c", 0, since=98.0)
    assert lone_elder([elder, third], {"m", "c"}, {"m", "c"}) is None
    assert plausible([elder, third], own.step) == [third]

def test_of_two_diverged_replicas_the_younger_takes_the_elder_s_state_whatever_their_ranks():
    # a (elder) made step 10 alone after a lost round: its lone step ranks below b's
    a = record("a", 10, [9.0, 9.0], round_id="lone", group=1, since=100.0)
    b = record("b", 10, FP, round_id="r", group=2, since=150.0)
    assert b.priority > a.priority
    assert not stage_view(a, [b], established={"b"}, elders=set()).diverged  # the elder keeps its own
    assert stage_view(b, [a], established={"a"}, elders={"a"}).diverged  # the younger takes the elder's
    # in a stage of three, ranks decide as before
    c = record("c", 10, FP, round_id="r", group=2, since=90.0)
    assert stage_view(a, [b, c], established={"b", "c"}, elders={"c"}).diverged
    assert not stage_view(b, [a, c], established={"a", "c"}, elders={"a", "c"}).diverged


def test_the_younger_of_two_ahead_of_its_elder_takes_the_elder_s_state_unless_the_elder_is_in_a_round():
    # b stepped alone (its round with a failed); a, the elder, would neither take b's state nor join b's round
    a_behind = record("a", 9, [9.0, 9.0], round_id="lone", since=100.0)
    b = record("b", 10, since=150.0)
    assert stage_view(b, [a_behind], established={"a"}, elders={"a"}).defer
    assert stage_view(b, [a_behind], established={"a"}, elders={"a"}).needs_state
    # a's round for step 10 is under way: it is about to be where b is
    in_round = record("a", 9, since=100.0).copy(update={"averaging": True})
    assert not stage_view(b, [in_round], established={"a"}, elders={"a"}).defer
    # the elder itself never defers to the younger; nor does anyone in a stage of three
    assert not stage_view(a_behind, [b], established={"b"}, elders=set()).needs_state
    c = record("c", 10, since=90.0)
    assert not stage_view(b, [a_behind, c], established={"a", "c"}, elders={"a", "c"}).defer


def test_the_younger_defers_only_once_its_elder_has_stayed_behind_a_while():
    # right after a round both took, the elder's record can still say the step before for a moment
    now = [0.0]
    hold = DeferHold(2.0, clock=lambda: now[0])
    b = record("b", 10, since=150.0)
    a_behind = record("a", 9, [9.0, 9.0], round_id="lone", since=100.0)
    a_caught_up = record("a", 10, since=100.0)

    def view(elder):
        return hold(stage_view(b, [elder], established={"a"}, elders={"a"}))

    assert not view(a_behind).needs_state  # first seen behind: held
    now[0] = 1.0
    assert not view(a_behind).needs_state
    assert not view(a_caught_up).needs_state  # its new record came: nothing to take, and the hold starts over
    now[0] = 2.5
    assert not view(a_behind).needs_state
    now[0] = 4.4
    assert not view(a_behind).needs_state
    now[0] = 4.5
    assert view(a_behind).defer and view(a_behind).needs_state  # behind for the whole hold: it defers
    # behind or diverged is never held back
    ahead = record("a", 12, since=100.0)
    assert DeferHold(2.0, clock=lambda: 0.0)(stage_view(b, [ahead], established={"a"}, elders={"a"})).behind


def test_a_download_from_the_elder_that_brings_this_replica_s_own_state_back_keeps_it_and_its_samples():
    # the elder caught up while the download ran: the same step, made by the same round
    entered, adopted = [], []
    host = SimpleNamespace(stage=1, step_count=10, state=SimpleNamespace(step=10, round_id="r10"),
                           optimizer=SimpleNamespace(samples=24), enter=entered.append)
    catch_up = CatchUp(host, intake=None)
    catch_up.adopt = lambda loaded, min_step: adopted.append(loaded) or True
    own = StateInfo(1, 10, "r10", 2).to_dict()
    catch_up.end((own, [], "a"), "deferring", 0, deferring=True)
    assert adopted == [] and entered == [Phase.COLLECTING]
    # another step or another round is adopted as before; so is anything while not deferring
    for info, deferring in ((StateInfo(1, 9, "r9", 2), True), (StateInfo(1, 10, "lone", 1), True),
                            (StateInfo(1, 10, "r10", 2), False)):
        catch_up.end((info.to_dict(), [], "a"), "why", 0, deferring=deferring)
    assert len(adopted) == 3
    # a malformed one is left to adopt, which refuses it
    catch_up.end(({"format": "nonsense"}, [], "a"), "why", 0, deferring=True)
    assert len(adopted) == 4
