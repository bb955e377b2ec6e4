"""The coordinator's signature on the checkpoints it verified: what its archive and swarm-export take.

A checkpoint's manifest pins every file by sha256 (manifest.py, verify.py), so a signature over the
manifest's bytes signs the whole checkpoint. The coordinator signs a stage checkpoint once it fetched
and verified it, and a run checkpoint once it assembled it; a checkpoint directory that reached its
disk any other way (copied in, left by an older version, restored from a mirror) has no signature by
its key, and neither its archive nor swarm-export uses it.

The key is an RSA key kept at ``<root>/<run_id>/coordinator.key`` (0600), made on the archive's first
start. It is not the coordinator's libp2p identity: without ``--identity`` that changes every start,
and the archive must go on verifying what it signed before. People compare keys by
:func:`fingerprint`, 16 hex digits the coordinator logs at start.

``SIGNATURE`` (next to the manifest, JSON, at most 16 KiB) holds the signer's public key (DER, base64)
and an RSA-PSS signature over a domain-separated message naming the run, the kind of checkpoint
(``stage<k>`` or ``run``) and the manifest's sha256, so that a stage signature cannot pass as a run
one, nor one run's as another's. Checking needs only ``cryptography`` (swarm-export does not import
hivemind); making and using the key goes through hivemind's RSAPrivateKey, as the DHT records do.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from swarm.checkpoint.errors import CheckpointError
from swarm.checkpoint.manifest import manifest_id
from swarm.checkpoint.verify import SIGNATURE_NAME, read_manifest

KEY_NAME = "coordinator.key"
RUN_KIND = "run"
FORMAT = 1
MAX_SIGNATURE_BYTES = 16 * 1024
MAX_KEY_FILE_BYTES = 16 * 1024
MIN_KEY_BITS, MAX_KEY_BITS = 2048, 4096  # a bigger key only makes checking slower, for no one's benefit
FINGERPRINT_HEX = 16
_DOMAIN = b"swarm checkpoint signature v1\n"
# What --signer takes: the 16 hex digits people compare, or all 64 (what the coordinator also logs) where
# a 64-bit match is too little (a key made to share a given 16-digit fingerprint costs about 2**64 hashes).
_FINGERPRINT = re.compile(f"[0-9a-f]{{{FINGERPRINT_HEX}}}|[0-9a-f]{{64}}")
# As hivemind's RSAPrivateKey.sign (which makes them) and RSAPublicKey.verify
_PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class UnsignedCheckpoint(CheckpointError):
    """A checkpoint with no SIGNATURE at all (e.g. written by a version that did not sign), not a bad one."""


def stage_kind(stage: int) -> str:
    """What a stage checkpoint's signature says it is."""
    return part_kind("stage", stage)


def part_kind(part: str, index: int) -> str:
    """What the signature of a checkpoint of `part` ("stage" or "expert") `index` says it is."""
    return f"{part}{index}"


def key_path(root: Path, run_id: str) -> Path:
    """Where the coordinator of `run_id` keeps its checkpoint signing key under the checkpoint root."""
    return Path(root) / run_id / KEY_NAME


def load_or_create_key(path: Path) -> Any:
    """The signing key at `path` (a hivemind RSAPrivateKey), made (0600, never overwritten) if absent."""
    from hivemind.utils.crypto import RSAPrivateKey  # (only the coordinator signs: swarm-export stays light)

    from swarm.dht.errors import SwarmDHTError
    from swarm.dht.identity import create_private_file
    from swarm.hivemind_internals import private_key_from

    path = Path(path)
    for _ in range(2):  # a second pass reads what another process created between our read and our create
        if path.exists():
            return private_key_from(_load_private(path))
        key = RSAPrivateKey()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if create_private_file(path, key.to_bytes(), "checkpoint signing key"):
                return key
        except SwarmDHTError as e:
            raise CheckpointError(str(e)) from None
    raise CheckpointError(f"checkpoint signing key {path} appears and vanishes")


def load_public_key(path: Path) -> rsa.RSAPublicKey:
    """The public half of the signing key at `path` (what swarm-export checks against)."""
    return _load_private(Path(path)).public_key()


def fingerprint(public_key: rsa.RSAPublicKey) -> str:
    """A short name of a public key for people to compare: the first 16 hex digits of its DER's sha256."""
    return key_digest(public_key)[:FINGERPRINT_HEX]


def key_digest(public_key: rsa.RSAPublicKey) -> str:
    """The sha256 (64 hex digits) of a public key's DER, of which :func:`fingerprint` is the start."""
    return hashlib.sha256(_der(public_key)).hexdigest()


def is_fingerprint(text: str) -> bool:
    """Whether `text` names a key as `expect` may: its 16-digit fingerprint or its whole key_digest."""
    return _FINGERPRINT.fullmatch(text) is not None


def public_key_of(key: Any) -> rsa.RSAPublicKey:
    """The `cryptography` public key of a hivemind RSAPrivateKey."""
    return serialization.load_der_private_key(key.to_bytes(), password=None).public_key()


