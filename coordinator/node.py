"""The coordinator's node: DHT bootstrap, the signed run config, and the swarm's status."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from swarm.config import RunConfig
from swarm.dht import (
    BackgroundLoop,
    ExpertHostRecord,
    RunInfo,
    SwarmKey,
    SwarmRecords,
    load_identity,
    peer_id,
    serve_run_info,
    start_dht,
    visible_maddrs,
)
from swarm.dht.node import NatOptions
from swarm.dht.reachability import serve_dial_back
from swarm.metrics import MetricsServer, Reply, Request
from swarm.model import build_stage, make_expert
from swarm.traffic import TrafficCollector

from .archive import MAX_BYTES_PER_PARAM, RunArchive
from .discovery import discovery_targets, own_address
from .status import SwarmGauges, build_status
from .web import StatusHistory, page_routes

log = logging.getLogger("swarm.coordinator")

LOOP_CALL_TIMEOUT = 30.0
STATUS_PERIOD = 2.0  # seconds between reads of the swarm's records for /status and /metrics


class Coordinator:
    """Publishes the run config (renewed before it expires) and watches the swarm through the DHT."""

    def __init__(self, config: RunConfig, host_maddrs: list[str], announce_maddrs: list[str],
                 identity_path: str | None = None, metrics_port: int | None = None,
                 checkpoint_dir: Path | None = None, swarm_key: SwarmKey | None = None,
                 metrics_networks: list | None = None, nat: NatOptions | None = None):
        self.config = config
        self.metrics_networks = metrics_networks  # peers' metrics addresses listed by /sd (None: any)
        self.identity = load_identity(identity_path)
        self.loop = BackgroundLoop("coordinator-loop").start()
        self.dht = None
        self.metrics_server = None
        self.archive: RunArchive | None = None
        self._stop_archive = threading.Event()
        try:
            # everyone dials the coordinator first: it is public by definition, and relays for servers behind NAT
            self.dht = start_dht(config.run_id, self.identity, (), host_maddrs, announce_maddrs,
                                 nat=nat or NatOptions(reachability="public", relay_service=True))
            self.records = SwarmRecords(self.dht, config.run_id, self.identity, swarm_key=swarm_key)
            self.peer_id = peer_id(self.dht)
            self.publish_config()
            serve_run_info(self.dht, self.loop, RunInfo(config.run_id, self.identity.owner_key, self.peer_id),
                           swarm_key=swarm_key)
            serve_dial_back(self.dht, self.loop, visible_maddrs(self.dht))
            self.registry = CollectorRegistry()
            self.gauges = SwarmGauges(self.registry)
            self.registry.register(TrafficCollector(self.dht))
            self._status = build_status(config.run_id, {}, [], num_experts=self._num_experts())
            self.history = StatusHistory()  # loss and samples/s over the run, for the live page's charts
            self._records: tuple[dict, list] = ({}, [])  # the last lookup's servers and metrics, for /sd
            self._expert_hosts: list[ExpertHostRecord] = []  # the last expert host lookup that answered
            if metrics_port is not None:
                self.metrics_server = MetricsServer(self.registry, metrics_port,
                                                   routes={"/status": self._status_reply,
                                                           "/sd": self._discovery, **page_routes()},
                                                   health=lambda: None if self.dht.is_alive() else "DHT exited")
            if checkpoint_dir is not None:
                self._start_archive(checkpoint_dir)
        except BaseException:
            self.shutdown()
            raise

    def _start_archive(self, root: Path) -> None:
        p2p = self.loop.run(self.dht.replicate_p2p(), LOOP_CALL_TIMEOUT)
        with torch.device("meta"):  # sizes only, no memory
            params = max(sum(p.numel() for p in build_stage(self.config, k).parameters())
                         for k in range(self.config.stages.num_stages))
            moe_layers = self.config.model.moe_layers() if self.config.model.moe is not None else []
            # an expert's checkpoint holds it in every MoE block (and, as any state, its gradient being accumulated)
            expert = sum(p.numel() for layer in moe_layers
                         for p in make_expert(self.config.model, layer, 0).parameters())
        self.archive = RunArchive(self.config, root, self.records, self.loop, self.peer_id,
                                  max_stage_bytes=MAX_BYTES_PER_PARAM * params + 2**20,
                                  max_expert_bytes=MAX_BYTES_PER_PARAM * expert + 2**20)
        self.archive.start(p2p)
        threading.Thread(target=self.archive.run, args=(self._stop_archive,), name="archive", daemon=True).start()
        log.info("keeping the run's checkpoints in %s", root)

    def initial_peers(self) -> list[str]:
        return visible_maddrs(self.dht)

    def publish_config(self) -> None:
        if not self.records.publish_run_config(self.config, ttl=self.config.network.record_ttl):
            log.warning("could not store the run config in the DHT (will retry)")

    def _num_experts(self) -> int | None:
        """Experts per MoE block, for /status; None unless they live on expert servers (no experts section)."""
        moe = self.config.model.moe
        return None if moe is None or not moe.expert_servers else moe.num_experts

    def refresh_status(self) -> dict[str, Any]:
        servers = self.records.lookup_all_servers(self.config.stages.num_stages)
        metrics = self.records.lookup_metrics()
        self._records = (servers, metrics)
        num_experts = self._num_experts()
        if num_experts is not None:
            try:
                self._expert_hosts = self.records.lookup_expert_hosts()
            except Exception as e:  # keep the last answer: better than reporting every expert unhosted
                log.warning("expert host lookup failed: %s", e)
        self._status = build_status(self.config.run_id, servers, metrics, self._expert_hosts, num_experts)
        self.history.record(self._status)
        self.gauges.update(self._status)
        return self._status

    def _status_reply(self, request: Request) -> Reply:
        """/status: the last status document, with the history that the live page `/` charts."""
        return Reply.json({**self._status, "history": self.history.columns()})

    def _discovery(self, request: Request) -> Reply:
        """Prometheus http_sd: the peers of the last lookup, and this coordinator as Prometheus reached it."""
        servers, metrics = self._records
        me = own_address(request.host, self.metrics_server.port)
        return Reply.json(discovery_targets(self.config.run_id, servers, metrics,
                                            coordinator=(me, self.peer_id) if me else None,
                                            networks=self.metrics_networks, expert_hosts=self._expert_hosts))

    def serve_until(self, stop: threading.Event) -> None:
        """Renew the run config and refresh the status until `stop` is set."""
        renew_every = self.config.network.announce_period
        next_renewal = 0.0
        elapsed = 0.0
        while not stop.is_set():
            try:
                if elapsed >= next_renewal:
                    self.publish_config()
                    next_renewal = elapsed + renew_every
                self.refresh_status()
            except Exception as e:  # the DHT may hiccup; the coordinator keeps going
                log.warning("status refresh failed: %s", e)
            if stop.wait(STATUS_PERIOD):
                break
            elapsed += STATUS_PERIOD

    def shutdown(self) -> None:
        self._stop_archive.set()
        if self.archive is not None:
            self.archive.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.dht is not None:
            self.dht.shutdown()
        self.loop.stop()
