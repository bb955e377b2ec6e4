"""Checkpoints on a local disk: written atomically, used only after they verify.

Layout (docs/checkpoints.md)::

    <root>/<run_id>/stage<k>/step<NNNNNNNNNN>/   StageCheckpoints: a server's states of stage k
    <root>/<run_id>/expert<e>/step<NNNNNNNNNN>/  StageCheckpoints(part="expert"): an expert host's states of
                                                 expert e (in every MoE block)
    <root>/<run_id>/run/step<NNNNNNNNNN>/        RunCheckpoints: the coordinator's whole-model copies

A checkpoint is built in a ``.tmp-*`` sibling, every file fsynced, then renamed into place and the
parent directory fsynced, so a ``step*`` directory is always complete. Deleting goes the other way
(renamed to ``.tmp-*`` first), so a crash never leaves half a ``step*`` directory either; leftover
``.tmp-*`` directories are ignored and removed once stale. Writing a step that is already on disk
replaces it: the caller's state is newer than what the old one holds (e.g. a later round).

Nothing read back is used before it verifies (verify.py). Pruning keeps the newest `keep`
checkpoints and never deletes the newest one that verifies, however many broken ones are newer.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import torch

from swarm.checkpoint.errors import CheckpointError, CheckpointExists
from swarm.checkpoint.manifest import (
    MANIFEST_NAME,
    PARTS,
    FileEntry,
    RunManifest,
    RunStageEntry,
    StageManifest,
    manifest_id,
)
from swarm.checkpoint.safefile import save_hashed
from swarm.checkpoint.verify import (
    STATE_NAME,
    VerifiedRun,
    check_listing,
    check_owner,
    check_stage,
    load_stage,
    read_manifest,
    verify_run,
)

logger = logging.getLogger(__name__)

STALE_TEMP_SECONDS = 3600.0  # a .tmp-* directory untouched this long belongs to no live writer or fetch
MAX_STEP = 10**10 - 1  # step directories are named with 10 digits
_STEP_DIR = re.compile(r"step([0-9]{10})")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]+")
_CHUNK = 1 << 20


def default_root() -> Path:
    """``$XDG_CACHE_HOME/swarm/checkpoints``, or ``~/.cache/swarm/checkpoints``."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "swarm" / "checkpoints"


