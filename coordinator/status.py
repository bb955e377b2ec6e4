"""The coordinator's view of the swarm, built from DHT records: `/status` JSON and swarm-wide gauges."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from swarm.dht import PeerMetricsRecord, ServerRecord

STATES = ("JOINING", "ONLINE", "OFFLINE")


def build_status(
    run_id: str, servers: dict[int, list[ServerRecord]], metrics: list[PeerMetricsRecord]
) -> dict[str, Any]:
    """Summarize server records and peer metrics into the `/status` document of ARCHITECTURE.md.

    The swarm's step is that of its slowest stage (the least of each stage's most advanced ONLINE
    server); loss and samples per second come from the trainers' own reports. The bottleneck stage is
    the one with the least ONLINE throughput (ties go to the lower stage; None without stages), and
    the volunteers are the distinct peers serving (not OFFLINE) or training.
    """
    stages = []
    stage_steps = []
    for stage in sorted(servers):
        records = sorted(servers[stage], key=lambda r: r.peer_id)
        online = [r for r in records if r.state == "ONLINE"]
        stage_steps.append(max((r.step for r in online), default=0))
        stages.append(
            {
                "stage": stage,
                "servers": [
                    {"peer_id": r.peer_id, "state": r.state, "throughput": r.throughput, "step": r.step}
                    for r in records
                ],
                "online": len(online),
                "throughput": sum(r.throughput for r in online),
            }
        )
    trainers = [m for m in metrics if m.role == "trainer"]
    losses = [m.loss for m in trainers if m.loss is not None]
    bottleneck = min(stages, key=lambda s: (s["throughput"], s["stage"]), default=None)
    volunteers = {r.peer_id for records in servers.values() for r in records if r.state != "OFFLINE"}
    volunteers.update(m.peer_id for m in trainers)
    return {
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


class SwarmGauges:
    """Prometheus gauges of the whole swarm, refreshed from each new status document."""

    def __init__(self, registry: CollectorRegistry):
        self.servers = Gauge("swarm_servers", "Servers by stage and state", ["stage", "state"], registry=registry)
        self.stage_step = Gauge("swarm_stage_step", "Most advanced optimizer step among a stage's servers",
                                ["stage"], registry=registry)
        self.stage_throughput = Gauge("swarm_stage_throughput_samples_per_second",
                                      "Announced throughput of a stage's ONLINE servers", ["stage"], registry=registry)
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
        self.step.set(status["step"])
        if status["loss"] is not None:
            self.loss.set(status["loss"])
        self.samples_per_second.set(status["samples_per_second"])
        self.trainers.set(status["trainers"])
        self.bottleneck.set(status["bottleneck_throughput"])
