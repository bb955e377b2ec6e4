"""Who a peer is: its libp2p identity (peer id) and the RSA key that signs its DHT records.

A persistent identity is two files: the libp2p private key at ``path`` (hivemind's P2P writes it on
first use) and the record-signing key at ``path + ".rsa"`` (DER, mode 0600). Keeping both lets a
restarted peer keep its peer id and keep owning the DHT records it wrote before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

from swarm.dht.errors import SwarmDHTError
from swarm.dht.keys import owner_key
from swarm.hivemind_internals import private_key_from

SIGNING_KEY_SUFFIX = ".rsa"


@dataclass(frozen=True)
class Identity:
    """A peer's keys. ``libp2p_path`` is None for a throwaway identity (a fresh peer id each start)."""

    signing_key: RSAPrivateKey = field(repr=False)
    libp2p_path: str | None = None

    @property
    def owner_key(self) -> bytes:
        """Owner marker (``[owner:ssh-rsa ...]``) under which this peer writes its DHT records."""
        return owner_key(self.signing_key)


def load_identity(path: str | os.PathLike | None) -> Identity:
    """Load (or create on first use) the identity stored at `path`; without a path, a fresh one."""
    if path is None:
        return Identity(RSAPrivateKey())
    path = str(path)
    if not Path(path).parent.is_dir():
        raise SwarmDHTError(f"cannot keep an identity at {path}: directory {Path(path).parent} does not exist")
    if os.path.isfile(path):
        _check_libp2p_identity(path)  # else p2pd fails later with an error that does not name the file
    return Identity(_load_or_create_signing_key(path + SIGNING_KEY_SUFFIX), libp2p_path=path)


def _check_libp2p_identity(path: str) -> None:
    try:
        with open(path, "rb") as file:
            PeerID.from_identity(file.read())
    except OSError as e:
        raise SwarmDHTError(f"cannot read libp2p identity {path}: {e.strerror}") from None
    except Exception:  # protobuf and key parsing raise various types
        raise SwarmDHTError(
            f"libp2p identity {path} is corrupt; restore it from a backup or delete it to start as a new peer"
        ) from None


def _load_or_create_signing_key(key_path: str) -> RSAPrivateKey:
    try:
        with open(key_path, "rb") as file:
            return _signing_key_from_der(file.read(), key_path)
    except FileNotFoundError:
        pass
    key = RSAPrivateKey()
    try:
        # O_EXCL: two peers started at once with the same path must not overwrite each other's key
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _load_or_create_signing_key(key_path)
    except OSError as e:
        raise SwarmDHTError(f"cannot create signing key {key_path}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as file:
        file.write(key.to_bytes())
    return key


def _signing_key_from_der(der: bytes, key_path: str) -> RSAPrivateKey:
    try:
        loaded = serialization.load_der_private_key(der, password=None)
    except (ValueError, TypeError):
        raise SwarmDHTError(
            f"signing key {key_path} is not a valid DER RSA private key; "
            "restore it from a backup or delete it to start as a new peer"
        ) from None
    if not isinstance(loaded, rsa.RSAPrivateKey):
        raise SwarmDHTError(f"signing key {key_path} holds a {type(loaded).__name__}, not an RSA key")
    return private_key_from(loaded)
