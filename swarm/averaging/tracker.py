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

from swarm.averaging.progress import ProgressRecord
from swarm.dht.errors import SwarmDHTError
from swarm.dht.node import wait_future

log = logging.getLogger(__name__)

PROGRESS_TTL_PERIODS = 5  # a record lives this many progress periods unless renewed
MIN_PAUSE_PERIODS = 0.2  # at most this often (in periods) even when nudged: bounds DHT traffic


def progress_key(prefix: str) -> str:
    return f"{prefix}.progress"


class StageProgressTracker:
    """Keeps this server's record fresh and the others' at hand; calls `on_update` after each read."""

    def __init__(self, dht: hivemind.DHT, prefix: str, owner_key: bytes, peer_id: str, period: float,
                 request_timeout: float, own_record: Callable[[], ProgressRecord], on_update: Callable[[], None]):
        self.dht, self.key, self.owner_key, self.peer_id = dht, progress_key(prefix), owner_key, peer_id
        self.period, self.request_timeout = period, request_timeout
        self.ttl = PROGRESS_TTL_PERIODS * period
        self._own_record, self._on_update = own_record, on_update
        self._others: list[tuple[ProgressRecord, float]] = []  # (record, expiration)
        self._published: tuple[ProgressRecord, float] | None = None  # (record, monotonic time)
        self._nudged = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"progress:{self.key}", daemon=True)
        self._thread.start()

    def nudge(self) -> None:
        """Publish and read again soon: this server's samples or step changed."""
        self._nudged.set()

    def others(self) -> list[ProgressRecord]:
        """Live records of the stage's other servers, as of the last read."""
        now = get_dht_time()
        return [record for record, expiration in self._others if expiration > now]

    def refresh(self) -> None:
        """Publish this server's record if it changed (or is getting old), then read everyone's."""
        if self._stop.is_set():  # left: publishing again would undo that
            return
        record = self._own_record()
        last = self._published
        if last is None or last[0] != record or time.monotonic() - last[1] > self.ttl / 2:
            if self._store(record.to_wire()):
                self._published = (record, time.monotonic())
        self._others = self._read()

    def stop(self, leave: bool = True) -> None:
        """Stop the thread; with `leave`, replace this server's record with None so others stop counting it."""
        self._stop.set()
        self._nudged.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.request_timeout * 2 + self.period)
        self._others = []
        if leave and self._published is not None:
            self._store(None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
                self._on_update()
            except Exception as e:  # noqa: BLE001 - a DHT hiccup must not stop the tracking
                log.warning("stage progress %s: %s", self.key, e)
            self._nudged.wait(self.period)
            self._nudged.clear()
            self._stop.wait(self.period * MIN_PAUSE_PERIODS)

    def _store(self, value: Any) -> bool:
        future = self.dht.store(self.key, subkey=self.owner_key, value=value,
                                expiration_time=get_dht_time() + self.ttl, return_future=True)
        try:
            return bool(wait_future(future, self.request_timeout, f"storing {self.key}"))
        except SwarmDHTError as e:
            log.debug("%s", e)
            return False

    def _read(self) -> list[tuple[ProgressRecord, float]]:
        future = self.dht.get(self.key, latest=True, return_future=True)
        try:
            found = wait_future(future, self.request_timeout, f"reading {self.key}")
        except SwarmDHTError as e:
            log.debug("%s", e)
            return self._others  # keep the last view; its records still expire on time
        if found is None or not isinstance(found.value, dict):
            return []
        others = []
        for item in found.value.values():
            record = ProgressRecord.from_wire(item.value) if item.value is not None else None
            if record is not None and record.peer_id != self.peer_id:
                others.append((record, item.expiration_time))
        return others
