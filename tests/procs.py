"""The swarm's programs as child processes of a test: output captured to files, every wait bounded.

Each program starts in a session (and process group) of its own, because it forks a hivemind DHT
process, which starts a p2pd daemon: stopping the program's pid alone can leave those behind.
:meth:`Proc.stop` asks the program to stop like `docker stop` does (SIGTERM to its main process),
then SIGKILLs whatever is left of its group. Every started program is registered until it has been
stopped, so the session fixture in conftest.py can kill the ones a failed test left running.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from coordinator.ports import free_port  # noqa: F401 - the tests take it from here
from tests.helpers import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCALHOST = ("--host-maddrs", "/ip4/127.0.0.1/tcp/0")  # every program in the tests listens on loopback only
STOP_TIMEOUT = 30.0  # seconds a program gets to exit after SIGTERM before its group is killed
KILL_TIMEOUT = 10.0  # seconds to reap a SIGKILLed program
TAIL_CHARS = 3000  # output shown when a wait fails

_running: set[Proc] = set()  # started and not yet stopped; see kill_all()
_counter = itertools.count()


def program(name: str) -> str:
    """Path of a console script: the one next to this Python (the venv's), else on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"console script {name} not found; install the project (pip install -e .)")
    return found


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without SWARM_* variables (they would change the flags), plus `extra`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWARM_")}
    env["OMP_NUM_THREADS"] = "1"  # several programs share a few cores; oversubscribed threads only slow them
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited while we looked
            continue
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


class Proc:
    """One running program; stdout and stderr go to files under `workdir`."""

    def __init__(self, name: str, args: list[str], workdir: Path, env: dict[str, str] | None = None,
                 netns: str | None = None):
        self.name = name
        self.argv = [program(name), *args]
        if netns is not None:  # inside a network namespace (tests/netlab): `ip netns exec` execs, same pid
            self.argv = ["ip", "netns", "exec", netns, *self.argv]
        label = f"{name}-{next(_counter)}"
        self.stdout_path = Path(workdir) / f"{label}.out"
        self.stderr_path = Path(workdir) / f"{label}.err"
        # the test's own cache: servers keep their checkpoints there, not in the user's ~/.cache
        env = {"XDG_CACHE_HOME": str(Path(workdir) / "cache"), **(env or {})}
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                          cwd=REPO_ROOT, env=child_env(env), start_new_session=True)
        self.pid = self.popen.pid  # also its process group id
        _running.add(self)

    def __repr__(self) -> str:
        return f"<{self.name} pid {self.pid}>"

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def describe(self) -> str:
        """The command line and the tail of its output, for failure messages."""
        return (f"{' '.join(self.argv)}\n(pid {self.pid}, exit code {self.popen.poll()})\n"
                f"--- stdout tail:\n{self.stdout()[-TAIL_CHARS:]}\n--- stderr tail:\n{self.stderr()[-TAIL_CHARS:]}")

    def has_exited(self) -> bool:
        """Whether the main process has exited, without reaping it (so its group id stays ours)."""
        if self.popen.returncode is not None:
            return True
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def wait_for_line(self, pattern: str, timeout: float, stream: str = "stdout") -> re.Match:
        """The first match of `pattern` (a regex, per line) in the output; fails if the program exits first."""
        regex = re.compile(pattern, re.MULTILINE)
        read = self.stdout if stream == "stdout" else self.stderr

        def matched() -> re.Match | None:
            exited = self.has_exited()  # checked before reading, so a last line printed before exit counts
            found = regex.search(read())
            if found is None and exited:
                raise AssertionError(f"{self.name} exited before printing {pattern!r}:\n{self.describe()}")
            return found

        return self.wait_until(matched, timeout, f"{self.name} to print {pattern!r}")

    def wait_until(self, predicate, timeout: float, what: str, interval: float = 0.1):
        """helpers.wait_until, with this program's output in the failure message."""
        try:
            return wait_until(predicate, timeout, interval, what)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.describe()}") from None

    def wait(self, timeout: float) -> int:
        """Exit code, once the program exits by itself within `timeout` seconds (then its group is swept)."""
        self.wait_until(self.has_exited, timeout, f"{self.name} to exit")
        return self._reap()

    def send_signal(self, sig: int) -> None:
        """Signal the main process only, as `docker stop` or `kill PID` would."""
        if not self.has_exited():
            os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Signal every process of the program's group, as Ctrl-C, `timeout` or systemd's KillMode do."""
        if not self.has_exited():
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, a bounded wait, then SIGKILL for anything left in the group; returns the exit code."""
        if self.popen.returncode is None:
            self.send_signal(signal.SIGTERM)
            try:
                wait_until(self.has_exited, timeout, 0.1, f"{self.name} to exit after SIGTERM")
            except AssertionError:
                pass  # killed below
        return self._reap()

    def kill(self) -> int:
        """SIGKILL the whole group now."""
        return self._reap()

    def _reap(self) -> int:
        # The main process is a zombie or alive, so nobody else can have taken its pid as a group id.
        if self.popen.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            code = self.popen.wait(KILL_TIMEOUT)
        finally:
            _running.discard(self)
        return code


