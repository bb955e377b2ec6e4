"""Which stage a new server hosts, and which experts a new expert server hosts. Pure logic, no I/O.

The stages' throughputs are what their servers announce, and a stranger's server can announce any
number: one record claiming a million samples per second would make its stage look served forever,
and every joiner would go elsewhere. So a claim counts for at most CLAIM_CAP times the lower median
of the run's serving claims (a minority, however far it claims, does not move that): a lone liar
weighs as one fast server, not as the whole stage.
"""

from __future__ import annotations

import random
from collections import Counter as Tally
from collections.abc import Mapping, Sequence

from swarm.dht import ExpertHostRecord, ServerRecord
from swarm.tenure import lower_median

SERVING_STATES = ("JOINING", "ONLINE")
CLAIM_CAP = 4.0  # a server's announced throughput counts at most this many times the run's lower median claim


def claim_cap(claims: Sequence[float]) -> float:
    """The most any one of these serving claims counts for (see the module docstring)."""
    median = lower_median(list(claims))
    return float("inf") if median is None else CLAIM_CAP * median


def counted_claims(servers: Mapping[int, Sequence[ServerRecord]]) -> dict[str, float]:
    """Each serving server's throughput as counted (its claim capped, see the module docstring), by peer id."""
    serving = [r for records in servers.values() for r in records if r.state in SERVING_STATES]
    cap = claim_cap([r.throughput for r in serving])
    return {r.peer_id: min(r.throughput, cap) for r in serving}


def stage_throughputs(servers: Mapping[int, Sequence[ServerRecord]], num_stages: int) -> list[float]:
    """Total counted throughput of each stage (claims capped, see the module docstring), counting servers
    that serve or are about to."""
    in_run = {stage: records for stage, records in servers.items() if 0 <= stage < num_stages}
    counted = counted_claims(in_run)
    totals = [0.0] * num_stages
    for stage, records in in_run.items():
        totals[stage] = sum(counted[r.peer_id] for r in records if r.state in SERVING_STATES)
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


def choose_experts(hosts: Sequence[ExpertHostRecord], num_experts: int, count: int,
                   rng: random.Random | None = None) -> list[int]:
    """The `count` experts served least: each serving host's announced throughput (capped as a stage server's is,
    see the module docstring) shared evenly among the experts it hosts, summed per expert. Ties (e.g. experts
    no host serves yet, or a run's first host) go to the expert with fewer hosts, JOINING ones counted, then at
    random, so a wave of joiners does not all take the same experts."""
    serving = [h for h in hosts if h.state in SERVING_STATES]
    cap = claim_cap([h.throughput for h in serving])
    served, load = [0.0] * num_experts, Tally()
    for host in serving:
        mine = [e for e in set(host.experts) if 0 <= e < num_experts]
        for e in mine:
            served[e] += min(host.throughput, cap) / len(mine)
            load[e] += 1
    draw = rng or random.Random()
    ties = [draw.random() for _ in range(num_experts)]
    return sorted(sorted(range(num_experts), key=lambda e: (served[e], load[e], ties[e]))[:count])
