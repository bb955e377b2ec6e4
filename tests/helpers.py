"""Small helpers shared by the tests: waiting on conditions, never on fixed sleeps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "",
               explain: Callable[[], str] | None = None) -> T:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds (saying
    what `explain` returns then, if given: the state the test waited on)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            said = f": {explain()}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}{said}")
        pause.wait(interval)
