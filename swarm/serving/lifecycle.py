"""The lifecycle every server shares: JOINING -> ONLINE -> OFFLINE, its announce loop, its ordered shutdown.

A subclass (StageServer, ExpertServer) says what its record is and where it is stored (`record`,
`_store`), what it does between two announcements (`_tick`, every `tick_period`), and what it tears
down after it stopped serving (`_teardown`). The order of a shutdown is the same for every server:
announce OFFLINE first (callers stop sending work), then stop answering (every service registered
with `_serve` is unregistered), then the subclass's own teardown (last checkpoint, compute thread).
"""

from __future__ import annotations

import logging
import threading
import time

import hivemind

from swarm.config import RunConfig
from swarm.dht import BackgroundLoop, ServerState, SwarmRecords, peer_id
from swarm.dht.reachability import Reachability, wait_until_reachable

log = logging.getLogger("swarm.serving")

LOOP_CALL_TIMEOUT = 30.0  # registering handlers, replicating the DHT's P2P


class ServerLifecycle:
    """What a server is (its state, p2p, services) from JOINING to OFFLINE; see the module docstring."""

    what = "server"  # how log lines name it

    def __init__(self, config: RunConfig, dht: hivemind.DHT, records: SwarmRecords, loop: BackgroundLoop,
                 reachability: Reachability | None = None):
        self.config, self.dht, self.records, self.loop = config, dht, records, loop
        self.peer_id = peer_id(dht)
        self.state = ServerState.JOINING
        self.reachability = reachability
        self._stop = threading.Event()
        self._announcer: threading.Thread | None = None
        self._announced = False  # a record of this server was (or may have been) stored: say OFFLINE when leaving
        self._p2p = None
        self._services: list = []  # (service, namespace) pairs answering on _p2p, unregistered at shutdown

    # what a subclass says --------------------------------------------------------------------------------------
    def record(self):
        raise NotImplementedError

    def _store(self, record, ttl: float) -> bool:
        raise NotImplementedError

    @property
    def tick_period(self) -> float:
        """Seconds between two `_tick`s (announcements are renewed every network.announce_period)."""
        return self.config.network.announce_period

    def _tick(self) -> None:
        """Work the announcer thread does every tick_period (nothing by default)."""

    def _teardown(self) -> None:
        """What the subclass stops after the server stopped answering."""

    # the lifecycle ---------------------------------------------------------------------------------------------
    @property
    def reach(self) -> str | None:
        """How others reach this server, as its record says (None: not checked)."""
        return self.reachability.state if self.reachability is not None else None

    def announce(self) -> bool:
        self._announced = True
        ok = self._store(self.record(), ttl=self.config.network.record_ttl)
        if not ok:
            log.warning("could not store this %s's record in the DHT (will retry)", self.what)
        return ok

    def _join_p2p(self) -> None:
        self._p2p = self.loop.run(self.dht.replicate_p2p(), LOOP_CALL_TIMEOUT)

    def _serve(self, registration):
        """Run `registration` (a coroutine registering a StageService on _p2p, which knows its namespace) and
        keep the service to unregister at shutdown."""
        service = self.loop.run(registration, LOOP_CALL_TIMEOUT)
        self._services.append((service, None))
        return service

    def _serve_servicer(self, servicer, namespace: str) -> None:
        """Register a hivemind servicer's handlers on _p2p under `namespace`, removed at shutdown."""
        self.loop.run(servicer.add_p2p_handlers(self._p2p, namespace=namespace), LOOP_CALL_TIMEOUT)
        self._services.append((servicer, namespace))

    def _go_online(self) -> None:
        """Once the reachability check has ended (nobody is sent to a server no one can dial yet): ONLINE,
        announced, and renewed by the announcer thread from now on."""
        wait_until_reachable(self.reachability)
        self.state = ServerState.ONLINE
        self.announce()
        self._announcer = threading.Thread(target=self._announce_forever, name="announcer", daemon=True)
        self._announcer.start()

    def _announce_forever(self) -> None:
        period = self.config.network.announce_period
        tick = min(self.tick_period, period)
        last_announce = time.monotonic()
        while not self._stop.wait(tick):
            try:
                self._tick()
            except Exception as e:  # whatever the tick does, the renewals go on
                log.warning("%s: %s", type(e).__name__, e)
            if time.monotonic() - last_announce < period - tick / 2:
                continue
            last_announce = time.monotonic()
            try:
                self.announce()
            except Exception as e:  # a DHT hiccup must not stop the renewals
                log.warning("announce failed: %s", e)

    def shutdown(self) -> None:
        """Announce OFFLINE first, so callers stop sending work, then stop answering, then `_teardown`."""
        self._stop.set()
        if self._announced:
            self.state = ServerState.OFFLINE
            try:
                self.announce()
            except Exception as e:
                log.warning("could not announce OFFLINE: %s", e)
        if self.loop.is_running:
            for service, namespace in self._services:
                try:
                    if namespace is None:
                        self.loop.run(service.unregister(self._p2p), LOOP_CALL_TIMEOUT)
                    else:
                        self.loop.run(service.remove_p2p_handlers(self._p2p, namespace=namespace), LOOP_CALL_TIMEOUT)
                except Exception as e:
                    log.debug("unregister failed: %s", e)
        self._services.clear()
        self._teardown()
