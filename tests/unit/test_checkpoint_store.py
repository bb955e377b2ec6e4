"""Checkpoints on disk: round trips, atomic writes, pruning, and every kind of broken checkpoint rejected."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from swarm.checkpoint import (
    CheckpointError,
    RunCheckpoints,
    RunManifest,
    StageCheckpoints,
    StageManifest,
    default_root,
    find_run_ids,
    manifest_id,
)
from swarm.checkpoint.manifest import MAX_MANIFEST_BYTES
from swarm.checkpoint.verify import STATE_NAME

pytestmark = pytest.mark.timeout(10)

RUN = "tiny"
HASH = "a" * 64
OTHER_HASH = "b" * 64


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "param/blocks.0.attn.qkv.weight": torch.randn(8, 4, generator=g),
        "param/blocks.0.ln.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "optim/0/exp_avg": torch.randn(8, 4, generator=g).to(torch.float16),
        "optim/0/step": torch.tensor(3.0),
        "param/tokens": torch.randint(0, 100, (5,), generator=g),
    }


def write(store: StageCheckpoints, step: int, seed: int | None = None, **overrides):
    fields = dict(step=step, num_stages=2, state_hash=HASH, round_id=f"round-{step}", group=2)
    return store.write(state(step if seed is None else seed), **{**fields, **overrides})


def stage_store(tmp_path: Path, stage: int = 1, keep: int = 3) -> StageCheckpoints:
    return StageCheckpoints(tmp_path, RUN, stage, keep)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def rewrite_manifest(path: Path, **changes) -> None:
    """Edit a manifest's fields in place (its files stay valid; only who it is for changes)."""
    fields = json.loads((path / "manifest.json").read_text())
    fields.update(changes)
    (path / "manifest.json").write_text(json.dumps(fields))


def test_round_trip_keeps_values_dtypes_and_manifest(tmp_path):
    store = stage_store(tmp_path)
    manifest, mid, path = write(store, 120)
    assert path == tmp_path / RUN / "stage1" / "step0000000120"
    assert sorted(os.listdir(path)) == ["manifest.json", STATE_NAME]
    assert mid == manifest_id((path / "manifest.json").read_bytes())
    loaded, loaded_id, tensors = store.load(path, state_hash=HASH)
    assert (loaded, loaded_id) == (manifest, mid)
    assert (loaded.run_id, loaded.stage, loaded.num_stages, loaded.step, loaded.group) == (RUN, 1, 2, 120, 2)
    assert loaded.files[STATE_NAME].size == (path / STATE_NAME).stat().st_size
    assert_same(tensors, state(120))
    assert store.path_for(mid) == path and store.path_for("0" * 64) is None


