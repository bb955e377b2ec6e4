"""Which thread may change what: owners that mutators check, so a hand-off that skipped its named function
fails loudly in tests instead of racing in a run.

An object with an owner (a stage replica's StageState and its optimizer) may be changed by any thread
until it is handed to its owning thread (`Owner.hand_to`: the stage's compute thread, once the server has
loaded its state and before it serves); from then on only that thread may change it, and every other
thread hands work to it through the backend's `submit`/`call`. The check is a thread comparison, on where
SWARM_CHECK_THREADS=1 (the test suite sets it, for the processes it starts too), off otherwise.
"""

from __future__ import annotations

import os
import threading

CHECK_ENV = "SWARM_CHECK_THREADS"


class WrongThread(RuntimeError):
    """A mutator ran on a thread other than its object's owner."""


def checks_on() -> bool:
    return os.environ.get(CHECK_ENV, "") == "1"


class Owner:
    """The thread that may change an object (`what`, for the error), once handed over."""

    def __init__(self, what: str):
        self.what = what
        self.thread: threading.Thread | None = None  # None: not handed over yet, any thread may
        self._check = checks_on()

    def hand_to(self, thread: threading.Thread) -> None:
        self.thread = thread

    def check(self, mutation: str) -> None:
        """Raise WrongThread if checks are on, the object was handed over, and this is not its owner."""
        if not self._check or self.thread is None:
            return
        current = threading.current_thread()
        if current is not self.thread:
            raise WrongThread(f"{mutation} of the {self.what} ran on thread {current.name!r}, but only its owner "
                              f"{self.thread.name!r} may change it: hand the work over (e.g. backend.submit)")
