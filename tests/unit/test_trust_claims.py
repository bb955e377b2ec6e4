"""Claims a stranger can sign with its own key: a state's step and parameters, a checkpoint's step.

Pure logic: swarm.tenure's book, progress.backs_state / stage_view with established servers, and
checkpoint.claims.believed.
"""

from __future__ import annotations

from swarm.averaging.progress import ProgressRecord, backs_state, sharing_priority, stage_view
from swarm.checkpoint.claims import CHECKPOINT_STEP_LEAD, believed, step_bound
from swarm.dht.schemas import CheckpointRecord, HeldCheckpoint
from swarm.tenure import TenureBook, lower_median

FP = [1.0, 2.0]  # the honest replicas' parameters (fingerprint)
LIE = [0.0, 0.0]  # a stranger's


def record(peer: str, step: int, fingerprint=FP, round_id: str = "r", group: int = 2, samples: int = 0,
           averaging: bool = False) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, step=step, samples=samples, round_id=round_id, group=group,
                          priority=sharing_priority(step, group, round_id, peer), fingerprint=fingerprint,
                          averaging=averaging)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tenure_counts_unbroken_presence_only():
    clock = Clock()
    book = TenureBook(clock)
    book.observe(["a", "b"])
    clock.now += 5
    book.observe(["a", "b", "c"])
    assert book.established_peers(["a", "b", "c"], 5.0) == {"a", "b"}
    book.observe(["a", "c"])  # b missed a read: its clock starts again
    book.observe(["a", "b", "c"])
    clock.now += 4
    assert book.established_peers(["a", "b", "c", "x"], 5.0) == {"a"}
    assert book.seconds("x") == 0.0
    patient = TenureBook(clock, grace=2.0)  # a gap shorter than the grace is no departure
    patient.observe(["a", "b"])
    clock.now += 1
    patient.observe(["a"])
    clock.now += 1
    patient.observe(["a", "b"])
    assert patient.seconds("b") == 2.0
    clock.now += 3
    patient.observe(["a"])
    patient.observe(["a", "b"])
    assert patient.seconds("b") == 0.0
    assert lower_median([5, 1, 10**9]) == 5 and lower_median([]) is None


def test_a_lone_claimant_one_step_ahead_moves_no_server_of_a_stage_of_three():
    own = record("a", 10)
    others = [record("b", 10), record("p", 11, LIE)]
    established = {"b", "p"}
    problem = backs_state("p", 11, LIE, own, others, established)
    assert problem is not None and "no established server besides p" in problem
    view = stage_view(own, others, established=established)
    assert not view.behind and not view.diverged
    # a joiner (no state of its own) does not take it either
    assert backs_state("p", 11, LIE, None, others, established) is not None


def test_a_new_key_vouches_for_nothing_however_many_there_are():
    own = record("a", 10)
    sybils = [record(f"s{i}", 11, LIE, group=1023) for i in range(50)]
    established = {"b"}
    others = [record("b", 10), *sybils]
    assert "not been watched long enough" in backs_state("s0", 11, LIE, own, others, established)
    view = stage_view(own, others, established=established)
    assert not view.behind and not view.diverged and not view.closed
    assert view.group_size == 2 and view.members == ("b",)  # nobody waits for the sybils either


def test_records_that_close_or_fill_a_batch_count_only_from_established_servers():
    own = record("a", 10, samples=4)
    liar = record("p", 10, samples=10**6, averaging=True)
    honest = record("b", 10, samples=4)
    view = stage_view(own, [honest, liar], established={"b"})
    assert view.samples == 8 and not view.closed
    # while nobody is established yet (a new stage), everyone counts, as before
    fresh = stage_view(own, [honest, record("c", 10, samples=4)], established=set())
    assert fresh.samples == 12 and fresh.group_size == 3


def test_an_honest_server_behind_catches_up_when_a_second_server_backs_the_state():
    own = record("a", 9)
    others = [record("b", 10), record("c", 10)]
    assert backs_state("b", 10, FP, own, others, {"b", "c"}) is None
    assert stage_view(own, others, established={"b", "c"}).behind
    # in a stage of two, the other established server is all there is
    assert backs_state("b", 10, FP, own, [record("b", 10)], {"b"}) is None
    assert stage_view(own, [record("b", 10)], established={"b"}).behind


def test_a_state_far_ahead_or_contradicted_at_its_step_is_refused():
    own = record("a", 10)
    others = [record("b", 10), record("c", 10), record("p", 10**9, LIE)]
    assert "beyond the stage's" in backs_state("p", 10**9, LIE, own, others, {"b", "c", "p"})
    # same step, better rank claimed (a bigger group), other parameters: most servers at the step disagree
    others = [record("b", 10), record("c", 10), record("p", 10, LIE, round_id="x", group=1023)]
    assert "differ from those of 2 of the 2" in backs_state("p", 10, LIE, own, others, {"b", "c", "p"})
    assert not stage_view(own, others, established={"b", "c", "p"}).diverged


def test_a_lone_step_ranks_below_the_group_and_its_server_takes_the_groups_state():
    own = record("a", 10, [9.0, 9.0], round_id="lone", group=1)
    others = [record("b", 10), record("c", 10)]
    assert stage_view(own, others, established={"b", "c"}).diverged
    assert backs_state("b", 10, FP, own, others, {"b", "c"}) is None


def held(step: int, fill: str = "a") -> HeldCheckpoint:
    return HeldCheckpoint(step=step, manifest_id=fill * 64, size=100)


def checkpoints(peer: str, *steps: int) -> CheckpointRecord:
    return CheckpointRecord(peer_id=peer, stage=1, state_hash="0" * 64, checkpoints=[held(s) for s in steps])


def test_a_checkpoint_far_ahead_of_the_servers_records_is_ignored_and_its_holder_named():
    bound = step_bound([40, 41, 10**9])
    assert bound == 41 + CHECKPOINT_STEP_LEAD
    kept, ignored = believed([checkpoints("honest", 25, 40), checkpoints("stranger", 9_999_999_999)], bound=bound)
    assert [r.peer_id for r in kept] == ["honest"] and [h.step for h in kept[0].checkpoints] == [25, 40]
    assert len(ignored) == 1 and "stranger" in ignored[0] and "9999999999" in ignored[0]


def test_only_established_holders_and_the_coordinator_are_believed():
    records = [checkpoints("old", 40), checkpoints("new", 41), checkpoints("coordinator", 10**6)]
    kept, ignored = believed(records, bound=50, trusted={"coordinator"}, established={"old"})
    assert sorted(r.peer_id for r in kept) == ["coordinator", "old"]
    assert "new" in ignored[0] and "not an established server" in ignored[0]
    # with no server's record to weigh steps against, only the coordinator is believed
    kept, ignored = believed(records, bound=None, trusted={"coordinator"})
    assert [r.peer_id for r in kept] == ["coordinator"] and len(ignored) == 2
