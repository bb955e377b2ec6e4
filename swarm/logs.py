"""Logging set-up for the programs (library modules only create loggers)."""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# seconds after the first stop signal: a program still shutting down then prints every thread's stack to stderr
STUCK_SHUTDOWN = 30.0


def setup_logging(level: str = "INFO") -> None:
    """Send log records to stderr once, and keep hivemind's own logging quieter than ours."""
    root = logging.getLogger()
    if not any(getattr(h, "_swarm", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler._swarm = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level.upper())
    try:
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")
    except ImportError:  # pragma: no cover - hivemind is a hard dependency
        pass
    logging.getLogger("hivemind").setLevel(max(logging.WARNING, root.level))
    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_drop_shutdown_noise)


def _drop_shutdown_noise(record: logging.LogRecord) -> bool:
    # p2pd's accept loop logs an ERROR for its own socket being closed on every clean shutdown.
    return "use of closed network connection" not in record.getMessage()


def stop_on_signals(stop: threading.Event, signals=(signal.SIGINT, signal.SIGTERM), stuck_after: float = STUCK_SHUTDOWN
                    ) -> None:
    """Set `stop` on any of `signals`. A program that has not exited `stuck_after` seconds after the first one
    prints the stack of every thread to stderr (faulthandler, which needs neither the GIL nor a lock) and goes
    on shutting down: a stuck exit then says where it is stuck (a CI run once saw a coordinator, signalled with
    its whole process group, neither exit nor log anything for 40 s)."""
    armed = []

    def handler(*_) -> None:
        if not armed:
            armed.append(True)
            faulthandler.dump_traceback_later(stuck_after, exit=False, file=sys.stderr)
        stop.set()

    for sig in signals:
        signal.signal(sig, handler)
