"""Tenure: how long this peer has itself watched another stay in the swarm, and what that lets it believe.

Pure logic, no I/O. A claim (a step, a state, a checkpoint) signed with a stranger's own key proves
only that the stranger made it. What a stranger cannot fake cheaply is time: a key that has been
seen ONLINE without a gap for `min_tenure` seconds, *by the one who decides*, has paid that time.
So a decision that moves this peer's state counts only established peers (watched at least
`min_tenure`), and a flood of fresh keys counts for nothing, however many there are. Each peer
keeps its own book: nobody's word about anybody's tenure is taken.

What remains possible: a patient stranger that stays ONLINE for `min_tenure` becomes established and
has one voice among its stage's established servers. Where it is the only other one, seniority
decides (swarm.averaging.progress.seniors): the server that was there first leads, and a peer's claim
to have been there first is believed only as far back as the reader itself cannot refute it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

DEFAULT_MIN_TENURE = 10.0  # seconds a peer must have been watched before its word counts


class TenureBook:
    """When this peer first saw each other peer in its current unbroken stretch of presence.

    A peer missing from reads for longer than `grace` seconds starts again from zero; a shorter gap (a
    record renewed late on a loaded machine, a read that missed it) is not a departure.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, grace: float = 0.0):
        self.clock, self.grace = clock, grace
        self._since: dict[str, float] = {}
        self._seen: dict[str, float] = {}  # when each peer was last present

    def observe(self, present: Iterable[str]) -> None:
        """The peers seen now (a whole read): newcomers start their clock, those absent past `grace` lose it."""
        now = self.clock()
        present = set(present)
        for peer in present:
            self._seen[peer] = now
        self._seen = {peer: seen for peer, seen in self._seen.items() if peer in present or now - seen < self.grace}
        self._since = {peer: self._since.get(peer, now) for peer in self._seen}

    def seconds(self, peer: str) -> float:
        """How long `peer` has been watched without a gap longer than `grace` (0 if it is not present)."""
        since = self._since.get(peer)
        return 0.0 if since is None else max(0.0, self.clock() - since)

    def since(self, peer: str) -> float | None:
        """When (on this book's clock) this peer first saw `peer` in its current stretch; None if absent."""
        return self._since.get(peer)

    def established(self, peer: str, min_tenure: float) -> bool:
        return peer in self._since and self.seconds(peer) >= min_tenure

    def established_peers(self, peers: Iterable[str], min_tenure: float) -> set[str]:
        return {peer for peer in peers if self.established(peer, min_tenure)}


def lower_median(values: Sequence[int]) -> int | None:
    """The lower median: a minority, however far it claims, does not move it. None if empty."""
    if not values:
        return None
    return sorted(values)[(len(values) - 1) // 2]
