"""Small TCP/UDP programs the lab's tests run inside hosts: they print what they measured as JSON.

    python -m tests.netlab.probes echo PORT              # TCP echo server; prints "ready"
    python -m tests.netlab.probes rtt HOST PORT N        # median round trip of 1-byte messages
    python -m tests.netlab.probes sink PORT              # TCP sink; prints bytes/s of the one transfer
    python -m tests.netlab.probes send HOST PORT BYTES   # sends BYTES, prints bytes/s
    python -m tests.netlab.probes dial HOST PORT TIMEOUT # prints whether a TCP connection opened
    python -m tests.netlab.probes udpsink PORT SECONDS   # counts datagrams until SECONDS after the first
    python -m tests.netlab.probes udpsend HOST PORT N    # sends N datagrams
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time

CHUNK = 64 * 1024


def _listen(port: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    if kind == socket.SOCK_STREAM:
        sock.listen()
    print("ready", flush=True)
    return sock


def echo(port: str) -> None:
    conn, peer = _listen(int(port)).accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(CHUNK):
        conn.sendall(data)


def rtt(host: str, port: str, n: str) -> None:
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(int(n)):
        start = time.monotonic()
        conn.sendall(b"x")
        conn.recv(1)
        times.append(time.monotonic() - start)
    print(json.dumps({"median_s": statistics.median(times), "min_s": min(times)}))


def sink(port: str) -> None:
    conn, peer = _listen(int(port)).accept()
    total, start = 0, None
    while data := conn.recv(CHUNK):
        start = start or time.monotonic()
        total += len(data)
    print(json.dumps({"bytes": total, "bytes_per_s": total / (time.monotonic() - start), "peer": peer[0]}))


def send(host: str, port: str, nbytes: str) -> None:
    conn = socket.create_connection((host, int(port)), timeout=30)
    payload, left = b"\0" * CHUNK, int(nbytes)
    start = time.monotonic()
    while left > 0:
        conn.sendall(payload[:left])
        left -= min(left, CHUNK)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)  # the sink closes once it has everything
    print(json.dumps({"bytes_per_s": int(nbytes) / (time.monotonic() - start)}))


def dial(host: str, port: str, timeout: str) -> None:
    try:
        socket.create_connection((host, int(port)), timeout=float(timeout)).close()
        print(json.dumps({"connected": True}))
    except OSError as e:
        print(json.dumps({"connected": False, "error": type(e).__name__}))


def udpsink(port: str, seconds: str) -> None:
    sock = _listen(int(port), socket.SOCK_DGRAM)
    sock.settimeout(60)
    sock.recv(CHUNK)
    count, deadline = 1, time.monotonic() + float(seconds)
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            sock.recv(CHUNK)
            count += 1
        except TimeoutError:
            break
    print(json.dumps({"received": count}))


def udpsend(host: str, port: str, n: str) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(int(n)):
        sock.sendto(b"x" * 100, (host, int(port)))
        time.sleep(0.001)  # below any rate limit: only the loss is measured


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
