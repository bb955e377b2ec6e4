"""Volunteers behind home routers take part: a swarm across the lab's NATs, and what each peer is told.

The coordinator and the stage-0 server are public; the stage-1 server and the trainer sit behind two
different NATs (nobody can open a connection to either). The stage-1 server is reached through the
coordinator's relay; the trainer only dials out. Before relays, this run stayed at step 0: the
trainer could not dial the stage-1 server and banned it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.netlab import Host, Lab
from tests.procs import INITIAL_PEERS_LINE, SERVER_START_TIMEOUT, Proc, ProcSet

pytestmark = pytest.mark.timeout(420)

COORDINATOR_TIMEOUT = 60.0
METRICS_PORT = 9100  # every host has its own network: the same port everywhere
RELAYED_LINE = r"reachability: relayed: no peer could dial .*192\.168\.\d+\.2.* through relay (\S+) "
DIRECT_LINE = r"reachability: direct \(\S+ dialed /ip4/11\.77\.\d+\.2/tcp/"
TOLD_BEHIND_NAT = "telling libp2p it is behind NAT"
UNREACHABLE_LINE = r"reachability: unreachable: no peer could dial .*no relay gave this peer a slot.*$"
STEPS = 20  # steps the stage-1 server must take through its relay
LOSS_DROP, LOSS_CEILING = 0.8, 4.0  # the loss falls below both (an untrained byte model's is ln 256 = 5.55)
TRAIN_TIMEOUT = 180.0
ROUNDS = 10  # averaging rounds both servers of a stage must complete, one of them relayed
DEAD_RELAY = "QmRutfXqr9bCJ7Zjr8kFjR4DUxWpJRTsNXXiBu36jyeHuc"  # a well-formed peer id nobody in the lab has
UNREACHABLE_TIMEOUT = 120.0  # join, the dial-back check, then the whole relay wait


def start_coordinator(procs: ProcSet, host: Host, config: Path, *args: str) -> list[str]:
    """The coordinator on `host`; its initial peers at the host's lab address."""
    proc = procs.start("swarm-coordinator", "--config", str(config), "--metrics-port", str(METRICS_PORT), *args,
                       netns=host.ns)
    line = proc.wait_for_line(INITIAL_PEERS_LINE, COORDINATOR_TIMEOUT)
    maddrs = [maddr for maddr in line.group(1).split() if f"/ip4/{host.address}/" in maddr]
    assert maddrs, line.group(0)
    return maddrs


def status(host: Host) -> dict | None:
    body = host.http_get(METRICS_PORT, "/status")
    return None if body is None else json.loads(body)


def servers(doc: dict | None) -> dict[str, dict]:
    return {} if doc is None else {s["peer_id"]: s for stage in doc["stages"] for s in stage["servers"]}


def serving_id(proc: Proc) -> str:
    return proc.wait_for_line(r"serving stage \d+ of \d+ .* as (\S+)$", SERVER_START_TIMEOUT, stream="stderr").group(1)


