"""Prometheus HTTP service discovery: every peer that announces a metrics address becomes a scrape target.

Prometheus polls the coordinator's `/sd` (an `http_sd_configs` endpoint) and gets back target groups
built from the DHT: servers from their stage records, expert servers from their expert host records,
trainers from their metrics records, and the coordinator itself. Each target carries the labels `role`,
`peer_id`, `run_id` and, for servers, `stage`, so per-peer series can be grouped without any per-peer
configuration.

The addresses come from strangers' (signed) records: each is a plain "host:port" (the record schema
refuses anything else), at most MAX_TARGETS are listed, and an address claimed by several peers is
listed once, for the claimant that sorts first (servers, then expert servers, then trainers; then by
peer id). An operator whose Prometheus should reach only certain networks gives them
(`--metrics-networks`): then only IP addresses inside them are listed, never a DNS name (which could
resolve anywhere).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from swarm.dht import ExpertHostRecord, PeerMetricsRecord, ServerRecord
from swarm.dht.schemas import ServerState, is_metrics_address

log = logging.getLogger("swarm.coordinator")

MAX_TARGETS = 4096  # one Prometheus scrapes this many peers at most through one coordinator
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(values: Sequence[str]) -> list[Network]:
    """CIDR blocks ("10.0.0.0/8", "::1/128", or a single address); ValueError naming the bad one."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise ValueError(f"not an IP network: {value!r} (expected CIDR such as 10.0.0.0/8)") from None
    return networks


def address_allowed(address: str, networks: Sequence[Network] | None) -> bool:
    """Whether a "host:port" may be listed: any when `networks` is None, else an IP inside one of them."""
    if networks is None:
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a DNS name
        return False
    return any(ip in network for network in networks)


def discovery_targets(
    run_id: str,
    servers: dict[int, list[ServerRecord]],
    metrics: Iterable[PeerMetricsRecord],
    coordinator: tuple[str, str] | None = None,
    networks: Sequence[Network] | None = None,
    expert_hosts: Iterable[ExpertHostRecord] = (),
) -> list[dict[str, Any]]:
    """The `/sd` document: one target group per peer with a metrics address.

    `coordinator` is (metrics address, peer id) of the coordinator itself, listed first.
    OFFLINE servers and expert hosts are left out: they are leaving, and their records expire soon
    after. With `networks`, so are peers whose address is not an IP inside one of them (the
    coordinator is kept).
    """
    claims: list[tuple[int, str, str, dict[str, str]]] = []  # (rank, peer id, address, labels)
    if coordinator is not None:
        address, peer = coordinator
        claims.append((0, peer, address, {"role": "coordinator"}))
    for stage, records in servers.items():
        for r in records:
            if r.metrics_addr is not None and r.state != ServerState.OFFLINE.value:
                claims.append((1, r.peer_id, r.metrics_addr, {"role": "server", "stage": str(stage)}))
    for h in expert_hosts:
        if h.metrics_addr is not None and h.state != ServerState.OFFLINE.value:
            claims.append((2, h.peer_id, h.metrics_addr, {"role": "expert"}))
    for m in metrics:
        if m.metrics_addr is not None:
            claims.append((3, m.peer_id, m.metrics_addr, {"role": m.role if m.role == "trainer" else "peer"}))
    groups: list[dict[str, Any]] = []
    taken: set[str] = set()
    for rank, peer, address, labels in sorted(claims, key=lambda c: (c[0], c[1])):
        if rank > 0 and not address_allowed(address, networks):
            log.debug("metrics address %s of %s is outside --metrics-networks: not listed", address, peer)
            continue
        if address in taken:
            log.debug("metrics address %s claimed again by %s: listed once", address, peer)
            continue
        if len(groups) >= MAX_TARGETS:
            log.warning("more than %d peers announce metrics addresses: the rest are not listed", MAX_TARGETS)
            break
        taken.add(address)
        groups.append({"targets": [address], "labels": {**labels, "peer_id": peer, "run_id": run_id}})
    return groups


def own_address(host_header: str | None, port: int) -> str | None:
    """The coordinator's metrics address as its caller reached it (the Host header), if it is a plain one."""
    if not host_header:
        return None
    address = host_header if host_header.rsplit(":", 1)[-1].isdigit() and not host_header.endswith("]") \
        else f"{host_header}:{port}"
    return address if is_metrics_address(address) else None
