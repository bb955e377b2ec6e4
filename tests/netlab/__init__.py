"""A network lab of namespaces: hosts with latency, rate limits, loss and home-router NAT, on one machine.

Every test before this one ran on 127.0.0.1: no latency, no bandwidth limit, every peer dialable. A
:class:`Lab` builds what volunteers really sit behind, with nothing but the kernel and two small
tools (shared/RECIPES.md has the measurements this follows):

- a router namespace, and one namespace per host, each host joined to the router by its own veth
  link. A public host i is 11.77.i.2/24, the router's side of its link 11.77.i.1: addresses that
  look public, as a volunteer's server or a cloud machine has (libp2p will not use a relay whose
  addresses are private, nor offer its own addresses in a reservation), though they exist only
  inside the namespaces the lab made, which have no route out. A NAT host i is 192.168.i.2/24, a
  home network's address, with the router at 192.168.i.1;
- per host link: a one-way latency (netem is not in this kernel: the router sends the link's
  packets, both ways, to an NFQUEUE that tests/netlab/delayer.py holds each packet on), an optional
  loss share (the same delayer), and uplink and downlink rates (tc tbf on the host's and on the
  router's end of the link). A packet from host a to host b crosses both links, so it is held
  latency(a) + latency(b): for a one-way latency L between every pair, give each host L / 2;
- hosts of kind ``"nat"`` sit behind the router's MASQUERADE, as behind a home router: they reach
  everyone, nobody opens a connection to them, and their peers see the router's address.

Names carry the owning process id (``swl<pid>x<n>-...``); a lab removes everything it made when
closed, and every new lab first sweeps away what labs of dead processes left (a killed test).
Needs root, iproute2, iptables and the NetfilterQueue package (``make test-net`` installs them).

    with Lab() as lab:
        a = lab.add_host("a", latency_ms=25, up_mbit=20)
        b = lab.add_host("b", kind="nat")
        lab.start()
        b.run(["python3", "-c", "..."])
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "swl"
PUBLIC_NET = "11.77"  # public host i: 11.77.i.2/24, router side 11.77.i.1 (only inside the lab)
HOME_NET = "192.168"  # a NAT host i: 192.168.i.2/24, its router 192.168.i.1
MAX_HOSTS = 250
BURST = "64kb"  # tbf bucket: a few dozen full packets, so a rate limit does not starve ACKs of a slow link
TBF_LATENCY = "400ms"  # longest a packet may wait in tbf's queue before being dropped (a router's buffer)
DELAYER_START_TIMEOUT = 30.0
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-")
_counter = itertools.count()
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
REPO_ROOT = Path(__file__).resolve().parent.parent.parent


class LabUnavailable(RuntimeError):
    """The machine lacks what the lab needs (root, a tool or a package); the message says what."""


def check_requirements() -> None:
    """Raise LabUnavailable naming what is missing; nothing is changed."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and iptables)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            missing.append(f"{tool} (Debian package {package})")
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        missing.append("the NetfilterQueue package (pip; needs Debian's libnetfilter-queue-dev to build)")
    if missing:
        raise LabUnavailable("the network lab needs " + ", ".join(missing) + "; `make test-net` installs them")


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _sh("ip", "netns", "list").stdout.splitlines() if line.strip()]


def _remove_namespace(ns: str) -> None:
    """Kill what runs in namespace `ns`, then delete it (its links go with it)."""
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:  # a namespace with live processes lingers after `del`
        pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
        time.sleep(0.05)
    _sh("ip", "netns", "del", ns, check=False)


def sweep() -> list[str]:
    """Remove the namespaces of labs whose owning process is gone (a killed test); returns their names."""
    removed = []
    for ns in _namespaces():
        match = _NAME.match(ns)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            _remove_namespace(ns)
            removed.append(ns)
    return removed


