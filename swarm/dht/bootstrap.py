"""Joining a run knowing only an initial peer's multiaddr.

The multiaddr's ``/p2p/<peer id>`` is the trust anchor: libp2p authenticates the channel to that peer,
so what it answers over the ``run_info`` RPC (run id, coordinator's owner key) is what that peer
vouches for. With the coordinator's key we then accept only the run config it signed.
Every peer that knows the run serves ``run_info``, so any peer's multiaddr works as an initial peer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import hivemind
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.multiaddr import Multiaddr

from swarm.config import RunConfig
from swarm.dht.errors import BootstrapError, DHTRequestTimeout, RunConfigNotFound
from swarm.dht.identity import Identity
from swarm.dht.loop import BackgroundLoop
from swarm.dht.node import (
    DEFAULT_STARTUP_TIMEOUT,
    NatOptions,
    add_run_validators,
    parse_maddrs,
    peer_id_of,
    start_dht,
)
from swarm.dht.private import SEALED_PREFIX, SwarmKey
from swarm.dht.records import SwarmRecords, other_publishers

logger = logging.getLogger(__name__)

DEFAULT_JOIN_TIMEOUT = 30.0  # whole join: run info from an initial peer, then the signed run config
DEFAULT_RUN_INFO_TIMEOUT = 5.0  # one run_info RPC to one peer
_RETRY_PAUSE = 0.5  # between rounds of asking; the answer may need the other side to finish starting
RPC_NAMESPACE = "swarm"  # with the servicer's class name, this is the protocol id on the wire


@dataclass(frozen=True)
class RunInfo:
    """What an initial peer tells a newcomer: which run this is and whose config to trust."""

    run_id: str
    coordinator_key: bytes  # the coordinator's owner marker, "[owner:ssh-rsa ...]"
    coordinator_peer_id: str

    def to_bytes(self) -> bytes:
        return MSGPackSerializer.dumps(dataclasses.asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> RunInfo:
        """Parse an answer; ValueError if it is not a well-formed RunInfo (unknown extra fields are fine)."""
        try:
            fields = MSGPackSerializer.loads(data)
        except Exception as e:  # msgpack raises a zoo of types on garbage
            raise ValueError(f"undecodable run info: {e}") from None
        types = {"run_id": str, "coordinator_key": bytes, "coordinator_peer_id": str}
        if not isinstance(fields, dict) or any(not isinstance(fields.get(k), t) for k, t in types.items()):
            raise ValueError(f"malformed run info: {fields!r:.200}")
        return cls(**{name: fields[name] for name in types})


RUN_INFO_PURPOSE = "run-info"  # what a private swarm's run_info answer is sealed for (see private.py)


class RunInfoServicer(ServicerBase):
    """Answers ``rpc_run_info`` with this peer's RunInfo (hivemind's ExpertInfo carries msgpack bytes).

    In a private swarm the answer is sealed with the swarm key: libp2p's identify protocol tells
    anyone who dials this peer the name it answers under, so whoever asks may be a stranger.
    """

    def __init__(self, info: RunInfo, swarm_key: SwarmKey | None = None):
        self.info = info
        answer = info.to_bytes()
        self._answer = answer if swarm_key is None else swarm_key.seal_bytes(answer, RUN_INFO_PURPOSE)

    async def rpc_run_info(self, request: runtime_pb2.ExpertInfo, context: P2PContext) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=self._answer)


def run_info_namespace(swarm_key: SwarmKey | None) -> str:
    """Where run_info is answered: a private swarm's name for it is derived from its key (see private.py)."""
    return RPC_NAMESPACE if swarm_key is None else swarm_key.run_info_namespace()


