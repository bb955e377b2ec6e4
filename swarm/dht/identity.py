"""Who a peer is: one RSA key, which is both its libp2p identity (peer id) and the key signing its DHT records.

Using one key for both binds every record to the peer that wrote it: a record's owner marker holds
the public key, the peer id is a hash of that same key, so a reader (and every DHT node storing the
record) checks that a record claiming ``peer_id: X`` was signed by X itself (keys.RunRecordGuard).

A persistent identity is one file at ``path``: a libp2p private key (protobuf, as hivemind's P2P
writes it), created on first use with mode 0600. Identities of older versions also kept a separate
record-signing key at ``path + ".rsa"``; it is no longer used. Without a path, the identity is
throwaway: a fresh key (and peer id) each start, handed to the libp2p daemon through a temporary file
that is removed as soon as the daemon has read it (see node.start_dht).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.dht.errors import SwarmDHTError
from swarm.dht.keys import owner_key, peer_id_of_public_key
from swarm.hivemind_internals import private_key_from

log = logging.getLogger(__name__)

LEGACY_SIGNING_KEY_SUFFIX = ".rsa"  # where versions before 0.12 kept a second key, for records only


@dataclass(frozen=True)
class Identity:
    """A peer's key. ``libp2p_path`` is None for a throwaway identity (a fresh peer id each start)."""

    signing_key: RSAPrivateKey = field(repr=False)
    libp2p_path: str | None = None

    @property
    def owner_key(self) -> bytes:
        """Owner marker (``[owner:ssh-rsa ...]``) under which this peer writes its DHT records."""
        return owner_key(self.signing_key)

    @property
    def peer_id(self) -> str:
        """The libp2p peer id (base58) of this key: what other peers see as this peer."""
        return peer_id_of_public_key(self.signing_key.get_public_key())

    def libp2p_key_bytes(self) -> bytes:
        """The key as a libp2p identity file holds it (what the daemon's ``-id`` flag reads)."""
        message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=self.signing_key.to_bytes())
        return message.SerializeToString()


def load_identity(path: str | os.PathLike | None) -> Identity:
    """Load (or create on first use) the identity stored at `path`; without a path, a fresh one."""
    if path is None:
        return Identity(RSAPrivateKey())
    path = str(path)
    if not Path(path).parent.is_dir():
        raise SwarmDHTError(f"cannot keep an identity at {path}: directory {Path(path).parent} does not exist")
    if os.path.isfile(path + LEGACY_SIGNING_KEY_SUFFIX):
        log.info("%s%s is no longer used: records are now signed with the libp2p key in %s, which binds them "
                 "to this peer's id", path, LEGACY_SIGNING_KEY_SUFFIX, path)
    return Identity(_load_or_create(path), libp2p_path=path)


def _load_or_create(path: str) -> RSAPrivateKey:
    try:
        with open(path, "rb") as file:
            return _key_from_libp2p_identity(file.read(), path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise SwarmDHTError(f"cannot read libp2p identity {path}: {e.strerror}") from None
    identity = Identity(RSAPrivateKey())
    if not create_private_file(path, identity.libp2p_key_bytes(), "libp2p identity"):
        return _load_or_create(path)  # another peer started with this path just wrote it
    return identity.signing_key


def create_private_file(path: str | os.PathLike, data: bytes, what: str) -> bool:
    """Write a secret to a new file only its owner reads (0600); False if the file exists already.

    O_EXCL: two peers started at once with the same path must not overwrite each other's secret.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError as e:
        raise SwarmDHTError(f"cannot create {what} {path}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return True


def _key_from_libp2p_identity(data: bytes, path: str) -> RSAPrivateKey:
    corrupt = SwarmDHTError(
        f"libp2p identity {path} is corrupt; restore it from a backup or delete it to start as a new peer")
    try:
        message = crypto_pb2.PrivateKey.FromString(data)
    except Exception:  # protobuf raises DecodeError, and worse on some garbage
        raise corrupt from None
    if message.key_type != crypto_pb2.KeyType.RSA:
        raise SwarmDHTError(
            f"libp2p identity {path} holds a {crypto_pb2.KeyType.Name(message.key_type)} key; swarm signs its "
            "records with the identity's key and needs RSA: delete the file to start as a new peer")
    try:
        loaded = serialization.load_der_private_key(message.data, password=None)
    except (ValueError, TypeError):
        raise corrupt from None
    if not isinstance(loaded, rsa.RSAPrivateKey):
        raise corrupt
    return private_key_from(loaded)
