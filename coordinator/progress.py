"""Progress for people: one line per update, or a live line on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressLine:
    """Prints training progress to a stream; rewrites one line in place when it is a terminal."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, every: int = 1):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.every = max(1, every)
        self.started = time.monotonic()

    def update(self, step: int, **fields: object) -> None:
        if not self.live and step % self.every and step != self.total:
            return
        parts = [f"step {step}/{self.total}"]
        for name, value in fields.items():
            parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
        parts.append(f"{time.monotonic() - self.started:.0f}s")
        line = " | ".join(parts)
        if self.live:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()
