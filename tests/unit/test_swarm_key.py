"""SwarmKey: the key file, the network id and run_info name it derives, sealing the run config."""

from __future__ import annotations

import stat

import pytest

from swarm.config import RunConfig
from swarm.dht import RunConfigInvalid, RunConfigRecord, SwarmDHTError, SwarmRecords, load_identity, load_swarm_key
from swarm.dht.private import SEALED_PREFIX, SEALED_RUN_ID, SwarmKey, is_sealed

pytestmark = pytest.mark.timeout(30)


def test_a_key_file_is_created_private_and_read_back(tmp_path):
    path = tmp_path / "swarm.key"
    with pytest.raises(SwarmDHTError, match="does not exist"):
        load_swarm_key(path)
    created = load_swarm_key(path, create=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_swarm_key(path) == created == load_swarm_key(path, create=True)
    for bad in ("", "zz" * 32, "ab" * 31, "ab" * 33):
        path.write_text(bad)
        with pytest.raises(SwarmDHTError, match="64 hex digits"):
            load_swarm_key(path)


def test_names_derive_from_the_key_and_the_run():
    a, b = SwarmKey(b"a" * 32), SwarmKey(b"b" * 32)
    assert a.network_id("run") == a.network_id("run") != b.network_id("run")
    assert a.network_id("run").startswith("run-") and a.network_id("run") != a.network_id("other")
    assert a.run_info_namespace() != b.run_info_namespace()
    assert "a" * 8 not in a.network_id("run")  # nothing of the secret itself


def test_sealed_text_opens_only_with_its_key_and_unchanged():
    a, b = SwarmKey(b"a" * 32), SwarmKey(b"b" * 32)
    sealed = a.seal("model:\n  d_model: 128\n")
    assert is_sealed(sealed) and sealed.startswith(SEALED_PREFIX) and "d_model" not in sealed
    assert a.open(sealed) == "model:\n  d_model: 128\n"
    assert a.seal("x") != a.seal("x")  # a fresh nonce each time
    tampered = sealed[:-4] + ("AAAA" if not sealed.endswith("AAAA") else "BBBB")
    for wrong, key in ((sealed, b), (tampered, a), ("model: {}", a), (SEALED_PREFIX + "!!", a)):
        with pytest.raises(ValueError):
            key.open(wrong)


def test_sealed_bytes_open_only_with_their_key_and_for_their_purpose():
    a, b = SwarmKey(b"a" * 32), SwarmKey(b"b" * 32)
    sealed = a.seal_bytes(b"run info naming run-0123", "run-info")
    assert b"run-0123" not in sealed and sealed.startswith(SEALED_PREFIX.encode())
    assert a.open_bytes(sealed, "run-info") == b"run info naming run-0123"
    with pytest.raises(ValueError):
        b.open_bytes(sealed, "run-info")
    with pytest.raises(ValueError):
        a.open_bytes(sealed, "config")  # sealed for one purpose, it opens for no other
    with pytest.raises(ValueError):
        a.open_bytes(sealed[:-1] + bytes([sealed[-1] ^ 1]), "run-info")
    with pytest.raises(ValueError):
        a.open_bytes(b"plain", "run-info")
    with pytest.raises(ValueError):  # nor does a sealed run config open as sealed bytes
        a.open_bytes(a.seal("text").encode(), "run-info")


def test_a_private_config_record_names_no_run_and_older_ones_still_read():
    key = SwarmKey(b"a" * 32)
    network_id = key.network_id("run")
    config = RunConfig(run_id=network_id)
    records = SwarmRecords(None, network_id, load_identity(None), swarm_key=key)
    sealed = key.seal(config.to_yaml())
    new = RunConfigRecord(run_id=SEALED_RUN_ID, config_yaml=sealed, coordinator_peer_id="Qm").to_wire()
    old = RunConfigRecord(run_id=network_id, config_yaml=sealed, coordinator_peer_id="Qm").to_wire()
    assert records._parse_run_config(new) == records._parse_run_config(old) == config
    with pytest.raises(RunConfigInvalid, match="start with --swarm-key"):  # a peer without the key is told why
        SwarmRecords(None, network_id, load_identity(None))._parse_run_config(new)
    other = RunConfigRecord(run_id=SEALED_RUN_ID, config_yaml=key.seal(RunConfig(run_id=key.network_id("x")).to_yaml()),
                            coordinator_peer_id="Qm").to_wire()
    with pytest.raises(RunConfigInvalid, match="is for run"):  # the run inside the seal is checked
        records._parse_run_config(other)
