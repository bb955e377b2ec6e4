"""Matchmaking declarations sent straight to the stage's other servers, besides the DHT.

hivemind's matchmaking finds a round's leader through the DHT: each member stores "looking for a
group under key K until time T" there, and reads the key until it sees a member that leads (the
earliest T). On two loaded cores a store and a read through the DHT process take 0.3-0.8 s, as long
as a batch's compute, and a member leaving matchmaking also waits for a store saying it stopped
looking. Yet the servers of a stage already know each other from their progress records. So each
member also sends its declaration straight to the servers it expects in the round (one libp2p call
each), and reads the others' from what they sent it; a round forms as soon as they arrive. The DHT
stays underneath, for what the direct way does not reach: a declaration is stored there too (in the
background) unless every expected server took it, and the DHT is read, its answer merged in, unless
every expected server has declared under the key straight to us; so a server not known yet, or one
that cannot be reached directly, is still found. (When the direct way reaches everyone, a round
stores and reads nothing in the DHT: stores and reads per round were most of a server's DHT traffic,
bench/scaling.py.)

A receiver believes a declaration only from a server it expects (the parent passes their peer ids
with each round, from the stage's signed records), only about the sender itself (libp2p
authenticates it), for a group key of this averager's prefix, and with an expiration within the
matchmaking horizon; it keeps at most :data:`MAX_KEYS` keys, one entry per server each. A server of
the stage that lies here can only make the others try to join it, which it could do through the
DHT anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterable

from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

MAX_KEYS = 16  # group keys kept at once (a round's key holds its step: a few are live at a time)
MAX_KEY_LENGTH = 256
# seconds between the starts of two DHT reads: the DHT is the fallback here, and reads every 0.05 s were most
# of a server's DHT traffic (bench/scaling.py)
MIN_LOOKUP_INTERVAL = 0.2
# A read with nothing new returns after at most this many seconds even with no DHT read to wait for: hivemind's
# matchmaking joins a leader only after a read that ends later than it asked for one, so a read that waited
# for the next declaration instead (up to the lookup timeout) held formed groups back (0.6-1.0 s, seen).
MAX_QUIET_READ = 0.05
CLOCK_SLACK = 1.0  # seconds a declaration may claim beyond the horizon (clocks of hosts differ)

Entry = tuple[float, bool]  # (expiration, looking for a group)
# (peers, group key, expiration, looking) -> sent to each of peers; whether every one of them took it
Send = Callable[[Iterable[PeerID], str, float, bool], Awaitable[bool]]


class Declarations:
    """The declarations this member was sent, by group key (asyncio; one event loop)."""

    def __init__(self, prefix: str, horizon: float):
        self.prefix, self.horizon = prefix, horizon
        self._pattern = re.compile(re.escape(prefix) + r"\.0b[01]*")
        self.expected: frozenset[PeerID] = frozenset()
        self._table: dict[str, dict[PeerID, Entry]] = {}
        self._changed: asyncio.Event | None = None  # created on the loop that uses it
        self.taken = self.refused = 0  # for tests and debugging

    @property
    def changed(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def expect(self, peers: Iterable[PeerID]) -> None:
        """The servers this member may hear from (its stage's, this round)."""
        self.expected = frozenset(peers)

    def take(self, sender: PeerID, key: object, expiration: object, looking: object) -> bool:
        """Keep `sender`'s declaration if it is believable (see the module's docstring); whether it was kept."""
        now = get_dht_time()
        if sender not in self.expected or not isinstance(key, str) or len(key) > MAX_KEY_LENGTH \
                or not self._pattern.fullmatch(key) or not isinstance(looking, bool) \
                or not isinstance(expiration, float) or not math.isfinite(expiration) \
                or not now < expiration <= now + self.horizon + CLOCK_SLACK:
            self.refused += 1
            return False
        self._forget_expired(now)
        if key not in self._table and len(self._table) >= MAX_KEYS:  # the key that lives shortest goes
            del self._table[min(self._table, key=lambda k: max(e for e, _ in self._table[k].values()))]
        entries = self._table.setdefault(key, {})
        if _supersedes((expiration, looking), entries.get(sender)):
            entries[sender] = (expiration, looking)
            self.changed.set()
        self.taken += 1
        return True

    def entries(self, key: str) -> dict[PeerID, Entry]:
        """What was declared under `key` by servers still expected, and not expired."""
        now = get_dht_time()
        return {peer: entry for peer, entry in self._table.get(key, {}).items()
                if peer in self.expected and entry[0] > now}

    def _forget_expired(self, now: float) -> None:
        for key in list(self._table):
            entries = self._table[key]
            for peer in [p for p, (expiration, _) in entries.items() if expiration <= now]:
                del entries[peer]
            if not entries:
                del self._table[key]


def merged(*sources: dict[PeerID, Entry], only_active: bool) -> list[tuple[PeerID, float]]:
    """(peer, expiration) of each declared averager, as hivemind's get_averagers returns them: per peer the
    entry that expires last wins (as in the DHT), then those no longer looking are left out if `only_active`."""
    best: dict[PeerID, Entry] = {}
    for source in sources:
        for peer, entry in source.items():
            if _supersedes(entry, best.get(peer)):
                best[peer] = entry
    return [(peer, expiration) for peer, (expiration, looking) in best.items() if looking or not only_active]


def _supersedes(entry: Entry, known: Entry | None) -> bool:
    """As in the DHT, the later expiration wins; at one expiration, "no longer looking" wins."""
    return known is None or (entry[0], not entry[1]) > (known[0], not known[1])


class DirectKeyManager(GroupKeyManager):
    """hivemind's GroupKeyManager (it keeps the group key), declaring and finding averagers both through
    the DHT and straight from the stage's servers (see the module's docstring)."""

    def __init__(self, base: GroupKeyManager, declarations: Declarations, send: Send, lookup_timeout: float):
        super().__init__(base.dht, base.prefix, base.group_bits, base.target_group_size)
        self.declarations, self._send, self.lookup_timeout = declarations, send, lookup_timeout
        self._found: dict[str, dict[PeerID, Entry]] = {}  # the last DHT read of each key
        self._lookups: dict[str, asyncio.Task] = {}
        self._returned: dict[str, list[tuple[PeerID, float]]] = {}
        self._background: set[asyncio.Task] = set()
        self._last_lookup = float("-inf")  # (event loop time)
        self._stored: dict[str, None] = {}  # group keys this member declared under in the DHT (newest last)

    async def declare_averager(self, group_key: str, peer_id: PeerID, expiration_time: float,
                               looking_for_group: bool = True) -> bool:
        # The DHT store runs in the background: hivemind awaits this call when a member leaves matchmaking
        # ("no longer looking"), which would hold the formed group back by a DHT round trip.
        declaring = self._declare(group_key, peer_id, float(expiration_time), looking_for_group)
        if looking_for_group:
            await declaring
        else:
            self._in_background(declaring)
        return True

    async def _declare(self, group_key: str, peer_id: PeerID, expiration: float, looking: bool) -> None:
        expected = self.declarations.expected
        if group_key in self._stored:  # our entry there is overwritten whatever the direct way does (leaving)
            self._store(group_key, peer_id, expiration, looking)
            if expected:
                await self._send(expected, group_key, expiration, looking)
        elif not (expected and await self._send(expected, group_key, expiration, looking)):
            self._store(group_key, peer_id, expiration, looking)

    def _store(self, group_key: str, peer_id: PeerID, expiration: float, looking: bool) -> None:
        self._stored[group_key] = None
        while len(self._stored) > MAX_KEYS:
            del self._stored[next(iter(self._stored))]
        self._in_background(super().declare_averager(group_key, peer_id, expiration, looking))

    async def get_averagers(self, group_key: str, only_active: bool) -> list[tuple[PeerID, float]]:
        declarations = self.declarations
        declarations.changed.clear()  # (a declaration taken from here on wakes the wait below)
        waits = set() if self._everyone_declared(group_key) else {self._lookup(group_key)}
        found = merged(self._found.get(group_key, {}), declarations.entries(group_key), only_active=only_active)
        if set(found) == set(self._returned.get(group_key, [])):
            # nothing new: wait for a declaration sent to us or for the DHT read, whichever comes first
            # (with no read to wait for, a short pause: see MAX_QUIET_READ)
            changed = asyncio.ensure_future(declarations.changed.wait())
            try:
                await asyncio.wait({changed, *waits}, timeout=self.lookup_timeout if waits else MAX_QUIET_READ,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
            found = merged(self._found.get(group_key, {}), declarations.entries(group_key), only_active=only_active)
        self._returned = {group_key: found}  # (only the key being read matters)
        return found

    def _everyone_declared(self, group_key: str) -> bool:
        """Whether every expected server declared under `group_key` straight to us (then the DHT could only add
        servers not expected)."""
        expected = self.declarations.expected
        return bool(expected) and expected <= set(self.declarations.entries(group_key))

    def _lookup(self, group_key: str) -> asyncio.Task:
        """The DHT read of `group_key` in flight, or a new one; its result lands in `_found`."""
        task = self._lookups.get(group_key)
        if task is None or task.done():
            self._lookups = {k: t for k, t in self._lookups.items() if not t.done()}
            loop = asyncio.get_running_loop()
            delay = max(0.0, self._last_lookup + MIN_LOOKUP_INTERVAL - loop.time())
            self._last_lookup = loop.time() + delay
            task = self._lookups[group_key] = asyncio.create_task(self._read(group_key, delay))
        return task

    async def _read(self, group_key: str, delay: float) -> None:
        await asyncio.sleep(delay)  # (a DHT that fails at once is not asked in a busy loop)
        if self._everyone_declared(group_key):  # (meanwhile)
            return
        try:
            found = await asyncio.wait_for(super().get_averagers(group_key, only_active=True), self.lookup_timeout)
        except Exception as e:  # noqa: BLE001 - the DHT is the fallback here: what was sent to us still counts
            logger.debug("reading %s from the DHT failed: %s", group_key, e)
            return
        self._found = {group_key: {peer: (float(expiration), True) for peer, expiration in found}}

    def _in_background(self, work: Awaitable) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)


def _log_failure(task: asyncio.Task) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        if task.exception() is not None:
            logger.debug("a matchmaking declaration failed: %s", task.exception())
