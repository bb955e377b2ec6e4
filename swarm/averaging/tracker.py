"""Publishing this server's progress and reading its stage's, in the DHT, on a thread of its own.

Each server of a stage owns one subkey (its owner marker, so only it can write there) of the key
``{prefix}.progress``. Records expire after PROGRESS_TTL_PERIODS periods, so a server that dies
without a word stops counting within a few seconds; one that leaves cleanly overwrites its record
with None at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.utils import get_dht_time

from swarm.averaging.channel import ProgressChannel
from swarm.averaging.progress import ProgressRecord, seniors
from swarm.dht.errors import SwarmDHTError
from swarm.dht.keys import PROGRESS_SUFFIX
from swarm.dht.node import require_alive, wait_future
from swarm.tenure import TenureBook

log = logging.getLogger(__name__)

PROGRESS_TTL_PERIODS = 5  # a record lives this many progress periods unless renewed
MIN_PAUSE_PERIODS = 0.2  # at most this often (in periods) even when nudged: bounds DHT traffic


def progress_key(prefix: str) -> str:
    return prefix + PROGRESS_SUFFIX  # (keys.RunRecordGuard guards these keys)


class StageProgressTracker:
    """Keeps this server's record fresh and the others' at hand; calls `on_update` after each change.

    With a :class:`~swarm.averaging.channel.ProgressChannel`, each change of this server's record
    is also pushed to the others at once, and theirs arrive the same way; the DHT, read every
    period, still decides who is in the stage and carries the records of servers that cannot be
    reached directly. A change is published in the DHT sooner (but at most every MIN_PAUSE_PERIODS)
    only when a push did not carry it, or there is no channel: a publication and a read every fifth
    of a period on every server of every stage were most of the DHT's traffic (bench/scaling.py).
    """

    def __init__(self, dht: hivemind.DHT, prefix: str, owner_key: bytes, peer_id: str, period: float,
                 request_timeout: float, own_record: Callable[[], ProgressRecord], on_update: Callable[[], None]):
        self.dht, self.key, self.owner_key, self.peer_id = dht, progress_key(prefix), owner_key, peer_id
        self.period, self.request_timeout = period, request_timeout
        self.ttl = PROGRESS_TTL_PERIODS * period
        self._own_record, self._on_update = own_record, on_update
        self._lock = threading.Lock()  # guards _others and _current
        self._others: dict[str, tuple[ProgressRecord, float]] = {}  # peer id -> (record, expiration)
        self._current: ProgressRecord | None = None  # this server's record, stamped when it last changed
        self._published: tuple[ProgressRecord, float] | None = None  # (record, monotonic time) in the DHT
        self._channel: ProgressChannel | None = None
        self._nudged = threading.Event()  # our record changed: publish soon
        self._wake = threading.Event()  # something changed: look again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # how long each other server has been seen in the DHT's reads, without a gap longer than its record's life
        # (on the DHT's clock, which the records' `since` claims are on too: progress.seniors compares them)
        self._tenure = TenureBook(clock=get_dht_time, grace=self.ttl)
        self._serving_since: float | None = None  # DHT time this server first published its progress

    def start(self, channel: ProgressChannel | None = None) -> None:
        self._channel = channel
        if channel is not None:
            channel.on_missed = self._wake.set
        self._thread = threading.Thread(target=self._run, name=f"progress:{self.key}", daemon=True)
        self._thread.start()

    def nudge(self) -> None:
        """This server's samples or step changed: push the record now, publish it in the DHT soon."""
        if self._channel is not None and not self._stop.is_set():
            record, changed = self._stamp()
            if changed:
                self._channel.push(record, [peer for peer, _ in self._live()])
        self._nudged.set()
        self._wake.set()

    def receive(self, record: ProgressRecord, sender: str) -> bool:
        """A record pushed by `sender`: taken if it is a known server's own and newer than what we hold."""
        with self._lock:
            known = self._others.get(sender)
            if self._stop.is_set() or known is None or record.peer_id != sender or record.updated <= known[0].updated:
                return False
            self._others[sender] = (record, max(known[1], get_dht_time() + self.ttl))
        self._wake.set()
        return True

    def others(self) -> list[ProgressRecord]:
        """Live records of the stage's other servers, as of the last read or push."""
        return [record for _, record in self._live()]

    def established(self, min_tenure: float) -> set[str]:
        """The other servers this one has seen in every read of the stage's progress for `min_tenure` seconds."""
        now = get_dht_time()
        with self._lock:
            live = [peer for peer, (_, expiration) in self._others.items() if expiration > now]
            return self._tenure.established_peers(live, min_tenure)

    def elders(self) -> set[str]:
        """The live servers that were serving this stage before this one began to (progress.seniors)."""
        with self._lock:
            now = get_dht_time()
            live = [record for record, expiration in self._others.values() if expiration > now]
            witnessed = {r.peer_id: since for r in live if (since := self._tenure.since(r.peer_id)) is not None}
            return seniors(self._serving_since, live, witnessed, slack=self.ttl)

    def refresh(self) -> None:
        """Publish this server's record if it changed (or is getting old), then read everyone's."""
        if self._stop.is_set():  # left: publishing again would undo that
            return
        record, _ = self._stamp()
        last = self._published
        if last is None or last[0] is not record or time.monotonic() - last[1] > self.ttl / 2:
            if self._store(record.to_wire()):
                self._published = (record, time.monotonic())
        self._merge(self._read())

    def read(self) -> None:
        """Read everyone's records without publishing this server's (a joiner has no progress yet)."""
        self._merge(self._read())

    def stop(self, leave: bool = True) -> None:
        """Stop the thread; with `leave`, replace this server's record with None so others stop counting it."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.request_timeout * 2 + self.period)
        with self._lock:
            self._others = {}
        if leave and self._published is not None:
            self._store(None)

    def _stamp(self) -> tuple[ProgressRecord, bool]:
        """This server's record now, stamped with the DHT time it last changed; and whether it just did."""
        with self._lock:
            if self._serving_since is None:  # this server's first record: it serves its stage from now on
                self._serving_since = get_dht_time()
            since = self._serving_since
        record = self._own_record().copy(update={"since": since})
        with self._lock:
            if record.same_progress(self._current):
                return self._current, False
            self._current = record.copy(update={"updated": get_dht_time()})
            return self._current, True

    def _live(self) -> list[tuple[str, ProgressRecord]]:
        now = get_dht_time()
        with self._lock:
            return [(peer, record) for peer, (record, expiration) in self._others.items() if expiration > now]

    def _merge(self, read: dict[str, tuple[ProgressRecord, float]] | None) -> None:
        """The DHT's records replace ours, except where a push brought a newer copy of the same server's."""
        if read is None:  # the read failed: keep the last view; its records still expire on time
            return
        with self._lock:
            self._tenure.observe(read)  # a server missing from a read starts its tenure anew
            for peer, (record, expiration) in read.items():
                known = self._others.get(peer)
                if known is not None and known[0].updated > record.updated:
                    read[peer] = (known[0], max(expiration, known[1]))
            self._others = read

    def _run(self) -> None:
        last = -float("inf")  # monotonic time of the last refresh
        pause = self.period * MIN_PAUSE_PERIODS
        while not self._stop.is_set():
            due = last + (pause if self._hurry() else self.period)
            if time.monotonic() >= due:
                self._nudged.clear()
                if self._channel is not None:
                    self._channel.clear_missed()
                try:
                    self.refresh()
                except Exception as e:  # noqa: BLE001 - a DHT hiccup must not stop the tracking
                    log.warning("stage progress %s: %s", self.key, e)
                last = time.monotonic()
            try:
                self._on_update()
            except Exception as e:  # noqa: BLE001
                log.warning("stage progress %s: %s", self.key, e)
            due = last + (pause if self._hurry() else self.period)
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()

    def _hurry(self) -> bool:
        """Whether to refresh before the period is up: this server's record changed and no push carried it."""
        return self._nudged.is_set() and (self._channel is None or self._channel.missed())

    def _store(self, value: Any) -> bool:
        try:
            require_alive(self.dht, f"storing {self.key}")
            future = self.dht.store(self.key, subkey=self.owner_key, value=value,
                                    expiration_time=get_dht_time() + self.ttl, return_future=True)
            return bool(wait_future(future, self.request_timeout, f"storing {self.key}"))
        except SwarmDHTError as e:
            log.debug("%s", e)
            return False

    def _read(self) -> dict[str, tuple[ProgressRecord, float]] | None:
        try:
            require_alive(self.dht, f"reading {self.key}")
            future = self.dht.get(self.key, latest=True, return_future=True)
            found = wait_future(future, self.request_timeout, f"reading {self.key}")
        except SwarmDHTError as e:
            log.debug("%s", e)
            return None
        if found is None or not isinstance(found.value, dict):
            return {}
        others = {}
        for item in found.value.values():
            record = ProgressRecord.from_wire(item.value) if item.value is not None else None
            if record is not None and record.peer_id != self.peer_id:
                others[record.peer_id] = (record, item.expiration_time)
        return others
