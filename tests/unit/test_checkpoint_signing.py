"""The coordinator's checkpoint signatures: what verifies, and each way one is refused with a clear CheckpointError."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.signing import (
    MAX_SIGNATURE_BYTES,
    RUN_KIND,
    UnsignedCheckpoint,
    fingerprint,
    key_digest,
    key_path,
    load_or_create_key,
    load_public_key,
    public_key_of,
    sign_checkpoint,
    stage_kind,
    verify_signature,
)
from swarm.checkpoint.store import RunCheckpoints, StageCheckpoints
from swarm.checkpoint.verify import SIGNATURE_NAME, check_stage, verify_run

pytestmark = pytest.mark.timeout(60)

RUN = "signed"
STATE_HASH = "ab" * 32


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory):
    """Two coordinators' keys: (ours, another's)."""
    root = tmp_path_factory.mktemp("keys")
    return load_or_create_key(key_path(root / "a", RUN)), load_or_create_key(key_path(root / "b", RUN))


def stage_checkpoint(root: Path, stage: int = 0, step: int = 3) -> Path:
    store = StageCheckpoints(root, RUN, stage, keep=5)
    return store.write({"w": torch.full((4,), float(step))}, step=step, num_stages=2, state_hash=STATE_HASH,
                       round_id="r", group=1)[2]


def run_checkpoint(root: Path) -> Path:
    stages = {k: stage_checkpoint(root, k) for k in range(2)}
    return RunCheckpoints(root, RUN, keep=5).write("run_id: signed\n", STATE_HASH, stages)[2]


def test_sign_and_verify_round_trip(keys, tmp_path: Path):
    ours, _ = keys
    public = public_key_of(ours)
    stage = stage_checkpoint(tmp_path)
    signer = sign_checkpoint(stage, ours, kind=stage_kind(0), run_id=RUN)
    assert signer == fingerprint(public) and len(signer) == 16
    for expect in (public, signer, key_digest(public)):
        assert verify_signature(stage, kind=stage_kind(0), run_id=RUN, expect=expect) == signer
    # SIGNATURE sits beside the manifest: the checkpoint still verifies, and is still placed atomically
    check_stage(stage, run_id=RUN, stage=0, state_hash=STATE_HASH)
    assert sorted(os.listdir(stage)) == [SIGNATURE_NAME, "manifest.json", "state.safetensors"]
    assert not list(stage.parent.glob(".tmp-*"))

    run = run_checkpoint(tmp_path)
    sign_checkpoint(run, ours, kind=RUN_KIND, run_id=RUN)
    assert verify_signature(run, kind=RUN_KIND, run_id=RUN, expect=public) == signer
    verify_run(run, run_id=RUN, state_hash=STATE_HASH, read_state=True)
    # a run checkpoint made from signed stage checkpoints copies only what their manifests list
    assert not (run / "stage0" / SIGNATURE_NAME).exists()


def test_a_changed_manifest_is_refused(keys, tmp_path: Path):
    ours, _ = keys
    stage = stage_checkpoint(tmp_path)
    sign_checkpoint(stage, ours, kind=stage_kind(0), run_id=RUN)
    manifest = stage / "manifest.json"
    data = manifest.read_bytes()
    manifest.write_bytes(data.replace(b'"step": 3', b'"step": 4'))  # one byte: still a valid manifest
    with pytest.raises(CheckpointError, match="the signature does not match the checkpoint's manifest"):
        verify_signature(stage, kind=stage_kind(0), run_id=RUN, expect=public_key_of(ours))


def test_another_keys_signature_is_refused(keys, tmp_path: Path):
    ours, theirs = keys
    stage = stage_checkpoint(tmp_path)
    sign_checkpoint(stage, theirs, kind=stage_kind(0), run_id=RUN)
    mine, other = fingerprint(public_key_of(ours)), fingerprint(public_key_of(theirs))
    for expect in (public_key_of(ours), mine, key_digest(public_key_of(ours))):
        with pytest.raises(CheckpointError, match=f"is signed by {other}, not by the coordinator \\({mine}"):
            verify_signature(stage, kind=stage_kind(0), run_id=RUN, expect=expect)
    # Their key inside our SIGNATURE, with our signature bytes: the key check refuses it before the signature.
    sign_checkpoint(stage, ours, kind=stage_kind(0), run_id=RUN)
    fields = json.loads((stage / SIGNATURE_NAME).read_bytes())
    sign_checkpoint(stage, theirs, kind=stage_kind(0), run_id=RUN)
    mixed = json.loads((stage / SIGNATURE_NAME).read_bytes()) | {"signature": fields["signature"]}
    (stage / SIGNATURE_NAME).write_text(json.dumps(mixed))
    with pytest.raises(CheckpointError, match="the signature does not match"):
        verify_signature(stage, kind=stage_kind(0), run_id=RUN, expect=other)


def test_a_signature_is_for_one_kind_and_run(keys, tmp_path: Path):
    ours, _ = keys
    public = public_key_of(ours)
    stage = stage_checkpoint(tmp_path)
    sign_checkpoint(stage, ours, kind=stage_kind(0), run_id=RUN)
    with pytest.raises(CheckpointError, match=r"signs a 'stage0' checkpoint of run 'signed', not a 'run' checkpoint"):
        verify_signature(stage, kind=RUN_KIND, run_id=RUN, expect=public)
    with pytest.raises(CheckpointError, match=r"not a 'stage1' checkpoint"):
        verify_signature(stage, kind=stage_kind(1), run_id=RUN, expect=public)
    with pytest.raises(CheckpointError, match=r"of run 'signed', not a 'stage0' checkpoint of run 'other'"):
        verify_signature(stage, kind=stage_kind(0), run_id="other", expect=public)
    # Its labels rewritten to pass as a run signature: the signature itself says no.
    fields = json.loads((stage / SIGNATURE_NAME).read_bytes()) | {"kind": RUN_KIND}
    (stage / SIGNATURE_NAME).write_text(json.dumps(fields))
    with pytest.raises(CheckpointError, match="the signature does not match"):
        verify_signature(stage, kind=RUN_KIND, run_id=RUN, expect=public)


@pytest.mark.parametrize("damage, message", [
    ("missing", r"is not signed \(no SIGNATURE\)"),
    ("empty", r"is not a signature \(not JSON\)"),
    ("truncated", r"is not a signature \(not JSON\)"),
    ("oversized", rf"larger than the {MAX_SIGNATURE_BYTES} bytes"),
    ("garbage", r"is not a signature \(not JSON\)"),
    ("list", r"is not a signature of format 1"),
    ("format", r"is not a signature of format 1"),
    ("field", r"field 'signature' must be a string"),
    ("key", r"the public key is not a DER public key"),
    ("small key", r"the public key is not an RSA key of 2048-4096 bits"),
    ("base64", r"the signature does not match"),
    ("directory", r"SIGNATURE cannot be read"),
    ("symlink", r"SIGNATURE cannot be read"),
])
def test_a_broken_signature_file_is_refused(keys, tmp_path: Path, damage: str, message: str):
    ours, _ = keys
    stage = stage_checkpoint(tmp_path)
    sign_checkpoint(stage, ours, kind=stage_kind(0), run_id=RUN)
    file = stage / SIGNATURE_NAME
    good = file.read_bytes()
    fields = json.loads(good)
    if damage in ("missing", "directory", "symlink"):
        file.unlink()
        if damage == "directory":
            file.mkdir()
        elif damage == "symlink":
            (tmp_path / "elsewhere").write_bytes(good)
            file.symlink_to(tmp_path / "elsewhere")
    else:
        weak = rsa.generate_private_key(public_exponent=65537, key_size=1024).public_key()  # cheap to break
        small = base64.b64encode(weak.public_bytes(serialization.Encoding.DER,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo)).decode()
        file.write_bytes({
            "empty": b"",
            "truncated": good[: len(good) // 2],
            "oversized": b" " * MAX_SIGNATURE_BYTES + good,
            "garbage": os.urandom(512),
            "list": b"[1, 2]",
            "format": json.dumps(fields | {"format": True}).encode(),
            "field": json.dumps(fields | {"signature": 7}).encode(),
            "key": json.dumps(fields | {"public_key": base64.b64encode(b"not a key").decode()}).encode(),
            "small key": json.dumps(fields | {"public_key": small}).encode(),
            "base64": json.dumps(fields | {"signature": "!!" + fields["signature"]}).encode(),
        }[damage])
    with pytest.raises(CheckpointError, match=message) as raised:
        verify_signature(stage, kind=stage_kind(0), run_id=RUN, expect=public_key_of(ours))
    assert isinstance(raised.value, UnsignedCheckpoint) == (damage == "missing")


def test_the_key_file_is_private_and_reused(tmp_path: Path):
    path = key_path(tmp_path, RUN)
    key = load_or_create_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_key(path)
    assert key_digest(public_key_of(again)) == key_digest(public_key_of(key)) == key_digest(load_public_key(path))
    stage = stage_checkpoint(tmp_path)
    sign_checkpoint(stage, key, kind=stage_kind(0), run_id=RUN)
    assert verify_signature(stage, kind=stage_kind(0), run_id=RUN, expect=load_public_key(path))

    path.write_bytes(b"not a key")
    with pytest.raises(CheckpointError, match=r"coordinator.key is corrupt: restore it from a backup, or delete it"):
        load_or_create_key(path)
    assert path.read_bytes() == b"not a key"  # never overwritten
    with pytest.raises(ValueError, match="a signer is named by 16 or 64 lowercase hex digits"):
        verify_signature(stage, kind=stage_kind(0), run_id=RUN, expect="ABC")
