"""Which announced stage checkpoints a peer believes: the step in a CheckpointRecord is a claim.

Pure logic, no I/O. A holder's record is signed with its own key, and the bytes it serves hash to its
own manifest, so a stranger can announce a genuine checkpoint of zeros at step 9,999,999,999. What
backs a checkpoint's step is not its holder but the stage's servers:

- the coordinator (the peer that signed the run config) is trusted for what it holds: it keeps only
  checkpoints it vetted with these same rules;
- any other holder's checkpoint is believed only up to `bound`, the furthest step the servers' own
  records make believable (their lower median plus CHECKPOINT_STEP_LEAD), and, where the caller
  watched the stage long enough to know its established servers, only from one of them.

Everything else is ignored, and each ignored claim comes back with its holder's peer id, to log.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from swarm.dht.schemas import CheckpointRecord
from swarm.tenure import lower_median

# A checkpoint is written on its server right after a step, so it may be a step or two ahead of what
# the slowest half of the stage's records said a moment before.
CHECKPOINT_STEP_LEAD = 2


def step_bound(steps: Iterable[int]) -> int | None:
    """The furthest checkpoint step the servers' records (`steps`) make believable; None if there are none."""
    median = lower_median(list(steps))
    return None if median is None else median + CHECKPOINT_STEP_LEAD


def believed(
    records: Iterable[CheckpointRecord],
    *,
    bound: int | None,
    trusted: Collection[str] = (),
    established: Collection[str] | None = None,
) -> tuple[list[CheckpointRecord], list[str]]:
    """`records` cut down to the checkpoints worth fetching, and a line per claim ignored (with its holder).

    `trusted` holders (the coordinator) are believed whole. Others need `bound` (None: nothing to weigh
    their steps against, so none is believed) and, if `established` is given, to be in it.
    """
    kept: list[CheckpointRecord] = []
    ignored: list[str] = []
    for record in records:
        if record.peer_id in trusted:
            kept.append(record)
            continue
        if established is not None and record.peer_id not in established:
            if record.checkpoints:
                who = "server" if record.part == "stage" else "host"
                ignored.append(f"{record.peer_id} announces checkpoints of {record.part} {record.stage} up to step "
                               f"{max(h.step for h in record.checkpoints)} but is not an established {who} of it")
            continue
        if bound is None:
            if record.checkpoints:
                ignored.append(f"{record.peer_id} announces checkpoints of {record.part} {record.stage}, and no "
                               "server's record says how far the run has trained")
            continue
        good = [held for held in record.checkpoints if held.step <= bound]
        far = [held.step for held in record.checkpoints if held.step > bound]
        if far:
            ignored.append(f"{record.peer_id} announces a checkpoint of {record.part} {record.stage} at step "
                           f"{max(far)}, beyond step {bound}, the furthest the servers' records make believable")
        if good:
            kept.append(record.copy(update={"checkpoints": good}))
    return kept, ignored