def find_run_ids(root: Path) -> list[str]:
    """The run ids under `root` that hold at least one run checkpoint directory, sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _RUN_ID.fullmatch(p.name) and _step_dirs(p / "run"))


class _StepDirs:
    """The ``step*`` directories under one parent: listing, atomic placing, pruning, stale temp cleanup."""

    def __init__(self, directory: Path, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        if not _RUN_ID.fullmatch(directory.parent.name):
            raise ValueError(f"run id must be letters, digits, '-' or '_', got {directory.parent.name!r}")
        self.dir = directory
        self.keep = keep
        self._intact_ids: set[tuple[str, str]] = set()  # (step dir name, manifest id) seen to verify
        self.cleanup_temp()

    def entries(self) -> list[Path]:
        """Complete checkpoint directories, newest step first."""
        return _step_dirs(self.dir)

    def new_temp_dir(self) -> Path:
        """A fresh ``.tmp-*`` directory beside the checkpoints (same disk, so it can be renamed into place)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f".tmp-{secrets.token_hex(8)}"
        path.mkdir()
        return path

    def cleanup_temp(self, max_age: float = STALE_TEMP_SECONDS) -> None:
        """Remove ``.tmp-*`` directories nobody has touched for `max_age` seconds (crashed writes)."""
        if not self.dir.is_dir():
            return
        now = time.time()
        for path in self.dir.glob(".tmp-*"):
            if now - _last_modified(path) > max_age:
                shutil.rmtree(path, ignore_errors=True)

    def newest_intact(self) -> Path | None:
        """The newest checkpoint directory whose files verify (remembered per manifest id), if any."""
        for path in self.entries():
            if self._intact(path):
                return path
        return None

    def prune(self, protect: Path | None = None) -> list[Path]:
        """Delete all but the newest `keep` checkpoints, the newest one that verifies and `protect`."""
        entries = self.entries()
        if len(entries) <= self.keep:
            return []
        kept = set(entries[: self.keep]) | {protect}
        for path in entries:
            if self._intact(path):
                kept.add(path)
                break
        removed = [path for path in entries if path not in kept]
        for path in removed:
            try:
                _remove(path)
            except OSError as e:  # the checkpoint just written is in place; an old one lingering is no failure
                logger.warning("could not remove old checkpoint %s: %s", path, e)
        names = {path.name for path in removed}
        self._intact_ids = {key for key in self._intact_ids if key[0] not in names}
        return removed

    def _intact(self, path: Path) -> bool:
        """Whether `path` verifies (files against its manifest); remembered per manifest id."""
        try:
            key = (path.name, manifest_id(read_manifest(path)))
            if key not in self._intact_ids:
                self._check(path)
                self._intact_ids.add(key)
            return True
        except (CheckpointError, OSError) as e:
            logger.warning("checkpoint %s does not verify: %s", path, e)
            return False

    def _check(self, path: Path) -> str:
        """Verify a checkpoint's files (not its tensors); its manifest id, or CheckpointError."""
        raise NotImplementedError

    def _place(self, temp: Path, step: int, data: bytes, replace: bool = True) -> Path:
        """Rename the complete checkpoint `temp` to ``step<N>``, replacing one of the same step if `replace`
        (else CheckpointExists, and `temp` is left to the caller)."""
        if not 0 <= step <= MAX_STEP:
            raise CheckpointError(f"step {step} is out of range 0..{MAX_STEP}")
        target = self.dir / f"step{step:010d}"
        _fsync_dir(temp)
        for _ in range(3):  # another writer of this directory may be replacing the same step
            try:
                os.rename(temp, target)
                break
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                if not replace:
                    raise CheckpointExists(f"{target} exists already, and is not replaced in place") from None
                _remove(target)
        else:
            raise CheckpointError(f"could not rename {temp} to {target}: it keeps being recreated")
        _fsync_dir(self.dir)
        self._intact_ids.add((target.name, manifest_id(data)))
        return target


