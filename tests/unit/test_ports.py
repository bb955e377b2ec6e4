"""coordinator.ports: metrics ports for local processes lie below the kernel's ephemeral range, never twice."""

from __future__ import annotations

import itertools
import random
import socket

import pytest

from coordinator import ports


def test_ports_below_the_ephemeral_range_and_never_twice():
    low = ports._ephemeral_low()
    if low <= ports.FREE_PORTS_FROM + 1000:
        pytest.fail(f"this machine's ephemeral range starts at {low}: no room below it to test in")
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    assert all(ports.FREE_PORTS_FROM <= p < low for p in picked)
    with socket.socket() as sock:  # each was free when handed out
        sock.bind(("127.0.0.1", picked[-1]))


def test_a_port_taken_is_skipped(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    others = random.Random(0)
    draws = itertools.chain([port], (others.randrange(20000, 30000) for _ in range(1000)))
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65000)
    monkeypatch.setattr(ports._port_rng, "randrange", lambda lo, hi: next(draws))
    try:
        got = ports.free_port()
    finally:
        taken.close()
    assert got != port
