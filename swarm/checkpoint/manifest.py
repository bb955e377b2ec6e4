"""Checkpoint manifests: what a checkpoint holds, as canonical JSON read back strictly.

A manifest may come from a peer, so reading one trusts nothing: the bytes are bounded before they
are parsed, every known field must have exactly its type (an int is not a bool, a sha256 is 64
lowercase hex digits), and file names must be plain names, so no manifest can point outside its
checkpoint directory. Fields this version does not know are ignored, as in the DHT records, so a
manifest written by a newer peer still reads. The layout is documented in docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from swarm.checkpoint.errors import CheckpointError

FORMAT = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 64 * 1024
MAX_NAME_CHARS = 255

_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # no '/', no leading '.'
_PART_DIR = re.compile(r"(stage|expert)[0-9]+")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]+")  # as RunConfig.validate() requires; it names a directory
# What a checkpoint of one hosted thing holds: a stage replica, or one expert (in every MoE block) of an expert host.
PARTS = ("stage", "expert")


def manifest_id(data: bytes) -> str:
    """The id of a checkpoint: sha256 (hex) of its manifest bytes, exactly as written."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its sha256 and size in bytes."""

    sha256: str
    size: int

    def __post_init__(self) -> None:
        _check_sha256(self.sha256, "sha256")
        _check_count(self.size, "size")


