"""The lab itself: latency, rates and loss as configured, NAT refusing what it should, nothing left behind.

Measured against what was asked for within 20% (the issue's bound): a round trip through two links
is twice the sum of their latencies; a bulk TCP transfer runs at the tighter of the sender's uplink
and the receiver's downlink, less its headers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import wait_until
from tests.netlab import Lab, lab_namespaces, sweep
from tests.procs import REPO_ROOT

pytestmark = pytest.mark.timeout(120)
PROBE = [sys.executable, "-m", "tests.netlab.probes"]


def serve(host, *args: str) -> subprocess.Popen:
    """A probe server on `host`, once it listens."""
    proc = host.popen([*PROBE, *args], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def result(proc: subprocess.Popen, timeout: float = 60) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out)


def probe(host, *args: str) -> dict:
    return json.loads(host.run([*PROBE, *args], cwd=REPO_ROOT, timeout=90).stdout)


def test_round_trip_is_twice_the_two_links_latencies(lab: Lab):
    a = lab.add_host("a", latency_ms=10)
    b = lab.add_host("b", latency_ms=40)
    c = lab.add_host("c")
    d = lab.add_host("d", queued=True)  # through a delayer at 0 ms (bench/wan.py --delayer-control)
    lab.start()
    assert len(lab._delayers) == 3  # a's, b's and d's; c's link has none
    server = serve(b, "echo", "7000")
    measured = probe(a, "rtt", b.address, "7000", "20")["median_s"]
    assert measured == pytest.approx(2 * (0.010 + 0.040), rel=0.2)
    server.wait(timeout=30)
    for host in (c, d):  # a link with no latency adds none, through the delayer or not
        server = serve(host, "echo", "7000")
        measured = probe(a, "rtt", host.address, "7000", "20")["median_s"]
        assert measured == pytest.approx(2 * 0.010, rel=0.2), host.name
        server.wait(timeout=30)


def test_uplink_and_downlink_rates_cap_a_transfer(lab: Lab):
    slow_up = lab.add_host("up", up_mbit=20)
    slow_down = lab.add_host("down", down_mbit=10)
    fast = lab.add_host("fast")
    lab.start()
    for sender, receiver, mbit in ((slow_up, fast, 20), (fast, slow_down, 10)):
        sink = serve(receiver, "sink", "7001")
        probe(sender, "send", receiver.address, "7001", str(int(mbit * 1e6 / 8 * 2)))  # two seconds' worth
        goodput = result(sink)["bytes_per_s"] * 8 / 1e6
        assert goodput == pytest.approx(mbit, rel=0.2), (sender.name, receiver.name, goodput)


def test_loss_drops_the_configured_share(lab: Lab):
    lossy = lab.add_host("lossy", loss=0.2)
    other = lab.add_host("other")
    lab.start()
    sink = serve(other, "udpsink", "7002", "3")
    lossy.run([*PROBE, "udpsend", other.address, "7002", "1000"], cwd=REPO_ROOT)
    received = result(sink)["received"]
    assert 720 <= received <= 880, received  # 800 expected; +-10 standard deviations of the binomial


def test_nat_host_dials_out_but_takes_no_connection_in(lab: Lab):
    public = lab.add_host("public")
    other = lab.add_host("other")
    home = lab.add_host("home", kind="nat")
    lab.start()
    sink = serve(public, "sink", "7003")
    probe(home, "send", public.address, "7003", "1000")
    assert result(sink)["peer"] == public.gateway  # the router's address, not the home host's
    listener = serve(home, "sink", "7004")
    try:
        assert probe(public, "dial", home.address, "7004", "3") == {"connected": False, "error": "TimeoutError"}
        sink = serve(other, "sink", "7004")  # the same dial to a public host opens
        assert probe(public, "dial", other.address, "7004", "3") == {"connected": True}
        sink.wait(timeout=30)
    finally:
        listener.kill()
        listener.communicate()


def test_close_leaves_nothing_behind():
    with Lab() as lab:
        lab.add_host("a", latency_ms=5)
        lab.add_host("b", kind="nat", rate_mbit=50)
        lab.start()
        assert len(lab_namespaces(os.getpid())) == 3
        delayer = lab._delayers[0]
    assert lab_namespaces(os.getpid()) == []
    assert delayer.poll() is not None


def test_a_killed_owner_is_swept_by_the_next_lab():
    code = ("import signal; from tests.netlab import Lab; lab = Lab(); lab.add_host('a', latency_ms=5); "
            "lab.start(); print('up', flush=True); signal.pause()")  # until the SIGKILL below
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        left = lab_namespaces(owner.pid)
        assert len(left) == 2
        delayers = _delayers_in(left)
        assert delayers
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert lab_namespaces(owner.pid) == left  # a SIGKILL gives no chance to clean up...
    assert sorted(sweep()) == sorted(left)  # ...so the next lab sweeps it (Lab() calls sweep())
    assert lab_namespaces(owner.pid) == []
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in delayers), 10, what="delayers to die")


def _delayers_in(namespaces: list[str]) -> list[int]:
    pids = []
    for ns in namespaces:
        pids += [int(pid) for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                                     text=True).stdout.split()]
    return pids


def test_bad_hosts_are_refused_before_anything_is_made():
    with Lab() as lab:
        for kwargs in ({"name": "Bad_Name"}, {"name": "router"}, {"name": "x", "kind": "cgnat"},
                       {"name": "x", "latency_ms": -1}, {"name": "x", "loss": 1.0}, {"name": "x", "up_mbit": 0}):
            with pytest.raises(ValueError):
                lab.add_host(**kwargs)
        assert lab_namespaces(os.getpid()) == []
