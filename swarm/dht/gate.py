"""A private swarm's RPCs answer only callers that prove they hold the swarm key.

libp2p's identify protocol lists every handler a peer serves to anyone who dials it, and the
bundled p2pd has no pre-shared-key option, so a stranger can name and call every handler of a
private swarm's peers. Here every call of a process with the gate installed carries a proof, and
every call it serves is checked against one before the handler reads a byte.

The proof for a call from peer A to peer B is ``HMAC-SHA256(rpc_key, b"swarm-rpc:" + A + B)`` over
their peer ids' bytes (``SwarmKey.rpc_key``). libp2p authenticates both peer ids and encrypts the
stream, so nobody else sees a proof, and a proof is good only from A's key toward B: replayed by
anyone else, or toward anyone else, it fails. Cost: one HMAC per pair (cached), 32 bytes per call.

Where it sits: every RPC of hivemind 1.1.12's P2P goes through four methods, stream handlers
(which protobuf stream handlers are built on) and unary ones (swarm.hivemind_internals.P2P_RPC_METHODS).
``install`` replaces them, once per process, with versions that call hivemind's own and add or
check the proof while a gate is installed, and change nothing while none is (a public swarm):
- a stream's caller writes the proof as soon as the stream opens; the callee reads exactly 32 bytes
  within PROOF_TIMEOUT and closes the stream unless they are the proof;
- a unary call's request bytes start with the proof; the callee refuses a call without it with
  an error that says so (GateRefused).
The gate is process-wide and read at each call: hivemind's DHT and averaging processes are forked,
so a program that installs it before starting them gates every P2P it has.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from hivemind.p2p import P2P, P2PContext, PeerID

from swarm.hivemind_internals import wrap_p2p_rpc_methods

if TYPE_CHECKING:
    from swarm.dht.private import SwarmKey

log = logging.getLogger(__name__)

PROOF_BYTES = 32  # one SHA-256 HMAC
PROOF_TIMEOUT = 5.0  # a stream's caller sends its proof at once: a stream silent this long is closed
MAX_CACHED_PROOFS = 4096  # (caller, callee) pairs whose proof is kept; a peer talks to far fewer at once
MAX_LOGGED_REFUSALS = 1024  # peers whose refusal was logged (each once); past this, refusals go to debug
REFUSED = "this peer serves a private swarm: the call carried no valid proof of the swarm key"
_DOMAIN = b"swarm-rpc:"


class GateRefused(PermissionError):
    """A unary call without a valid proof of the swarm key (the caller sees its message)."""


class RpcGate:
    """Proofs of one swarm key, per ordered (caller, callee) pair of peer ids."""

    def __init__(self, swarm_key: SwarmKey):
        self._key = swarm_key.rpc_key()
        self._proofs: OrderedDict[tuple[bytes, bytes], bytes] = OrderedDict()
        self._logged: set[str] = set()

    def proof(self, caller: PeerID, callee: PeerID) -> bytes:
        """The proof a call from `caller` to `callee` carries."""
        pair = (caller.to_bytes(), callee.to_bytes())
        found = self._proofs.get(pair)
        if found is None:
            found = hmac.new(self._key, _DOMAIN + pair[0] + pair[1], hashlib.sha256).digest()
            self._proofs[pair] = found
            if len(self._proofs) > MAX_CACHED_PROOFS:
                self._proofs.popitem(last=False)
        return found

    def admits(self, proof: bytes, caller: PeerID, callee: PeerID) -> bool:
        """Whether `proof` is the one `caller` owes `callee`; a refusal is logged once per caller."""
        if hmac.compare_digest(proof, self.proof(caller, callee)):
            return True
        name = caller.to_base58()
        first = name not in self._logged and len(self._logged) < MAX_LOGGED_REFUSALS
        if first:
            self._logged.add(name)
        log.log(logging.WARNING if first else logging.DEBUG,
                "refused calls from peer %s: they carry no valid proof of the swarm key (a stranger, or a peer "
                "started without this swarm's --swarm-key)", name)
        return False


_gate: RpcGate | None = None
_hivemind: dict[str, Any] = {}  # hivemind's own methods by role, replaced on P2P by install()


def install(swarm_key: SwarmKey) -> RpcGate:
    """Gate every RPC of this process (and of the processes it forks from now on) with `swarm_key`."""
    global _gate
    _patch()
    _gate = RpcGate(swarm_key)
    return _gate


def uninstall() -> None:
    """Calls and handlers of this process carry and ask for no proof any more (tests)."""
    global _gate
    _gate = None


def installed() -> RpcGate | None:
    return _gate


def _patch() -> None:
    if _hivemind:
        return
    _hivemind.update(wrap_p2p_rpc_methods({"add_stream": _add_stream, "call_stream": _call_stream,
                                           "add_unary": _add_unary, "call_unary": _call_unary}))


# --- the four methods, gated ----------------------------------------------------------------------

async def _add_stream(self: P2P, name: str, handler: Any, balanced: bool = False) -> None:
    async def checked(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gate = _gate
        if gate is not None:
            try:
                proof = await asyncio.wait_for(reader.readexactly(PROOF_BYTES), PROOF_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                proof = b""
            if not gate.admits(proof, stream_info.peer_id, self.peer_id):
                writer.close()
                return
        await handler(stream_info, reader, writer)

    await _hivemind["add_stream"](self, name, checked, balanced)


async def _call_stream(self: P2P, peer_id: PeerID, handler_name: str) -> tuple:
    stream_info, reader, writer = await _hivemind["call_stream"](self, peer_id, handler_name)
    gate = _gate
    if gate is not None:
        writer.write(gate.proof(self.peer_id, peer_id))
        await writer.drain()
    return stream_info, reader, writer


async def _add_unary(self: P2P, handle_name: str, handler: Any, input_protobuf_type: Any,
                     balanced: bool = False) -> None:
    async def checked(request: _Unparsed, context: P2PContext) -> Any:
        data, gate = request.data, _gate
        if gate is not None:
            if not gate.admits(data[:PROOF_BYTES], context.remote_id, context.local_id):
                raise GateRefused(REFUSED)
            data = data[PROOF_BYTES:]
        return await handler(input_protobuf_type.FromString(data), context)

    # hivemind parses the request before calling the handler: it gets the bytes as they came, checked here first
    await _hivemind["add_unary"](self, handle_name, checked, _Unparsed, balanced)


async def _call_unary(self: P2P, peer_id: PeerID, handle_name: str, input: Any, output_protobuf_type: Any) -> Any:
    gate = _gate
    if gate is not None:
        input = _Proven(gate.proof(self.peer_id, peer_id), input)
    return await _hivemind["call_unary"](self, peer_id, handle_name, input, output_protobuf_type)


class _Unparsed:
    """A unary request's bytes, in the place of hivemind's parsed protobuf."""

    def __init__(self, data: bytes):
        self.data = data

    @classmethod
    def FromString(cls, data: bytes) -> _Unparsed:  # noqa: N802 - the name hivemind calls
        return cls(data)


class _Proven:
    """A unary request that serializes with its proof in front."""

    def __init__(self, proof: bytes, message: Any):
        self.proof, self.message = proof, message

    def SerializeToString(self) -> bytes:  # noqa: N802 - the name hivemind calls
        return self.proof + self.message.SerializeToString()
