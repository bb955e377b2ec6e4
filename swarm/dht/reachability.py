"""Can other peers dial this one? Found out on join and said in one line: direct, relayed or unreachable.

A server nobody can dial serves nobody. Behind a home router (NAT) the libp2p daemon takes a slot on a
relay (swarm.dht.node.NatOptions) and is reached through it; this module tells the volunteer which
case they are in, with the fix, and gives the server's record the answer (`reach`), so routing and
/status can show it.

How: every peer answers ``dial_back`` (DialBackServicer): given the addresses a newcomer listens on,
it opens a plain TCP connection to each (nothing is sent) and says which opened. The newcomer asks
the peers it joined through; if one reached it, it is **direct**. If none did, it waits a while for
its daemon to hold a relay address (``/p2p-circuit``): **relayed**; else **unreachable**.

What a stranger can make a peer do with ``dial_back``: open (and at once close) TCP connections to at
most MAX_ADDRS addresses of its choosing, one request of each caller at a time and at most
MAX_CONCURRENT_CHECKS at once, never to a loopback address unless this peer itself listens on
loopback only (a swarm on one machine). libp2p itself already dials whatever addresses peers
announce, so this adds no new reach; it is bounded so that it adds no new volume either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import hivemind
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.multiaddr import Multiaddr

from swarm.dht.loop import BackgroundLoop
from swarm.dht.node import parse_maddrs, peer_id_of, visible_maddrs
from swarm.dht.relays import RelayOffer, ask_relay, throwaway_daemon
from swarm.dht.schemas import DIRECT, RELAYED, UNREACHABLE
from swarm.hivemind_internals import connect

log = logging.getLogger(__name__)

RPC_NAMESPACE = "swarm"
MAX_ADDRS = 8  # addresses one request may ask to dial
MAX_ADDR_CHARS = 256
MAX_REQUEST_BYTES = MAX_ADDRS * (MAX_ADDR_CHARS + 8) + 16  # bounded before decoding
MAX_CONCURRENT_CHECKS = 4  # dial-back requests served at once, from everyone together
DIAL_TIMEOUT = 3.0  # one TCP connect; a NAT drops the SYN, so a closed door looks like this running out
RPC_TIMEOUT = DIAL_TIMEOUT + 3.0
ASK_PEERS = 3  # peers asked to dial back, in turn, until one reaches us
RELAY_WAIT = 30.0  # after no peer reached us: how long the daemon gets to hold a relay slot
CHECK_TIME = ASK_PEERS * (RPC_TIMEOUT + 1.0) + RELAY_WAIT + 5.0  # the longest a whole check can take

CIRCUIT = "/p2p-circuit"
MIN_RELAYED_BYTES = 1 << 30  # a relay that resets connections sooner cannot carry training traffic

PORT_HINT = ("to be dialed directly, forward a TCP port on your router to this machine and start with "
             "--host-maddrs /ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/PORT")


def dialable(maddr: str, allow_loopback: bool) -> tuple[str, int] | None:
    """(host, port) to dial for a multiaddr that is a plain /ip4|ip6/.../tcp/PORT address; None otherwise."""
    if len(maddr) > MAX_ADDR_CHARS or CIRCUIT in maddr:
        return None
    try:
        parsed = Multiaddr(maddr)
        protocols = [p.name for p in parsed.protocols()]
        ip_kind = protocols[0] if protocols else None
        if ip_kind not in ("ip4", "ip6") or len(protocols) < 2 or protocols[1] != "tcp":
            return None
        ip = ipaddress.ip_address(parsed[ip_kind])
        port = int(parsed["tcp"])
    except (ValueError, KeyError, TypeError):
        return None
    if not 0 < port < 65536 or ip.is_unspecified or ip.is_multicast or (ip.is_loopback and not allow_loopback):
        return None
    return str(ip), port


async def _opens(host: str, port: int, timeout: float) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


class DialBackServicer(ServicerBase):
    """Answers ``rpc_dial_back``: which of the caller's listen addresses a TCP connection opens to."""

    def __init__(self, allow_loopback: bool, dial_timeout: float = DIAL_TIMEOUT):
        self.allow_loopback = allow_loopback
        self.dial_timeout = dial_timeout
        self._busy: set[PeerID] = set()
        self._slots: asyncio.Semaphore | None = None  # made in the loop that serves

    async def rpc_dial_back(self, request: runtime_pb2.ExpertInfo, context: P2PContext) -> runtime_pb2.ExpertInfo:
        data = request.serialized_info
        caller = context.remote_id
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"dial_back request of {len(data)} bytes (at most {MAX_REQUEST_BYTES})")
        try:
            asked = MSGPackSerializer.loads(data)
        except Exception:
            raise ValueError("undecodable dial_back request") from None
        if not isinstance(asked, list) or len(asked) > MAX_ADDRS or not all(isinstance(a, str) for a in asked):
            raise ValueError(f"a dial_back request is a list of at most {MAX_ADDRS} multiaddr strings")
        if caller in self._busy:
            raise ValueError("one dial_back request at a time")
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_CONCURRENT_CHECKS)
        self._busy.add(caller)
        try:
            async with self._slots:
                targets = {maddr: dialable(maddr, self.allow_loopback) for maddr in dict.fromkeys(asked)}
                targets = {maddr: target for maddr, target in targets.items() if target is not None}
                opened = await asyncio.gather(*(_opens(*target, self.dial_timeout) for target in targets.values()))
        finally:
            self._busy.discard(caller)
        reached = [maddr for maddr, ok in zip(targets, opened) if ok]
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(reached))


