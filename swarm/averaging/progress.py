"""Collective progress of one stage: what each server publishes, and what a server concludes from it.

Pure logic, no I/O. Every server of a stage publishes a :class:`ProgressRecord`: its step, the
samples it accumulated towards the next step, and which round made its current state (the round's
id and group size; replicas made by the same round are equal). From the others' records,
:func:`stage_view` decides:

- ready: the servers whose samples make the same step as this one's hold a full batch between them
  (a server whose round for step t+1 runs beside compute counts its new samples towards t+2), or
  another server already closed that batch and began its round (closed);
- who to expect in a round: every server not ahead of this one (one behind catches up and joins);
- behind: some server is at a later step, so this one downloads the stage's state;
- diverged: a server at the same step holds a state made by another round that ranks higher (a
  lone step after a failed round, or a group that formed apart), or one made by the same round
  whose parameters differ (an all-reduce that lost a member partway: hivemind leaves the part that
  member reduced with each survivor's own values), and that ranks higher; this one downloads that
  state.

Ranks (:func:`sharing_priority`, in the signed records) are also the order a download asks the
stage's servers in (StateIntake.fetch): later steps first, then states averaged by larger groups,
then a tie-break fixed by the round and, within a round, by the server, so two diverged replicas
never both download from each other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from pydantic.v1 import StrictBool, StrictStr, confloat, conint, conlist

from swarm.dht.schemas import WireRecord
from swarm.tenure import lower_median

DEFER_HOLD_PERIODS = 2  # progress periods a stage of two's elder stays behind before the younger takes its state
INITIAL_ROUND = "init"  # the state every replica starts from: the run's seeded initialization
MAX_RANKED_GROUP = 1023  # groups larger than this rank as this large
# How closely replicas made by the same round agree. Uncompressed, they are identical where the
# hardware is. Compressed, they are not: each member reduces its part of the vector in float32 and
# gets the others' parts back through the codec, and the differences add up over the steps (fp16,
# 4 servers, configs/small.yaml stage 1: 5e-7 of the parameters' sum after one round). A round
# that lost part of the vector is caught where it happens (AveragingProcess raises PartialRound);
# the fingerprint is the backstop for whatever else makes replicas drift apart. A lost part moves
# the sum by 2e-6..4e-5 after one step on that stage (simulated, n = 2..4), so under compression
# the backstop catches only the larger drifts.
EXACT_RTOL = 1e-6
COMPRESSED_RTOL = 5e-5
# How far beyond most of its stage's servers a server's step may be and still be believed: a round
# may end on one server a moment before the others publish its step.
MAX_STEP_LEAD = 2


def fingerprint_rtol(compression: str) -> float:
    """The tolerance for replicas averaged with `compression` (an averaging.compression value)."""
    return EXACT_RTOL if compression == "none" else COMPRESSED_RTOL


class ProgressRecord(WireRecord):
    """One server's progress towards its stage's next step (DHT key ``{run}_stage{k}_averaging.progress``)."""

    peer_id: StrictStr
    step: conint(strict=True, ge=0)
    samples: conint(strict=True, ge=0)  # accumulated since `step`
    round_id: StrictStr  # the round that made this server's state at `step`
    group: conint(strict=True, ge=1)  # how many servers that round averaged
    priority: confloat(strict=True)  # its rank as a source of state (sharing_priority)
    updated: confloat(strict=True) = 0.0  # DHT time it was published: of two copies, the later counts
    fingerprint: conlist(confloat(strict=True), min_items=2, max_items=2) | None = None  # param_fingerprint
    # A round for step+1 is under way beside compute: `samples` count towards step+2
    averaging: StrictBool = False
    # DHT time this server began serving its stage (its current stretch): a claim, believed by each
    # reader only as far back as it cannot refute it (see seniors)
    since: confloat(strict=True) | None = None

    @property
    def next_batch(self) -> int:
        """The step that this server's `samples` will make."""
        return self.step + 1 + self.averaging

    def same_progress(self, other: ProgressRecord | None) -> bool:
        """Whether `other` says the same, whenever it was published."""
        return other is not None and self.dict(exclude={"updated"}) == other.dict(exclude={"updated"})


def step_bound(steps: Sequence[int]) -> int | None:
    """The furthest step the stage's servers (`steps`, as their records say) make believable.

    Any server may sign a record claiming any step; the lower median does not move however far a
    minority claims to be. None if there are no records.
    """
    median = lower_median(steps)
    return None if median is None else median + MAX_STEP_LEAD


def plausible(records: Sequence[ProgressRecord], own_step: int | None = None,
              leader: str | None = None) -> list[ProgressRecord]:
    """The records whose step is within :func:`step_bound` of the others' and this server's own (a liar's are
    dropped), and `leader`'s at any step (see :func:`lone_elder`)."""
    steps = [r.step for r in records] + ([] if own_step is None else [own_step])
    bound = step_bound(steps)
    return [r for r in records if bound is None or r.step <= bound or r.peer_id == leader]


