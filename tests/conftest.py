"""Fixtures shared by the tests: a fast run config, started programs, and a session-end process sweep."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import pytest
import torch

from swarm.config import RunConfig
from swarm.threads import CHECK_ENV
from tests.procs import REPO_ROOT, ProcSet, kill_all

# Mutators check they run on their owner's thread, here and in every process the tests start (swarm.threads)
os.environ[CHECK_ENV] = "1"

# One torch thread per test process: make test runs two of them on two cores beside the programs the
# integration tests start. With torch's default (a thread per core) a worker's OpenMP threads wait on
# each other whenever one is descheduled, and a 3 s unit test took over 60 s on a loaded CI machine.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/tiny.yaml, tuned so tests see state changes within seconds and load data quickly."""
    config = RunConfig.load(REPO_ROOT / "configs" / "tiny.yaml")
    config.network.announce_period = 1.0  # OFFLINE / ONLINE changes reach the DHT within a second
    config.network.record_ttl = 5.0
    config.data.max_bytes = 300_000
    config.averaging.min_tenure = 2.0  # joiners adopt a state within seconds (the trust tests set their own)
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    config.validate()
    config.save(path)
    return path


@pytest.fixture
def procs(tmp_path: Path):
    """Start programs with `procs.start(name, *args)`; all are stopped when the test ends."""
    started = ProcSet(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture(scope="session", autouse=True)
def _kill_leftover_processes():
    """At the end of the session, kill programs a failed test left running and any other stray child."""
    yield
    leaked = [repr(proc) for proc in kill_all()]
    for pid, cmdline in _descendants(os.getpid()).items():
        if "resource_tracker" in cmdline:  # multiprocessing's own helper; it exits with us
            continue
        if "torch_shm_manager" in cmdline:  # torch's shared-memory helper (hivemind averaging); exits with us,
            continue  # and killing it first makes this process abort at exit ("Broken pipe", status 134)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        leaked.append(f"pid {pid}: {cmdline[:200]}")
    if leaked:
        warnings.warn("killed processes left behind by the tests: " + "; ".join(leaked), stacklevel=1)


def _descendants(root: int) -> dict[int, str]:
    """Live descendants of process `root` and their command lines, read from /proc."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited while we looked
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            parents[int(entry.name)] = int(ppid)
            cmdlines[int(entry.name)] = cmdline.strip()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = cmdlines[pid]
                frontier.append(pid)
    return found