def serve_run_info(
    dht: hivemind.DHT, loop: BackgroundLoop, info: RunInfo, timeout: float = DEFAULT_RUN_INFO_TIMEOUT,
    swarm_key: SwarmKey | None = None,
) -> RunInfoServicer:
    """Answer run_info requests from now on, on `dht`'s libp2p daemon (handlers live in `loop`)."""
    servicer = RunInfoServicer(info, swarm_key)

    async def register() -> None:
        p2p = await dht.replicate_p2p()
        await servicer.add_p2p_handlers(p2p, namespace=run_info_namespace(swarm_key))

    loop.run(register(), timeout)
    return servicer


def request_run_info(
    dht: hivemind.DHT,
    loop: BackgroundLoop,
    initial_peers: Sequence[str | Multiaddr],
    timeout: float = DEFAULT_JOIN_TIMEOUT,
    rpc_timeout: float = DEFAULT_RUN_INFO_TIMEOUT,
    swarm_key: SwarmKey | None = None,
) -> RunInfo:
    """Ask the initial peers, in turn and in rounds, for the run info until one answers or `timeout` passes."""
    namespace = run_info_namespace(swarm_key)
    peers = list(dict.fromkeys(peer_id_of(maddr) for maddr in parse_maddrs(initial_peers, "initial peer", True)))
    deadline = time.monotonic() + timeout
    failures: dict[PeerID, str] = {}
    while True:
        for peer in peers:
            left = deadline - time.monotonic()
            if left <= 0:
                reasons = "; ".join(f"{peer}: {reason}" for peer, reason in failures.items()) or "not asked"
                hint = ("is the swarm private? then start with --swarm-key and a copy of its key" if swarm_key is None
                        else "do they belong to the swarm of this --swarm-key?")
                raise BootstrapError(
                    f"none of the initial peers told which run they serve within {timeout:g}s ({reasons}): "
                    f"are they swarm peers of a running coordinator? {hint}"
                )
            try:
                answer = loop.run(_ask_run_info(dht, peer, min(rpc_timeout, left), namespace), left + 1.0)
                return RunInfo.from_bytes(_unsealed_answer(answer, swarm_key))
            except Exception as e:  # an unreachable or misbehaving peer: note why, try the next one
                failures[peer] = _one_line(e)
                logger.debug("run_info from %s failed: %s", peer, failures[peer])
        # every peer failed this round: pause briefly (they may still be starting), bounded by the deadline
        time.sleep(min(_RETRY_PAUSE, max(0.0, deadline - time.monotonic())))


def _one_line(error: Exception, limit: int = 200) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def _ask_run_info(dht: hivemind.DHT, peer: PeerID, timeout: float, namespace: str) -> bytes:
    # replicate_p2p blocks this loop on the DHT process the first time; loop.run bounds the caller anyway
    p2p = await dht.replicate_p2p()
    stub = RunInfoServicer.get_stub(p2p, peer, namespace=namespace)
    response = await stub.rpc_run_info(runtime_pb2.ExpertInfo(), timeout=timeout)
    return response.serialized_info


def _unsealed_answer(answer: bytes, swarm_key: SwarmKey | None) -> bytes:
    """A run_info answer as RunInfo.from_bytes reads it; an older peer of a private swarm answers unsealed."""
    if swarm_key is None or not answer.startswith(SEALED_PREFIX.encode()):
        return answer
    return swarm_key.open_bytes(answer, RUN_INFO_PURPOSE)


INITIAL_PEERS_FILE_PREFIX = "@"  # `--initial-peers @FILE`: the multiaddrs are in FILE (compose, scripts)
MAX_INITIAL_PEERS_FILE = 64 * 1024  # bytes read from such a file


