"""Logging set-up for the programs (library modules only create loggers)."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
