"""What the request handlers of a stage server and of an expert server share."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from swarm.backend import Overloaded, Worker
from swarm.protocol import BAD_REQUEST, NOT_READY, RequestRejected, StageHandler, StageRequest
from swarm.routing.experts import ExpertsUnavailable


class CountingHandler(StageHandler):
    """Runs a request's work on the server's worker thread and counts every outcome and answer time in
    the server's metrics (`requests{kind,status}`, `latency{kind}`). Subclasses say which worker."""

    def __init__(self, server: Any):
        self.server = server

    @property
    def worker(self) -> Worker:
        raise NotImplementedError

    async def _run(self, request: StageRequest, fn, *args):
        """`fn(*args)` on the worker; what it refuses becomes the error reply the caller can act on."""
        try:
            return await asyncio.wrap_future(self.worker.submit(fn, *args))
        except (Overloaded, ExpertsUnavailable) as e:  # full, or too few experts answered: later, or elsewhere
            self._count(request.kind, NOT_READY)
            raise RequestRejected(NOT_READY, str(e)) from None
        except ValueError as e:  # the input checks of the module, backend or expert host
            self._count(request.kind, BAD_REQUEST)
            raise RequestRejected(BAD_REQUEST, str(e)) from None

    def _count(self, kind: str, status: str) -> None:
        self.server.metrics.requests.labels(kind=kind, status=status).inc()

    def _done(self, request: StageRequest, started: float) -> None:
        self._count(request.kind, "ok")
        self.server.metrics.latency.labels(kind=request.kind).observe(time.perf_counter() - started)
