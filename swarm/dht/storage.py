"""What a DHT node keeps for other peers: bounded in bytes, entries and lifetime, whoever asks.

hivemind's DHTLocalStorage keeps every value any peer stores, until the expiry that peer chose: a
stock hivemind node made a coordinator hold 96 MiB for 30 days in 6 s (+126 MiB RSS). BoundedStorage
takes its place as every node's storage and cache (install_bounded_storage) and keeps only:

- entries that expire at most MAX_RECORD_LIFETIME ahead (a record's ttl is at most MAX_RECORD_TTL,
  plus a minute for clocks that disagree);
- subkeys of at most MAX_SUBKEY_BYTES; values of at most a record (MAX_RECORD_BYTES and its
  signature) at the run's keys and OTHER_VALUE_BYTES at any other key (hivemind's averaging stores
  a float or a bool there);
- at most `max_subkeys` subkeys per key and `budget` bytes per pool. The run's keys and all other
  keys are two pools, so a flood of one cannot crowd out the other. An entry is charged its bytes
  plus ENTRY_OVERHEAD for the Python objects that hold it.

A store that does not fit is judged by shares. An entry at a run key belongs to its signer (the
run's guard admits there only subkeys that are exactly their signer's owner marker); an entry at
another key is its own owner. The owner holding the most loses entries (its oldest first) while
it still holds more than the storer would; when no owner does, the store is refused. Ties go to
what is held: an owner seen earlier, or an entry that expires sooner. So one key flooding the run's
keys is the first to lose what it stored, a renewal never grows memory, and the records of this
node's own key and of the run's coordinator are never dropped.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time
from hivemind.utils.timed_storage import ValueWithExpiration

from swarm.dht.keys import MAX_RECORD_BYTES, MAX_RECORD_LIFETIME, MAX_SUBKEY_BYTES, SIGNATURE_BYTES

logger = logging.getLogger(__name__)

OTHER_VALUE_BYTES = 256
ENTRY_OVERHEAD = 1280  # measured: 0.95-1.25 KB of Python objects per entry besides its subkey and value bytes
REPORT_PERIOD = 60.0  # seconds between two warnings about refused or dropped entries
_PLAIN = None  # the "subkey" of a plain value (hivemind's API says subkey=None)


@dataclass(frozen=True)
class PoolLimits:
    budget: int  # bytes charged to all entries of the pool
    max_subkeys: int  # per key
    max_value: int  # bytes of one value


@dataclass(frozen=True)
class StorageLimits:
    run: PoolLimits  # the run's keys (signed records)
    other: PoolLimits  # every other key (hivemind's averaging; anything a stranger makes up)


MiB = 1 << 20
RUN_RECORD = MAX_RECORD_BYTES + SIGNATURE_BYTES
# For scale: a swarm of 1,000 peers (64 stages x 8 servers, 488 trainers) with the largest records each kind
# allows holds ~7 MB in all (tests/unit/test_dht_storage.py); a node holds it all only in a swarm of at most
# 5 nodes (hivemind's num_replicas), otherwise its share of the keys. Cached copies of others' are bounded apart.
STORAGE_LIMITS = StorageLimits(run=PoolLimits(8 * MiB, 4096, RUN_RECORD),
                               other=PoolLimits(2 * MiB, 256, OTHER_VALUE_BYTES))
CACHE_LIMITS = StorageLimits(run=PoolLimits(2 * MiB, 4096, RUN_RECORD),
                             other=PoolLimits(MiB // 4, 256, OTHER_VALUE_BYTES))


class _Entry:
    __slots__ = ("value", "expiration", "charge", "owner", "seq")

    def __init__(self, value: bytes, expiration: float, charge: int, owner: Any, seq: int):
        self.value, self.expiration, self.charge, self.owner, self.seq = value, expiration, charge, owner, seq


class _Owner:
    __slots__ = ("charge", "tiebreak", "trusted", "slots", "version")

    def __init__(self, tiebreak: float, trusted: bool):
        self.charge, self.tiebreak, self.trusted, self.version = 0, tiebreak, trusted, 0
        self.slots: dict[tuple[DHTID, Any], None] = {}  # (key, subkey) of its entries, oldest first


class _Pool:
    """The entries of one kind of key: their bytes and who holds them, largest holder first."""

    def __init__(self, limits: PoolLimits):
        self.limits, self.used = limits, 0
        self.owners: dict[Any, _Owner] = {}
        self._largest: list[tuple[int, float, int, Any]] = []  # (-charge, -tiebreak, version, owner id): lazy
        self._versions = itertools.count(1)

    def charge(self, owner_id: Any, owner: _Owner, delta: int) -> None:
        owner.charge += delta
        self.used += delta
        if not owner.slots:
            del self.owners[owner_id]
            return
        owner.version = next(self._versions)  # the owner's older items in the heap are stale from now on
        if owner.trusted:
            return
        heapq.heappush(self._largest, (-owner.charge, -owner.tiebreak, owner.version, owner_id))
        if len(self._largest) > 2 * len(self.owners) + 64:
            self._largest = [(-o.charge, -o.tiebreak, o.version, i) for i, o in self.owners.items() if not o.trusted]
            heapq.heapify(self._largest)

    def largest(self) -> tuple[Any, _Owner] | None:
        """The untrusted owner holding the most (of two holding as much, the later one)."""
        while self._largest:
            _, _, version, owner_id = self._largest[0]
            owner = self.owners.get(owner_id)
            if owner is not None and owner.version == version:
                return owner_id, owner
            heapq.heappop(self._largest)
        return None


def _subkey_bytes(subkey: Any) -> int | None:
    """What a subkey weighs; None if it is not a plain scalar (msgpack may decode a tuple, hashable and huge)."""
    if subkey is None or isinstance(subkey, (bool, int, float)):
        return 16
    if isinstance(subkey, (bytes, str)):
        return len(subkey)
    return None


class BoundedStorage:
    """A DHT node's local storage (or cache) that keeps within `limits` (see the module docstring).

    It answers what hivemind's DHTProtocol and DHTNode ask of their storage and cache: store,
    store_subkey, get, items, `in`, `del`, len. A dictionary value is returned as a fresh
    DictionaryDHTValue, so whatever a caller merges into it stays out of the storage.
    """

    def __init__(self, limits: StorageLimits, trusted: Iterable[bytes] = (), run_keys: Iterable[DHTID] = ()):
        self.limits = limits
        self.trusted = set(trusted)  # owner markers whose records are never dropped
        self.run_keys: set[DHTID] = set(run_keys)
        self._run, self._other = _Pool(limits.run), _Pool(limits.other)
        self._data: dict[DHTID, dict[Any, _Entry]] = {}
        self._expiring: list[tuple[float, int, DHTID, Any]] = []  # (expiration, seq, key, subkey): lazy
        self._entries = 0
        self._seq = itertools.count()
        self.refused = self.dropped = 0  # since the last report
        self._last_report = time.monotonic()

    # what hivemind calls
    def store(self, key: DHTID, value: Any, expiration_time: float, subkey: Any = None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if isinstance(value, DictionaryDHTValue):  # a whole dictionary: a search result being cached
            with value.freeze():
                items = list(value.items())
            return any([self.store_subkey(key, sub, item.value, item.expiration_time) for sub, item in items])
        return self._put(key, _PLAIN, value, expiration_time)

    def store_subkey(self, key: DHTID, subkey: Any, value: Any, expiration_time: float) -> bool:
        if subkey is _PLAIN:  # hivemind never sends it as a subkey; refused rather than mistaken for a plain value
            return False
        return self._put(key, subkey, value, expiration_time)

    def get(self, key: DHTID) -> ValueWithExpiration | None:
        self._expire(get_dht_time())
        entries = self._data.get(key)
        if not entries:
            return None
        if _PLAIN in entries:
            entry = entries[_PLAIN]
            return ValueWithExpiration(entry.value, entry.expiration)
        dictionary = DictionaryDHTValue()
        for subkey, entry in entries.items():
            dictionary.store(subkey, entry.value, entry.expiration)
        return ValueWithExpiration(dictionary, dictionary.latest_expiration_time)

    def items(self) -> Iterator[tuple[DHTID, ValueWithExpiration]]:
        self._expire(get_dht_time())
        for key in list(self._data):
            found = self.get(key)
            if found is not None:
                yield key, found

    def __contains__(self, key: DHTID) -> bool:
        self._expire(get_dht_time())
        return key in self._data

    def __delitem__(self, key: DHTID) -> None:
        for subkey in list(self._data.get(key, ())):
            self._remove(key, subkey)

    def __len__(self) -> int:
        self._expire(get_dht_time())
        return len(self._data)

    def __bool__(self) -> bool:
        return bool(self._data)

    def __repr__(self) -> str:
        return f"BoundedStorage({len(self._data)} keys, {self._entries} entries, {self.used_bytes} bytes)"

    # ours
    @property
    def used_bytes(self) -> int:
        """Bytes charged to every entry held (values, subkeys and ENTRY_OVERHEAD each)."""
        return self._run.used + self._other.used

    @property
    def entries(self) -> int:
        return self._entries

    def trust(self, markers: Iterable[bytes]) -> None:
        """Never drop what `markers` (owner markers) sign, nor refuse it for want of room."""
        for marker in markers:
            self.trusted.add(marker)
            owner = self._run.owners.get(marker)
            if owner is not None and not owner.trusted:
                owner.trusted = True
                self._run.charge(marker, owner, 0)  # out of the largest-holder order from now on

    def set_run_keys(self, key_ids: Iterable[DHTID]) -> None:
        """Treat `key_ids` as the run's keys from now on; what is held there (unchecked) is dropped."""
        key_ids = set(key_ids) - self.run_keys
        for key in key_ids & self._data.keys():
            del self[key]
        self.run_keys |= key_ids

    def _pool(self, key: DHTID) -> _Pool:
        return self._run if key in self.run_keys else self._other

    def _put(self, key: DHTID, subkey: Any, value: Any, expiration: float) -> bool:
        now = get_dht_time()
        pool = self._pool(key)
        subkey_bytes = _subkey_bytes(subkey)
        if (not isinstance(value, bytes) or subkey_bytes is None or subkey_bytes > MAX_SUBKEY_BYTES
                or len(value) > pool.limits.max_value or not now <= expiration <= now + MAX_RECORD_LIFETIME):
            return self._refuse()
        self._expire(now)
        entries = self._data.get(key, {})
        old = entries.get(subkey)
        # hivemind's rule: a key holds a plain value or a dictionary, whichever expires later
        superseded = [s for s in entries if (s is _PLAIN) != (subkey is _PLAIN)]
        if (old is not None and old.expiration >= expiration) or any(entries[s].expiration >= expiration
                                                                     for s in superseded):
            return False
        owner_id = subkey if pool is self._run and isinstance(subkey, bytes) else (key, subkey)
        trusted = owner_id in self.trusted
        owner = pool.owners.get(owner_id)
        charge = len(value) + subkey_bytes + ENTRY_OVERHEAD
        after = (charge + (owner.charge if owner else 0) - (old.charge if old else 0),
                 expiration if isinstance(owner_id, tuple) else owner.tiebreak if owner else float("inf"))
        if old is None and len(entries) - len(superseded) >= pool.limits.max_subkeys \
                and not self._make_room_in_key(key, pool, owner_id, after, trusted):
            return self._refuse()
        if (old is None or charge > old.charge) and not self._make_room(pool, charge - (old.charge if old else 0),
                                                                         owner_id, after, trusted):
            return self._refuse()
        for stale in superseded + [subkey]:
            if stale in self._data.get(key, ()):  # (room making may have dropped a superseded one)
                self._remove(key, stale)
        self._add(key, subkey, _Entry(value, expiration, charge, owner_id, next(self._seq)), pool, trusted)
        return True

    def _make_room_in_key(self, key: DHTID, pool: _Pool, storer: Any, after: tuple, trusted: bool) -> bool:
        """Drop the entry at `key` whose owner holds the most, if it holds more than the storer would."""
        candidates = [(owner.charge, owner.tiebreak, subkey) for subkey, entry in self._data[key].items()
                      if entry.owner != storer and entry.owner not in self.trusted
                      for owner in [pool.owners[entry.owner]]]
        if not candidates:
            return trusted
        charge, tiebreak, subkey = max(candidates, key=lambda c: c[:2])
        if not trusted and (charge, tiebreak) <= after:
            return False
        self._remove(key, subkey, dropped=True)
        return True

    def _make_room(self, pool: _Pool, grows: int, storer: Any, after: tuple, trusted: bool) -> bool:
        """Drop entries of the largest holders until `grows` more bytes fit in `pool`."""
        while pool.used + grows > pool.limits.budget:
            largest = pool.largest()
            if largest is None or largest[0] == storer:
                return trusted  # the storer is the largest holder: it alone may not grow (a trusted one may)
            owner_id, owner = largest
            if not trusted and (owner.charge, owner.tiebreak) <= after:
                return False
            key, subkey = next(iter(owner.slots))
            self._remove(key, subkey, dropped=True)
        return True

    def _add(self, key: DHTID, subkey: Any, entry: _Entry, pool: _Pool, trusted: bool) -> None:
        self._data.setdefault(key, {})[subkey] = entry
        owner = pool.owners.get(entry.owner)
        if owner is None:
            owner = pool.owners[entry.owner] = _Owner(entry.seq, trusted)
        if isinstance(entry.owner, tuple):
            owner.tiebreak = entry.expiration
        owner.slots[key, subkey] = None
        pool.charge(entry.owner, owner, entry.charge)
        self._entries += 1
        heapq.heappush(self._expiring, (entry.expiration, entry.seq, key, subkey))
        if len(self._expiring) > 2 * self._entries + 64:  # stale items of renewed or dropped entries
            self._expiring = [(e.expiration, e.seq, k, s) for k, held in self._data.items() for s, e in held.items()]
            heapq.heapify(self._expiring)

    def _remove(self, key: DHTID, subkey: Any, dropped: bool = False) -> None:
        entries = self._data[key]
        entry = entries.pop(subkey)
        if not entries:
            del self._data[key]
        pool = self._pool(key)
        owner = pool.owners[entry.owner]
        del owner.slots[key, subkey]
        pool.charge(entry.owner, owner, -entry.charge)
        self._entries -= 1
        if dropped:
            self.dropped += 1
            self._report()

    def _expire(self, now: float) -> None:
        while self._expiring and self._expiring[0][0] < now:
            _, seq, key, subkey = heapq.heappop(self._expiring)
            entry = self._data.get(key, {}).get(subkey)
            if entry is not None and entry.seq == seq:
                self._remove(key, subkey)

    def _refuse(self) -> bool:
        self.refused += 1
        self._report()
        return False

    def _report(self) -> None:
        if time.monotonic() - self._last_report < REPORT_PERIOD:
            return
        logger.warning("DHT storage: refused %d stores and dropped %d entries of the largest holders in the last "
                       "%.0f s (%s)", self.refused, self.dropped, time.monotonic() - self._last_report, self)
        self.refused = self.dropped = 0
        self._last_report = time.monotonic()


def install_bounded_storage(protocol: Any, trusted: Iterable[bytes], run_keys: Iterable[DHTID] = ()) -> None:
    """Bound a DHT node's storage and cache (hivemind's DHTProtocol) from now on; idempotent.

    What the node held until now is moved over within the bounds. `run_keys` are the run's keys if the
    node checked them with the run's guard from its start (see BoundedStorage.set_run_keys otherwise).
    """
    trusted, run_keys = list(trusted), list(run_keys)
    for name, limits in (("storage", STORAGE_LIMITS), ("cache", CACHE_LIMITS)):
        held = getattr(protocol, name)
        if not isinstance(held, BoundedStorage):
            bounded = BoundedStorage(limits, trusted, run_keys)
            for key, item in list(held.items()):
                bounded.store(key, item.value, item.expiration_time)
            setattr(protocol, name, bounded)
        else:
            held.trust(trusted)