class ProcSet:
    """Programs started for one test (or module); stop_all() ends them, last started first."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.procs: list[Proc] = []

    def start(self, name: str, *args: str, env: dict[str, str] | None = None, netns: str | None = None) -> Proc:
        proc = Proc(name, [str(a) for a in args], self.workdir, env, netns)
        self.procs.append(proc)
        return proc

    def run(self, name: str, *args: str, timeout: float, env: dict[str, str] | None = None) -> Proc:
        """Start a program and wait (at most `timeout` seconds) for it to exit by itself."""
        proc = self.start(name, *args, env=env)
        proc.wait(timeout)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def kill_all() -> list[Proc]:
    """SIGKILL every program that was started and never stopped; returns them."""
    left = sorted(_running, key=lambda p: p.pid)
    for proc in left:
        proc.kill()
    return left


# --- the swarm's programs --------------------------------------------------------------------------

COORDINATOR_START_TIMEOUT = 60.0  # from exec to "initial peers:" (imports torch and hivemind, starts a DHT)
INITIAL_PEERS_LINE = r"^initial peers: (.+)$"


class Coordinator:
    """A running swarm-coordinator and what it printed."""

    def __init__(self, proc: Proc, maddrs: list[str], metrics_port: int | None):
        self.proc = proc
        self.maddrs = maddrs
        self.metrics_port = metrics_port
        self.peer_id = maddrs[0].rsplit("/p2p/", 1)[1]


def start_coordinator(procs: ProcSet, config_path: Path, *args: str, metrics_port: int | None = None) -> Coordinator:
    """Start swarm-coordinator on loopback and wait until it prints its initial peers."""
    extra = ["--metrics-port", str(metrics_port)] if metrics_port is not None else []
    proc = procs.start("swarm-coordinator", "--config", str(config_path), *LOCALHOST, *extra, *args)
    line = proc.wait_for_line(INITIAL_PEERS_LINE, COORDINATOR_START_TIMEOUT)
    return Coordinator(proc, line.group(1).split(), metrics_port)


# --- peers and what they serve over HTTP ------------------------------------------------------------

SERVER_START_TIMEOUT = 150.0  # exec to "serving stage K" (imports, join, build and time the stage)
SERVING_LINE = r"serving stage (\d+) of \d+ .* as (\S+)$"
HTTP_TIMEOUT = 5.0


def http_get(port: int, path: str) -> str | None:
    """The body of http://127.0.0.1:PORT/PATH, or None while nothing answers there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=HTTP_TIMEOUT) as reply:
            return reply.read().decode()
    except OSError:  # not listening yet, reset, timed out
        return None


def metric(port: int, name: str, **labels: str) -> float | None:
    """Sum of the /metrics samples called `name` whose labels include `labels`; None if there is none."""
    body = http_get(port, "/metrics")
    return None if body is None else metric_in(body, name, **labels)


def metric_in(body: str, name: str, **labels: str) -> float | None:
    """metric() on a /metrics text already read (several figures from one scrape)."""
    values = [sample.value for family in text_string_to_metric_families(body) for sample in family.samples
              if sample.name == name and labels.items() <= sample.labels.items()]
    return sum(values) if values else None


class Peer:
    """A running swarm-peer with /metrics on `metrics_port`."""

    def __init__(self, proc: Proc, metrics_port: int):
        self.proc = proc
        self.metrics_port = metrics_port
        self.peer_id: str | None = None  # a server's, once wait_serving() has read it

    def __repr__(self) -> str:
        return f"<peer {self.peer_id or '?'} {self.proc!r}>"

    def metric(self, name: str, **labels: str) -> float | None:
        """metric() of this peer: None while its /metrics does not answer or has no such sample."""
        return metric(self.metrics_port, name, **labels)

    def wait_serving(self, timeout: float = SERVER_START_TIMEOUT) -> int:
        """Wait until a server prints that it serves its stage; returns the stage and sets `peer_id`."""
        line = self.proc.wait_for_line(SERVING_LINE, timeout, stream="stderr")
        self.peer_id = line.group(2)
        return int(line.group(1))


def start_peer(procs: ProcSet, coordinator: Coordinator, *args: str) -> Peer:
    """Start swarm-peer joined to `coordinator` on loopback, with /metrics on a free port (does not wait)."""
    port = free_port()
    proc = procs.start("swarm-peer", "--initial-peers", *coordinator.maddrs, *LOCALHOST,
                       "--metrics-port", str(port), *args)
    return Peer(proc, port)
