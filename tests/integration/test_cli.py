"""The programs as people run them: `swarm-coordinator` and `swarm-peer --check`, good and bad input.

Errors a person can cause must end with one clear `PROG: error:` line on stderr and a non-zero exit,
never a traceback (ARCHITECTURE.md, "Interfaces").
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from swarm.config import RunConfig
from tests.procs import (
    LOCALHOST,
    SERVER_START_TIMEOUT,
    Coordinator,
    Proc,
    ProcSet,
    free_port,
    group_members,
    start_coordinator,
)

pytestmark = pytest.mark.timeout(90)

RUN_ID = "cli-test"  # given with --run-id, so the peer must print the coordinator's override
CHECK_TIMEOUT = 45.0  # swarm-peer --check: imports, DHT start, run info, signed config
DEAD_PEER_BOUND = 30.0  # a join against an address nobody listens on must give up at least this fast
ERROR_EXIT_TIMEOUT = 30.0  # a bad flag or config is refused (after imports, before any network)
SHUTDOWN_TIMEOUT = 20.0  # SIGTERM to exit, and then to the last process of the group gone
GROUP_SHUTDOWN_TIMEOUT = 40.0  # the same when the whole group is signalled (the DHT's shutdown times out first)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory, tiny_config_path: Path):
    procs = ProcSet(tmp_path_factory.mktemp("cli"))
    try:
        yield start_coordinator(procs, tiny_config_path, "--run-id", RUN_ID)
    finally:
        procs.stop_all()


def assert_clear_error(proc: Proc, prog: str, *mentions: str) -> str:
    """The program failed with one `PROG: error:` line (the last line of stderr) and no traceback."""
    assert proc.returncode not in (0, None), proc.describe()
    stderr = proc.stderr()
    assert "Traceback" not in stderr, proc.describe()
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(f"{prog}: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.describe()
    for mention in mentions:
        assert mention in errors[0], proc.describe()
    return errors[0]


def check_output(proc: Proc) -> tuple[str, RunConfig]:
    """The description line and the run config a successful `swarm-peer --check` printed."""
    assert proc.returncode == 0, proc.describe()
    description, _, yaml_text = proc.stdout().partition("\n")
    return description, RunConfig.from_yaml(yaml_text)


def test_coordinator_prints_initial_peers_and_check_prints_its_config(
    coordinator: Coordinator, procs: ProcSet, tiny_config_path: Path
):
    assert coordinator.maddrs and all(
        m.startswith("/ip4/127.0.0.1/tcp/") and m.endswith(f"/p2p/{coordinator.peer_id}") for m in coordinator.maddrs
    ), coordinator.maddrs

    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", *LOCALHOST,
                     timeout=CHECK_TIMEOUT)

    description, printed = check_output(proc)
    expected = RunConfig.load(tiny_config_path)
    expected.run_id = RUN_ID
    assert printed == expected
    assert description.startswith(f"run {RUN_ID}:"), description


def test_check_against_a_dead_address_fails_fast_and_clearly(coordinator: Coordinator, procs: ProcSet):
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{coordinator.peer_id}"  # a real peer id, nobody listening
    started = time.monotonic()
    proc = procs.run("swarm-peer", "--initial-peers", dead, "--check", *LOCALHOST, timeout=DEAD_PEER_BOUND)
    assert time.monotonic() - started < DEAD_PEER_BOUND
    assert_clear_error(proc, "swarm-peer", dead)


def test_garbage_initial_peer_is_a_clear_error(procs: ProcSet):
    proc = procs.run("swarm-peer", "--initial-peers", "garbage", "--check", *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert_clear_error(proc, "swarm-peer", "'garbage'")


@pytest.mark.parametrize(("flags", "expected"), [
    (("--relays", "/ip4/127.0.0.1/tcp/5"), ("bad relay", "/p2p/<peer id>")),
    (("--relays", "garbage"), ("bad relay", "'garbage'")),
    (("--reachability", "sometimes"), ("--reachability", "invalid choice")),
])
def test_bad_nat_flags_are_clear_errors(procs: ProcSet, coordinator: Coordinator, flags, expected):
    proc = procs.run("swarm-peer", "--initial-peers", coordinator.maddrs[0], "--role", "server", *flags,
                     *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert proc.returncode != 0, proc.describe()
    assert_clear_error(proc, "swarm-peer", *expected)


def test_a_server_with_a_persistent_identity_starts_its_relay_client(procs: ProcSet, coordinator: Coordinator,
                                                                     tmp_path: Path):
    # hivemind checks a persistent identity is free with a throwaway daemon (auto-relay, no relays): the relay
    # flags of a server's own daemon must not reach it, or p2pd refuses to start (seen in the image's swarm)
    server = procs.start("swarm-peer", "--initial-peers", coordinator.maddrs[0], "--role", "server", "--stage", "0",
                         "--identity", str(tmp_path / "server.id"), *LOCALHOST)
    server.wait_for_line(r"reachability: direct", SERVER_START_TIMEOUT, stream="stderr")
    server.wait_for_line(r"serving stage 0 of", SERVER_START_TIMEOUT, stream="stderr")


def test_out_of_range_flag_is_an_argparse_error(procs: ProcSet, coordinator: Coordinator):
    proc = procs.run("swarm-peer", "--initial-peers", coordinator.maddrs[0], "--check", "--inject-failure-rate", "2",
                     *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert proc.returncode == 2, proc.describe()
    assert "usage: swarm-peer" in proc.stderr()
    assert_clear_error(proc, "swarm-peer", "--inject-failure-rate", "2")


def test_in_flight_must_be_positive(procs: ProcSet, coordinator: Coordinator):
    proc = procs.run("swarm-peer", "--initial-peers", coordinator.maddrs[0], "--role", "trainer", "--in-flight", "0",
                     *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert proc.returncode == 2, proc.describe()
    assert_clear_error(proc, "swarm-peer", "--in-flight", "at least 1")


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--activation-cache-mb", "nan", "finite number"), ("--activation-cache-ttl", "0", "finite number"),
    ("--rebalance-period", "0", "finite number"), ("--rebalance-period", "inf", "finite number"),
    ("--max-queue", "0", "at least 1"), ("--max-queue", "2.5", "whole number"),
    ("--inject-slowdown", "0.5", ">= 1"), ("--inject-slowdown", "inf", ">= 1"),
    ("--max-wait", "0", "> 0"), ("--max-wait", "nan", "> 0")])
def test_server_flags_must_be_sane(procs: ProcSet, coordinator: Coordinator, flag: str, value: str, expected: str):
    proc = procs.run("swarm-peer", "--initial-peers", coordinator.maddrs[0], "--role", "server", flag, value,
                     *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert proc.returncode == 2, proc.describe()
    assert_clear_error(proc, "swarm-peer", flag, expected)


def test_movable_and_no_rebalance_contradict(procs: ProcSet, coordinator: Coordinator):
    proc = procs.run("swarm-peer", "--initial-peers", coordinator.maddrs[0], "--role", "server", "--stage", "0",
                     "--movable", "--no-rebalance", *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert proc.returncode != 0, proc.describe()
    assert_clear_error(proc, "swarm-peer", "--movable and --no-rebalance")


def test_missing_config_is_a_clear_error(procs: ProcSet, tmp_path: Path):
    missing = tmp_path / "missing.yaml"
    proc = procs.run("swarm-coordinator", "--config", str(missing), *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert_clear_error(proc, "swarm-coordinator", str(missing))


def test_bad_metrics_network_is_a_clear_error(procs: ProcSet, tiny_config_path: Path):
    proc = procs.run("swarm-coordinator", "--config", str(tiny_config_path), "--metrics-networks", "10.0.0.0/8",
                     "10.0.0.0/40", *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert_clear_error(proc, "swarm-coordinator", "'10.0.0.0/40'", "not an IP network")


def test_config_with_unknown_key_is_a_clear_error(procs: ProcSet, tmp_path: Path, tiny_config_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(tiny_config_path.read_text().replace("  n_layer:", "  n_layers_typo: 4\n  n_layer:", 1))
    proc = procs.run("swarm-coordinator", "--config", str(bad), *LOCALHOST, timeout=ERROR_EXIT_TIMEOUT)
    assert_clear_error(proc, "swarm-coordinator", "model.n_layers_typo")


def test_initial_peers_from_the_environment(coordinator: Coordinator, procs: ProcSet):
    env = {"SWARM_INITIAL_PEERS": " ".join(coordinator.maddrs)}
    proc = procs.run("swarm-peer", "--check", *LOCALHOST, env=env, timeout=CHECK_TIMEOUT)
    _, printed = check_output(proc)
    assert printed.run_id == RUN_ID


def test_a_flag_wins_over_its_environment_variable(coordinator: Coordinator, procs: ProcSet):
    env = {"SWARM_INITIAL_PEERS": "garbage"}
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", *LOCALHOST, env=env,
                     timeout=CHECK_TIMEOUT)
    _, printed = check_output(proc)
    assert printed.run_id == RUN_ID


def assert_exits_cleanly(proc: Proc, timeout: float) -> None:
    """The program exits with code 0 within `timeout`, and so do its DHT process and p2pd daemon."""
    proc.wait_until(proc.has_exited, timeout, f"{proc.name} to exit")
    # checked before wait() reaps it, which kills whatever is left of its group
    proc.wait_until(lambda: not group_members(proc.pid), timeout, f"{proc.name}'s child processes to exit")
    assert proc.wait(0) == 0, proc.describe()


def test_coordinator_exits_cleanly_on_sigterm(procs: ProcSet, tiny_config_path: Path):
    coordinator = start_coordinator(procs, tiny_config_path)
    coordinator.proc.send_signal(signal.SIGTERM)
    assert_exits_cleanly(coordinator.proc, SHUTDOWN_TIMEOUT)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_coordinator_exits_when_its_whole_process_group_is_signalled(
    procs: ProcSet, tiny_config_path: Path, sig: signal.Signals
):
    # Ctrl-C, `timeout` and systemd signal every process of the group: p2pd dies at once, so the DHT's
    # graceful shutdown times out and its fallback (SIGTERM to the forked DHT process) must work.
    coordinator = start_coordinator(procs, tiny_config_path)
    coordinator.proc.signal_group(sig)
    assert_exits_cleanly(coordinator.proc, GROUP_SHUTDOWN_TIMEOUT)