class StageCheckpoints(_StepDirs):
    """The checkpoints of one stage on this disk: ``<root>/<run_id>/stage<k>/``; with `part` "expert", of
    expert k: ``<root>/<run_id>/expert<k>/``."""

    def __init__(self, root: Path, run_id: str, stage: int, keep: int, part: str = "stage"):
        if part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        self.run_id = run_id
        self.stage = stage
        self.part = part
        super().__init__(Path(root) / run_id / f"{part}{stage}", keep)

    def write(self, tensors: dict[str, torch.Tensor], *, step: int, num_stages: int, state_hash: str,
              round_id: str, group: int) -> tuple[StageManifest, str, Path]:
        """Save a state as checkpoint ``step<step>``; (manifest, manifest id, its directory). For an expert,
        `num_stages` is the run's number of experts per block.

        The tensors must not change while this runs: hand over a snapshot if training goes on.
        """
        temp = self.new_temp_dir()
        try:
            state = temp / STATE_NAME
            sha256, size = save_hashed(_cpu_tensors(tensors), state)  # one pass: written and hashed
            _fsync(state)
            entry = FileEntry(sha256=sha256, size=size)
            manifest = StageManifest(run_id=self.run_id, stage=self.stage, num_stages=num_stages, step=step,
                                     state_hash=state_hash, round_id=round_id, group=group, created=time.time(),
                                     files={STATE_NAME: entry}, part=self.part)
            data = manifest.to_bytes()
            _write_synced(temp / MANIFEST_NAME, data)
            path = self._place(temp, step, data)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        self.prune(protect=path)
        return manifest, manifest_id(data), path

    def load(self, path: Path, *, state_hash: str, run_id: str | None = None,
             stage: int | None = None) -> tuple[StageManifest, str, dict[str, torch.Tensor]]:
        """Verify the checkpoint at `path` and read its tensors; CheckpointError says what is wrong.

        `run_id` and `stage` default to this store's; `path` may be anywhere (e.g. a fetched copy).
        """
        return load_stage(Path(path), run_id=self.run_id if run_id is None else run_id,
                          stage=self.stage if stage is None else stage, state_hash=state_hash, part=self.part)

    def newest_verified(self, *, state_hash: str) -> tuple[StageManifest, str, dict[str, torch.Tensor], Path] | None:
        """The newest checkpoint that verifies, as (manifest, manifest id, tensors, path); None if none does."""
        for path in self.entries():
            try:
                manifest, mid, tensors = self.load(path, state_hash=state_hash)
            except CheckpointError as e:
                logger.warning("skipping checkpoint %s: %s", path, e)
                continue
            return manifest, mid, tensors, path
        return None

    def install(self, staged: Path) -> Path:
        """Put a complete stage checkpoint directory (e.g. fetched from a peer) in place as ``step<N>``.

        Its files are verified first. A directory made by :meth:`new_temp_dir` is renamed (or
        removed if it does not verify); one elsewhere is copied, verified while copying, and left.
        """
        staged = Path(staged)
        data = read_manifest(staged)
        manifest = StageManifest.from_bytes(data, where=str(staged / MANIFEST_NAME))
        if staged.parent.resolve() == self.dir.resolve() and staged.name.startswith(".tmp-"):
            temp = staged
            try:
                self._check(staged)
            except CheckpointError:
                shutil.rmtree(staged, ignore_errors=True)  # ours to clean: no use keeping a bad copy
                raise
            for name in manifest.files:
                _fsync(staged / name)
        else:
            temp = self.new_temp_dir()
            try:
                check_owner(staged, manifest, run_id=self.run_id, stage=self.stage, state_hash=None, part=self.part)
                _copy_verified(staged, temp, manifest.files, data)
            except BaseException:
                shutil.rmtree(temp, ignore_errors=True)
                raise
        path = self._place(temp, manifest.step, data)
        self.prune(protect=path)
        return path

    def path_for(self, manifest_id_: str) -> Path | None:
        """The checkpoint held here whose manifest has this id (to serve it to peers), if any."""
        for path in self.entries():
            try:
                if manifest_id(read_manifest(path)) == manifest_id_:
                    return path
            except (CheckpointError, OSError):
                continue
        return None

    def _check(self, path: Path) -> str:
        return check_stage(path, run_id=self.run_id, stage=self.stage, state_hash=None, part=self.part)[1]