def read_initial_peers(values: Sequence[str], timeout: float, stop: Callable[[float], bool] | None = None) -> list[str]:
    """The multiaddrs of `--initial-peers`: each value is one, or `@FILE` naming a file that lists some.

    A coordinator started with `--initial-peers-file FILE` writes that file once others can join; a
    peer started at the same time (as compose does) waits up to `timeout` seconds for it to appear.
    `stop(seconds)` waits between looks and returns True to give up early (a shutdown signal).
    """
    found: list[str] = []
    wait = stop or (lambda seconds: bool(time.sleep(seconds)))
    for value in values:
        if not value.startswith(INITIAL_PEERS_FILE_PREFIX):
            found.append(value)
            continue
        path = Path(value[len(INITIAL_PEERS_FILE_PREFIX):])
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline or wait(_RETRY_PAUSE):
                raise BootstrapError(f"initial peers file {path} did not appear within {timeout:.0f}s "
                                     "(the coordinator writes it with --initial-peers-file once it is up)")
        with open(path, "rb") as f:
            text = f.read(MAX_INITIAL_PEERS_FILE + 1)
        if len(text) > MAX_INITIAL_PEERS_FILE:
            raise BootstrapError(f"initial peers file {path} is over {MAX_INITIAL_PEERS_FILE} bytes")
        listed = text.decode(errors="replace").split()
        if not listed:
            raise BootstrapError(f"initial peers file {path} lists no multiaddr")
        found.extend(listed)
    return found


def write_initial_peers(path: str | Path, maddrs: Sequence[str]) -> None:
    """Write the multiaddrs others can join through, atomically (a reader never sees half a file)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(f"{m}\n" for m in maddrs))
    temporary.replace(path)


def join_run(
    initial_peers: Sequence[str | Multiaddr],
    identity: Identity,
    loop: BackgroundLoop,
    *,
    host_maddrs: Sequence[str | Multiaddr] = ("/ip4/127.0.0.1/tcp/0",),
    announce_maddrs: Sequence[str | Multiaddr] = (),
    client_mode: bool = False,
    timeout: float = DEFAULT_JOIN_TIMEOUT,
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
    swarm_key: SwarmKey | None = None,
    nat: NatOptions | None = None,
) -> tuple[hivemind.DHT, RunInfo, RunConfig]:
    """Join the run the initial peers belong to: start a DHT node, learn the run, fetch its signed config.

    Raises BootstrapError if no initial peer answers, RunConfigNotFound if the coordinator's config does
    not show up within `timeout`, RunConfigInvalid if it is unusable. The DHT is shut down on failure;
    on success the caller owns it (and should serve_run_info with the returned RunInfo).
    """
    if not initial_peers:
        raise BootstrapError("no initial peers given: pass the multiaddr the coordinator printed")
    deadline = time.monotonic() + timeout
    dht = start_dht(
        None, identity, initial_peers, host_maddrs, announce_maddrs, client_mode, startup_timeout=startup_timeout,
        nat=nat,
    )
    try:
        info = request_run_info(dht, loop, initial_peers, timeout=max(0.0, deadline - time.monotonic()),
                                swarm_key=swarm_key)
        add_run_validators(dht, info.run_id, coordinator_key=info.coordinator_key)
        records = SwarmRecords(dht, info.run_id, identity, swarm_key=swarm_key)
        return dht, info, _wait_for_run_config(records, info, deadline)
    except BaseException:
        dht.shutdown()
        raise


def _wait_for_run_config(records: SwarmRecords, info: RunInfo, deadline: float) -> RunConfig:
    """Fetch the coordinator's config, retrying until `deadline`: it may not have reached our neighbors yet.

    A config signed by anyone else (a coordinator restarted with a new identity) is never taken instead:
    the error then names its signers and what to do.
    """
    others: tuple[str, ...] = ()
    while True:
        left = deadline - time.monotonic()
        try:
            return records.fetch_run_config(info.coordinator_key, timeout=max(left, 0.1))
        except (RunConfigNotFound, DHTRequestTimeout) as e:  # RunConfigInvalid won't improve by waiting
            others = getattr(e, "others", others)
            if deadline - time.monotonic() <= 0:
                raise RunConfigNotFound(
                    f"joined run {info.run_id!r} but found no run config signed by its coordinator "
                    f"(peer {info.coordinator_peer_id}) in the DHT: is the coordinator still running?"
                    + other_publishers(others), others) from None
        time.sleep(min(_RETRY_PAUSE, max(0.0, deadline - time.monotonic())))
