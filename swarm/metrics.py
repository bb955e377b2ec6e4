"""Prometheus metrics and the small HTTP server every process exposes on `--metrics-port`.

Each process builds its own :class:`CollectorRegistry` (no global metrics at import), so several
peers can live in one test process. `/metrics` serves the Prometheus text format; `/status`, when
a status function is given, serves JSON (the coordinator's view of the swarm).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class MetricsServer:
    """Serves `/metrics` (and optionally `/status`) over HTTP from a background thread."""

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str = "0.0.0.0",
        status: Callable[[], dict[str, Any]] | None = None,
    ):
        self.registry = registry
        self.status = status
        handler = _make_handler(self)
        try:
            self.httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port}: {e.strerror}") from None
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(server.registry))
            elif path == "/status" and server.status is not None:
                try:
                    body = json.dumps(server.status()).encode()
                except Exception as e:  # a status failure must not take the server down
                    log.warning("status failed: %s", e)
                    self._reply(500, "text/plain", f"status failed: {e}\n".encode())
                    return
                self._reply(200, "application/json", body)
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /status\n")

        def _reply(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:  # keep scrapes out of the logs
            log.debug("metrics http: " + fmt, *args)

    return Handler
