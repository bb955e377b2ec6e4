"""swarm.dht.gate: proofs of the swarm key per ordered pair of peers, and hivemind's four RPC methods,
gated while a gate is installed and exactly hivemind's while none is. A fake p2pd client stands in for the
daemon (tests/integration/test_private_swarm.py runs the real thing)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import logging
from types import SimpleNamespace

import pytest
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

from swarm.dht import gate
from swarm.dht.private import SwarmKey
from swarm.hivemind_internals import P2P_RPC_METHODS

pytestmark = pytest.mark.timeout(30)

KEY, OTHER = SwarmKey(b"k" * 32), SwarmKey(b"o" * 32)
A, B, C = (PeerID(bytes([0, 3]) + name) for name in (b"AAA", b"BBB", b"CCC"))
REQUEST = runtime_pb2.ExpertInfo(serialized_info=b"request")
REPLY = runtime_pb2.ExpertInfo(serialized_info=b"reply")


@pytest.fixture(autouse=True)
def no_gate():
    gate.uninstall()
    yield
    gate.uninstall()


def test_a_proof_is_the_keys_hmac_of_the_ordered_pair():
    proofs = gate.RpcGate(KEY)
    expected = hmac.new(KEY.rpc_key(), b"swarm-rpc:" + A.to_bytes() + B.to_bytes(), hashlib.sha256).digest()
    assert proofs.proof(A, B) == expected and len(expected) == gate.PROOF_BYTES
    others = {proofs.proof(B, A), proofs.proof(A, C), proofs.proof(C, B), gate.RpcGate(OTHER).proof(A, B)}
    assert expected not in others and len(others) == 4
    assert KEY.rpc_key() not in {KEY._derive("seal"), OTHER.rpc_key()}  # its own purpose, its own key


def test_only_the_pairs_proof_is_admitted_and_a_refused_peer_is_logged_once(caplog):
    proofs = gate.RpcGate(KEY)
    assert proofs.admits(proofs.proof(A, B), A, B)
    with caplog.at_level(logging.DEBUG, logger=gate.__name__):
        for proof in (b"", proofs.proof(A, B)[:31], proofs.proof(B, A), proofs.proof(A, C),
                      gate.RpcGate(OTHER).proof(A, B)):
            assert not proofs.admits(proof, A, B)
        assert not proofs.admits(b"", C, B)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [A.to_base58() in m for m in warned] == [True, False] and C.to_base58() in warned[1]


def test_proofs_and_logged_refusals_stay_bounded(monkeypatch):
    monkeypatch.setattr(gate, "MAX_CACHED_PROOFS", 4)
    monkeypatch.setattr(gate, "MAX_LOGGED_REFUSALS", 3)
    proofs = gate.RpcGate(KEY)
    peers = [PeerID(bytes([0, 2, n, n])) for n in range(20)]
    for peer in peers:
        assert proofs.admits(proofs.proof(peer, B), peer, B)  # each a new pair
        assert not proofs.admits(b"x" * 32, peer, B)
    assert len(proofs._proofs) == 4 and len(proofs._logged) == 3
    assert proofs.proof(peers[0], B) == gate.RpcGate(KEY).proof(peers[0], B)  # evicted: computed again, the same


def test_hivemind_still_has_the_four_methods_the_gate_wraps():
    # hivemind 1.1.12's names and parameters: if an upgrade changes them, this fails, not a private swarm
    gate._patch()
    expected = {"add_binary_stream_handler": ["self", "name", "handler", "balanced"],
                "call_binary_stream_handler": ["self", "peer_id", "handler_name"],
                "_add_protobuf_unary_handler": ["self", "handle_name", "handler", "input_protobuf_type", "balanced"],
                "_call_unary_protobuf_handler": ["self", "peer_id", "handle_name", "input", "output_protobuf_type"]}
    assert set(P2P_RPC_METHODS.values()) == set(expected)
    for role, name in P2P_RPC_METHODS.items():
        assert list(inspect.signature(gate._hivemind[role]).parameters) == expected[name], name
        assert getattr(P2P, name) is not gate._hivemind[role]


# --- the four methods against a fake p2pd client --------------------------------------------------------

class FakeWriter:
    def __init__(self):
        self.written, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.written += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class FakeClient:
    """What P2P's four methods call on hivemind's p2pd client, recorded."""

    def __init__(self):
        self.stream_handlers, self.unary_handlers, self.unary_sent = {}, {}, []
        self.writer = FakeWriter()

    async def stream_handler(self, name, handler, balanced=False):
        self.stream_handlers[name] = handler

    async def stream_open(self, peer_id, protocols):
        return SimpleNamespace(peer_id=peer_id, proto=protocols[0]), asyncio.StreamReader(), self.writer

    async def add_unary_handler(self, name, handler, balanced=False):
        self.unary_handlers[name] = handler

    async def call_unary_handler(self, peer_id, name, data):
        self.unary_sent.append(data)
        return REPLY.SerializeToString()

    def close(self):
        pass


class DaemonlessP2P(P2P):
    """hivemind's P2P (its methods, patched or not) over a FakeClient: nothing to terminate."""

    def __del__(self):
        pass