def lone_elder(others: Sequence[ProgressRecord], established: Collection[str] | None,
               elders: Collection[str] | None) -> str | None:
    """The stage's one other established server, if it is this server's elder: in a stage of two the elder's
    word is all there is, at any step (see :func:`backs_state`). Bounded by the median of two steps, which is
    this server's own, a server that fell more than MAX_STEP_LEAD behind (its elder stepping alone before it
    was counted) would never see the elder ahead, and so never catch up."""
    peer = lone_peer(others, established)
    return peer if peer is not None and elders is not None and peer in elders else None


def lone_peer(others: Sequence[ProgressRecord], established: Collection[str] | None) -> str | None:
    """The stage's one other established server, if there is exactly one (a stage of two); else None."""
    counted = [] if established is None else [r.peer_id for r in others if r.peer_id in established]
    return counted[0] if len(counted) == 1 else None


def voters(others: Sequence[ProgressRecord], established: Collection[str] | None) -> list[ProgressRecord]:
    """The records whose word moves this server's rounds: the established servers' (swarm.tenure) if the
    stage has any, else everyone's (a stage whose servers are all new has nothing but its seed to protect)."""
    if established is None:
        return list(others)
    trusted = [r for r in others if r.peer_id in established]
    return trusted if trusted else list(others)


def seniors(own_since: float | None, others: Sequence[ProgressRecord], witnessed: Mapping[str, float],
            slack: float) -> set[str]:
    """The servers that were serving the stage before this one (which began at `own_since`; None: it
    serves nothing yet, so every one is).

    A server's `since` is its own claim. `witnessed` holds when this one first saw each in its current
    stretch (same clock: DHT time). A server first seen more than `slack` after this one began cannot
    have been there before: its claim counts back no further than `slack` before it was seen. One
    already there when this one came cannot be refuted, and its claim stands (a record without one
    counts from when it was seen). Two honest servers so agree on which came first, and a stranger
    that joins a server cannot claim to be its elder. `slack` covers a record's way through the DHT
    and clocks a little apart.
    """
    if own_since is None:
        return {r.peer_id for r in others}
    elder = set()
    for r in others:
        seen = witnessed.get(r.peer_id)
        if seen is None:
            continue
        claimed = seen if r.since is None else r.since
        if seen - own_since > slack:
            claimed = max(claimed, seen - slack)
        if claimed < own_since:
            elder.add(r.peer_id)
    return elder


def backs_state(sender: str, step: int, fingerprint: Sequence[float] | None, own: ProgressRecord | None,
                others: Sequence[ProgressRecord], established: Collection[str] | None,
                rtol: float = EXACT_RTOL, elders: Collection[str] | None = None) -> str | None:
    """Why the state `sender` offers at `step` must not be adopted, or None if the stage backs it.

    Only established servers vote (all, when `established` is None), the sender's own record never: its
    step must be within the bound of the voters' steps, this server's own counted; most voters at its
    step must agree with its fingerprint, and at least one must, unless the stage has no established
    server besides the sender and this one (a stage of two). There the sender's word is all there is,
    at any step, and it counts only if the sender is this server's elder (`elders`, see
    :func:`seniors`; unchecked when None): the one that served first leads. So no lone claimant moves a
    stage of three or more, no new one moves anybody, and one that joins a lone server does not lead it.
    """
    if established is not None and sender not in established:
        return f"{sender} has not been watched long enough to vouch for a state"
    peers = [r for r in others if r.peer_id != sender and (established is None or r.peer_id in established)]
    if not peers and own is not None and elders is not None:
        # a stage of two: the elder's word is all there is, however far ahead. A bound against this server's own
        # step would leave one that fell more than MAX_STEP_LEAD behind (its elder stepping alone before it was
        # counted) refusing every state the elder offers, for good
        if sender in elders:
            return None
        return (f"{sender} is the stage's only other established server and began serving after this one: "
                "in a stage of two, the elder leads")
    votes = peers + ([own] if own is not None else [])
    bound = step_bound([r.step for r in votes])
    if bound is not None and step > bound:
        return f"its step {step} is beyond the stage's ({bound - MAX_STEP_LEAD} by most established servers' progress)"
    at_step = [r for r in peers if r.step == step]  # (this server's own parameters are what is in question)
    agree = sum(not fingerprints_differ(r.fingerprint, fingerprint, rtol) for r in at_step)
    if 2 * agree < len(at_step):
        return (f"its parameters differ from those of {len(at_step) - agree} of the {len(at_step)} servers at "
                f"step {step}")
    if agree == 0 and peers:
        return (f"no established server besides {sender} is at step {step} with its parameters "
                f"({len(peers)} others are established)")
    return None


def round_of(step: int, members: Sequence[str]) -> str:
    """Id of the round that took a stage to `step` by averaging over `members` (one: a lone step)."""
    source = f"{step}:" + ",".join(sorted(members))
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def sharing_priority(step: int, group: int, round_: str, peer_id: str = "") -> float:
    """Rank of a replica as a source of state: step first, then the size of its round, then the round,
    then the server. A float64 holds about 16 digits: up to 6 for the step, 3 for the group and about
    4 for each tie-break (an exact tie is rare, and stage_view breaks it by peer id)."""
    round_tie = int(hashlib.sha256(round_.encode()).hexdigest()[:3], 16) / 16**3  # in [0, 1)
    server_tie = int(hashlib.sha256(peer_id.encode()).hexdigest()[:3], 16) / 16**6  # in [0, 1/4096)
    return float(step) + (min(group, MAX_RANKED_GROUP) + round_tie + server_tie) / (MAX_RANKED_GROUP + 1)


