"""The coordinator's view of the swarm, built from DHT records: `/status` JSON and swarm-wide gauges."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from swarm.dht import ExpertHostRecord, PeerMetricsRecord, ServerRecord
from swarm.serving.placement import counted_claims

STATES = ("JOINING", "ONLINE", "OFFLINE")


def build_status(
    run_id: str, servers: dict[int, list[ServerRecord]], metrics: list[PeerMetricsRecord],
    expert_hosts: Iterable[ExpertHostRecord] = (), num_experts: int | None = None,
) -> dict[str, Any]:
    """Summarize server records and peer metrics into the `/status` document of ARCHITECTURE.md.

    The swarm's step is that of its slowest stage (the least of each stage's most advanced ONLINE
    server); loss and samples per second come from the trainers' own reports. A stage's throughput is its
    ONLINE servers' announced throughputs, each capped as placement counts claims (4 x the lower median:
    one stranger's huge claim does not hide the bottleneck), and `share` is its part of all stages'. The
    bottleneck stage is the one with the least (ties go to the lower stage; None without stages), and
    the volunteers are the distinct peers serving a stage or experts (not OFFLINE) or training. An MoE
    run with expert servers (`num_experts` given) adds who hosts each expert: see expert_status.
    """
    stages = []
    stage_steps = []
    counted = counted_claims({stage: [r for r in records if r.state == "ONLINE"] for stage, records in servers.items()})
    for stage in sorted(servers):
        records = sorted(servers[stage], key=lambda r: r.peer_id)
        online = [r for r in records if r.state == "ONLINE"]
        stage_steps.append(max((r.step for r in online), default=0))
        stages.append(
            {
                "stage": stage,
                "servers": [
                    {"peer_id": r.peer_id, "state": r.state, "throughput": r.throughput, "step": r.step,
                     "reach": r.reach, "averaging_bytes_per_sample": r.averaging_bytes_per_sample,
                     **({} if r.outer_step is None else {"outer_step": r.outer_step, "drift": r.drift})}
                    for r in records
                ],
                "online": len(online),
                "throughput": sum(counted[r.peer_id] for r in online),
            }
        )
    total = sum(s["throughput"] for s in stages)
    for s in stages:
        s["share"] = s["throughput"] / total if total > 0 else 0.0
    trainers = [m for m in metrics if m.role == "trainer"]
    losses = [m.loss for m in trainers if m.loss is not None]
    bottleneck = min(stages, key=lambda s: (s["throughput"], s["stage"]), default=None)
    volunteers = {r.peer_id for records in servers.values() for r in records if r.state != "OFFLINE"}
    volunteers.update(m.peer_id for m in trainers)
    status = {
        "run_id": run_id,
        "step": min(stage_steps, default=0),
        "loss": sum(losses) / len(losses) if losses else None,
        "samples_per_second": sum(m.samples_per_second for m in trainers),
        "samples": sum(m.samples for m in trainers),
        "trainers": len(trainers),
        "bottleneck_throughput": min((s["throughput"] for s in stages), default=0.0),
        "bottleneck_stage": bottleneck["stage"] if bottleneck is not None else None,
        "volunteers": len(volunteers),
        "stages": stages,
    }
    if num_experts is not None:
        expert_hosts = list(expert_hosts)
        status.update(expert_status(expert_hosts, num_experts))
        status["volunteers"] = len(volunteers | {h.peer_id for h in expert_hosts if h.state != "OFFLINE"})
    return status


def expert_status(hosts: Iterable[ExpertHostRecord], num_experts: int) -> dict[str, Any]:
    """The MoE part of `/status`: the hosts of each expert 0 .. num_experts-1, and which have none ONLINE.

    OFFLINE hosts are leaving and left out; JOINING ones are listed (not yet serving) but do not count
    as hosting. Indices a host lists beyond the run's experts (a host of another config) are ignored, and
    `expert_hosts` counts the distinct ONLINE hosts of at least one of the run's experts.
    """
    hosts = sorted((h for h in hosts if h.state != "OFFLINE"), key=lambda h: h.peer_id)
    by_expert: list[list[ExpertHostRecord]] = [[] for _ in range(num_experts)]
    for host in hosts:
        for expert in host.experts:
            if expert < num_experts:
                by_expert[expert].append(host)
    online = {h.peer_id for records in by_expert for h in records if h.state == "ONLINE"}
    return {
        "experts": [
            {
                "expert": expert,
                "hosts": [{"peer_id": h.peer_id, "state": h.state, "throughput": h.throughput, "step": h.step,
                           "reach": h.reach}
                          for h in records],
            }
            for expert, records in enumerate(by_expert)
        ],
        "expert_hosts": len(online),
        "unhosted_experts": [e for e, records in enumerate(by_expert) if not any(h.state == "ONLINE" for h in records)],
    }


class SwarmGauges:
    """Prometheus gauges of the whole swarm, refreshed from each new status document."""

    def __init__(self, registry: CollectorRegistry):
        self.servers = Gauge("swarm_servers", "Servers by stage and state", ["stage", "state"], registry=registry)
        self.stage_step = Gauge("swarm_stage_step", "Most advanced optimizer step among a stage's servers",
                                ["stage"], registry=registry)
        self.stage_throughput = Gauge("swarm_stage_throughput_samples_per_second",
                                      "Announced throughput of a stage's ONLINE servers (claims capped)", ["stage"],
                                      registry=registry)
        self.stage_share = Gauge("swarm_stage_throughput_share", "A stage's part of all stages' throughput",
                                 ["stage"], registry=registry)
        self.step = Gauge("swarm_step", "Optimizer step of the slowest stage", registry=registry)
        self.loss = Gauge("swarm_loss", "Mean training loss reported by trainers", registry=registry)
        self.samples_per_second = Gauge("swarm_samples_per_second", "Training samples per second, all trainers",
                                        registry=registry)
        self.trainers = Gauge("swarm_trainers", "Trainers reporting metrics", registry=registry)
        self.bottleneck = Gauge("swarm_bottleneck_throughput_samples_per_second",
                                "Throughput of the slowest stage", registry=registry)

    def update(self, status: dict[str, Any]) -> None:
        for stage in status["stages"]:
            label = str(stage["stage"])
            for state in STATES:
                count = sum(1 for s in stage["servers"] if s["state"] == state)
                self.servers.labels(stage=label, state=state).set(count)
            self.stage_step.labels(stage=label).set(max((s["step"] for s in stage["servers"]), default=0))
            self.stage_throughput.labels(stage=label).set(stage["throughput"])
            self.stage_share.labels(stage=label).set(stage["share"])
        self.step.set(status["step"])
        if status["loss"] is not None:
            self.loss.set(status["loss"])
        self.samples_per_second.set(status["samples_per_second"])
        self.trainers.set(status["trainers"])
        self.bottleneck.set(status["bottleneck_throughput"])
