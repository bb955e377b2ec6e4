"""Verifying checkpoints read back from a disk: nothing in them is trusted until it checks out.

File sizes are compared with the manifest before any hashing, every file's sha256 must match, no
file may be missing or extra, and tensors are read with safetensors (no pickle) and must be finite.
A stage checkpoint must be of the expected run, stage and (if given) state hash; a run checkpoint
must hold exactly the stage checkpoints its manifest lists, each verified in turn.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import BinaryIO, NamedTuple

import safetensors.torch
import torch
from safetensors import SafetensorError

from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    FileEntry,
    RunManifest,
    StageManifest,
    manifest_id,
)

STATE_NAME = "state.safetensors"  # the file every stage checkpoint must list
# The coordinator's signature of a checkpoint it verified (signing.py). Not listed in the manifest (it signs
# the manifest's bytes) and never served (serving.py sends the manifest and what it lists), so a listing
# tolerates it; whether it is there and good is signing.verify_signature's to say, not this module's.
SIGNATURE_NAME = "SIGNATURE"
_CHUNK = 1 << 20


def check_stage(path: Path, *, run_id: str, stage: int, state_hash: str | None,
                expect_id: str | None = None, part: str = "stage") -> tuple[StageManifest, str]:
    """Verify a stage checkpoint's (or, with `part` "expert", expert `stage`'s) manifest and files (not its
    tensors); (manifest, manifest id).

    `state_hash` None skips that check; `expect_id`, if given, is the manifest id it must have.
    """
    data = read_manifest(path)
    mid = manifest_id(data)
    if expect_id is not None and mid != expect_id:
        raise CheckpointError(f"{path / MANIFEST_NAME}: sha256 {mid} is not the expected {expect_id}")
    manifest = StageManifest.from_bytes(data, where=str(path / MANIFEST_NAME))
    check_owner(path, manifest, run_id=run_id, stage=stage, state_hash=state_hash, part=part)
    if STATE_NAME not in manifest.files:
        raise CheckpointError(f"{path / MANIFEST_NAME}: lists no {STATE_NAME}")
    check_listing(path, set(manifest.files))
    for name, entry in manifest.files.items():
        _check_file(path / name, entry)
    return manifest, mid


def load_stage(path: Path, *, run_id: str, stage: int, state_hash: str,
               expect_id: str | None = None, part: str = "stage") -> tuple[StageManifest, str, dict[str, torch.Tensor]]:
    """Verify a stage checkpoint and read its tensors: (manifest, manifest id, tensors).

    The tensors are read after the files verify. That is sound because a checkpoint's files are
    never rewritten in place: directories are only ever renamed in whole or removed.
    """
    manifest, mid = check_stage(path, run_id=run_id, stage=stage, state_hash=state_hash, expect_id=expect_id,
                                part=part)
    return manifest, mid, _read_tensors(path / STATE_NAME)


Loaded = dict[int, tuple[StageManifest, dict[str, torch.Tensor]]]  # index -> (manifest, tensors or {})


class VerifiedRun(NamedTuple):
    """A run checkpoint that verified: its manifest and id, and each stage's and expert's checkpoint."""

    manifest: RunManifest
    id: str
    stages: Loaded
    experts: Loaded


def verify_run(path: Path, *, run_id: str, state_hash: str | None, read_state: bool) -> VerifiedRun:
    """Verify a run checkpoint and every stage and expert checkpoint in it; their tensors too if `read_state`
    (else {})."""
    data = read_manifest(path)
    run = RunManifest.from_bytes(data, where=str(path / MANIFEST_NAME))
    if run.run_id != run_id:
        raise CheckpointError(f"run checkpoint {path} is for run {run.run_id!r}, not {run_id!r}")
    if state_hash is not None and run.state_hash != state_hash:
        raise CheckpointError(f"run checkpoint {path} has state hash {run.state_hash[:12]}, not {state_hash[:12]} "
                              "(another model shape or number of stages)")
    check_listing(path, {entry.dir for entry in run.stages + run.experts}, directories=True)
    loaded: dict[str, Loaded] = {"stage": {}, "expert": {}}
    experts_per_block: set[int] = set()
    for entry in run.stages + run.experts:
        where = dict(run_id=run.run_id, stage=entry.stage, state_hash=run.state_hash, expect_id=entry.manifest_sha256,
                     part=entry.part)
        if read_state:
            manifest, _, tensors = load_stage(path / entry.dir, **where)
        else:
            (manifest, _), tensors = check_stage(path / entry.dir, **where), {}
        if manifest.step != entry.step:
            raise CheckpointError(f"run checkpoint {path}: {entry.dir} is step {manifest.step}, the run manifest "
                                  f"says step {entry.step}")
        if entry.part == "stage" and manifest.num_stages != len(run.stages):
            raise CheckpointError(f"run checkpoint {path}: {entry.dir} is of a run of {manifest.num_stages} stages, "
                                  f"the run manifest lists {len(run.stages)}")
        if entry.part == "expert":
            experts_per_block.add(manifest.num_stages)  # (an expert's manifest counts the run's experts there)
        loaded[entry.part][entry.stage] = (manifest, tensors)
    if len(experts_per_block) > 1:
        raise CheckpointError(f"run checkpoint {path}: its experts' manifests disagree on the number of experts "
                              f"({sorted(experts_per_block)})")
    return VerifiedRun(run, manifest_id(data), loaded["stage"], loaded["expert"])


def check_owner(path: Path, manifest: StageManifest, *, run_id: str, stage: int, state_hash: str | None,
                part: str = "stage") -> None:
    """The checkpoint at `path` is of `run_id` and `part` `stage`, and of `state_hash` unless that is None."""
    if manifest.run_id != run_id:
        raise CheckpointError(f"checkpoint {path} is for run {manifest.run_id!r}, not {run_id!r}")
    if manifest.part != part:
        raise CheckpointError(f"checkpoint {path} is of {manifest.part} {manifest.stage}, not of a {part}")
    if manifest.stage != stage:
        raise CheckpointError(f"checkpoint {path} is for {part} {manifest.stage}, not {stage}")
    if state_hash is not None and manifest.state_hash != state_hash:
        raise CheckpointError(f"checkpoint {path} has state hash {manifest.state_hash[:12]}, not {state_hash[:12]} "
                              "(another model shape or number of stages)")


def check_listing(path: Path, expected: set[str], directories: bool = False) -> None:
    """`path` holds the manifest and exactly the `expected` entries: regular files (or real directories).

    A coordinator's SIGNATURE beside the manifest may be there too (it is checked by signing.py)."""
    try:
        present = set(os.listdir(path)) - {MANIFEST_NAME, SIGNATURE_NAME}
        modes = {name: os.lstat(path / name).st_mode for name in expected & present}
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be listed: {e.strerror}") from None
    if present != expected:
        raise CheckpointError(f"checkpoint {path}: unexpected {sorted(present - expected)}, "
                              f"missing {sorted(expected - present)} (against its manifest)")
    for name, mode in modes.items():
        if not (stat.S_ISDIR(mode) if directories else stat.S_ISREG(mode)):
            raise CheckpointError(f"{path / name} is not a {'directory' if directories else 'regular file'}")


