"""Checkpoints of stage states and of whole runs: on disks, announced in the DHT, fetched and verified.

Format: docs/checkpoints.md. Map of the subsystem, from what a server uses down to the files::

    keeper.py    StageKeeper: a server's checkpoints of its stage, written every N steps / S seconds
                 beside compute, announced (CheckpointRecord), served, and restored from when the
                 stage has no live server (own disk or any holder); coordinator.archive does the same
                 for the whole run
    schedule.py  CheckpointSchedule: when the next checkpoint is due (steps or seconds; 0 turns either off),
                 for stage and expert servers alike
    claims.py    which announced checkpoints a peer believes: a record's step is a claim, bounded by the run's
    transfer.py  fetch_checkpoint / fetch_newest: every byte hashed; a lying holder banned, the next tried
    serving.py   CheckpointServer: a streaming libp2p RPC serving held files by manifest id, bounded slots
    wire.py      the transfer wire format both sides share: namespace, frame limits, reply codes
    store.py     StageCheckpoints (a server's stage states), RunCheckpoints (the coordinator's whole-run
                 copies): atomic writes, install of fetched copies, pruning
    safefile.py  a safetensors file written in one pass, its bytes hashed as they go out
    verify.py    check_stage / load_stage / verify_run: manifests, listings, sizes, sha256s, finite tensors
    signing.py   the coordinator's key and SIGNATURE files: what its archive and swarm-export take
    manifest.py  StageManifest, RunManifest: canonical JSON written, strictly validated when read;
                 manifest_id() is the sha256 of the bytes, the id the DHT announces
    errors.py    CheckpointError
"""

from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.manifest import FileEntry, RunManifest, RunStageEntry, StageManifest, manifest_id
from swarm.checkpoint.store import RunCheckpoints, StageCheckpoints, default_root, find_run_ids

__all__ = [
    "CheckpointError",
    "FileEntry",
    "RunCheckpoints",
    "RunManifest",
    "RunStageEntry",
    "StageCheckpoints",
    "StageManifest",
    "default_root",
    "find_run_ids",
    "manifest_id",
]