def lab_namespaces(owner: int | None = None) -> list[str]:
    """Namespaces of labs (of process `owner` only, if given) that exist now."""
    return [ns for ns in _namespaces() if (m := _NAME.match(ns)) and (owner is None or int(m.group(1)) == owner)]


@dataclass
class Host:
    """One machine of the lab: its namespace, address and link."""

    lab: Lab
    name: str
    index: int
    kind: str = "public"
    latency_ms: float = 0.0
    up_mbit: float | None = None
    down_mbit: float | None = None
    loss: float = 0.0
    queued: bool = False  # its link's packets go through the delayer even with no latency or loss (a control)
    ns: str = field(init=False)

    def __post_init__(self) -> None:
        self.ns = f"{self.lab.tag}-{self.name}"

    @property
    def network(self) -> str:
        return f"{PUBLIC_NET if self.kind == 'public' else HOME_NET}.{self.index}"

    @property
    def address(self) -> str:
        return f"{self.network}.2"

    @property
    def gateway(self) -> str:
        return f"{self.network}.1"

    @property
    def router_link(self) -> str:
        return f"h{self.index}"

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def run(self, argv: list[str], timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        done = subprocess.run(self.argv(argv), timeout=timeout, **kwargs)
        if check and done.returncode != 0:
            raise RuntimeError(f"on {self.name}: {' '.join(argv)} failed ({done.returncode}):\n"
                               f"{done.stdout}\n{done.stderr}")
        return done

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), **kwargs)

    def http_get(self, port: int, path: str, timeout: float = 5.0) -> str | None:
        """The body of http://127.0.0.1:PORT/PATH as seen inside this host, or None while nothing answers.

        Asked from a thread that enters the host's network namespace (setns affects only that thread),
        so a test can poll a peer's /status without starting a process each time.
        """
        answer: list[str | None] = [None]
        failed: list[OSError] = []

        def fetch() -> None:
            fd = os.open(f"/var/run/netns/{self.ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, _CLONE_NEWNET) != 0:
                    failed.append(OSError(ctypes.get_errno(), f"setns into {self.ns}"))
                    return
            finally:
                os.close(fd)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
                    answer[0] = reply.read().decode()
            except OSError:  # not listening yet, reset, timed out
                pass

        thread = threading.Thread(target=fetch, name=f"http-{self.name}")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return answer[0]

    def python(self, code: str, *args: str, timeout: float = 60) -> str:
        """Run `code` with this Python in the host's namespace; its stdout."""
        return self.run([sys.executable, "-c", code, *args], timeout=timeout).stdout


class Lab:
    """A router and hosts in namespaces; build with add_host() then start(); close() removes it all."""

    def __init__(self) -> None:
        check_requirements()
        sweep()
        self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.router_ns = f"{self.tag}-router"
        self.hosts: dict[str, Host] = {}
        self._delayers: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces, in order of creation
        self.started = False

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_host(self, name: str, kind: str = "public", latency_ms: float = 0.0, up_mbit: float | None = None,
                 down_mbit: float | None = None, rate_mbit: float | None = None, loss: float = 0.0,
                 queued: bool = False) -> Host:
        """A host on its own link; `rate_mbit` caps both directions unless up/down say otherwise. With
        `queued`, its packets cross the userspace delayer even at 0 ms: what the delayer itself costs (its
        CPU, on the machine the swarm shares) then weighs on both sides of a latency comparison."""
        if self.started:
            raise RuntimeError("add hosts before start()")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", name) or name == "router" or name in self.hosts:
            raise ValueError(f"host name {name!r}: lowercase letters and digits, unique, not 'router'")
        if kind not in ("public", "nat"):
            raise ValueError(f"host kind {kind!r}: 'public' or 'nat'")
        if latency_ms < 0 or not 0.0 <= loss < 1.0:
            raise ValueError("latency_ms must be >= 0 and loss in [0, 1)")
        if len(self.hosts) >= MAX_HOSTS:
            raise ValueError(f"at most {MAX_HOSTS} hosts")
        up = up_mbit if up_mbit is not None else rate_mbit
        down = down_mbit if down_mbit is not None else rate_mbit
        for rate in (up, down):
            if rate is not None and rate <= 0:
                raise ValueError("rates must be > 0 Mbit/s")
        host = Host(self, name, len(self.hosts) + 1, kind, latency_ms, up, down, loss, queued)
        self.hosts[name] = host
        return host

    def start(self) -> Lab:
        """Build the namespaces, links, rates, NAT and delayers; on any failure remove what was made."""
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.started = True
        return self

    def _router(self, *argv: str) -> None:
        _sh("ip", "netns", "exec", self.router_ns, *argv)

    def _build(self) -> None:
        self._add_namespace(self.router_ns)
        self._router("sysctl", "-qw", "net.ipv4.ip_forward=1")
        for host in self.hosts.values():
            self._add_namespace(host.ns)
            link = host.router_link
            _sh("ip", "link", "add", "name", "eth0", "netns", host.ns, "type", "veth",
                "peer", "name", link, "netns", self.router_ns)
            _sh("ip", "-n", host.ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _sh("ip", "-n", self.router_ns, "addr", "add", f"{host.gateway}/24", "dev", link)
            _sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", self.router_ns, "link", "set", link, "up")
            _sh("ip", "-n", host.ns, "route", "add", "default", "via", host.gateway)
            if host.up_mbit is not None:
                _sh("ip", "netns", "exec", host.ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                    "rate", f"{host.up_mbit}mbit", "burst", BURST, "latency", TBF_LATENCY)
            if host.down_mbit is not None:
                self._router("tc", "qdisc", "add", "dev", link, "root", "tbf",
                             "rate", f"{host.down_mbit}mbit", "burst", BURST, "latency", TBF_LATENCY)
            if host.kind == "nat":  # a home router: out through MASQUERADE, in only what was asked for
                subnet = f"{host.network}.0/24"
                self._router("iptables", "-t", "nat", "-A", "POSTROUTING", "-s", subnet, "!", "-o", link,
                             "-j", "MASQUERADE")
                self._router("iptables", "-A", "FORWARD", "-o", link, "-m", "conntrack",
                             "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
                self._router("iptables", "-A", "FORWARD", "-o", link, "-j", "DROP")
            if host.latency_ms > 0 or host.loss > 0 or host.queued:
                self._start_delayer(host)

    def _add_namespace(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._made.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _start_delayer(self, host: Host) -> None:
        """A delayer on queue `index` in the router, then both directions of the host's link sent to it.

        The queue is bound before any packet is sent to it: a queue nobody listens on drops packets.
        """
        queue = str(host.index)
        argv = ["ip", "netns", "exec", self.router_ns, sys.executable, "-m", "tests.netlab.delayer",
                "--queue", queue, "--delay-ms", str(host.latency_ms), "--loss", str(host.loss)]
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._delayers.append(proc)
        line = _read_line(proc, DELAYER_START_TIMEOUT)
        if line.strip() != "bound":
            proc.kill()
            raise RuntimeError(f"the delayer of {host.name} did not start: {line!r} {proc.stderr.read()}")
        link = host.router_link
        self._router("iptables", "-t", "mangle", "-A", "PREROUTING", "-i", link, "-j", "NFQUEUE", "--queue-num", queue)
        self._router("iptables", "-t", "mangle", "-A", "POSTROUTING", "-o", link, "-j", "NFQUEUE", "--queue-num", queue)

    def close(self) -> None:
        """Kill what runs in the lab's namespaces and delete them. Safe to call twice."""
        for proc in self._delayers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self._delayers.clear()
        for ns in reversed(self._made):
            _remove_namespace(ns)
        self._made.clear()
        self.started = False

    def delayers_alive(self) -> bool:
        return all(proc.poll() is None for proc in self._delayers)


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One line of the process's stdout, or '' if it exits or `timeout` passes first."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            return ""
    return proc.stdout.readline()
