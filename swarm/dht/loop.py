"""An asyncio event loop on a thread of our own, so sync code can drive P2P handlers and calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from swarm.tasks import hold_tasks

T = TypeVar("T")

DEFAULT_LOOP_START_TIMEOUT = 10.0
DEFAULT_LOOP_STOP_TIMEOUT = 5.0


class BackgroundLoop:
    """Runs an asyncio loop on a daemon thread; ``run(coro, timeout)`` executes a coroutine there.

    P2P replicas and the handlers registered on them belong to the loop that created them, so one
    process should keep one BackgroundLoop for all its RPC servers and clients.
    """

    def __init__(self, name: str = "swarm-loop"):
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = DEFAULT_LOOP_START_TIMEOUT) -> BackgroundLoop:
        """Start the thread and wait until its loop runs."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} is already started")
        started = threading.Event()
        self._loop = hold_tasks(asyncio.new_event_loop())
        self._thread = threading.Thread(target=self._serve, args=(started,), name=self.name, daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise TimeoutError(f"{self.name} did not start within {timeout:g}s")
        return self

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(started.set)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or not self.is_running:
            raise RuntimeError(f"{self.name} is not running")
        return self._loop

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and return its result; TimeoutError (and the task cancelled) after `timeout`."""
        try:
            loop = self.loop
        except RuntimeError:
            coro.close()  # never awaited: close it so Python does not warn
            raise
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise TimeoutError(f"coroutine {coro.__qualname__} did not finish within {timeout:g}s") from None

    def stop(self, timeout: float = DEFAULT_LOOP_STOP_TIMEOUT) -> None:
        """Cancel what still runs on the loop, stop it and join its thread (at most `timeout` seconds)."""
        if not self.is_running:
            return
        try:
            self.run(self._cancel_tasks(), timeout)
        except TimeoutError:
            pass  # the loop is stuck in a blocking call; stop it anyway
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)

    @staticmethod
    async def _cancel_tasks() -> None:
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> BackgroundLoop:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