def param_fingerprint(params: Iterable[torch.Tensor]) -> list[float]:
    """Two numbers that differ between replicas whose parameters differ: the sum and the sum of squares."""
    total, squares = 0.0, 0.0
    with torch.no_grad():
        for p in params:  # accumulated in float64 without a float64 copy of the parameters
            total += float(p.sum(dtype=torch.float64))
            squares += float(torch.linalg.vector_norm(p, dtype=torch.float64)) ** 2
    return [total, squares]


def fingerprints_differ(a: Sequence[float] | None, b: Sequence[float] | None, rtol: float = EXACT_RTOL) -> bool:
    """Whether two replicas' parameters differ (unknown fingerprints never do)."""
    if a is None or b is None:
        return False
    return any(not math.isclose(x, y, rel_tol=rtol, abs_tol=rtol) for x, y in zip(a, b))


@dataclass(frozen=True)
class StageView:
    """What one server knows about its stage at a moment."""

    step: int  # this server's
    samples: int  # the stage's towards the step this server's samples make, this server's own included
    group_size: int  # servers a round at this step should gather: itself and every one not ahead
    behind: bool  # some server is ahead of where this one's round (if any) takes it
    diverged: bool
    closed: bool = False  # another server closed the batch this one's samples make (its round for it began)
    members: tuple[str, ...] = ()  # the peer ids of the others that group_size counts
    # a stage of two whose elder is behind this one, not in a round: the elder would never take this one's
    # state nor join its rounds, so this one takes the elder's, a step back though it is
    defer: bool = False

    @property
    def needs_state(self) -> bool:
        return self.behind or self.diverged or self.defer


def stage_view(own: ProgressRecord, others: Iterable[ProgressRecord], rtol: float = EXACT_RTOL,
               established: Collection[str] | None = None, elders: Collection[str] | None = None) -> StageView:
    """This server's view of the stage, given its own record and the live records of the others.

    With `established` (the peers this server watched long enough, swarm.tenure), only their records
    close a batch, count towards it or are waited for (see :func:`voters`), and a server is behind or
    diverged only from a state the stage backs (:func:`backs_state`, with `elders`): a stranger's record
    moves nothing. Of two diverged replicas in a stage of two, the younger takes the elder's state
    (whatever their ranks): the elder would not take the younger's.
    """
    others = list(others)
    counted = voters(others, established)
    same_step = [r for r in others if r.step == own.step]
    lone = elders is not None and lone_peer(others, established) is not None

    def backed(r: ProgressRecord) -> bool:
        return established is None or backs_state(r.peer_id, r.step, r.fingerprint, own, others, established,
                                                  rtol, elders) is None

    def outranks(r: ProgressRecord) -> bool:
        if lone and r.peer_id in established:
            return r.peer_id in elders
        return (r.priority, r.peer_id) > (own.priority, own.peer_id)

    return StageView(
        step=own.step,
        samples=own.samples + sum(r.samples for r in counted if r.next_batch == own.next_batch),
        group_size=1 + sum(r.step <= own.step for r in counted),
        members=tuple(r.peer_id for r in counted if r.step <= own.step),
        behind=any(r.step > own.step + own.averaging and backed(r) for r in others),
        # (a server ahead closed it only if its step is believed: else this one would wait for a catch-up it refuses)
        closed=any(r.step + r.averaging >= own.next_batch and (r.step <= own.step or backed(r)) for r in counted),
        defer=lone and any(r.peer_id in established and r.peer_id in elders and r.step < own.step and not r.averaging
                           and backed(r) for r in others),
        diverged=any(outranks(r)
                     and (r.round_id != own.round_id or fingerprints_differ(r.fingerprint, own.fingerprint, rtol))
                     and backed(r)
                     for r in same_step),
    )


class DeferHold:
    """Holds a stage view's `defer` back until it has lasted `hold` seconds.

    Right after a round the two servers of a stage shared, the elder's record can still say the step
    before (its new one is on its way, by push or the next read): deferring then downloads this server's
    own state back and drops the samples it computed meanwhile (seen once in four 150-step runs, 24
    samples). An elder really behind stays behind; the younger takes its state a moment later.
    """

    def __init__(self, hold: float, clock: Callable[[], float] = time.monotonic):
        self.hold, self.clock = hold, clock
        self.since: float | None = None  # when the elder was first seen behind, in this stretch

    def __call__(self, view: StageView) -> StageView:
        if not view.defer or view.behind or view.diverged:
            self.since = None
            return view
        now = self.clock()
        if self.since is None:
            self.since = now
        return view if now - self.since >= self.hold else dataclasses.replace(view, defer=False)
