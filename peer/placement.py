"""Which stage a new server should host. Pure logic, no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swarm.dht import ServerRecord

SERVING_STATES = ("JOINING", "ONLINE")


def stage_throughputs(servers: Mapping[int, Sequence[ServerRecord]], num_stages: int) -> list[float]:
    """Total announced throughput of each stage, counting servers that serve or are about to."""
    totals = [0.0] * num_stages
    for stage, records in servers.items():
        if 0 <= stage < num_stages:
            totals[stage] = sum(r.throughput for r in records if r.state in SERVING_STATES)
    return totals


def choose_stage(servers: Mapping[int, Sequence[ServerRecord]], num_stages: int) -> int:
    """The stage with the least total throughput: it is the swarm's bottleneck.

    Ties (e.g. an empty swarm) go to the stage with fewer servers, then the lower index, so the
    first servers of a run fill the stages in order.
    """
    totals = stage_throughputs(servers, num_stages)

    def count(stage: int) -> int:
        return sum(1 for r in servers.get(stage, ()) if r.state in SERVING_STATES)

    return min(range(num_stages), key=lambda s: (totals[s], count(s), s))
