"""Prometheus metrics and the small HTTP server every process exposes on `--metrics-port`.

Each process builds its own :class:`CollectorRegistry` (no global metrics at import), so several
peers can live in one test process. `/metrics` serves the Prometheus text format and `/healthz`
says whether the process is doing its job. Other pages are routes: the coordinator adds `/status`
(JSON), `/sd` (Prometheus service discovery) and `/` (the live page for people).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_REQUEST_LINE = 8192  # bytes of "GET /path HTTP/1.1"; longer ones are refused with 414


@dataclass(frozen=True)
class Request:
    """What a route sees of an HTTP GET: its path, query string and Host header (all untrusted)."""

    path: str
    query: str
    host: str | None


@dataclass(frozen=True)
class Reply:
    code: int
    content_type: str
    body: bytes
    cache: str = "no-store"  # live figures: never cached; static assets say otherwise

    @classmethod
    def json(cls, document: Any) -> Reply:
        return cls(200, "application/json", json.dumps(document).encode())


Route = Callable[[Request], Reply]


class MetricsServer:
    """Serves `/metrics`, `/healthz` and the given routes over HTTP from a background thread.

    `health` returns None when all is well, else a one-line reason (then `/healthz` answers 503).
    A route that raises answers 500 with the error and the server keeps serving.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str = "0.0.0.0",
        routes: dict[str, Route] | None = None,
        health: Callable[[], str | None] | None = None,
    ):
        self.registry = registry
        self.routes: dict[str, Route] = {"/metrics": self._metrics, "/healthz": self._health, **(routes or {})}
        self.health = health
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

    def add_route(self, path: str, route: Route) -> None:
        self.routes[path] = route

    def _metrics(self, request: Request) -> Reply:
        return Reply(200, CONTENT_TYPE_LATEST, generate_latest(self.registry))

    def _health(self, request: Request) -> Reply:
        problem = self.health() if self.health is not None else None
        if problem is None:
            return Reply(200, "text/plain; charset=utf-8", b"ok\n")
        return Reply(503, "text/plain; charset=utf-8", f"unhealthy: {problem}\n".encode())

    def answer(self, request: Request) -> Reply:
        route = self.routes.get(request.path)
        if route is None:
            listed = ", ".join(sorted(p for p in self.routes if p != "/"))
            return Reply(404, "text/plain; charset=utf-8", f"not found: try {listed}\n".encode())
        try:
            return route(request)
        except Exception as e:  # a failing page must not take the server down
            log.warning("%s failed: %s", request.path, e)
            return Reply(500, "text/plain; charset=utf-8", f"{request.path} failed: {e}\n".encode())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if len(self.requestline) > MAX_REQUEST_LINE:
                self._send(Reply(414, "text/plain", b"request line too long\n"))
                return
            path, _, query = self.path.partition("?")
            self._send(server.answer(Request(path, query, self.headers.get("Host"))))

        def _send(self, reply: Reply) -> None:
            self.send_response(reply.code)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            self.send_header("Cache-Control", reply.cache)
            self.end_headers()
            self.wfile.write(reply.body)

        def log_message(self, fmt: str, *args: Any) -> None:  # keep scrapes out of the logs
            log.debug("metrics http: " + fmt, *args)

    return Handler


def metrics_address(port: int, host: str | None, maddrs: list[str]) -> str:
    """The "host:port" at which Prometheus should scrape this process, announced in its DHT record.

    `host` (from --metrics-host) wins. Otherwise the host of the first multiaddr that is not a
    loopback or wildcard address (announce multiaddrs come first in `maddrs`), else the first
    loopback one: a swarm on one machine is scraped over 127.0.0.1.
    """
    if host:
        return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    hosts = []
    for maddr in maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
            hosts.append(f"[{parts[2]}]" if parts[1] == "ip6" else parts[2])
    wildcard = {"0.0.0.0", "[::]"}
    loopback = [h for h in hosts if h.startswith("127.") or h in ("[::1]", "localhost")]
    routable = [h for h in hosts if h not in wildcard and h not in loopback]
    return f"{(routable or loopback or ['127.0.0.1'])[0]}:{port}"
