"""Ports for the metrics servers of processes started on this machine (swarm-local, the tests).

A port taken from the kernel's ephemeral range (a bind to port 0) is free again once that socket closes,
and a p2p daemon listening on /tcp/0 may be given it before the program it was meant for binds it (seen: a
container's metrics server found its port taken by its own daemon). So the ports handed out here lie below
that range, and none twice in one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

FREE_PORTS_FROM = 20000  # free_port picks from here up to the kernel's ephemeral range
FREE_PORT_TRIES = 1000
_handed_out: set[int] = set()
_port_rng = random.Random()  # not the global one: a caller that seeds it must not change our picks


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for a bind to port 0."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range where there is one,
    never handed out before by this process."""
    high = _ephemeral_low()
    for _ in range(FREE_PORT_TRIES if high > FREE_PORTS_FROM + 1000 else 0):
        port = _port_rng.randrange(FREE_PORTS_FROM, high)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # no range below the ephemeral one: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
