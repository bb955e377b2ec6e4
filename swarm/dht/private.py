"""Private swarms: a shared secret (the swarm key) that peers without it cannot join a run with.

The libp2p daemon bundled with hivemind has no pre-shared-key option, so a stranger can still dial
a private swarm's peers. The key keeps it out all the same:

- every RPC a peer of a private swarm serves (the DHT's, run_info, stages, checkpoints, averaging,
  expert state) answers only callers that prove they hold the key: a 32-byte HMAC under `rpc_key`
  of the caller's and the callee's peer ids, checked before the handler reads a byte
  (swarm.dht.gate). A stranger cannot even be a node of the swarm's DHT.

In depth, should the key's RPC proofs ever be bypassed, what a stranger could see is named so it
learns nothing from it:

- the run's network id is ``{run_id}-{tag}``, with a tag of 24 hex digits derived from the key:
  every DHT key of the run (config, servers, metrics, checkpoints, averaging progress), every
  stage's RPC namespace and every averaging group key and handler is named from it, so a stranger
  can neither find the run's records, nor call its servers, nor match into its averaging groups;
- the ``run_info`` RPC that tells a newcomer which run an initial peer serves answers under a name
  derived from the key, and its answer is sealed: libp2p's identify protocol lists every handler
  name a peer serves to whoever dials it, so the name alone keeps nobody out;
- the run config is sealed (AES-256-GCM under a key derived from the swarm key) in its DHT record,
  and the record names the run as SEALED_RUN_ID rather than by its network id, so a DHT node that
  happens to store it learns neither.

A swarm key file holds 64 hex digits (32 random bytes); `swarm-coordinator --swarm-key FILE` creates
it if missing, and volunteers start with a copy.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from swarm.dht.errors import SwarmDHTError
from swarm.dht.identity import create_private_file

KEY_BYTES = 32
TAG_HEX = 24  # 96 bits of the network id a stranger would have to guess
SEALED_PREFIX = "sealed:v1:"  # a sealed value: this prefix, then base64 of nonce + ciphertext
SEALED_RUN_ID = "sealed"  # what a private swarm's config record says its run is: the run id is inside the seal
_NONCE_BYTES = 12
_KEY_FILE = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class SwarmKey:
    """The secret of a private swarm (see the module docstring)."""

    secret: bytes = field(repr=False)

    def _derive(self, purpose: str) -> bytes:
        return hmac.new(self.secret, f"swarm-key:{purpose}".encode(), hashlib.sha256).digest()

    def network_id(self, run_id: str) -> str:
        """The id the run goes by on the network: its records, RPCs and averaging are named from it."""
        return f"{run_id}-{self._derive(f'network:{run_id}').hex()[:TAG_HEX]}"

    def rpc_key(self) -> bytes:
        """The key of the proofs a private swarm's RPCs carry (swarm.dht.gate)."""
        return self._derive("rpc")

    def run_info_namespace(self) -> str:
        """The P2P namespace under which peers of this swarm answer run_info."""
        return f"swarm-{self._derive('run-info').hex()[:TAG_HEX]}"

    def seal(self, text: str) -> str:
        """`text` encrypted and authenticated, as a string for a DHT record."""
        nonce = os.urandom(_NONCE_BYTES)
        sealed = AESGCM(self._derive("seal")).encrypt(nonce, text.encode(), None)
        return SEALED_PREFIX + base64.b64encode(nonce + sealed).decode()

    def open(self, sealed: str) -> str:
        """The text `seal` sealed; ValueError if `sealed` was not sealed by this key, or was changed."""
        if not sealed.startswith(SEALED_PREFIX):
            raise ValueError("it is not sealed")
        try:
            blob = base64.b64decode(sealed[len(SEALED_PREFIX):], validate=True)
            return AESGCM(self._derive("seal")).decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:], None).decode()
        except (ValueError, InvalidTag, UnicodeDecodeError):
            raise ValueError("it was sealed with another swarm key, or changed") from None


    def seal_bytes(self, data: bytes, purpose: str) -> bytes:
        """`data` encrypted and authenticated for one `purpose` (it opens for that purpose only)."""
        nonce = os.urandom(_NONCE_BYTES)
        return SEALED_PREFIX.encode() + nonce + AESGCM(self._derive("seal")).encrypt(nonce, data, purpose.encode())

    def open_bytes(self, sealed: bytes, purpose: str) -> bytes:
        """The bytes `seal_bytes` sealed for `purpose`; ValueError if not sealed by this key for it, or changed."""
        prefix = SEALED_PREFIX.encode()
        if not sealed.startswith(prefix):
            raise ValueError("it is not sealed")
        blob = sealed[len(prefix):]
        try:
            return AESGCM(self._derive("seal")).decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:], purpose.encode())
        except (ValueError, InvalidTag):
            raise ValueError("it was sealed with another swarm key, or changed") from None


def is_sealed(text: str) -> bool:
    return text.startswith(SEALED_PREFIX)


def load_swarm_key(path: str | os.PathLike, create: bool = False) -> SwarmKey:
    """The swarm key in the file at `path`; with `create`, a new one is written there (mode 0600) if it is missing."""
    path = Path(path).expanduser()
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        if not create:
            raise SwarmDHTError(f"swarm key {path} does not exist: ask the run's coordinator for a copy") from None
        return _create(path)
    except (OSError, UnicodeDecodeError) as e:
        raise SwarmDHTError(f"cannot read swarm key {path}: {e}") from None
    if not _KEY_FILE.fullmatch(text):
        raise SwarmDHTError(f"swarm key {path} must hold 64 hex digits (32 bytes), as swarm-coordinator writes it")
    return SwarmKey(bytes.fromhex(text))


def _create(path: Path) -> SwarmKey:
    secret = secrets.token_bytes(KEY_BYTES)
    if not create_private_file(path, (secret.hex() + "\n").encode(), "swarm key"):
        return load_swarm_key(path)  # written meanwhile by another process
    return SwarmKey(secret)