class RunCheckpoints(_StepDirs):
    """Whole-run checkpoints (one verified checkpoint per stage, and per expert that has one in a run with expert
    servers): ``<root>/<run_id>/run/``."""

    def __init__(self, root: Path, run_id: str, keep: int):
        self.run_id = run_id
        super().__init__(Path(root) / run_id / "run", keep)

    def write(self, config_yaml: str, state_hash: str, stage_dirs: dict[int, Path],
              expert_dirs: dict[int, Path] | None = None) -> tuple[RunManifest, str, Path]:
        """Copy one stage checkpoint per stage, and the expert checkpoints of `expert_dirs` (by expert index),
        each verified on the way, into a new run checkpoint."""
        temp = self.new_temp_dir()
        try:
            entries, num_stages = self._copy_in(temp, "stage", stage_dirs, state_hash)
            if len(num_stages) != 1 or sorted(stage_dirs) != list(range(min(num_stages))):
                raise CheckpointError(f"a run checkpoint needs exactly one checkpoint of each stage, got stages "
                                      f"{sorted(stage_dirs)} whose manifests say num_stages {sorted(num_stages)}")
            experts, per_block = self._copy_in(temp, "expert", expert_dirs or {}, state_hash)
            if len(per_block) > 1:
                raise CheckpointError(f"expert checkpoints of runs of {sorted(per_block)} experts per block")
            run = RunManifest(run_id=self.run_id, state_hash=state_hash, config_yaml=config_yaml,
                              created=time.time(), stages=entries, experts=experts)
            data = run.to_bytes()
            _write_synced(temp / MANIFEST_NAME, data)
            path = self._place(temp, run.step, data, replace=False)  # a run checkpoint is never replaced
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        self.prune(protect=path)
        return run, manifest_id(data), path

    def _copy_in(self, temp: Path, part: str, dirs: dict[int, Path], state_hash: str
                 ) -> tuple[list[RunStageEntry], set[int]]:
        """Copy each checkpoint of `part` in `dirs` (index -> directory), verified, into `temp`: their entries,
        and the counts of their part their manifests say the run has."""
        entries, counts = [], set()
        for k in sorted(dirs):
            src, name = Path(dirs[k]), f"{part}{k}"
            data = read_manifest(src)
            manifest = StageManifest.from_bytes(data, where=str(src / MANIFEST_NAME))
            check_owner(src, manifest, run_id=self.run_id, stage=k, state_hash=state_hash, part=part)
            (temp / name).mkdir()
            _copy_verified(src, temp / name, manifest.files, data)
            entries.append(RunStageEntry(stage=k, step=manifest.step, manifest_sha256=manifest_id(data), dir=name,
                                         part=part))
            counts.add(manifest.num_stages)
        return entries, counts

    def load(self, path: Path, state_hash: str | None = None) -> VerifiedRun:
        """Verify the run checkpoint at `path` and every checkpoint in it, and read all their tensors."""
        return verify_run(Path(path), run_id=self.run_id, state_hash=state_hash, read_state=True)

    def newest_verified(self, state_hash: str | None = None) -> tuple[VerifiedRun, Path] | None:
        """The newest run checkpoint that verifies, with its path."""
        for path in self.entries():
            try:
                return self.load(path, state_hash), path
            except CheckpointError as e:
                logger.warning("skipping run checkpoint %s: %s", path, e)
        return None

    def _check(self, path: Path) -> str:
        return verify_run(path, run_id=self.run_id, state_hash=None, read_state=False).id


def _cpu_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors refuses shared storage)."""
    result, storages = {}, set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"checkpoint tensors must map str to tensor, got {name!r}: {type(tensor).__name__}")
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages:
            tensor = tensor.clone()
        storages.add(storage)
        result[name] = tensor
    return result


def _fsync(file: Path) -> None:
    with open(file, "rb") as f:
        os.fsync(f.fileno())


def _copy_verified(src: Path, dst: Path, files: dict[str, FileEntry], manifest_data: bytes) -> None:
    """Copy a checkpoint's manifest and files into the empty `dst`, hashing what is copied; fsynced."""
    check_listing(src, set(files))
    for name, entry in files.items():
        digest = hashlib.sha256()
        try:
            if os.lstat(src / name).st_size != entry.size:
                raise CheckpointError(f"{src / name} is not the {entry.size} bytes its manifest says")
            with open(src / name, "rb") as f, open(dst / name, "xb") as out:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                size = out.tell()
                out.flush()
                os.fsync(out.fileno())
        except OSError as e:
            raise CheckpointError(f"cannot copy {src / name}: {e.strerror}") from None
        if FileEntry(sha256=digest.hexdigest(), size=size) != entry:
            raise CheckpointError(f"{src / name} does not match its manifest (corrupted or changed while copied)")
    _write_synced(dst / MANIFEST_NAME, manifest_data)
    _fsync_dir(dst)


def _write_synced(file: Path, data: bytes) -> None:
    with open(file, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory; renamed away first, so no half-deleted ``step*`` is ever seen."""
    doomed = path.parent / f".tmp-removed-{secrets.token_hex(8)}"
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return  # another writer of this directory removed it first
    shutil.rmtree(doomed, ignore_errors=True)


def _step_dirs(directory: Path) -> list[Path]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    steps = [(int(m[1]), name) for name in names if (m := _STEP_DIR.fullmatch(name))]
    return [directory / name for _, name in sorted(steps, reverse=True) if (directory / name).is_dir()]


def _last_modified(path: Path) -> float:
    """The newest mtime of `path` and what it directly holds (a fetch in progress touches its files)."""
    try:
        times = [path.lstat().st_mtime] + [entry.stat(follow_symlinks=False).st_mtime for entry in os.scandir(path)]
    except OSError:
        return time.time()
    return max(times)
