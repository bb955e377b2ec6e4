"""What a relay promises: ask its libp2p relay service for a slot and read the limits it answers with.

Why this exists. hivemind's p2pd, started with ``-relay=1``, runs *two* circuit-relay services on one
host, both on the same protocol: one with the limits we give it (``-relayService=1``, ...), which
libp2p starts when the peer learns it is public, and one that p2pd always starts after its own setup,
with libp2p's default limits (a relayed connection is reset after 128 KiB each way, or 2 minutes).
Whichever registers last answers. With reachability forced public (a coordinator) both start within
the daemon's first moments, in either order: on a quiet machine ours usually wins, on a loaded one
not always, and then every relayed activation and averaging part is cut off after its first
128 KiB ("the message declared 1 tensors, 0 arrived"; seen in CI as averaging groups that never
formed). We cannot change p2pd, so a relaying peer asks its own relay, right after start, what it
promises, and starts its daemon again if the answer is libp2p's defaults (swarm.dht.node.start_dht).

The question is circuit relay v2's own RESERVE (a HopMessage on ``/libp2p/circuit/relay/0.2.0/hop``);
the relay answers STATUS with the reservation and its Limit {duration seconds, data bytes}. The asker
is a throwaway daemon on this machine; the slot it gets is freed when it disconnects. The reply is
read with every size bounded (MAX_REPLY_BYTES), as from any peer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID

from swarm.hivemind_internals import connect, open_stream

log = logging.getLogger(__name__)

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
RESERVE = b"\x02\x08\x00"  # varint length 2, then HopMessage {type (field 1, varint): RESERVE = 0}
MAX_REPLY_BYTES = 4096  # go-libp2p's own bound on a circuit message
STATUS_OK = 100
LIBP2P_DEFAULT_DATA = 1 << 17  # what a relay with libp2p's default limits lets through per connection
PROBE_TIMEOUT = 15.0  # start a throwaway daemon, connect, ask

# HopMessage fields (circuit.proto): type = 1, peer = 2, reservation = 3, limit = 4, status = 5;
# Limit: duration = 1 (uint32, seconds), data = 2 (uint64, bytes)
_HOP_LIMIT, _HOP_STATUS, _LIMIT_DURATION, _LIMIT_DATA = 4, 5, 1, 2
_VARINT, _LEN = 0, 2


class RelayReplyError(ValueError):
    """The relay's reply is not a well-formed HopMessage."""


@dataclass(frozen=True)
class RelayOffer:
    """A relay's answer to RESERVE: status, and the limits of each relayed connection (None: unlimited)."""

    status: int
    duration_s: int | None = None
    data_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    def carries(self, nbytes: int) -> bool:
        """Whether a relayed connection may carry `nbytes` each way before the relay resets it."""
        return self.ok and (self.data_bytes is None or self.data_bytes >= nbytes)

    def describe(self) -> str:
        if not self.ok:
            return f"refused a slot (status {self.status})"
        data = "unlimited" if self.data_bytes is None else f"{self.data_bytes} bytes"
        duration = "unlimited" if self.duration_s is None else f"{self.duration_s} s"
        return f"each relayed connection: {data} each way, {duration}"


def _varint(body: bytes, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(body):
            raise RelayReplyError("a varint runs past the end of the message")
        byte = body[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift >= 64:
            raise RelayReplyError("a varint longer than 64 bits")


def _fields(body: bytes):
    """(field number, wire type, value) of a protobuf message: ints for varints, bytes for the rest."""
    at = 0
    while at < len(body):
        key, at = _varint(body, at)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, at = _varint(body, at)
        elif wire == _LEN:
            size, at = _varint(body, at)
            if size > len(body) - at:
                raise RelayReplyError("a field runs past the end of the message")
            value, at = body[at:at + size], at + size
        elif wire in (1, 5):  # fixed 64 / 32 bits: not in this message, skipped
            size = 8 if wire == 1 else 4
            if size > len(body) - at:
                raise RelayReplyError("a field runs past the end of the message")
            value, at = body[at:at + size], at + size
        else:
            raise RelayReplyError(f"wire type {wire} is not used by circuit relay messages")
        yield number, wire, value


def parse_hop_reply(body: bytes) -> RelayOffer:
    """The RelayOffer in a HopMessage body (without its length prefix)."""
    status, duration, data = None, None, None
    for number, wire, value in _fields(body):
        if number == _HOP_STATUS and wire == _VARINT:
            status = value
        elif number == _HOP_LIMIT and wire == _LEN:
            for inner, inner_wire, inner_value in _fields(value):
                if inner == _LIMIT_DURATION and inner_wire == _VARINT:
                    duration = inner_value
                elif inner == _LIMIT_DATA and inner_wire == _VARINT:
                    data = inner_value
    if status is None:
        raise RelayReplyError("the relay's reply carries no status")
    return RelayOffer(status, duration, data)


async def ask_relay(p2p: P2P, relay: PeerID) -> RelayOffer:
    """Ask `relay` (already connected, or findable by `p2p`'s daemon) for a slot; its offer."""
    reader, writer = await open_stream(p2p, relay, HOP_PROTOCOL)
    try:
        writer.write(RESERVE)
        await writer.drain()
        size = 0
        for shift in range(0, 35, 7):  # the length prefix: a varint of at most 5 bytes
            byte = (await reader.readexactly(1))[0]
            size |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
        else:
            raise RelayReplyError("the reply's length prefix is longer than 5 bytes")
        if size > MAX_REPLY_BYTES:
            raise RelayReplyError(f"the reply declares {size} bytes, more than {MAX_REPLY_BYTES}")
        return parse_hop_reply(await reader.readexactly(size))
    finally:
        writer.close()


def has_public_address(maddrs: list[str]) -> bool:
    """Whether one of `maddrs` is a globally routable IP: libp2p takes relay slots only on such peers."""
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            try:
                if ipaddress.ip_address(parts[2]).is_global:
                    return True
            except ValueError:
                continue
    return False


async def throwaway_daemon(host_maddrs: list[str]) -> P2P:
    """A bare libp2p daemon for one question to other peers: no DHT, AutoNAT, port mapping or relays."""
    return await P2P.create(host_maddrs=host_maddrs, dht_mode="client", auto_nat=False, nat_port_map=False,
                            use_relay=False)


async def _probe(relay: PeerID, maddrs: list[str]) -> RelayOffer:
    asker = await throwaway_daemon(["/ip4/127.0.0.1/tcp/0"])
    try:
        await connect(asker, relay, maddrs)
        return await ask_relay(asker, relay)
    finally:
        await asker.shutdown()


def probe_own_relay(relay: str, maddrs: list[str], timeout: float = PROBE_TIMEOUT) -> RelayOffer | None:
    """What this machine's relay `relay` (peer id) at `maddrs` offers, asked by a throwaway daemon;
    None if it could not be asked (logged: then nothing is known either way)."""
    def ask() -> RelayOffer:  # in a thread of its own: the caller may be running an event loop
        return asyncio.run(asyncio.wait_for(_probe(PeerID.from_base58(relay), maddrs), timeout))

    try:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="relay-probe") as pool:
            return pool.submit(ask).result()
    except Exception as e:  # noqa: BLE001 - a failed probe tells nothing about the relay
        log.info("could not ask this peer's relay what it offers: %s: %s", type(e).__name__, e)
        return None
