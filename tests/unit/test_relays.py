"""A relay's answer to RESERVE, read as from any peer; a public relay's daemon started again until its relay
offers our limits; and the question asked of a real daemon."""

from __future__ import annotations

import asyncio

import pytest

import swarm.dht.node as node
from swarm.dht.identity import load_identity
from swarm.dht.node import RELAY_DATA_LIMIT, RELAY_START_ATTEMPTS, NatOptions, peer_id, start_dht, visible_maddrs
from swarm.dht.relays import (
    HOP_PROTOCOL,
    MAX_REPLY_BYTES,
    RelayOffer,
    RelayReplyError,
    ask_relay,
    has_public_address,
    parse_hop_reply,
    probe_own_relay,
)

pytestmark = pytest.mark.timeout(120)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def reply(status: int | None = 100, duration: int | None = None, data: int | None = None,
          reservation: bytes = field(1, 1_900_000_000) + field(3, b"voucher")) -> bytes:
    limit = (field(1, duration) if duration is not None else b"") + (field(2, data) if data is not None else b"")
    body = field(1, 2) + field(3, reservation)  # type STATUS, the reservation (skipped)
    if duration is not None or data is not None:
        body += field(4, limit)
    return body + (field(5, status) if status is not None else b"")


def test_a_reply_with_libp2p_default_limits_is_read_as_such():
    offer = parse_hop_reply(reply(100, 120, 1 << 17))
    assert offer == RelayOffer(100, 120, 1 << 17)
    assert offer.ok and offer.carries(1 << 17) and not offer.carries(RELAY_DATA_LIMIT)


def test_a_reply_without_limits_is_unlimited_and_a_refusal_carries_nothing():
    assert parse_hop_reply(reply(100)).carries(RELAY_DATA_LIMIT)
    refused = parse_hop_reply(reply(200))
    assert not refused.ok and not refused.carries(1) and "status 200" in refused.describe()


@pytest.mark.parametrize("body, why", [
    (b"", "no status"),
    (reply(None, 120, 1 << 17), "no status"),
    (field(5, 100)[:-1] + b"\x80", "past the end"),  # a varint cut off
    (b"\x08" + b"\xff" * 10 + b"\x01", "64 bits"),
    (field(4, b"\x08\x01")[:-1], "past the end"),  # a length beyond the body
    (bytes([4 << 3 | 3]), "wire type 3"),  # groups are not circuit relay's
])
def test_a_malformed_reply_is_refused_with_a_reason(body, why):
    with pytest.raises(RelayReplyError, match=why):
        parse_hop_reply(body)


def test_only_a_globally_routable_address_makes_a_relay_useful():
    assert has_public_address(["/ip4/11.77.1.2/tcp/4000/p2p/Qm"])
    assert not has_public_address(["/ip4/127.0.0.1/tcp/1", "/ip4/192.168.1.2/tcp/1", "/ip4/10.0.0.1/tcp/1",
                                   "/ip4/192.0.2.2/tcp/1", "/dns4/example.org/tcp/1", "garbage"])


class FakeDHT:
    def __init__(self):
        self.stopped = False

    def shutdown(self):
        self.stopped = True


@pytest.mark.parametrize("bad_starts", [0, 2, RELAY_START_ATTEMPTS])
def test_a_public_relay_starts_again_while_its_relay_offers_libp2p_defaults(monkeypatch, bad_starts):
    started, problems = [], iter(["libp2p's default limits"] * bad_starts + [None])
    monkeypatch.setattr(node, "_start_dht_once", lambda *args: started.append(FakeDHT()) or started[-1])
    monkeypatch.setattr(node, "relay_problem", lambda dht: next(problems))
    dht = start_dht("run", load_identity(None), nat=NatOptions(reachability="public", relay_service=True))
    assert len(started) == min(bad_starts + 1, RELAY_START_ATTEMPTS)
    assert dht is started[-1] and not dht.stopped  # the last one serves, even if its relay stayed limited
    assert all(earlier.stopped for earlier in started[:-1])


@pytest.mark.parametrize("nat", [NatOptions(), NatOptions(reachability="public"), NatOptions(relay_service=True)])
def test_a_peer_that_is_not_a_public_relay_is_not_checked(monkeypatch, nat):
    monkeypatch.setattr(node, "_start_dht_once", lambda *args: FakeDHT())
    monkeypatch.setattr(node, "relay_problem", lambda dht: pytest.fail("checked"))
    start_dht("run", load_identity(None), nat=nat)
    assert nat.p2pd_env() == {}


def test_a_real_relay_answers_with_its_limits():
    """A coordinator-like daemon on loopback: the throwaway asker gets an offer, ours or libp2p's (the race
    is p2pd's, so either may have won here; on loopback nobody takes a slot, so start_dht does not check)."""
    dht = start_dht("run", load_identity(None), nat=NatOptions(reachability="public", relay_service=True))
    try:
        offer = probe_own_relay(peer_id(dht), visible_maddrs(dht))
        assert offer is not None and offer.ok
        assert (offer.duration_s, offer.data_bytes) in ((120, 1 << 17), (86400, RELAY_DATA_LIMIT))
    finally:
        dht.shutdown()


class FakeP2P:
    """A p2p whose stream to the relay carries `sent` back; records what was written."""

    def __init__(self, sent: bytes):
        self.sent, self.written = sent, bytearray()
        self._client = self

    async def stream_open(self, peer, protocols):
        assert protocols == (HOP_PROTOCOL,)
        reader = asyncio.StreamReader()
        reader.feed_data(self.sent)
        reader.feed_eof()
        outer = self

        class Writer:
            def write(self, data):
                outer.written += data

            async def drain(self):
                pass

            def close(self):
                pass

        return None, reader, Writer()


def test_ask_relay_sends_reserve_and_reads_one_bounded_reply():
    body = reply(100, 120, 1 << 17)
    p2p = FakeP2P(varint(len(body)) + body + b"trailing bytes are not read")
    assert asyncio.run(ask_relay(p2p, None)) == RelayOffer(100, 120, 1 << 17)
    assert bytes(p2p.written) == b"\x02\x08\x00"  # HopMessage {type: RESERVE}, length-prefixed


@pytest.mark.parametrize("sent, error", [
    (varint(MAX_REPLY_BYTES + 1), RelayReplyError),  # refused before reading (or allocating) the body
    (b"\xff" * 6, RelayReplyError),  # a length prefix that never ends
    (varint(10) + b"short", asyncio.IncompleteReadError),
])
def test_ask_relay_refuses_an_oversized_or_cut_reply(sent, error):
    with pytest.raises(error):
        asyncio.run(ask_relay(FakeP2P(sent), None))
