"""Child processes of `swarm-local`: start them, read what they print, end them all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

END_TIMEOUT = 15.0  # seconds a process gets to exit after SIGTERM before SIGKILL


class Child:
    """One program of the swarm, in its own process group (it forks a DHT and a p2pd daemon)."""

    def __init__(self, name: str, module: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.out_path = log_dir / f"{name}.out"
        with open(self.log_path, "wb") as err, open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         env=None if env is None else {**os.environ, **env})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for_output(self, pattern: str, timeout: float, stop: threading.Event) -> re.Match:
        """Wait until the program's stdout matches `pattern`; RuntimeError if it exits or times out."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            match = regex.search(self.out_path.read_text(errors="replace"))
            if match:
                return match
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}: {self.last_error()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} printed nothing matching {pattern!r} within {timeout:.0f}s")
            if stop.wait(0.1):
                raise KeyboardInterrupt

    def last_error(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def terminate(self) -> None:
        # Only the program itself: it shuts down its own DHT and averaging processes, and a
        # server must still be able to announce OFFLINE through them.
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def end(self, timeout: float = END_TIMEOUT) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; also kills whatever the program forked."""
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        _signal_group(self.proc.pid, signal.SIGKILL)  # leftovers of the group (a p2pd daemon)
        return self.proc.returncode


def end_all(children: list[Child]) -> None:
    """End every child: all get SIGTERM at once, then each is waited for (SIGKILL if it lingers)."""
    for child in children:
        child.terminate()
    for child in children:
        child.end()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
