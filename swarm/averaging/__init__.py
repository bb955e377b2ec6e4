"""Averaging among the servers of one stage: they step together on the gradient of all their samples.

Map of the subsystem, from what a server uses down to pure logic::

    stepper.py   StageStepper: the narrow interface StageBackend steps through (take a micro-batch's
                 gradients, ready?, step); swarm.optim.StageOptimizer is the one-server implementation
    averager.py  StageAverager: the collective one. Waits until the stage as a whole has a full
                 batch (samples that come after it are held for the next step), then averages the
                 batch's gradients (weighted by sample counts) on a thread of its own while the
                 compute thread keeps serving (those samples count one step late); the compute
                 thread applies the same step on every replica between two requests. Steps alone
                 (and says so) when a round fails; catches up when behind (downloading beside
                 compute too); load_state_from_peers() for a server joining its stage. Composed of
                 the parts below, each owning its fields: its phase, its kind of round, retries,
                 groups formed ahead, catch-up, the ledger, the progress tracker
    rounds.py    Phase (collecting, round in flight, catching up, solo), Retries (pure), and Round: one
                 kind of round behind one interface (due, start, the network part, apply); PlainRound,
                 the mean gradient through hivemind's all-reduce
    local.py     LocalAverager: the low-communication mode (averaging.mode local): each server takes
                 averaging.local_steps steps of its own, then the stage's servers average their
                 pseudo-gradients (slow weights minus their own) and all take the same outer Nesterov
                 step (OuterRound, a Round); a StageAverager in every other respect (catch-up,
                 groups formed ahead, state serving)
    intake.py    StateIntake: downloads of the stage's state, bounded, skipping servers refused lately,
                 and the checks that the stage's progress backs what came
    feedback.py  ErrorFeedback: what the codec rounds off a server's pseudo-gradients, kept and sent
                 with its next one (local mode); pure
    ledger.py    SampleLedger: late samples (accumulated while a round ran) and those held while a batch
                 is due; what a round's start, a failed round and a replaced state do to them; pure
    ahead.py     GroupsAhead: the group of a stage's next round forms while its batch fills
    catchup.py   CatchUp: the state downloads (a replica behind, or apart, takes the stage's state from
                 a server of it) and uploads
    tracker.py   StageProgressTracker: a thread that publishes this server's progress and reads the
                 stage's, through the DHT
    progress.py  what each server publishes of its stage's progress, and what a server concludes from it
    direct.py    matchmaking declarations sent straight to the stage's other servers, besides the DHT
    channel.py   ProgressChannel: progress pushed straight to the stage's other servers over libp2p,
                 so a full batch is known at once rather than at the next DHT read
    sharded.py   ShardedRound, a Round for when the moments are sharded (averaging.zero): meet, plan,
                 run the collective, apply; a failed round changes nothing and is tried again
    zero_round.py  one member's side of a sharded round (averaging.zero): gradients sent to every owner
                 of each chunk, each owner steps its chunks, the primary's updates gathered, moments
                 handed to new owners
    crosscheck.py  how a chunk's owners compare results (updates by hash, sums of squares), and the
                 bounds on chunks nobody else computes; pure
    collective.py  the mailbox of sharded rounds: libp2p messages, checked (the layout, ownership and
                 chunk AdamW are pure logic in swarm.zero)
    process.py   AveragingProcess: hivemind's DecentralizedAverager (a forked process: matchmaking,
                 all-reduce, state serving) with every timeout from the config and bounded calls
    metrics.py   AveragingMetrics: swarm_averaging_* Prometheus metrics
    progress.py  ProgressRecord, stage_view(), backs_state(): what the records mean (ready, behind,
                 diverged), and whether the stage's established servers back a state; pure (who is
                 established: the tracker's swarm.tenure book)
    robust.py    robust aggregation of one part of the gradient: what a reducer makes of its members' parts
    codecs.py    pure-torch compression codecs installed into hivemind
    errors.py    AveragingError and its subclasses

The replica's state (parameters, moments, step, round) is read and replaced only through
swarm.state.StageState; a state a peer sends is checked there (names, shapes, dtypes, finite) and
in intake.py (its step and parameters backed by the stage's established servers) before it replaces
anything.

Every network wait is bounded by a value of ``AveragingConfig`` (see swarm.config).
"""

from swarm.averaging.averager import StageAverager, averaging_prefix
from swarm.averaging.channel import ProgressChannel
from swarm.averaging.errors import AveragingError, StateDownloadError
from swarm.averaging.local import INNER, LocalAverager
from swarm.averaging.metrics import FAILED, LOCAL, SUCCEEDED, AveragingMetrics
from swarm.averaging.progress import INITIAL_ROUND
from swarm.averaging.stepper import StageStepper

__all__ = [
    "FAILED",
    "INITIAL_ROUND",
    "INNER",
    "LOCAL",
    "SUCCEEDED",
    "AveragingError",
    "AveragingMetrics",
    "LocalAverager",
    "ProgressChannel",
    "StageAverager",
    "StageStepper",
    "StateDownloadError",
    "averaging_prefix",
]