def fake_p2p(peer_id: PeerID) -> P2P:
    p2p = DaemonlessP2P()
    p2p.peer_id, p2p._client = peer_id, FakeClient()
    p2p._listen_task = asyncio.get_running_loop().create_future()  # "already listening"
    return p2p


async def stream_exchange(sent: bytes) -> tuple[bytes | None, bool]:
    """B serves a stream handler through P2P; A's `sent` bytes arrive on it. What the handler read, if it
    was called, and whether the stream was closed unserved."""
    served = []

    async def handler(info, reader, writer):
        served.append(await reader.read())

    callee = fake_p2p(B)
    await callee.add_binary_stream_handler("h", handler)
    reader = asyncio.StreamReader()
    reader.feed_data(sent)
    reader.feed_eof()
    writer = FakeWriter()
    await callee._client.stream_handlers["h"](SimpleNamespace(peer_id=A), reader, writer)
    return (served[0] if served else None), writer.closed


async def unary_exchange(sent: bytes) -> bytes:
    """B serves a unary handler through P2P and answers A's `sent` bytes; the reply's bytes."""
    async def handler(request, context: P2PContext):
        assert request == REQUEST and context.remote_id == A and context.local_id == B
        return REPLY

    callee = fake_p2p(B)
    await getattr(P2P, P2P_RPC_METHODS["add_unary"])(callee, "u", handler, runtime_pb2.ExpertInfo)
    return await callee._client.unary_handlers["u"](sent, A)


async def calls_of(p2p: P2P, methods: dict | None = None) -> tuple[bytes, bytes]:
    """What A writes on a stream it opens to B, and the bytes of a unary request it sends B (through
    `methods`, hivemind's own, or else P2P's as they are now)."""
    def method(role):
        return methods[role] if methods else getattr(P2P, P2P_RPC_METHODS[role])

    _, _, writer = await method("call_stream")(p2p, B, "h")
    writer.write(b"hello")
    assert await method("call_unary")(p2p, B, "u", REQUEST, runtime_pb2.ExpertInfo) == REPLY
    return writer.written, p2p._client.unary_sent[-1]


def test_without_a_gate_the_four_methods_are_hiveminds():
    async def scenario():
        gate.install(KEY)
        gate.uninstall()  # patched, and no gate: what a public swarm's peer sends is byte for byte hivemind's
        plain = await calls_of(fake_p2p(A), gate._hivemind)
        assert await calls_of(fake_p2p(A)) == plain == (b"hello", REQUEST.SerializeToString())
        assert await stream_exchange(b"hello") == (b"hello", False)
        assert await unary_exchange(REQUEST.SerializeToString()) == REPLY.SerializeToString()

    asyncio.run(scenario())


def test_with_a_gate_calls_carry_the_proof_and_handlers_take_only_calls_that_do():
    async def scenario():
        proof = gate.install(KEY).proof(A, B)
        assert await calls_of(fake_p2p(A)) == (proof + b"hello", proof + REQUEST.SerializeToString())
        assert await stream_exchange(proof + b"hello") == (b"hello", False)  # the handler reads after the proof
        assert await unary_exchange(proof + REQUEST.SerializeToString()) == REPLY.SerializeToString()
        wrong = gate.RpcGate(OTHER).proof(A, B)
        for sent in (b"hello", wrong + b"hello", b"", gate.RpcGate(KEY).proof(B, A) + b"hello"):
            assert await stream_exchange(sent) == (None, True)  # closed, the handler never called
            with pytest.raises(gate.GateRefused, match="private swarm: the call carried no valid proof"):
                await unary_exchange(sent + REQUEST.SerializeToString())

    asyncio.run(scenario())


def test_a_stream_that_sends_no_proof_is_closed_after_the_deadline(monkeypatch):
    monkeypatch.setattr(gate, "PROOF_TIMEOUT", 0.05)
    served = []

    async def handler(info, reader, writer):
        served.append(True)

    async def scenario():
        gate.install(KEY)
        callee = fake_p2p(B)
        await callee.add_binary_stream_handler("h", handler)
        reader, writer = asyncio.StreamReader(), FakeWriter()
        reader.feed_data(b"x" * 31)  # and then nothing: the stream stays open
        await asyncio.wait_for(callee._client.stream_handlers["h"](SimpleNamespace(peer_id=A), reader, writer), 5)
        assert writer.closed and not served

    asyncio.run(scenario())
