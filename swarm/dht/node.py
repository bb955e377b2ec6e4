"""Starting a hivemind DHT node for a run, with our validators, bounded waits and clear errors."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import itertools
import logging
import os
import re
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import hivemind
from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from swarm.dht import gate
from swarm.dht.errors import BootstrapError, DHTProcessGone, DHTRequestTimeout, InvalidMultiaddr, SwarmDHTError
from swarm.dht.identity import Identity, create_private_file
from swarm.dht.keys import RunRecordGuard, make_validators, run_validators
from swarm.dht.private import SwarmKey
from swarm.dht.relays import has_public_address, probe_own_relay
from swarm.dht.storage import install_bounded_storage
from swarm.dht.verified import RememberedValidator
from swarm.hivemind_internals import add_p2pd_flags, mend_p2p
from swarm.tasks import keep_tasks_alive
from swarm.traffic import count_unary_rpcs, shared_counter

log = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT = 30.0  # p2pd start + first contact with the initial peers
DEFAULT_RPC_TIMEOUT = 3.0  # one DHT RPC to one peer (hivemind's wait_timeout)
DEFAULT_CALL_TIMEOUT = 10.0  # one call into the DHT process (a get, a store, a query of its state)

_LOCAL_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
REACHABILITY_CHOICES = ("auto", "public", "private")
RELAY_CIRCUITS = 64  # relayed connections one peer may hold through us at once (p2pd's default: 16)
RELAY_DATA_LIMIT = 1 << 40  # bytes a relayed connection may carry each way before the relay resets it
RELAY_TIME_LIMIT = "24h0m0s"  # how long one relayed connection may last (p2pd's default: 30 minutes)
BOOTSTRAP_ATTEMPTS = 2  # DHT starts while no initial peer answers at once (see _start_dht_joined)
BOOTSTRAP_RETRY_PAUSE = 1.0
RELAY_START_ATTEMPTS = 8  # daemon starts of a public relay until its relay offers our limits


@dataclass(frozen=True)
class NatOptions:
    """How a peer's libp2p daemon deals with NAT: what it believes about itself, relays it uses and offers.

    - `reachability`: ``auto`` lets libp2p's AutoNAT find out (peers that can reach us dial back);
      ``public`` / ``private`` say so up front (a coordinator is public by definition: everyone dials it).
    - `relay_client`: behind NAT, take a slot on a relay and be reached through it (servers; a trainer
      only dials out, so it needs none). The relays are `relays`, default the initial peers; upgraded to
      a direct connection by hole punching (libp2p's DCUtR) where the NAT allows.
    - `relay_service`: relay for peers behind NAT once this peer is public (libp2p starts the service
      only on a public peer), at most RELAY_CIRCUITS circuits a peer, each for up to RELAY_DATA_LIMIT
      bytes a direction and RELAY_TIME_LIMIT. p2pd also runs a second relay service with libp2p's
      default limits (128 KiB a connection), and the two race (swarm.dht.relays): a peer that is
      public from its start checks which won and starts its daemon again if it was libp2p's
      (start_dht). The coordinator and servers relay; a trainer or a tool does not.
    """

    reachability: str = "auto"
    relay_client: bool = False
    relay_service: bool = False
    relays: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.reachability not in REACHABILITY_CHOICES:
            choices = ', '.join(REACHABILITY_CHOICES)
            raise ValueError(f"reachability must be one of {choices}, not {self.reachability!r}")

    def p2p_kwargs(self, initial_peers: Sequence[Multiaddr]) -> dict[str, Any]:
        """hivemind P2P.create's arguments for these options."""
        kwargs: dict[str, Any] = {"use_relay": True, "use_auto_relay": self.relay_client}
        if self.reachability != "auto":
            kwargs["force_reachability"] = self.reachability
        relays = [str(maddr) for maddr in parse_maddrs(self.relays, "relay", need_peer_id=True)]
        if self.relay_client and (relays or initial_peers):
            kwargs["trusted_relays"] = relays or [str(maddr) for maddr in initial_peers]
        return kwargs

    def p2pd_flags(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """p2pd flags hivemind does not pass: the relay service's limits, and use only the named relays
        (libp2p's relay discovery would wait minutes for four candidates before reserving a slot on any)."""
        flags: dict[str, Any] = {}
        if self.relay_service:
            flags.update(relayService=True, relayMaxCircuits=RELAY_CIRCUITS, relayDataLimit=RELAY_DATA_LIMIT,
                         relayTimeLimit=RELAY_TIME_LIMIT)
        if "trusted_relays" in kwargs:
            flags["relayDiscovery"] = False
        return flags

    @property
    def verifies_relay(self) -> bool:
        """Whether this peer's relay must be checked once it is up: it relays and is public from its first
        moment, so two relay services race inside its daemon (swarm.dht.relays)."""
        return self.relay_service and self.reachability == "public"

    def p2pd_env(self) -> dict[str, str]:
        """Environment for p2pd. A daemon that verifies its relay runs Go on one core: there the race is
        mostly won by our relay service (measured: 10 of 10 starts quiet, 8 of 12 on a loaded machine,
        against 1 of 10 and 2 of 8 with all cores), so it rarely needs a second start."""
        return {"GOMAXPROCS": "1"} if self.verifies_relay else {}


def parse_maddrs(maddrs: Sequence[str | Multiaddr], what: str, need_peer_id: bool = False) -> list[Multiaddr]:
    """Parse multiaddrs given by a person; a bad one raises InvalidMultiaddr naming it."""
    if isinstance(maddrs, (str, Multiaddr)):
        maddrs = [maddrs]  # a lone string would otherwise be split into characters
    parsed = []
    for maddr in maddrs:
        try:
            parsed_maddr = Multiaddr(str(maddr))
        except ValueError as e:
            raise InvalidMultiaddr(f"bad {what} {str(maddr)!r}: {e}") from None
        if need_peer_id and "p2p" not in parsed_maddr:
            raise InvalidMultiaddr(
                f"bad {what} {str(maddr)!r}: it must end with /p2p/<peer id>, "
                "copy the whole address the coordinator printed"
            )
        parsed.append(parsed_maddr)
    return parsed


def peer_id_of(maddr: Multiaddr) -> PeerID:
    """The peer id in a multiaddr's /p2p/ part: libp2p checks it, so it authenticates the peer."""
    return PeerID.from_base58(maddr["p2p"])


class _DHTProcess(hivemind.DHT):
    """hivemind's DHT, whose process ends on SIGTERM.

    The process is forked, so it inherits the Python signal handlers of its parent: a program that
    handles SIGTERM by setting a flag (swarm-local) would leave a DHT process that SIGTERM, and so
    hivemind's own shutdown ("terminating it the hard way"), can no longer stop, and the program
    waits for it forever at exit.

    With a swarm key, its RPCs are gated by that key (swarm.dht.gate), whether or not the
    process that starts it is.
    """

    def __init__(self, *args: Any, swarm_key: SwarmKey | None = None, p2pd_flags: dict[str, Any] | None = None,
                 p2pd_env: dict[str, str] | None = None, **kwargs: Any):
        self._swarm_key = swarm_key  # before hivemind's __init__, which may fork already
        self._p2pd_flags = p2pd_flags or {}
        self._p2pd_env = p2pd_env or {}
        self.bytes_sent = shared_counter()  # bytes of its DHT RPCs (swarm.traffic), read by this process
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(self._p2pd_env)  # this process's only child is its p2pd
        if self._swarm_key is not None:
            gate.install(self._swarm_key)
        count_unary_rpcs(self.bytes_sent)
        if self._p2pd_flags:
            flags = dict(self._p2pd_flags)
            relay_discovery = {"relayDiscovery": flags.pop("relayDiscovery")} if "relayDiscovery" in flags else {}
            add_p2pd_flags(flags, with_trusted_relays=relay_discovery)
        super().run()


def start_dht(
    run_id: str | None,
    identity: Identity,
    initial_peers: Sequence[str | Multiaddr] = (),
    host_maddrs: Sequence[str | Multiaddr] = _LOCAL_HOST_MADDRS,
    announce_maddrs: Sequence[str | Multiaddr] = (),
    client_mode: bool = False,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    swarm_key: SwarmKey | None = None,
    nat: NatOptions | None = None,
) -> hivemind.DHT:
    """Start a DHT node guarded by the run's validators; with initial peers, join their swarm.

    `run_id` may be None while the run is not known yet (see join_run): then only signatures are
    checked until :func:`add_run_validators` is called. Raises BootstrapError if no initial peer answers.
    With `swarm_key` (a private swarm), the node's RPCs carry and ask for proofs of it (swarm.dht.gate);
    so do they when this process installed the gate. `nat` says how its daemon deals with NAT (NatOptions).

    A peer that relays and says it is public has its relay's limits checked once it is up, and its
    daemon started again while they are libp2p's defaults (swarm.dht.relays says why that happens).
    """
    nat = nat or NatOptions()
    args = (run_id, identity, initial_peers, host_maddrs, announce_maddrs, client_mode, startup_timeout,
            rpc_timeout, swarm_key, nat)
    for attempt in itertools.count(1):
        dht = _start_dht_joined(*args)
        problem = relay_problem(dht) if nat.verifies_relay else None
        if problem is None:
            return dht
        if attempt == RELAY_START_ATTEMPTS:
            log.error("%s, %d times in a row; serving anyway: peers behind NAT that are relayed through this "
                      "peer will fail once a connection carries more than that", problem, attempt)
            return dht
        log.warning("%s (a race inside the libp2p daemon); starting it again (%d/%d)", problem, attempt,
                    RELAY_START_ATTEMPTS)
        dht.shutdown()


def _start_dht_joined(*args) -> hivemind.DHT:
    """_start_dht_once, tried again once if no initial peer answered at once: the DHT ping a fresh daemon
    sends its initial peers has `rpc_timeout` (3 s), which a loaded machine can miss (once in the lab, a
    server behind NAT joining beside three other peers' start). A dead address fails twice, in seconds."""
    for attempt in itertools.count(1):
        try:
            return _start_dht_once(*args)
        except BootstrapError as e:
            if attempt >= BOOTSTRAP_ATTEMPTS or not e.quick:
                raise
            log.warning("%s; trying once more", e)
            time.sleep(BOOTSTRAP_RETRY_PAUSE)


def relay_problem(dht: hivemind.DHT) -> str | None:
    """What is wrong with this peer's relay ("it offers libp2p's default limits"); None if it offers ours,
    if it could not be asked, or if it has no public address (then nobody takes a slot on it)."""
    maddrs = visible_maddrs(dht, latest=True)
    if not has_public_address(maddrs):
        return None
    offer = probe_own_relay(peer_id(dht), maddrs)
    if offer is None or offer.carries(RELAY_DATA_LIMIT):
        return None
    return f"this peer's relay came up with libp2p's default limits, not ours ({offer.describe()})"


def _start_dht_once(run_id, identity, initial_peers, host_maddrs, announce_maddrs, client_mode, startup_timeout,
                    rpc_timeout, swarm_key, nat: NatOptions) -> hivemind.DHT:
    initial = parse_maddrs(initial_peers, "initial peer", need_peer_id=True)
    hosts = parse_maddrs(host_maddrs, "host multiaddr")
    announce = parse_maddrs(announce_maddrs, "announce multiaddr")
    p2p_kwargs = nat.p2p_kwargs(initial)
    keep_tasks_alive()  # in the DHT process it forks, too
    mend_p2p()  # (ditto) before this process's handlers are added
    collect_before_fork()
    with _identity_file(identity) as identity_path:
        dht = _DHTProcess(
            initial_peers=[str(maddr) for maddr in initial],
            start=True,
            await_ready=False,  # we wait ourselves, bounded (hivemind would wait forever)
            # one validator that remembers what it accepted (swarm.dht.verified); the run's are merged into it later
            record_validators=[RememberedValidator(make_validators(run_id, identity.signing_key))],
            client_mode=client_mode,
            host_maddrs=[str(maddr) for maddr in hosts],
            announce_maddrs=[str(maddr) for maddr in announce] or None,
            identity_path=identity_path,
            # a fresh key is nobody's: asking the swarm whether it is taken would only cost a second daemon
            check_if_identity_free=identity.libp2p_path is not None,
            startup_timeout=startup_timeout,  # p2pd launch
            wait_timeout=rpc_timeout,
            bootstrap_timeout=rpc_timeout,  # how long to wait for more initial peers after the first answers
            swarm_key=swarm_key,
            p2pd_flags=nat.p2pd_flags(p2p_kwargs),
            p2pd_env=nat.p2pd_env(),
            **p2p_kwargs,
        )
        try:
            dht.wait_until_ready(timeout=startup_timeout)
            # from its first moments on, what others store here is bounded (storage.py)
            call_in_dht(dht, _BoundStorage(run_id, [identity.owner_key]), startup_timeout)
        except Exception as e:
            dht.shutdown()
            private = swarm_key is not None or gate.installed() is not None
            raise _startup_error(e, initial, hosts, startup_timeout, private) from e
        except BaseException:  # KeyboardInterrupt: leave no DHT process behind
            dht.shutdown()
            raise
    return dht


class _BoundStorage:
    # A picklable callable: the run's keys are computed in the DHT process (their ids would not fit the pipe)
    def __init__(self, run_id: str | None, trusted: list[bytes]):
        self.run_id, self.trusted = run_id, trusted

    async def __call__(self, _dht: hivemind.DHT, node: Any) -> None:
        run_keys = RunRecordGuard(self.run_id).key_ids if self.run_id is not None else []
        install_bounded_storage(node.protocol, self.trusted, run_keys)


@contextlib.contextmanager
def _identity_file(identity: Identity) -> Iterator[str]:
    """The path of the identity's libp2p key file; a throwaway key lives in a private temporary one.

    The daemon reads the file when it starts, so the temporary copy is gone once the DHT is ready.
    """
    if identity.libp2p_path is not None:
        yield identity.libp2p_path
        return
    with tempfile.TemporaryDirectory(prefix="swarm-identity-") as directory:  # mode 0700
        path = os.path.join(directory, "peer.id")
        create_private_file(path, identity.libp2p_key_bytes(), "temporary libp2p identity")
        yield path


# hivemind refuses to bootstrap from a peer whose DHT time (the wall clock) is MAX_DHT_TIME_DISCREPANCY_SECONDS off
_CLOCK_SKEW = re.compile(r"local time must be within .*local: ([0-9.]+), peer: ([0-9.]+)")


def _startup_error(error: Exception, initial: list[Multiaddr], hosts: list[Multiaddr], timeout: float,
                   private: bool = False) -> Exception:
    """Translate hivemind's startup failures into one actionable line."""
    message = str(error)
    skew = _CLOCK_SKEW.search(message)
    if skew is not None:
        off = float(skew.group(1)) - float(skew.group(2))
        return SwarmDHTError(
            f"this machine's clock is {abs(off):.0f}s {'ahead of' if off > 0 else 'behind'} the initial peer's, and "
            f"peers refuse clocks more than {MAX_DHT_TIME_DISCREPANCY_SECONDS}s apart (records expire by the clock): "
            "set the clock right (enable NTP, e.g. `timedatectl set-ntp true`) and start again"
        )
    if "address already in use" in message:
        listen = " ".join(str(maddr) for maddr in hosts)
        return SwarmDHTError(f"cannot listen on {listen}: the port is taken, choose another (or port 0)")
    timed_out = isinstance(error, (TimeoutError, concurrent.futures.TimeoutError))
    if initial and (
        timed_out
        or "failed to connect to bootstrap peers" in message  # p2pd could not reach any of them
        or "bootstrap failed" in message  # reached, but none answered the DHT ping
    ):
        peers = " ".join(str(maddr) for maddr in initial)
        # a private swarm's peers answer nobody without its key (swarm.dht.gate): that looks the same here
        hint = ("do they belong to the swarm of this --swarm-key?" if private
                else "is the swarm private? then start with --swarm-key and a copy of its key")
        said = "" if timed_out else f" ({message.splitlines()[0][:200]})" if message else ""
        failed = BootstrapError(
            f"none of the initial peers ({peers}) answered{f' within {timeout:g}s' if timed_out else said}: "
            f"is the coordinator running and reachable from this machine? {hint}"
        )
        failed.quick = not timed_out
        return failed
    if timed_out:
        return SwarmDHTError(f"the DHT node did not start within {timeout:g}s")
    if isinstance(error, P2PDaemonError):
        return SwarmDHTError(f"the libp2p daemon failed to start: {message}")
    return SwarmDHTError(f"the DHT node failed to start: {type(error).__name__}: {message}")


def add_run_validators(dht: hivemind.DHT, run_id: str, timeout: float = DEFAULT_CALL_TIMEOUT,
                       coordinator_key: bytes | None = None) -> None:
    """Start checking the run's records (owner rules and schemas) on a DHT started with run_id=None.

    The records `coordinator_key` (an owner marker) signs are never dropped from this node's storage.
    """
    trusted = [coordinator_key] if coordinator_key is not None else []
    call_in_dht(dht, _AddValidators(run_validators(run_id), trusted), timeout)


class _AddValidators:
    # A picklable callable (hivemind.DHT.add_validators would wait on its DHT process without a timeout)
    def __init__(self, validators: list[Any], trusted: list[bytes]):
        self.validators, self.trusted = validators, trusted

    async def __call__(self, _dht: hivemind.DHT, node: Any) -> None:
        protocol = node.protocol
        protocol.record_validator.extend(self.validators)
        # A node that joined before it knew the run stored and cached the run's records unchecked (hivemind
        # caches what others find on the nodes nearest to it): a stranger's plain value could sit there and
        # win over every signed record. The storage drops them all as it learns the run's keys: their owners
        # renew them, other nodes hold them.
        install_bounded_storage(protocol, self.trusted)
        run_keys = [key_id for guard in self.validators for key_id in getattr(guard, "key_ids", ())]
        for held in (protocol.storage, protocol.cache):
            held.set_run_keys(run_keys)


def require_alive(dht: hivemind.DHT, what: str) -> None:
    """Raise DHTProcessGone unless `dht`'s process runs. Call before each request to it.

    A request is a message down a pipe to that process. Once the process is gone (killed), nobody
    reads the pipe: a few dozen requests fill it, and the next one blocks its caller forever.
    """
    if not dht.is_alive():
        raise DHTProcessGone(f"{what}: this peer's DHT process is not running")


def call_in_dht(dht: hivemind.DHT, coro: Callable[[hivemind.DHT, Any], Awaitable[Any]], timeout: float) -> Any:
    """Run `coro(dht, node)` inside the DHT process, waiting at most `timeout` seconds."""
    require_alive(dht, "a call into the DHT process")
    future = dht.run_coroutine(coro, return_future=True)
    return wait_future(future, timeout, "a call into the DHT process")


def wait_future(future: Any, timeout: float, what: str) -> Any:
    """The result of an MPFuture, or DHTRequestTimeout (and the future cancelled) after `timeout`."""
    try:
        return future.result(timeout=timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):
        future.cancel()
        raise DHTRequestTimeout(f"{what} did not finish within {timeout:g}s") from None


async def _visible_maddrs(_dht: hivemind.DHT, node: Any) -> list[str]:
    return [str(maddr) for maddr in await node.get_visible_maddrs()]


async def _latest_maddrs(_dht: hivemind.DHT, node: Any) -> list[str]:
    return [str(maddr) for maddr in await node.get_visible_maddrs(latest=True)]


def visible_maddrs(dht: hivemind.DHT, timeout: float = DEFAULT_CALL_TIMEOUT, latest: bool = False) -> list[str]:
    """Multiaddrs (with /p2p/<peer id>) at which other peers can reach this node: its initial peers.

    With `latest`, asked of the daemon now (a relay address it took since it started is among them);
    otherwise those it had when it started.
    """
    return call_in_dht(dht, _latest_maddrs if latest else _visible_maddrs, timeout)


async def _peer_id(_dht: hivemind.DHT, node: Any) -> str:
    return node.peer_id.to_base58()


def peer_id(dht: hivemind.DHT, timeout: float = DEFAULT_CALL_TIMEOUT) -> str:
    """This node's libp2p peer id, base58 (``dht.peer_id`` would wait without a timeout)."""
    return call_in_dht(dht, _peer_id, timeout)


def collect_before_fork() -> None:
    """Collect garbage now, before hivemind forks a child (the DHT, an averaging process).

    Garbage still uncollected at the fork is inherited, and the child's collector would free it
    there: a torch tensor in shared memory (an averager's buffers) is then closed in the child,
    which tries to unlink a file its owner already unlinked, and torch aborts the child
    ("could not unlink the shared memory file"). A DHT process died that way in one test run.
    """
    gc.collect()
