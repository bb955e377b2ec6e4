"""Small helpers shared by the tests: waiting on conditions, never on fixed sleeps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "") -> T:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        pause.wait(interval)