def test_manifest_bytes_are_canonical_and_strict():
    manifest = StageManifest.from_bytes(json.dumps({
        "format": 1, "kind": "stage", "run_id": "tiny", "stage": 1, "num_stages": 2, "step": 120,
        "state_hash": HASH, "round_id": "r", "group": 2, "created": 1764556800, "future_field": [1],
        "files": {"state.safetensors": {"sha256": "c" * 64, "size": 123456}},
    }).encode())
    assert manifest.created == 1764556800.0  # an int time reads as a float; unknown fields are ignored
    assert StageManifest.from_bytes(manifest.to_bytes()) == manifest
    assert json.loads(manifest.to_bytes())["kind"] == "stage"
    good = json.loads(manifest.to_bytes())
    for change, message in [
        ({"step": True}, "'step' must be an integer"),
        ({"step": -1}, "'step' must be an integer"),
        ({"stage": 2}, "out of range"),
        ({"format": 2}, "format 2"),
        ({"kind": "run"}, "expected 'stage'"),
        ({"state_hash": "A" * 64}, "sha256"),
        ({"files": {".hidden": {"sha256": "c" * 64, "size": 1}}}, "not allowed"),
        ({"files": {"a/b": {"sha256": "c" * 64, "size": 1}}}, "not allowed"),
        ({"files": {"state.safetensors": {"sha256": "c" * 64, "size": 1.0}}}, "'size' must be an integer"),
        ({"files": {}}, "'files' is empty"),
        ({"run_id": "../x"}, "'run_id'"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            StageManifest.from_bytes(json.dumps({**good, **change}).encode())
    del good["round_id"]
    with pytest.raises(CheckpointError, match="missing field"):
        StageManifest.from_bytes(json.dumps(good).encode())
    for data, message in [(b"[1]", "JSON object"), (b"\xff", "UTF-8"), (b'{"a": NaN}', "NaN"),
                          (b'{"format": 1, "format": 1}', "twice"), (b"[" * 100_000, "bytes")]:
        with pytest.raises(CheckpointError, match=message):
            StageManifest.from_bytes(data, where="peer manifest")


def test_leftover_temp_dir_is_ignored_and_cleaned_once_stale(tmp_path):
    store = stage_store(tmp_path)
    write(store, 1)
    leftover = store.new_temp_dir()
    (leftover / STATE_NAME).write_bytes(b"half a file")
    assert store.entries() == [store.dir / "step0000000001"]
    store.cleanup_temp()
    assert leftover.exists()  # fresh: it could be a write or a fetch in progress
    old = 1_000_000_000
    os.utime(leftover / STATE_NAME, (old, old))
    os.utime(leftover, (old, old))
    stage_store(tmp_path)  # a new store cleans up on start
    assert not leftover.exists()


def test_failure_before_the_rename_leaves_no_step_dir(tmp_path, monkeypatch):
    store = stage_store(tmp_path)
    write(store, 1)

    def crash(*args, **kwargs):
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "rename", crash)
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write(store, 2)
    monkeypatch.undo()
    assert store.entries() == [store.dir / "step0000000001"]
    assert [p.name for p in store.dir.iterdir()] == ["step0000000001"]
    assert store.newest_verified(state_hash=HASH)[0].step == 1


def test_rewriting_a_step_replaces_it(tmp_path):
    store = stage_store(tmp_path)
    _, first, path = write(store, 5, seed=1)
    manifest, second, again = write(store, 5, seed=2)
    assert again == path and first != second
    assert [p.name for p in store.dir.iterdir()] == [path.name]
    assert_same(store.load(path, state_hash=HASH)[2], state(2))


def test_prune_keeps_the_newest(tmp_path):
    store = stage_store(tmp_path, keep=2)
    for step in (10, 20, 30, 40):
        write(store, step)
    assert [p.name for p in store.entries()] == ["step0000000040", "step0000000030"]


def test_prune_never_deletes_the_newest_good_one(tmp_path):
    store = stage_store(tmp_path, keep=4)
    paths = [write(store, step)[2] for step in (10, 20, 30, 40)]
    good = paths[1]
    for path in paths[2:]:
        (path / STATE_NAME).write_bytes(b"rot")  # both newest ones go bad
    store = stage_store(tmp_path, keep=2)  # a restart (with a smaller keep) forgets what it had verified
    store.prune()
    assert [p.name for p in store.entries()] == ["step0000000040", "step0000000030", "step0000000020"]
    assert store.newest_verified(state_hash=HASH)[3] == good


def test_prune_spares_what_was_just_written(tmp_path):
    """Older-looking steps of an earlier run with the same id must not evict the state just saved."""
    store = stage_store(tmp_path, keep=2)
    for step in (500, 600):
        write(store, step, state_hash=OTHER_HASH)
    path = write(store, 7)[2]
    assert path in store.entries()
    assert store.newest_verified(state_hash=HASH)[3] == path


def flip_byte(path: Path) -> None:
    data = bytearray((path / STATE_NAME).read_bytes())
    data[-3] ^= 0x01
    (path / STATE_NAME).write_bytes(bytes(data))


def nan_state(path: Path) -> None:
    """A state whose files verify but one of whose tensors holds a NaN."""
    tensors = state(0)
    tensors["param/blocks.0.attn.qkv.weight"][0, 0] = float("nan")
    save_file(tensors, str(path / STATE_NAME))
    data = (path / STATE_NAME).read_bytes()
    rewrite_manifest(path, files={STATE_NAME: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}})


