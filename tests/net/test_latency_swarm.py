"""A swarm across the lab at 100 ms one way (200 ms round trips): it trains, nobody healthy is banned, and
both stages' averaging rounds keep completing.

Coordinator, two servers per stage and a trainer, each on its own host; every link adds 50 ms each
way, so any two hosts are 100 ms apart. Timeouts were tuned on loopback; this is where a too-short
one would ban a healthy server or fail every round.
"""

from __future__ import annotations

import re

import pytest

from tests.net.test_nat_swarm import METRICS_PORT, rounds, start_coordinator
from tests.netlab import Lab
from tests.procs import ProcSet

pytestmark = pytest.mark.timeout(420)

LINK_MS = 50.0  # each way, on every link: 100 ms between two hosts
ROUNDS = 5  # averaging rounds each server must complete
TRAIN_TIMEOUT = 240.0  # join (about 25 s at this latency), then the rounds (about 15 steps a minute)


def test_a_swarm_at_100_ms_one_way_trains_without_banning_healthy_servers(lab: Lab, procs: ProcSet,
                                                                         tiny_config_path):
    hub = lab.add_host("hub", latency_ms=LINK_MS)
    servers = {name: lab.add_host(name, latency_ms=LINK_MS) for name in ("a0", "b0", "a1", "b1")}
    laptop = lab.add_host("laptop", latency_ms=LINK_MS)
    lab.start()
    join = ("--initial-peers", *start_coordinator(procs, hub, tiny_config_path))
    procs_of = {name: procs.start("swarm-peer", *join, "--role", "server", "--stage", name[1],
                                  "--metrics-port", str(METRICS_PORT), netns=host.ns)
                for name, host in servers.items()}
    trainer = procs.start("swarm-peer", *join, "--role", "trainer", netns=laptop.ns)

    def completed() -> dict[str, float] | None:
        done = {name: rounds(host, "succeeded") for name, host in servers.items()}
        return done if min(done.values()) >= ROUNDS else None

    try:
        done = trainer.wait_until(completed, TRAIN_TIMEOUT, f"{ROUNDS} averaging rounds on every server")
    except AssertionError as e:  # which server fell behind, and what it said
        counts = {name: (rounds(host, "succeeded"), rounds(host, "failed")) for name, host in servers.items()}
        logs = "\n".join(f"=== server {name}: rounds (succeeded, failed) {counts[name]}\n{proc.describe()}"
                         for name, proc in procs_of.items())
        raise AssertionError(f"{e}\n{logs}") from None
    failed = {name: rounds(host, "failed") for name, host in servers.items()}
    bans = re.findall(r".* banned for .*", trainer.stderr())
    # every server is healthy: a ban is a timeout too short for the distance (the whole log says which call)
    assert not bans, "\n".join(bans) + "\n" + trainer.describe()
    for proc in procs_of.values():
        assert proc.returncode is None, proc.describe()
    print(f"rounds succeeded {done}, failed {failed}")  # for the record (pytest -s)