def serve_dial_back(dht: hivemind.DHT, loop: BackgroundLoop, own_maddrs: Sequence[str], timeout: float = 10.0,
                    ) -> DialBackServicer:
    """Answer dial_back requests from now on; loopback addresses are dialed only if we listen on nothing else."""
    allow_loopback = all(_is_loopback(maddr) for maddr in own_maddrs if CIRCUIT not in maddr)
    servicer = DialBackServicer(allow_loopback)

    async def register() -> None:
        p2p = await dht.replicate_p2p()
        await servicer.add_p2p_handlers(p2p, namespace=RPC_NAMESPACE)

    loop.run(register(), timeout)
    return servicer


def _is_loopback(maddr: str) -> bool:
    try:
        parsed = Multiaddr(maddr)
        kind = next(p.name for p in parsed.protocols())
        return kind in ("ip4", "ip6") and ipaddress.ip_address(parsed[kind]).is_loopback
    except (ValueError, KeyError, StopIteration):
        return False


async def ask_dial_back(dht: hivemind.DHT, peer: PeerID, maddrs: Sequence[str], timeout: float = RPC_TIMEOUT,
                        ) -> list[str]:
    """The addresses among `maddrs` that `peer` could open a TCP connection to."""
    p2p = await dht.replicate_p2p()
    stub = DialBackServicer.get_stub(p2p, peer, namespace=RPC_NAMESPACE)
    request = runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(list(maddrs)[:MAX_ADDRS]))
    answer = await asyncio.wait_for(stub.rpc_dial_back(request), timeout)
    data = answer.serialized_info
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError("oversized dial_back answer")
    reached = MSGPackSerializer.loads(data)
    if not isinstance(reached, list):
        raise ValueError("malformed dial_back answer")
    return [maddr for maddr in reached if maddr in maddrs]  # only what we asked about counts


async def _relay_offer(dht: hivemind.DHT, relay: PeerID) -> RelayOffer:
    """What `relay` promises each relayed connection (we hold a slot there; asking again renews it)."""
    return await asyncio.wait_for(ask_relay(await dht.replicate_p2p(), relay), RPC_TIMEOUT)


@dataclass
class Reachability:
    """What is known about whether others can dial this peer; `state` is None until the check ends."""

    state: str | None = None
    line: str = ""
    via: str | None = None  # the peer that dialed us back, or the relay we are reached through
    listening: list[str] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)  # set when the check ends, known or not

    @property
    def known(self) -> bool:
        return self.state is not None

    def wait(self, timeout: float) -> bool:
        """Whether the check ended within `timeout` seconds."""
        return self.ended.wait(timeout)


class ReachabilityError(RuntimeError):
    """The check could not be made (this peer's own addresses could not be listed)."""


def relay_of(maddrs: Sequence[str]) -> str | None:
    """The relay's peer id in the first /p2p-circuit address among `maddrs`; None if there is none."""
    for maddr in maddrs:
        head, sep, _ = maddr.partition(CIRCUIT)
        if sep and "/p2p/" in head:
            return head.rsplit("/p2p/", 1)[1]
    return None


