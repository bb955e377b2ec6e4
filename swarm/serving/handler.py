"""What the request handlers of a stage server and of an expert server share: counting every outcome, and
wrappers around any handler (fault injection, requests in flight)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import hivemind
from prometheus_client import Gauge

from swarm.protocol import (
    BAD_REQUEST,
    INTERNAL,
    NOT_READY,
    RequestRejected,
    StageHandler,
    StageReply,
    StageRequest,
    StageService,
    WireLimits,
    register,
)
from swarm.routing.experts import ExpertsUnavailable
from swarm.worker import Overloaded, Worker


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
            return await asyncio.wrap_future(self.worker.submit(fn, *args, kind=request.kind))
        except (Overloaded, ExpertsUnavailable) as e:  # full, or too few experts answered: later, or elsewhere
            self._count(request.kind, NOT_READY)
            raise RequestRejected(NOT_READY, str(e)) from None
        except ValueError as e:  # the input checks of the module, backend or expert host
            self._count(request.kind, BAD_REQUEST)
            raise RequestRejected(BAD_REQUEST, str(e)) from None

    def _check_room(self, kind: str, what: str, max_wait: float | None, patient: bool = False) -> None:
        """Refuse (not_ready), from a request's metadata alone, what the worker has no room for: its queue full,
        or with `max_wait`, more queued work ahead of the request than this server lets a caller wait (in a swarm
        with several servers a stage, the caller is better served by another: README, Where servers go), unless
        the caller is `patient` (it says it has no other server to go to: refused, it would only wait and ask
        again; a stranger saying so only gets the queue max_queue bounds anyway)."""
        worker = self.worker
        if worker.queue_depth >= worker.max_queue:  # the worker would refuse it (Overloaded) once read
            self._count(kind, NOT_READY)
            raise RequestRejected(NOT_READY, f"{what} has {worker.queue_depth} tasks queued, its limit (max_queue "
                                             f"{worker.max_queue}); try again later")
        if max_wait is not None and not patient and (wait := worker.expected_wait()) > max_wait:
            self._count(kind, NOT_READY)
            raise RequestRejected(NOT_READY, f"{what} has {wait:.2f}s of work queued ahead, past its limit (max_wait "
                                             f"{max_wait:g}s); try another server or later")

    def _count(self, kind: str, status: str) -> None:
        self.server.metrics.requests.labels(kind=kind, status=status).inc()

    def _done(self, request: StageRequest, started: float) -> None:
        self._count(request.kind, "ok")
        self.server.metrics.latency.labels(kind=request.kind).observe(time.perf_counter() - started)


class Wrapper(StageHandler):
    """A handler around another: what it does not override goes to the inner one (admit, its counters)."""

    def __init__(self, inner: StageHandler):
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def forward(self, request: StageRequest) -> StageReply:
        return await self.inner.forward(request)

    async def backward(self, request: StageRequest) -> StageReply:
        return await self.inner.backward(request)


class FaultInjection(Wrapper):
    """Fault injection (`--inject-delay`, `--inject-failure-rate`) around any handler: every request waits
    `delay` seconds first, and a `failure_rate` share of them is answered with an INTERNAL error, counted as
    `injected` by `count(kind, status)`. Refusals from metadata (`admit`) stay immediate."""

    def __init__(self, inner: StageHandler, delay: float, failure_rate: float, count: Callable[[str, str], None],
                 rng: random.Random | None = None):
        super().__init__(inner)
        self.delay, self.failure_rate, self.count = delay, failure_rate, count
        self._rng = rng or random.Random()

    async def _inject(self, request: StageRequest) -> None:
        if self.delay > 0:
            await asyncio.sleep(self.delay)
        if self.failure_rate > 0 and self._rng.random() < self.failure_rate:
            self.count(request.kind, "injected")
            raise RequestRejected(INTERNAL, "injected failure (--inject-failure-rate)")

    async def forward(self, request: StageRequest) -> StageReply:
        await self._inject(request)
        return await self.inner.forward(request)

    async def backward(self, request: StageRequest) -> StageReply:
        await self._inject(request)
        return await self.inner.backward(request)


class InFlight(Wrapper):
    """Counts the requests being answered now, by kind, in `gauge` (injected delays included)."""

    def __init__(self, inner: StageHandler, gauge: Gauge):
        super().__init__(inner)
        self.gauge = gauge

    async def forward(self, request: StageRequest) -> StageReply:
        with self.gauge.labels(kind=request.kind).track_inprogress():
            return await self.inner.forward(request)

    async def backward(self, request: StageRequest) -> StageReply:
        with self.gauge.labels(kind=request.kind).track_inprogress():
            return await self.inner.backward(request)


def with_faults(handler: CountingHandler, delay: float, failure_rate: float) -> StageHandler:
    """`handler` itself when no fault is asked for, else wrapped in FaultInjection."""
    if delay <= 0 and failure_rate <= 0:
        return handler
    return FaultInjection(handler, delay, failure_rate, handler._count)


async def serve(p2p: hivemind.p2p.P2P, handler: StageHandler, namespace: str, limits: WireLimits,
                receive_timeout: float, max_concurrent: int) -> StageService:
    """Register `handler` (wrapped or not) on `p2p` under `namespace`, refusing from metadata with its `admit`."""
    return await register(p2p, handler, namespace, limits=limits, receive_timeout=receive_timeout,
                          admit=handler.admit, max_concurrent=max_concurrent)
