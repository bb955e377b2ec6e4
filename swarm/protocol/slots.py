"""Request and transfer slots shared per caller: what one peer, or a crowd of new ones, may hold at once.

A slot is whatever a served call keeps while it runs (a request being received and answered, a
checkpoint file being sent). A global cap alone lets one caller take every slot by opening calls
and sending nothing; so three caps apply together:

- ``total``: slots held by everyone;
- ``per_caller``: slots one caller (its libp2p-authenticated peer id) holds;
- ``newcomers``: slots held together by callers this server has not served yet. A caller becomes
  known when one of its calls succeeds (``vouch``); known callers are remembered, most recent last,
  up to ``MAX_KNOWN``. So a flood of fresh peer ids, however many, leaves ``total - newcomers``
  slots to the callers that were served before it.

Each caller's count lives only while it holds a slot, so the table is bounded by ``total``.
Everything runs on one event loop: no locks.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

MAX_KNOWN = 4096  # callers remembered as served: more than a swarm has trainers and servers
PER_CALLER_SHARE = 4  # by default one caller holds at most a quarter of the slots
NEWCOMER_SHARE = 2  # by default callers never served before hold at most half of them together


class CallerSlots:
    """Slots under a global, a per-caller and a newcomers' cap (see the module's docstring)."""

    def __init__(self, total: int, per_caller: int | None = None, newcomers: int | None = None,
                 max_known: int = MAX_KNOWN, what: str = "requests", total_name: str = "max_concurrent"):
        if total < 1:
            raise ValueError(f"need at least 1 slot, got {total}")
        self.total = total
        self.per_caller = max(1, total // PER_CALLER_SHARE) if per_caller is None else per_caller
        self.newcomers = max(1, total // NEWCOMER_SHARE) if newcomers is None else newcomers
        if not 1 <= self.per_caller <= total or not 1 <= self.newcomers <= total:
            raise ValueError(f"need 1 <= per_caller, newcomers <= total ({total}), "
                             f"got {self.per_caller}, {self.newcomers}")
        self.max_known = max_known
        self.what, self.total_name = what, total_name  # for the refusal messages
        self.active = 0  # slots held now, by everyone
        self.newcomers_active = 0  # ... by callers not known when they took them
        self._held: dict[str, int] = {}  # caller -> slots it holds (callers holding none are absent)
        self._new: dict[str, int] = {}  # caller -> slots it took while still a newcomer
        self._known: OrderedDict[str, None] = OrderedDict()
        self._freed: asyncio.Event | None = None  # set when a slot comes back (for `wait_take`)

    def held(self, caller: str) -> int:
        return self._held.get(caller, 0)

    def is_known(self, caller: str) -> bool:
        return caller in self._known

    def refusal(self, caller: str) -> str | None:
        """Why `caller` cannot take a slot now, or None if it can."""
        if self.active >= self.total:
            return (f"the server is already taking in {self.active} {self.what}, its limit "
                    f"({self.total_name} {self.total})")
        if self.held(caller) >= self.per_caller:
            return (f"this caller already has {self.held(caller)} {self.what} in, the most one caller may "
                    f"(per caller {self.per_caller} of {self.total_name} {self.total})")
        if not self.is_known(caller) and self.newcomers_active >= self.newcomers:
            return (f"callers this server has not served yet have {self.newcomers_active} {self.what} in, all they "
                    f"may together (newcomers {self.newcomers} of {self.total_name} {self.total}; the rest are "
                    "kept for callers it served before)")
        return None

    def try_take(self, caller: str) -> str | None:
        """Take a slot for `caller` now: None if taken, else why not (nothing taken)."""
        reason = self.refusal(caller)
        if reason is None:
            self.active += 1
            self._held[caller] = self.held(caller) + 1
            if not self.is_known(caller):
                self.newcomers_active += 1
                self._new[caller] = self._new.get(caller, 0) + 1
        return reason

    async def wait_take(self, caller: str, timeout: float) -> str | None:
        """Take a slot for `caller`, waiting up to `timeout` seconds for one: None if taken, else why not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (reason := self.try_take(caller)) is not None:
            left = deadline - loop.time()
            if left <= 0:
                return reason
            if self._freed is None:
                self._freed = asyncio.Event()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                return self.try_take(caller)
        return None

    def give_back(self, caller: str) -> None:
        """Return one slot `caller` took."""
        held = self.held(caller)
        if held <= 0:
            raise RuntimeError(f"caller {caller} gives back a slot it does not hold")
        self.active -= 1
        if held == 1:
            del self._held[caller]
        else:
            self._held[caller] = held - 1
        new = self._new.get(caller, 0)
        if new:  # a slot taken as a newcomer counts as one until it comes back
            self.newcomers_active -= 1
            if new == 1:
                del self._new[caller]
            else:
                self._new[caller] = new - 1
        if self._freed is not None:  # wake every waiter; each checks its own caps again
            self._freed.set()
            self._freed = None

    def vouch(self, caller: str) -> None:
        """`caller` was served: from now on it takes slots as a known caller."""
        self._known[caller] = None
        self._known.move_to_end(caller)
        while len(self._known) > self.max_known:
            self._known.popitem(last=False)