def check_reachability(
    own_maddrs: Callable[[], list[str]],
    ask: Callable[[PeerID, list[str]], list[str]],
    peers: Sequence[PeerID],
    result: Reachability,
    relay_wait: float = RELAY_WAIT,
    poll: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    relay_offer: Callable[[str], RelayOffer | None] = lambda relay: None,
) -> Reachability:
    """Fill `result`: direct if one of `peers` (asked in turn, ASK_PEERS at most) dials one of our addresses,
    else relayed once our daemon holds a relay address (waiting up to `relay_wait`), else unreachable.

    `own_maddrs()` lists the daemon's addresses now (circuit addresses included), `ask(peer, maddrs)` is
    the dial_back RPC, `relay_offer(relay)` what a relay promises each relayed connection (None: unknown);
    all are passed in so the logic can be tested without a network. A relay that cuts connections
    short (libp2p's default limits) is named in the line: relayed work through it would fail.
    """
    try:
        return _check(own_maddrs, ask, peers, result, relay_wait, poll, clock, relay_offer)
    finally:
        result.ended.set()


def _check(own_maddrs, ask, peers, result: Reachability, relay_wait: float, poll, clock,
           relay_offer) -> Reachability:
    def maddrs_now() -> list[str] | None:
        try:
            return own_maddrs()
        except Exception as e:  # noqa: BLE001 - a call into the DHT process that failed once; asked again
            log.debug("could not list this peer's addresses: %s: %s", type(e).__name__, e)
            return None

    deadline = clock() + relay_wait
    while (maddrs := maddrs_now()) is None:
        if clock() >= deadline:
            raise ReachabilityError(f"could not list this peer's own addresses within {relay_wait:g}s")
        poll(0.5)
    listening = sorted((maddr for maddr in maddrs if CIRCUIT not in maddr), key=_is_loopback)  # loopback last
    result.listening = listening
    if listening and not any(dialable(maddr, allow_loopback=True) for maddr in listening):
        # the check opens a TCP connection: "nobody reached" a QUIC-only peer would say nothing
        result.line = (f"reachability: unknown: the check dials TCP, and this peer listens on none "
                       f"({', '.join(listening[:3])}); libp2p's AutoNAT decides whether it takes a relay slot")
        return result
    failures = []
    for peer in list(dict.fromkeys(peers))[:ASK_PEERS]:
        try:
            reached = ask(peer, listening)
        except Exception as e:  # a peer that cannot answer tells nothing either way
            failures.append(f"{peer.to_base58()[-8:]}: {type(e).__name__}: {e}"[:200])
            continue
        if reached:
            result.via = peer.to_base58()
            result.line = f"reachability: direct ({result.via[-8:]} dialed {reached[0]})"
            result.state = DIRECT
            return result
    shown = ", ".join(listening[:3]) or "no address"
    asked = f"no peer could dial {shown}" + (f" (not answered: {'; '.join(failures)})" if failures else "")
    deadline = clock() + relay_wait
    while True:
        relay = relay_of(maddrs_now() or [])
        if relay is not None:
            result.via = relay
            result.line = (f"reachability: relayed: {asked}; others reach this peer through relay {relay[-8:]} "
                           f"(hole punching makes it direct where the NAT allows). {PORT_HINT}")
            offer = relay_offer(relay)
            if offer is not None and not offer.carries(MIN_RELAYED_BYTES):
                result.line += (f". BUT relay {relay[-8:]} {offer.describe()}: activations and averaging parts "
                                "through it will be cut off; relay through a swarm coordinator or a public server "
                                "(--relays), or forward a port")
            result.state = RELAYED
            return result
        if clock() >= deadline:
            break
        poll(0.5)
    result.line = (f"reachability: unreachable: {asked}, and no relay gave this peer a slot within "
                   f"{relay_wait:g}s; other peers cannot send it work. {PORT_HINT}, or name a relay that takes "
                   f"peers behind NAT with --relays /ip4/.../tcp/.../p2p/<peer id>")
    result.state = UNREACHABLE
    return result


PRECHECK_TIMEOUT = ASK_PEERS * (RPC_TIMEOUT + 1.0) + 10.0  # a throwaway daemon, then the peers asked in turn