@dataclass(frozen=True)
class StageManifest:
    """``manifest.json`` of one checkpoint of a hosted part: a stage (``part`` "stage"), or an expert
    (``part`` "expert": then ``stage`` is the expert's index and ``num_stages`` the run's experts per block).
    A manifest without ``part`` is a stage's (as every manifest was before experts had checkpoints)."""

    KIND: ClassVar[str] = "stage"

    run_id: str
    stage: int
    num_stages: int
    step: int
    state_hash: str
    round_id: str
    group: int
    created: float
    files: dict[str, FileEntry]
    part: str = "stage"

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        if type(self.part) is not str or self.part not in PARTS:
            raise CheckpointError(f"field 'part' must be one of {PARTS}, got {self.part!r:.80}")
        _check_count(self.num_stages, "num_stages", minimum=1)
        _check_count(self.stage, "stage")
        if self.stage >= self.num_stages:
            raise CheckpointError(f"{self.part} {self.stage} is out of range for {self.num_stages} {self.part}s")
        _check_count(self.step, "step")
        _check_sha256(self.state_hash, "state_hash")
        _check_type(self.round_id, str, "round_id", "a string")
        _check_count(self.group, "group")
        _check_created(self.created)
        _check_files(self.files)

    def to_bytes(self) -> bytes:
        return _dump(self.KIND, dataclasses.asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> StageManifest:
        """Parse and validate; CheckpointError (prefixed with `where`) on any problem."""
        try:
            fields = _load(data, cls.KIND)
            fields.setdefault("part", "stage")
            files = _field(fields, "files", dict, "an object")
            fields["files"] = {name: _file_entry(entry, name) for name, entry in files.items()}
            return cls(**_known(cls, fields))
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None


@dataclass(frozen=True)
class RunStageEntry:
    """One checkpoint in a run checkpoint: a stage's, or (``part`` "expert") an expert's, whose index is then
    ``stage``; the sub-directory holding it (``stage<k>`` or ``expert<e>``) and its manifest's sha256."""

    stage: int
    step: int
    manifest_sha256: str
    dir: str
    part: str = "stage"

    def __post_init__(self) -> None:
        _check_count(self.stage, "stage")
        _check_count(self.step, "step")
        _check_sha256(self.manifest_sha256, "manifest_sha256")
        _check_type(self.dir, str, "dir", "a string")
        if type(self.part) is not str or self.part not in PARTS:
            raise CheckpointError(f"field 'part' must be one of {PARTS}, got {self.part!r:.80}")
        if not _PART_DIR.fullmatch(self.dir) or self.dir != f"{self.part}{self.stage}":
            raise CheckpointError(f"{self.part} {self.stage} must live in dir '{self.part}{self.stage}', "
                                  f"not {self.dir!r:.80}")


@dataclass(frozen=True)
class RunManifest:
    """``manifest.json`` of a run checkpoint: the run config, one verified checkpoint per stage and, for a
    run with expert servers, one per expert that had one (by index; a manifest without ``experts`` has none)."""

    KIND: ClassVar[str] = "run"

    run_id: str
    state_hash: str
    config_yaml: str
    created: float
    stages: list[RunStageEntry]
    experts: list[RunStageEntry] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        _check_sha256(self.state_hash, "state_hash")
        _check_type(self.config_yaml, str, "config_yaml", "a string")
        _check_created(self.created)
        _check_type(self.stages, list, "stages", "a list")
        if not self.stages:
            raise CheckpointError("field 'stages' is empty")
        indices = [entry.stage for entry in self.stages]
        if indices != list(range(len(indices))):
            raise CheckpointError(f"stages must be listed as 0, 1, ..., got {indices}")
        if any(entry.part != "stage" for entry in self.stages):
            raise CheckpointError("field 'stages' lists a checkpoint that is not a stage's")
        _check_type(self.experts, list, "experts", "a list")
        experts = [entry.stage for entry in self.experts]
        if any(entry.part != "expert" for entry in self.experts) or experts != sorted(set(experts)):
            raise CheckpointError(f"experts must be expert checkpoints listed by increasing index, got {experts}")

    @property
    def step(self) -> int:
        """The step a run checkpoint is named by: the smallest stage step in it."""
        return min(entry.step for entry in self.stages)

    def to_bytes(self) -> bytes:
        return _dump(self.KIND, dataclasses.asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> RunManifest:
        """Parse and validate; CheckpointError (prefixed with `where`) on any problem."""
        try:
            fields = _load(data, cls.KIND)
            stages = _field(fields, "stages", list, "a list")
            fields["stages"] = [_run_stage_entry(entry, i) for i, entry in enumerate(stages)]
            experts = fields.setdefault("experts", [])
            _check_type(experts, list, "experts", "a list")
            fields["experts"] = [_run_stage_entry(entry, i, "experts") for i, entry in enumerate(experts)]
            return cls(**_known(cls, fields))
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None


def _dump(kind: str, fields: dict[str, Any]) -> bytes:
    data = json.dumps({"format": FORMAT, "kind": kind, **fields}, sort_keys=True, indent=2, allow_nan=False)
    encoded = data.encode() + b"\n"
    if len(encoded) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"a {kind} manifest of {len(encoded)} bytes exceeds the {MAX_MANIFEST_BYTES} allowed")
    return encoded


def _load(data: bytes, kind: str) -> dict[str, Any]:
    """The top-level object of a manifest of `kind`, with 'format' and 'kind' checked and removed."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    try:
        parsed = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise CheckpointError("is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"is not valid JSON: {e}") from None
    except RecursionError:
        raise CheckpointError("is nested too deeply") from None
    if not isinstance(parsed, dict):
        raise CheckpointError(f"must be a JSON object, got {type(parsed).__name__}")
    if _field(parsed, "format", int, "an integer") != FORMAT:
        raise CheckpointError(f"has format {parsed['format']}; this version reads format {FORMAT}")
    if _field(parsed, "kind", str, "a string") != kind:
        raise CheckpointError(f"is a {parsed['kind']!r} manifest, expected {kind!r}")
    if type(parsed.get("created")) is int:  # a float written without its '.0' is still a time
        parsed["created"] = float(parsed["created"])
    return parsed


def _known(cls: type, fields: dict[str, Any]) -> dict[str, Any]:
    """The dataclass fields of `cls` from `fields` (unknown keys dropped); missing ones are errors."""
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [name for name in names if name not in fields]
    if missing:
        raise CheckpointError(f"missing field(s) {', '.join(map(repr, missing))}")
    return {name: fields[name] for name in names}


def _file_entry(entry: Any, name: str) -> FileEntry:
    _check_type(entry, dict, f"files[{name!r}]", "an object")
    try:
        return FileEntry(**_known(FileEntry, entry))
    except CheckpointError as e:
        raise CheckpointError(f"files[{name!r}]: {e}") from None


def _run_stage_entry(entry: Any, index: int, where: str = "stages") -> RunStageEntry:
    _check_type(entry, dict, f"{where}[{index}]", "an object")
    try:
        return RunStageEntry(**_known(RunStageEntry, {"part": "stage", **entry}))
    except CheckpointError as e:
        raise CheckpointError(f"{where}[{index}]: {e}") from None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise CheckpointError("has a key twice in one object")
    return result


def _no_constant(name: str) -> Any:
    raise CheckpointError(f"holds {name}, which is not JSON")


def _field(fields: dict[str, Any], name: str, kind: type, described: str) -> Any:
    if name not in fields:
        raise CheckpointError(f"missing field {name!r}")
    _check_type(fields[name], kind, name, described)
    return fields[name]


def _check_type(value: Any, kind: type, name: str, described: str) -> None:
    if type(value) is not kind:  # exact type: bool is a subclass of int, and must not pass as one
        raise CheckpointError(f"field {name!r} must be {described}, got {value!r:.80}")


def _check_count(value: Any, name: str, minimum: int = 0) -> None:
    if type(value) is not int or value < minimum:
        raise CheckpointError(f"field {name!r} must be an integer >= {minimum}, got {value!r:.80}")


def _check_sha256(value: Any, name: str) -> None:
    if type(value) is not str or not _SHA256.fullmatch(value):
        raise CheckpointError(f"field {name!r} must be 64 lowercase hex digits (a sha256), got {value!r:.80}")


def _check_run_id(value: Any) -> None:
    if type(value) is not str or not _RUN_ID.fullmatch(value) or len(value) > MAX_NAME_CHARS:
        raise CheckpointError(f"field 'run_id' must be letters, digits, '-' or '_', got {value!r:.80}")


def _check_created(value: Any) -> None:
    if type(value) is not float or not math.isfinite(value):
        raise CheckpointError(f"field 'created' must be a finite number (seconds since the epoch), got {value!r:.80}")


def _check_files(files: Any) -> None:
    _check_type(files, dict, "files", "an object")
    if not files:
        raise CheckpointError("field 'files' is empty")
    for name, entry in files.items():
        if not is_plain_name(name) or name == MANIFEST_NAME:
            raise CheckpointError(f"file name {name!r:.80} is not allowed: plain names only "
                                  f"(letters, digits, '.', '_', '-'; no leading '.', no '..', not {MANIFEST_NAME})")
        _check_type(entry, FileEntry, f"files[{name!r}]", "a FileEntry")


def is_plain_name(name: Any) -> bool:
    """Whether `name` can only name a file directly inside a checkpoint directory."""
    return (type(name) is str and len(name) <= MAX_NAME_CHARS and _FILE_NAME.fullmatch(name) is not None
            and ".." not in name)
