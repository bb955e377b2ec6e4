"""The pure parts of a stage's averaging rounds (swarm.averaging.rounds): when a failed round's batch tries
again, and when a replica gives up and steps alone."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from swarm.averaging.rounds import Phase, PlainRound, Retries, Round

pytestmark = pytest.mark.timeout(10)


def test_a_failed_round_tries_again_after_a_pause_that_doubles_up_to_its_max():
    retries = Retries(max_tries=3, first_pause=0.25, max_pause=1.0)
    assert retries.may_run(0.0)
    waits = []
    now = 100.0
    for _ in range(5):
        retries.wait(now)
        waits.append(retries.next_at - now)
        assert not retries.may_run(now) and retries.may_run(retries.next_at)
    assert waits == [0.25, 0.5, 1.0, 1.0, 1.0]
    retries.succeeded()
    retries.wait(now)
    assert retries.next_at - now == 0.25  # a round that succeeded starts the pauses again


def test_a_batch_gets_max_tries_then_the_replica_steps_alone_until_a_round_succeeds():
    retries = Retries(max_tries=3)
    assert [retries.another_try() for _ in range(4)] == [True, True, True, False]
    assert retries.tries == 3
    retries.succeeded()
    assert retries.tries == 0 and retries.another_try()
    retries.gave_up()  # stepped alone: a stage whose rounds keep failing pays the tries once, not every step
    assert not retries.another_try()


def test_hold_waits_the_current_pause_without_doubling_it():
    retries = Retries(first_pause=0.5)
    retries.hold(10.0)
    assert retries.next_at == 10.5 and retries.pause == 0.5


def test_every_kind_of_round_has_the_one_interface():
    from swarm.averaging.local import OuterRound
    from swarm.averaging.sharded import ShardedRound

    for kind in (PlainRound, ShardedRound, OuterRound):
        assert issubclass(kind, Round) and not getattr(kind, "__abstractmethods__", None), kind
    assert not ShardedRound.forms_ahead and PlainRound.forms_ahead and OuterRound.forms_ahead
    with pytest.raises(TypeError):
        Round(None)  # start() is what a kind must say


def test_solo_is_for_good():
    """A replica whose averaging process died steps alone from then on: a round that ends after it noticed
    (its apply enters collecting) does not bring it back."""
    from swarm.averaging.averager import StageAverager

    replica = SimpleNamespace(phase=Phase.COLLECTING, _phase_lock=threading.Lock())
    StageAverager.enter(replica, Phase.ROUND)
    assert replica.phase is Phase.ROUND
    StageAverager.enter(replica, Phase.SOLO)
    StageAverager.enter(replica, Phase.COLLECTING)
    assert replica.phase is Phase.SOLO
