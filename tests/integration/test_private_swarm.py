"""A private swarm: `swarm-coordinator --swarm-key FILE`; only peers with a copy of the file get in.

The programs run as people run them (like test_cli). Without the key a peer learns nothing from
the initial peer and cannot find the run config; with a wrong key neither; with the key it joins.
A stranger's DHT node (stock hivemind) finds nothing under the run's own id, and what it could hold
under the private id is sealed.
"""

from __future__ import annotations

from pathlib import Path

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator

from swarm.config import RunConfig
from swarm.dht import load_identity, load_swarm_key
from swarm.dht.keys import dht_key
from swarm.dht.private import SEALED_PREFIX
from tests.integration.test_cli import CHECK_TIMEOUT, assert_clear_error, check_output
from tests.procs import LOCALHOST, ProcSet, start_coordinator

pytestmark = pytest.mark.timeout(180)

RUN_ID = "private-test"
JOIN_TIMEOUT = "5"  # a peer without the key gives up this fast (no initial peer answers it)


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory, tiny_config_path: Path):
    root = tmp_path_factory.mktemp("private")
    key_file = root / "swarm.key"
    procs = ProcSet(root)
    try:
        coordinator = start_coordinator(procs, tiny_config_path, "--run-id", RUN_ID, "--swarm-key", str(key_file))
        yield coordinator, key_file
    finally:
        procs.stop_all()


def test_the_coordinator_writes_a_private_key_file(private):
    _, key_file = private
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert len(key_file.read_text().strip()) == 64


def test_a_peer_with_the_key_joins(private, procs: ProcSet):
    coordinator, key_file = private
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", "--swarm-key", str(key_file),
                     *LOCALHOST, timeout=CHECK_TIMEOUT)
    _, config = check_output(proc)
    assert config.run_id == load_swarm_key(key_file).network_id(RUN_ID)


def test_a_peer_without_the_key_or_with_another_learns_nothing(private, procs: ProcSet, tmp_path: Path):
    coordinator, _ = private
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", "--join-timeout", JOIN_TIMEOUT,
                     *LOCALHOST, timeout=CHECK_TIMEOUT)
    assert_clear_error(proc, "swarm-peer", "--swarm-key")
    assert RUN_ID not in proc.stdout() + proc.stderr()
    other = tmp_path / "other.key"
    other.write_text("ab" * 32)
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", "--join-timeout", JOIN_TIMEOUT,
                     "--swarm-key", str(other), *LOCALHOST, timeout=CHECK_TIMEOUT)
    assert_clear_error(proc, "swarm-peer", "this --swarm-key")
    proc = procs.run("swarm-peer", "--initial-peers", *coordinator.maddrs, "--check", "--swarm-key",
                     str(tmp_path / "missing.key"), *LOCALHOST, timeout=CHECK_TIMEOUT)
    assert_clear_error(proc, "swarm-peer", "missing.key", "does not exist")


def test_a_stranger_in_the_dht_cannot_read_the_run_config(private):
    coordinator, key_file = private
    # stock hivemind, with the signature validator only to strip signatures off what it reads
    stranger = hivemind.DHT(initial_peers=coordinator.maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True,
                            record_validators=[RSASignatureValidator(load_identity(None).signing_key)])
    try:
        assert stranger.get(dht_key(RUN_ID, "config"), latest=True) is None  # the run's own id finds nothing
        # even knowing the private id, what the DHT holds there is sealed
        found = stranger.get(dht_key(load_swarm_key(key_file).network_id(RUN_ID), "config"), latest=True)
        assert found is not None
        [record] = [item.value for item in found.value.values()]
        assert record["config_yaml"].startswith(SEALED_PREFIX) and "model:" not in record["config_yaml"]
        opened = RunConfig.from_yaml(load_swarm_key(key_file).open(record["config_yaml"]))
        assert opened.run_id.startswith(RUN_ID + "-")
    finally:
        stranger.shutdown()
