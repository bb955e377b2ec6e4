"""Whether others can dial a peer: the check's logic, the dial_back handler's bounds, and the NAT options."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from swarm.dht.node import NatOptions, parse_maddrs
from swarm.dht.reachability import (
    ASK_PEERS,
    MAX_ADDRS,
    MAX_REQUEST_BYTES,
    DialBackServicer,
    Reachability,
    ReachabilityError,
    check_reachability,
    dialable,
    relay_of,
)
from swarm.dht.relays import RelayOffer
from swarm.dht.schemas import DIRECT, RELAYED, UNREACHABLE

pytestmark = pytest.mark.timeout(30)

RELAY = "QmRutfXqr9bCJ7Zjr8kFjR4DUxWpJRTsNXXiBu36jyeHuc"
SELF = "QmZZ6KnFXFzwNLtFxEsr3Dkoy9qugixnBH5oVzAbFURCAj"
LISTEN = [f"/ip4/192.168.3.2/tcp/4100/p2p/{SELF}", f"/ip4/127.0.0.1/tcp/4100/p2p/{SELF}"]
CIRCUIT = f"/ip4/11.77.1.2/tcp/4000/p2p/{RELAY}/p2p-circuit/p2p/{SELF}"


def peers(n: int) -> list[PeerID]:
    return [PeerID(bytes([0x12, 0x20]) + bytes([i]) * 32) for i in range(n)]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_peer_one_of_the_asked_can_dial_is_direct():
    asked = []

    def ask(peer, maddrs):
        asked.append(peer)
        if len(asked) == 1:
            raise TimeoutError("no answer")  # a peer that cannot answer tells nothing: the next is asked
        return [maddrs[0]]

    result = check_reachability(lambda: LISTEN, ask, peers(2), Reachability())
    assert result.state == DIRECT and result.ended.is_set()
    assert result.via == peers(2)[1].to_base58() and LISTEN[0] in result.line
    assert asked == peers(2)


def test_a_peer_listening_on_quic_only_is_not_called_behind_nat_by_a_check_that_dials_tcp():
    quic = [f"/ip4/192.168.3.2/udp/4100/quic-v1/p2p/{SELF}"]
    result = check_reachability(lambda: quic, lambda peer, maddrs: pytest.fail("asked"), peers(2), Reachability())
    assert result.state is None and result.ended.is_set()
    assert result.line.startswith("reachability: unknown") and quic[0] in result.line
    # with a TCP address beside it, the check asks as before
    both = [f"/ip4/192.168.3.2/tcp/4100/p2p/{SELF}", *quic]
    result = check_reachability(lambda: both, lambda peer, maddrs: [maddrs[0]], peers(1), Reachability())
    assert result.state == DIRECT


def test_no_dial_and_a_relay_address_is_relayed_the_relay_named():
    clock = FakeClock()
    calls = []

    def own():
        calls.append(clock.now)
        return LISTEN + ([CIRCUIT] if clock.now >= 2.0 else [])  # the slot comes two seconds in

    result = check_reachability(own, lambda peer, maddrs: [], peers(5), Reachability(), relay_wait=30,
                                poll=clock.sleep, clock=clock)
    assert result.state == RELAYED and result.via == RELAY
    assert "--announce-maddrs" in result.line and RELAY[-8:] in result.line
    assert result.listening == LISTEN  # circuit addresses are never offered for dialing back
    assert clock.now == pytest.approx(2.0)


@pytest.mark.parametrize("offer, warned", [
    (None, False),  # not known: the slot is all we know
    (RelayOffer(100, 86400, 1 << 40), False),  # a swarm relay's limits
    (RelayOffer(100, None, None), False),  # unlimited
    (RelayOffer(100, 120, 1 << 17), True),  # libp2p's defaults: every activation would be cut off
])
def test_a_relay_that_cuts_connections_short_is_named_in_the_line(offer, warned):
    asked = []

    def relay_offer(relay):
        asked.append(relay)
        return offer

    result = check_reachability(lambda: LISTEN + [CIRCUIT], lambda peer, maddrs: [], peers(1), Reachability(),
                                relay_offer=relay_offer)
    assert result.state == RELAYED and asked == [RELAY]
    assert ("131072 bytes each way" in result.line) == warned
    assert ("--relays" in result.line) == warned


def test_no_dial_and_no_relay_is_unreachable_after_the_wait():
    clock = FakeClock()
    asked = []
    result = check_reachability(lambda: LISTEN, lambda peer, maddrs: asked.append(peer) or [], peers(5),
                                Reachability(), relay_wait=7, poll=clock.sleep, clock=clock)
    assert result.state == UNREACHABLE and result.via is None
    assert "--relays" in result.line and "--announce-maddrs" in result.line
    assert clock.now == pytest.approx(7.0)
    assert len(asked) == ASK_PEERS  # not every peer of the swarm


def test_an_answer_naming_addresses_never_asked_about_is_not_believed():
    from swarm.dht.reachability import ask_dial_back

    class Stub:
        async def rpc_dial_back(self, request):
            return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(["/ip4/6.6.6.6/tcp/1"]))

    class DHT:
        async def replicate_p2p(self):
            return None

    original = DialBackServicer.get_stub
    DialBackServicer.get_stub = classmethod(lambda cls, *a, **k: Stub())
    try:
        assert asyncio.run(ask_dial_back(DHT(), peers(1)[0], LISTEN)) == []
    finally:
        DialBackServicer.get_stub = original


def test_a_check_that_fails_still_ends():
    clock = FakeClock()

    def own():
        raise RuntimeError("DHT process gone")

    result = Reachability()
    with pytest.raises(ReachabilityError):
        check_reachability(own, lambda peer, maddrs: [], peers(1), result, relay_wait=7, poll=clock.sleep,
                           clock=clock)
    assert result.ended.is_set() and not result.known
    assert clock.now == pytest.approx(7.0)


def test_a_listing_of_its_own_addresses_that_fails_now_and_then_does_not_end_the_check():
    # (a call into the DHT process failed once in the lab, right after the server joined, and the check ended
    # silently: no reachability line at all)
    clock = FakeClock()
    calls = []

    def own():
        calls.append(clock.now)
        if len(calls) % 2:  # every other call fails, the first among them
            raise TimeoutError("a call into the DHT process")
        return LISTEN + ([CIRCUIT] if clock.now >= 2.0 else [])

    result = check_reachability(own, lambda peer, maddrs: [], peers(1), Reachability(), relay_wait=30,
                                poll=clock.sleep, clock=clock)
    assert result.state == RELAYED and result.listening == LISTEN


@pytest.mark.parametrize("maddr, loopback_ok, expected", [
    (f"/ip4/11.77.2.2/tcp/4000/p2p/{SELF}", False, ("11.77.2.2", 4000)),
    ("/ip4/127.0.0.1/tcp/4000", False, None),
    ("/ip4/127.0.0.1/tcp/4000", True, ("127.0.0.1", 4000)),
    ("/ip6/::1/tcp/5", True, ("::1", 5)),
    ("/ip4/0.0.0.0/tcp/1", True, None),
    ("/ip4/224.0.0.1/tcp/1", True, None),
    ("/ip4/1.2.3.4/udp/5/quic", True, None),
    (CIRCUIT, True, None),
    ("/dns4/example.com/tcp/4", True, None),
    ("/ip4/1.2.3.4/tcp/" + "9" * 300, True, None),
    ("garbage", True, None),
])
def test_only_plain_tcp_addresses_are_dialed(maddr, loopback_ok, expected):
    assert dialable(maddr, loopback_ok) == expected


def test_relay_of_names_the_relay_of_a_circuit_address():
    assert relay_of(LISTEN) is None
    assert relay_of([LISTEN[0], CIRCUIT]) == RELAY


def serve_request(servicer: DialBackServicer, payload: bytes, caller: PeerID | None = None) -> list[str]:
    context = SimpleNamespace(remote_id=caller or peers(1)[0])
    request = runtime_pb2.ExpertInfo(serialized_info=payload)
    answer = asyncio.run(servicer.rpc_dial_back(request, context))
    return MSGPackSerializer.loads(answer.serialized_info)


def test_dial_back_reports_which_address_opened():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))  # bound, not listening: the connection is refused
            shut = closed.getsockname()[1]
            open_maddr, shut_maddr = f"/ip4/127.0.0.1/tcp/{port}", f"/ip4/127.0.0.1/tcp/{shut}"
            servicer = DialBackServicer(allow_loopback=True, dial_timeout=5)
            assert serve_request(servicer, MSGPackSerializer.dumps([open_maddr, shut_maddr])) == [open_maddr]
            strict = DialBackServicer(allow_loopback=False, dial_timeout=5)  # a public peer never dials its loopback
            assert serve_request(strict, MSGPackSerializer.dumps([open_maddr])) == []


@pytest.mark.parametrize("payload", [
    b"\xc1garbage",
    MSGPackSerializer.dumps({"not": "a list"}),
    MSGPackSerializer.dumps([1, 2]),
    MSGPackSerializer.dumps(["/ip4/1.2.3.4/tcp/1"] * (MAX_ADDRS + 1)),
    b"x" * (MAX_REQUEST_BYTES + 1),
])
def test_a_malformed_or_oversized_request_is_refused_without_dialing(payload, monkeypatch):
    dialed = []
    monkeypatch.setattr("swarm.dht.reachability._opens", lambda *a: dialed.append(a))
    with pytest.raises(ValueError):
        serve_request(DialBackServicer(allow_loopback=True), payload)
    assert dialed == []


def test_one_request_of_a_caller_at_a_time():
    servicer = DialBackServicer(allow_loopback=True)
    caller = peers(1)[0]
    servicer._busy.add(caller)  # its first request is being served
    with pytest.raises(ValueError, match="one dial_back request at a time"):
        serve_request(servicer, MSGPackSerializer.dumps([]), caller)
    assert serve_request(servicer, MSGPackSerializer.dumps([]), peers(2)[1]) == []  # others are served


def test_nat_options_map_to_the_daemon():
    initial = parse_maddrs([f"/ip4/11.77.1.2/tcp/4000/p2p/{RELAY}"], "initial peer", True)
    server = NatOptions(relay_client=True, relay_service=True)
    kwargs = server.p2p_kwargs(initial)
    assert kwargs == {"use_relay": True, "use_auto_relay": True, "trusted_relays": [str(initial[0])]}
    flags = server.p2pd_flags(kwargs)
    assert flags["relayDiscovery"] is False and flags["relayService"] is True  # explicit: see NatOptions
    assert flags["relayDataLimit"] >= 1 << 32
    named = NatOptions(relay_client=True, relays=(f"/ip4/11.77.9.9/tcp/1/p2p/{SELF}",)).p2p_kwargs(initial)
    assert named["trusted_relays"] == [f"/ip4/11.77.9.9/tcp/1/p2p/{SELF}"]
    coordinator = NatOptions(reachability="public", relay_service=True)
    kwargs = coordinator.p2p_kwargs(())
    assert kwargs == {"use_relay": True, "use_auto_relay": False, "force_reachability": "public"}
    assert "relayDiscovery" not in coordinator.p2pd_flags(kwargs) and coordinator.p2pd_flags(kwargs)["relayService"]
    trainer = NatOptions()
    assert "trusted_relays" not in trainer.p2p_kwargs(initial)  # a trainer only dials out
    assert trainer.p2pd_flags(trainer.p2p_kwargs(initial)) == {}  # and its daemon is hivemind's default
    with pytest.raises(ValueError, match="reachability"):
        NatOptions(reachability="sometimes")


@pytest.mark.parametrize("hosts, announce", [
    (["/ip4/127.0.0.1/tcp/0"], []),  # one machine: no NAT between its peers
    (["/ip4/0.0.0.0/tcp/4100"], ["/ip4/11.77.1.2/tcp/4100"]),  # a forwarded port, announced
])
def test_no_nat_precheck_where_the_answer_is_known_or_moot(monkeypatch, hosts, announce):
    import swarm.dht.reachability as reachability

    monkeypatch.setattr(reachability, "_dialed_directly", lambda *a: pytest.fail("asked"))
    assert reachability.behind_nat([f"/ip4/11.77.1.2/tcp/4000/p2p/{RELAY}"], hosts, announce) is False


@pytest.mark.parametrize("dialed, expected", [(True, False), (False, True), (None, False)])
def test_behind_nat_only_when_a_peer_answered_and_none_could_dial(monkeypatch, dialed, expected):
    import swarm.dht.reachability as reachability

    async def dialed_directly(initial_peers, host_maddrs):
        assert host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
        return dialed

    monkeypatch.setattr(reachability, "_dialed_directly", dialed_directly)
    assert reachability.behind_nat([f"/ip4/11.77.1.2/tcp/4000/p2p/{RELAY}"], ["/ip4/0.0.0.0/tcp/0"], []) is expected


def test_the_nat_precheck_of_a_peer_listening_on_quic_only_is_unknown(monkeypatch):
    # the peers asked open TCP connections: they could reach none of a QUIC-only peer's addresses, which
    # says nothing about its NAT (it was once taken for "behind NAT", relayed, and its calls cut short)
    import swarm.dht.reachability as reachability

    class Asker:
        shut = False

        async def get_visible_maddrs(self):
            return [f"/ip4/192.168.3.2/udp/4100/quic-v1/p2p/{SELF}"]

        async def shutdown(self):
            Asker.shut = True

    async def daemon(listen):
        assert listen == ["/ip4/0.0.0.0/udp/0/quic-v1"]
        return Asker()

    monkeypatch.setattr(reachability, "throwaway_daemon", daemon)
    monkeypatch.setattr(reachability, "connect", lambda *a: pytest.fail("asked"))
    quic = ["/ip4/0.0.0.0/udp/4100/quic-v1"]
    assert asyncio.run(reachability._dialed_directly([f"/ip4/11.77.1.2/tcp/4000/p2p/{RELAY}"], quic)) is None
    assert Asker.shut
    assert reachability.behind_nat([f"/ip4/11.77.1.2/tcp/4000/p2p/{RELAY}"], quic, []) is False