def test_a_server_and_a_trainer_behind_two_nats_train_through_a_relay(lab: Lab, procs: ProcSet, tiny_config_path):
    hub = lab.add_host("hub")
    public = lab.add_host("public")
    home = lab.add_host("home", kind="nat")
    laptop = lab.add_host("laptop", kind="nat")
    lab.start()
    join = ("--initial-peers", *start_coordinator(procs, hub, tiny_config_path))
    stage0 = procs.start("swarm-peer", *join, "--role", "server", "--stage", "0", netns=public.ns)
    stage1 = procs.start("swarm-peer", *join, "--role", "server", "--stage", "1", netns=home.ns)
    trainer = procs.start("swarm-peer", *join, "--role", "trainer", netns=laptop.ns)
    stage0.wait_for_line(DIRECT_LINE, SERVER_START_TIMEOUT, stream="stderr")
    relay = stage1.wait_for_line(RELAYED_LINE, SERVER_START_TIMEOUT, stream="stderr").group(1)
    coordinator_id = join[1].rsplit("/p2p/", 1)[1]
    assert coordinator_id.endswith(relay)  # the coordinator relays by default
    ids = serving_id(stage0), serving_id(stage1)

    def reached() -> dict | None:
        found = servers(status(hub))
        return found if all(found.get(i, {}).get("state") == "ONLINE" for i in ids) else None

    found = stage1.wait_until(reached, 30, "both servers ONLINE in /status")
    assert (found[ids[0]]["reach"], found[ids[1]]["reach"]) == ("direct", "relayed")

    def loss() -> float | None:
        return (status(hub) or {}).get("loss")

    first = trainer.wait_until(loss, TRAIN_TIMEOUT, "a first loss report")
    target = min(LOSS_DROP * first, LOSS_CEILING)

    def trained() -> bool:
        steps = [int(s) for s in re.findall(r"stage 1 step (\d+) ", stage1.stderr())]
        return bool(steps) and max(steps) >= STEPS and (loss() or target) < target

    stage1.wait_until(trained, TRAIN_TIMEOUT, f"{STEPS} steps on the relayed server, the loss below {target:.2f}")
    assert "reachability" not in trainer.stderr()  # a trainer only dials out: it is not checked
    # asked before its daemon started, the server behind NAT told libp2p so (a relay slot at once, hole punching)
    assert TOLD_BEHIND_NAT in stage1.stderr() and TOLD_BEHIND_NAT not in stage0.stderr()


def test_a_server_behind_nat_with_no_relay_is_told_it_is_unreachable_and_how_to_fix_it(
        lab: Lab, procs: ProcSet, tiny_config_path):
    hub = lab.add_host("hub")
    home = lab.add_host("home", kind="nat")
    lab.start()
    join = ("--initial-peers", *start_coordinator(procs, hub, tiny_config_path))
    gone = f"/ip4/{hub.gateway}/tcp/4001/p2p/{DEAD_RELAY}"  # the only relay it may use is down
    server = procs.start("swarm-peer", *join, "--role", "server", "--stage", "0", "--relays", gone,
                         netns=home.ns)
    line = server.wait_for_line(UNREACHABLE_LINE, UNREACHABLE_TIMEOUT, stream="stderr").group(0)
    assert "192.168." in line and "--announce-maddrs" in line
    server_id = serving_id(server)  # it still serves: peers of its own network may reach it
    found = server.wait_until(lambda: servers(status(hub)).get(server_id), 30, "its record in /status")
    assert found["reach"] == "unreachable"


def rounds(host: Host, outcome: str) -> float:
    """swarm_averaging_rounds_total{outcome=...} on the server of `host` (0 while it does not answer)."""
    body = host.http_get(METRICS_PORT, "/metrics") or ""
    return sum(sample.value for family in text_string_to_metric_families(body) for sample in family.samples
               if sample.name == "swarm_averaging_rounds_total" and sample.labels.get("outcome") == outcome)


def test_an_averaging_group_with_a_server_behind_nat_completes_its_rounds(lab: Lab, procs: ProcSet,
                                                                          tiny_config_path):
    hub = lab.add_host("hub")
    public = lab.add_host("public")
    home = lab.add_host("home", kind="nat")
    second = lab.add_host("second")
    laptop = lab.add_host("laptop", kind="nat")
    lab.start()
    join = ("--initial-peers", *start_coordinator(procs, hub, tiny_config_path))
    metrics = ("--metrics-port", str(METRICS_PORT))
    for host in (public, home):
        procs.start("swarm-peer", *join, "--role", "server", "--stage", "0", *metrics, netns=host.ns)
    procs.start("swarm-peer", *join, "--role", "server", "--stage", "1", netns=second.ns)
    trainer = procs.start("swarm-peer", *join, "--role", "trainer", netns=laptop.ns)
    trainer.wait_until(lambda: min(rounds(public, "succeeded"), rounds(home, "succeeded")) >= ROUNDS,
                       TRAIN_TIMEOUT, f"{ROUNDS} averaging rounds of stage 0, one member relayed")