def _check_file(file: Path, entry: FileEntry) -> None:
    """Check a file's size (before reading it), then its sha256, against its manifest entry."""
    try:
        size = os.lstat(file).st_size
        if size != entry.size:
            raise CheckpointError(f"{file} is {size} bytes, its manifest says {entry.size} (truncated or overwritten)")
        with open(file, "rb") as f:
            digest = _hash(f).sha256
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {e.strerror}") from None
    if digest != entry.sha256:
        raise CheckpointError(f"{file} has sha256 {digest[:12]}, its manifest says {entry.sha256[:12]} (corrupted)")


def read_manifest(path: Path) -> bytes:
    """The bytes of ``path/manifest.json``, refusing to read more than a manifest may hold."""
    file = path / MANIFEST_NAME
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {e.strerror}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{file} is larger than the {MAX_MANIFEST_BYTES} bytes a manifest may have")
    return data


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a verified safetensors file; every float tensor must be finite."""
    try:
        tensors = safetensors.torch.load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.numel() and not _finite(tensor):
            raise CheckpointError(f"{file}: non-finite values in {name}")
    return tensors


def _finite(tensor: torch.Tensor) -> bool:
    # NaN and inf both reach the min or the max; one pass, no mask (isfinite().all() is far slower).
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def _hash(f: BinaryIO) -> FileEntry:
    digest, size = hashlib.sha256(), 0
    buffer = memoryview(bytearray(_CHUNK))
    while n := f.readinto(buffer):
        digest.update(buffer[:n])
        size += n
    return FileEntry(sha256=digest.hexdigest(), size=size)