BREAKAGES = {
    "truncated": (lambda p: (p / STATE_NAME).write_bytes((p / STATE_NAME).read_bytes()[:-10]), "truncated"),
    "flipped byte": (flip_byte, "corrupted"),
    "another run": (lambda p: rewrite_manifest(p, run_id="other"), "is for run 'other', not 'tiny'"),
    "another stage": (lambda p: rewrite_manifest(p, stage=0), "is for stage 0, not 1"),
    "another state hash": (lambda p: rewrite_manifest(p, state_hash=OTHER_HASH), "has state hash bbbbbbbbbbbb"),
    "extra file": (lambda p: (p / "notes.txt").write_text("hi"), r"unexpected \['notes.txt'\]"),
    "missing state": (lambda p: (p / STATE_NAME).unlink(), r"missing \['state.safetensors'\]"),
    "escaping file name": (lambda p: rewrite_manifest(p, files={"../x": {"sha256": "c" * 64, "size": 1}}),
                           "'../x' is not allowed"),
    "oversize manifest": (lambda p: rewrite_manifest(p, padding="x" * MAX_MANIFEST_BYTES), "larger than"),
    "no manifest": (lambda p: (p / "manifest.json").unlink(), "cannot be read"),
    "non-finite tensor": (nan_state, "non-finite values in param/blocks.0.attn.qkv.weight"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_broken_checkpoint_is_rejected_and_the_previous_one_used(tmp_path, caplog, breakage):
    store = stage_store(tmp_path)
    good = write(store, 10)[2]
    bad = write(store, 20)[2]
    breaker, message = BREAKAGES[breakage]
    breaker(bad)
    with pytest.raises(CheckpointError, match=message) as error:
        store.load(bad, state_hash=HASH)
    assert str(bad) in str(error.value)  # the message names the checkpoint
    with caplog.at_level(logging.WARNING, logger="swarm.checkpoint.store"):
        manifest, _, tensors, path = store.newest_verified(state_hash=HASH)
    assert (manifest.step, path) == (10, good)
    assert_same(tensors, state(10))
    assert str(bad) in caplog.text


def test_nothing_verifies_gives_none(tmp_path):
    store = stage_store(tmp_path)
    assert store.newest_verified(state_hash=HASH) is None
    flip_byte(write(store, 1)[2])
    assert store.newest_verified(state_hash=HASH) is None


def test_install_a_fetched_checkpoint(tmp_path):
    source = StageCheckpoints(tmp_path / "peer", RUN, 1, keep=3)
    _, mid, fetched = write(source, 30)
    store = stage_store(tmp_path / "me")
    staged = store.new_temp_dir()
    for name in os.listdir(fetched):
        (staged / name).write_bytes((fetched / name).read_bytes())
    path = store.install(staged)
    assert path == store.dir / "step0000000030" and not staged.exists()
    assert store.load(path, state_hash=HASH)[1] == mid
    elsewhere = store.install(source.entries()[0])  # outside the store: copied, the original stays
    assert elsewhere == path and fetched.exists()
    flip_byte(fetched)
    with pytest.raises(CheckpointError, match="does not match its manifest"):
        store.install(fetched)
    assert store.entries() == [path]


def test_install_rejects_another_stage(tmp_path):
    _, _, fetched = write(StageCheckpoints(tmp_path / "peer", RUN, 0, keep=3), 30)
    with pytest.raises(CheckpointError, match="is for stage 0, not 1"):
        stage_store(tmp_path / "me").install(fetched)


def test_an_expert_checkpoint_lives_apart_and_never_loads_as_a_stage_or_another_expert(tmp_path):
    experts = StageCheckpoints(tmp_path, RUN, 1, keep=3, part="expert")
    manifest, _, path = write(experts, 30, num_stages=4)
    assert path == tmp_path / RUN / "expert1" / "step0000000030"
    assert manifest.part == "expert" and json.loads((path / "manifest.json").read_text())["part"] == "expert"
    assert_same(experts.load(path, state_hash=HASH)[2], state(30))
    with pytest.raises(CheckpointError, match="is of expert 1, not of a stage"):
        stage_store(tmp_path / "me").install(path)  # stage 1 of the same run: the index alone would match
    with pytest.raises(CheckpointError, match="is for expert 1, not 2"):
        StageCheckpoints(tmp_path / "me", RUN, 2, keep=3, part="expert").install(path)
    with pytest.raises(ValueError, match="part must be one of"):
        StageCheckpoints(tmp_path, RUN, 1, keep=3, part="experts")


def test_a_manifest_without_part_is_a_stages_and_a_bad_part_is_refused(tmp_path):
    _, _, path = write(stage_store(tmp_path), 30)
    fields = json.loads((path / "manifest.json").read_text())
    assert fields.pop("part") == "stage"
    older = json.dumps({"format": 1, "kind": "stage", **fields}).encode()  # as written before experts had any
    assert StageManifest.from_bytes(older).part == "stage"
    for bad in ("expert ", "", 1, None, True):
        with pytest.raises(CheckpointError, match="field 'part'"):
            StageManifest.from_bytes(json.dumps({"format": 1, "kind": "stage", **fields, "part": bad}).encode())
    with pytest.raises(CheckpointError, match="expert 4 is out of range for 4 experts"):
        StageManifest.from_bytes(json.dumps({"format": 1, "kind": "stage", **fields, "part": "expert",
                                             "stage": 4, "num_stages": 4}).encode())


def test_install_removes_a_staged_copy_that_does_not_verify(tmp_path):
    _, _, fetched = write(StageCheckpoints(tmp_path / "peer", RUN, 1, keep=3), 30)
    store = stage_store(tmp_path / "me")
    staged = store.new_temp_dir()
    for name in os.listdir(fetched):
        (staged / name).write_bytes((fetched / name).read_bytes())
    flip_byte(staged)
    with pytest.raises(CheckpointError, match="corrupted"):
        store.install(staged)
    assert not staged.exists() and store.entries() == []


def test_run_id_must_be_a_plain_name(tmp_path):
    with pytest.raises(ValueError, match="run id"):
        StageCheckpoints(tmp_path, "..", 0, keep=1)


def two_stages(tmp_path: Path, steps: tuple[int, int] = (12, 10)) -> dict[int, Path]:
    return {k: write(StageCheckpoints(tmp_path / f"server{k}", RUN, k, keep=3), step, seed=k)[2]
            for k, step in enumerate(steps)}


def test_run_checkpoint_round_trip(tmp_path):
    runs = RunCheckpoints(tmp_path / "coord", RUN, keep=2)
    run, mid, path = runs.write("run_id: tiny\n", HASH, two_stages(tmp_path))
    assert path.name == "step0000000010" and run.step == 10
    assert sorted(os.listdir(path)) == ["manifest.json", "stage0", "stage1"]
    assert mid == manifest_id((path / "manifest.json").read_bytes())
    (loaded, _, stages, experts), where = runs.newest_verified(HASH)
    assert (loaded, where) == (run, path) and RunManifest.from_bytes(run.to_bytes()) == run
    assert sorted(stages) == [0, 1] and experts == {} and run.experts == []
    for k in (0, 1):
        manifest, tensors = stages[k]
        assert (manifest.stage, manifest.step) == (k, (12, 10)[k])
        assert_same(tensors, state(k))
    assert find_run_ids(tmp_path / "coord") == [RUN]
    assert find_run_ids(tmp_path / "server0") == []


def test_run_checkpoint_with_a_tampered_stage_is_rejected(tmp_path, caplog):
    runs = RunCheckpoints(tmp_path / "coord", RUN, keep=2)
    good = runs.write("run_id: tiny\n", HASH, two_stages(tmp_path))[2]
    bad = runs.write("run_id: tiny\n", HASH, two_stages(tmp_path / "later", (22, 20)))[2]
    rewrite_manifest(bad / "stage1", group=3)  # the stage manifest is no longer the one the run recorded
    with pytest.raises(CheckpointError, match="is not the expected"):
        runs.load(bad)
    with caplog.at_level(logging.WARNING, logger="swarm.checkpoint.store"):
        assert runs.newest_verified(HASH)[1] == good
    assert str(bad) in caplog.text
    flip_byte(good / "stage0")
    with pytest.raises(CheckpointError, match="corrupted"):
        runs.load(good)
    assert runs.newest_verified(HASH) is None


def test_run_manifest_is_strict():
    entry = {"stage": 0, "step": 1, "manifest_sha256": "c" * 64, "dir": "stage0"}
    good = {"format": 1, "kind": "run", "run_id": RUN, "state_hash": HASH, "config_yaml": "", "created": 1.0,
            "stages": [entry]}
    assert RunManifest.from_bytes(json.dumps(good).encode()).step == 1
    for change, message in [
        ({"stages": [{**entry, "dir": "../stage0"}]}, "must live in dir 'stage0'"),
        ({"stages": [{**entry, "dir": "stage1"}]}, "must live in dir 'stage0'"),
        ({"stages": [entry, entry]}, "listed as 0, 1"),
        ({"stages": []}, "empty"),
        ({"kind": "stage"}, "expected 'run'"),
        ({"stages": [{**entry, "part": "expert", "dir": "expert0"}]}, "not a stage's"),
        ({"experts": [entry]}, "expert checkpoints listed by increasing index"),
        ({"experts": [{**entry, "part": "expert", "dir": "stage0"}]}, "must live in dir 'expert0'"),
        ({"experts": [{**entry, "part": "expert", "dir": "expert0"}] * 2}, "listed by increasing index"),
        ({"experts": [{**entry, "part": "experts", "dir": "experts0"}]}, "field 'part' must be one of"),
        ({"experts": {"0": entry}}, "'experts' must be a list"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            RunManifest.from_bytes(json.dumps({**good, **change}).encode())


def test_a_run_manifest_from_before_experts_reads_with_none():
    entry = {"stage": 0, "step": 1, "manifest_sha256": "c" * 64, "dir": "stage0"}  # no "part"
    old = {"format": 1, "kind": "run", "run_id": RUN, "state_hash": HASH, "config_yaml": "", "created": 1.0,
           "stages": [entry]}  # no "experts"
    run = RunManifest.from_bytes(json.dumps(old).encode())
    assert run.experts == [] and run.stages[0].part == "stage"


def test_a_run_checkpoint_holds_and_verifies_the_experts_that_have_checkpoints(tmp_path):
    experts = {e: write(StageCheckpoints(tmp_path / f"host{e}", RUN, e, keep=3, part="expert"), 40 + e,
                        seed=10 + e, num_stages=4)[2] for e in (0, 3)}  # experts 1 and 2 have none yet
    runs = RunCheckpoints(tmp_path / "coord", RUN, keep=2)
    run, _, path = runs.write("run_id: tiny\n", HASH, two_stages(tmp_path), experts)
    assert sorted(os.listdir(path)) == ["expert0", "expert3", "manifest.json", "stage0", "stage1"]
    assert [(e.part, e.stage, e.step, e.dir) for e in run.experts] == [("expert", 0, 40, "expert0"),
                                                                     ("expert", 3, 43, "expert3")]
    assert run.step == 10  # named by its stages, as before
    loaded = runs.load(path, HASH)
    assert loaded.manifest == run and sorted(loaded.experts) == [0, 3]
    assert_same(loaded.experts[3][1], state(13)) and loaded.experts[3][0].part == "expert"
    flip_byte(path / "expert3")
    with pytest.raises(CheckpointError, match="corrupted"):
        runs.load(path)
    with pytest.raises(CheckpointError, match="is of expert 0, not of a stage"):
        runs.write("", HASH, {0: experts[0], 1: two_stages(tmp_path / "b")[1]})
    with pytest.raises(CheckpointError, match="is for expert 3, not 1"):
        runs.write("", HASH, two_stages(tmp_path / "c"), {1: experts[3]})


def test_run_checkpoint_needs_every_stage_of_the_run(tmp_path):
    runs = RunCheckpoints(tmp_path / "coord", RUN, keep=2)
    stages = two_stages(tmp_path)
    with pytest.raises(CheckpointError, match="one checkpoint of each stage"):
        runs.write("", HASH, {1: stages[1]})
    with pytest.raises(CheckpointError, match="has state hash"):
        runs.write("", OTHER_HASH, stages)
    assert runs.entries() == [] and not any(runs.dir.iterdir())


def test_default_root_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_root() == tmp_path / "swarm" / "checkpoints"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_root() == Path.home() / ".cache" / "swarm" / "checkpoints"