async def _dialed_directly(initial_peers: Sequence[str], host_maddrs: Sequence[str]) -> bool | None:
    listen = [re.sub(r"/(tcp|udp)/\d+", r"/\1/0", str(maddr), count=1) for maddr in host_maddrs]  # ports of its own
    asker = await throwaway_daemon(listen)
    try:
        own = [str(maddr) for maddr in await asker.get_visible_maddrs()]
        if not any(dialable(maddr, allow_loopback=True) for maddr in own):
            return None  # (the check opens a TCP connection: a QUIC-only peer's "none reached" would say nothing)
        answered = False
        for maddr in parse_maddrs(initial_peers, "initial peer", need_peer_id=True)[:ASK_PEERS]:
            peer = peer_id_of(maddr)
            try:
                await asyncio.wait_for(connect(asker, peer, [str(maddr)]), RPC_TIMEOUT)
                stub = DialBackServicer.get_stub(asker, peer, namespace=RPC_NAMESPACE)
                request = runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(own[:MAX_ADDRS]))
                answer = await asyncio.wait_for(stub.rpc_dial_back(request), RPC_TIMEOUT)
            except Exception as e:  # noqa: BLE001 - a peer that cannot answer tells nothing either way
                log.debug("pre-check: %s did not answer: %s", peer, e)
                continue
            data = answer.serialized_info
            reached = MSGPackSerializer.loads(data) if len(data) <= MAX_REQUEST_BYTES else None
            if not isinstance(reached, list):
                continue
            answered = True
            if any(maddr in own for maddr in reached):
                return True
        return False if answered else None
    finally:
        await asker.shutdown()


def behind_nat(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str],
               ) -> bool:
    """Before a server's daemon starts: whether this machine is behind NAT, asked of the initial peers with a
    throwaway daemon listening as the server will (on another port). True only if a peer answered and
    none could dial it; False when unknown, and not asked at all when the answer is known or moot: with
    --announce-maddrs (a forwarded port: the throwaway's port would not be), or listening on loopback only.

    Why: libp2p's AutoNAT takes its first probe 15 s after start; until it says "private" the daemon
    takes no relay slot and does no hole punching, and a connection relayed before then stays relayed.
    A server told up front takes its slot at once and opens direct connections where the NAT allows
    (measured in the lab: a stage behind NAT at 50 ms one way, 0.68 of the all-public swarm's samples/s
    with AutoNAT, 0.96 told up front; joining in 7.7 s instead of 19).
    """
    if announce_maddrs or all(_is_loopback(maddr) for maddr in host_maddrs):
        return False
    try:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nat-precheck") as pool:
            found = pool.submit(lambda: asyncio.run(asyncio.wait_for(
                _dialed_directly(initial_peers, host_maddrs), PRECHECK_TIMEOUT))).result()
    except Exception as e:  # noqa: BLE001 - unknown: libp2p's AutoNAT finds out as before
        log.info("could not learn up front whether other peers can dial this machine: %s: %s", type(e).__name__, e)
        return False
    return found is False


def wait_until_reachable(result: Reachability | None) -> None:
    """Before a server goes ONLINE: wait for its check to end, so that nobody is sent to a server that
    no one can dial yet (behind NAT, its relay slot takes seconds; callers would ban it meanwhile).
    Whatever the answer, the server then goes ONLINE: peers on its own network may still reach it."""
    if result is not None and not result.ended.is_set():
        log.info("waiting to learn whether other peers can dial this server (at most %.0fs)", CHECK_TIME)
        if not result.wait(CHECK_TIME):
            log.warning("reachability still unknown after %.0fs; going ONLINE anyway", CHECK_TIME)


def start_check(dht: hivemind.DHT, loop: BackgroundLoop, initial_peers: Sequence[str], result: Reachability,
                ) -> threading.Thread:
    """Check in the background (a NAT'd peer's relay may take seconds), logging the one line when known."""
    peers = [peer_id_of(maddr) for maddr in parse_maddrs(initial_peers, "initial peer", need_peer_id=True)]

    def ask(peer: PeerID, maddrs: list[str]) -> list[str]:
        return loop.run(ask_dial_back(dht, peer, maddrs), RPC_TIMEOUT + 1.0)

    def offer_of(relay: str) -> RelayOffer | None:
        try:
            return loop.run(_relay_offer(dht, PeerID.from_base58(relay)), RPC_TIMEOUT + 1.0)
        except Exception as e:  # unknown: the relay gave us a slot, which is all we know
            log.debug("could not ask relay %s what it offers: %s", relay, e)
            return None

    def run() -> None:
        try:
            check_reachability(lambda: visible_maddrs(dht, latest=True), ask, peers, result, relay_offer=offer_of)
        except Exception as e:  # noqa: BLE001 - the DHT went away (shutting down), or it failed for good
            (log.warning if dht.is_alive() else log.debug)(
                "reachability: unknown (the check failed: %s: %s); this server serves all the same, and peers "
                "that cannot dial it route around it", type(e).__name__, e)
            return
        (log.info if result.state == DIRECT else log.warning)("%s", result.line)

    thread = threading.Thread(target=run, name="reachability", daemon=True)
    thread.start()
    return thread