def sign_checkpoint(path: Path, key: Any, *, kind: str, run_id: str) -> str:
    """Write ``path/SIGNATURE`` for the checkpoint at `path` with `key` (hivemind's RSAPrivateKey).

    Atomic: written in a ``.tmp-*`` directory beside the checkpoint (same disk; a crashed write's is
    removed as stale by the store), then renamed into place. Returns the signer's fingerprint.
    """
    path = Path(path)
    data = read_manifest(path)
    public = public_key_of(key)
    signature = key.sign(_message(kind, run_id, manifest_id(data)))  # base64 already
    text = json.dumps({"format": FORMAT, "kind": kind, "run_id": run_id,
                       "public_key": base64.b64encode(_der(public)).decode(), "signature": signature.decode()},
                      sort_keys=True) + "\n"
    temp = path.parent / f".tmp-{secrets.token_hex(8)}"
    temp.mkdir()
    try:
        with open(temp / SIGNATURE_NAME, "xb") as f:
            f.write(text.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp / SIGNATURE_NAME, path / SIGNATURE_NAME)
        _fsync_dir(path)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return fingerprint(public)


def verify_signature(path: Path, *, kind: str, run_id: str, expect: rsa.RSAPublicKey | str) -> str:
    """Check that the checkpoint at `path` is signed as `kind` of `run_id` by `expect` (a public key, or its
    fingerprint or key_digest); the signer's fingerprint, or CheckpointError saying what is wrong. Files are
    not hashed: the signature covers the manifest, and verify.py checks the files against it."""
    path = Path(path)
    if isinstance(expect, str) and not is_fingerprint(expect):
        raise ValueError(f"a signer is named by {FINGERPRINT_HEX} or 64 lowercase hex digits, got {expect!r:.80}")
    fields = _read_signature(path / SIGNATURE_NAME)
    if fields["kind"] != kind or fields["run_id"] != run_id:
        raise CheckpointError(f"{path / SIGNATURE_NAME} signs a {fields['kind']!r:.40} checkpoint of run "
                              f"{fields['run_id']!r:.80}, not a {kind!r} checkpoint of run {run_id!r}")
    public = _public_key(fields["public_key"], path / SIGNATURE_NAME)
    signer = fingerprint(public)
    if isinstance(expect, str):
        wanted, matches = expect, key_digest(public).startswith(expect)
    else:  # the whole key, not a prefix of its hash
        wanted, matches = fingerprint(expect), _der(public) == _der(expect)
    if not matches:
        raise CheckpointError(f"checkpoint {path} is signed by {signer}, not by the coordinator ({wanted})")
    try:
        signature = base64.b64decode(fields["signature"], validate=True)
        public.verify(signature, _message(kind, run_id, manifest_id(read_manifest(path))), _PADDING, hashes.SHA256())
    except (binascii.Error, ValueError, InvalidSignature):
        raise CheckpointError(f"{path / SIGNATURE_NAME}: the signature does not match the checkpoint's manifest "
                              "(changed after it was signed, or signed for another checkpoint)") from None
    return signer


def _message(kind: str, run_id: str, mid: str) -> bytes:
    return _DOMAIN + f"run {run_id}\nkind {kind}\nmanifest {mid}\n".encode()


def _read_signature(file: Path) -> dict[str, str]:
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise UnsignedCheckpoint(f"checkpoint {file.parent} is not signed (no {SIGNATURE_NAME})") from None
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {e.strerror}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_SIGNATURE_BYTES + 1)
    except OSError as e:  # a directory (EISDIR) among others
        raise CheckpointError(f"{file} cannot be read: {e.strerror}") from None
    if len(data) > MAX_SIGNATURE_BYTES:
        raise CheckpointError(f"{file} is larger than the {MAX_SIGNATURE_BYTES} bytes a signature may have")
    try:
        fields = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise CheckpointError(f"{file} is not a signature (not JSON)") from None
    if not isinstance(fields, dict) or fields.get("format") != FORMAT or type(fields["format"]) is not int:
        raise CheckpointError(f"{file} is not a signature of format {FORMAT}")
    for name in ("kind", "run_id", "public_key", "signature"):
        if type(fields.get(name)) is not str:
            raise CheckpointError(f"{file}: field {name!r} must be a string")
    return fields


def _public_key(text: str, file: Path) -> rsa.RSAPublicKey:
    try:
        key = serialization.load_der_public_key(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError, UnsupportedAlgorithm):
        raise CheckpointError(f"{file}: the public key is not a DER public key") from None
    if not isinstance(key, rsa.RSAPublicKey) or not MIN_KEY_BITS <= key.key_size <= MAX_KEY_BITS:
        raise CheckpointError(f"{file}: the public key is not an RSA key of {MIN_KEY_BITS}-{MAX_KEY_BITS} bits")
    return key


def _load_private(path: Path) -> rsa.RSAPrivateKey:
    corrupt = (f"checkpoint signing key {path} is corrupt: restore it from a backup, or delete it to sign with "
               "a new key (what the old one signed then no longer counts as the coordinator's)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint signing key {path}: {e.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise CheckpointError(corrupt)
    try:
        key = serialization.load_der_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise CheckpointError(corrupt) from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise CheckpointError(corrupt)
    return key


def _der(public_key: rsa.RSAPublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
