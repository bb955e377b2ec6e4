"""Run config: exact YAML round trip and clear errors naming the field."""

from pathlib import Path

import pytest
import yaml

from swarm.config import ConfigError, RunConfig

pytestmark = pytest.mark.timeout(30)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["tiny.yaml", "small.yaml"])
def test_shipped_configs_round_trip_exactly(name, tmp_path):
    config = RunConfig.load(CONFIGS / name)
    config.save(tmp_path / "again.yaml")
    again = RunConfig.load(tmp_path / "again.yaml")
    assert again == config
    assert again.to_yaml() == config.to_yaml()


def test_non_default_values_survive_round_trip():
    config = RunConfig()
    config.model.dropout = 0.125
    config.optimizer.lr = 3.5e-4
    config.data.tokenizer = "tok.json"
    config.stages.wire_dtype = "bfloat16"
    again = RunConfig.from_yaml(config.to_yaml())
    assert again == config
    assert isinstance(again.optimizer.lr, float) and again.data.tokenizer == "tok.json"


def test_ints_are_accepted_for_float_fields():
    config = RunConfig.from_dict({"optimizer": {"lr": 1, "min_lr": 0}})
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)


def test_small_config_has_tens_of_millions_of_parameters():
    m = RunConfig.load(CONFIGS / "small.yaml").model
    approx = m.n_layer * (4 + 2 * m.mlp_ratio) * m.d_model**2
    assert 10e6 < approx < 100e6


@pytest.mark.parametrize(
    "data, field",
    [
        ({"model": {"n_layers": 4}}, "model.n_layers"),
        ({"bogus": 1}, "bogus"),
        ({"model": {"n_layer": 6}, "stages": {"num_stages": 4}}, "stages.num_stages"),
        ({"model": {"d_model": 0}}, "model.d_model"),
        ({"model": {"n_head": -2}}, "model.n_head"),
        ({"optimizer": {"batch_size": 0}}, "optimizer.batch_size"),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr"),
        ({"optimizer": {"micro_batch_size": 64, "batch_size": 32}}, "optimizer.micro_batch_size"),
        ({"optimizer": {"ahead_wait_seconds": -1.0}}, "optimizer.ahead_wait_seconds"),
        ({"optimizer": {"ahead_wait_seconds": 60.0}}, "optimizer.ahead_wait_seconds"),
        ({"model": {"n_layer": True}}, "model.n_layer"),
        ({"model": {"d_model": 100, "n_head": 3}}, "model.d_model"),
        ({"stages": {"wire_dtype": "int8"}}, "stages.wire_dtype"),
        ({"averaging": {"compression": "zip"}}, "averaging.compression"),
        ({"averaging": {"progress_period": 0}}, "averaging.progress_period"),
        ({"averaging": {"target_group_size": 1}}, "averaging.target_group_size"),
        ({"averaging": {"request_timeout": 6.0, "min_matchmaking_time": 5.0}}, "averaging.request_timeout"),
        ({"averaging": {"min_matchmaking_time": 12.0, "matchmaking_timeout": 10.0}}, "averaging.min_matchmaking_time"),
        ({"averaging": {"next_chunk_timeout": 40.0, "allreduce_timeout": 30.0}}, "averaging.next_chunk_timeout"),
        ({"averaging": {"zero": {"replicas": 0}}}, "averaging.zero.replicas"),
        ({"averaging": {"zero": {"chunk_elements": 2**17 + 1}}}, "averaging.zero.chunk_elements"),
        ({"averaging": {"zero": {"enabled": "yes"}}}, "averaging.zero.enabled"),
        ({"averaging": {"zero": {"enabled": True}, "compression": "float16"}}, "averaging.compression"),
        ({"averaging": {"expert_replica_period": -1}}, "averaging.expert_replica_period"),
        ({"averaging": {"expert_replica_period": float("inf")}}, "averaging.expert_replica_period"),
        ({"averaging": {"expert_replica_period": True}}, "averaging.expert_replica_period"),
        ({"model": {"moe": {"num_experts": 65, "expert_servers": True}}}, "model.moe.num_experts"),
        ({"data": {"val_percent": 0}}, "data.val_percent"),
        ({"network": {"record_ttl": 1.0, "announce_period": 5.0}}, "network.record_ttl"),
        ({"network": {"record_ttl": 7200.0}}, "at most 3600"),
        ({"model": [1, 2]}, "model"),
        ({"run_id": "a b"}, "run_id"),
    ],
)
def test_bad_configs_are_rejected_naming_the_field(data, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        RunConfig.from_dict(data)


def test_bad_yaml_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="YAML"):
        RunConfig.from_yaml("model: [unclosed")
    with pytest.raises(ConfigError, match="cannot read"):
        RunConfig.load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        RunConfig.from_yaml("- a list")


@pytest.mark.parametrize(
    "data, field",
    [
        ({"network": {"timeout_floor": 90.0, "request_timeout": 60.0}}, "network.timeout_floor"),
        ({"network": {"ban_seconds": 30.0, "max_ban_seconds": 10.0}}, "network.max_ban_seconds"),
        ({"network": {"timeout_multiplier": 0}}, "network.timeout_multiplier"),
        ({"network": {"max_wait": 0.0}}, "network.max_wait"),
        ({"network": {"max_wait": float("nan")}}, "network.max_wait"),
        ({"network": {"max_wait": -1.0}}, "network.max_wait"),
        ({"optimizer": {"ahead_wait_seconds": 3.0}}, "network.timeout_floor"),  # (its default, 5 s)
        ({"optimizer": {"round_wait_seconds": 2.5}}, "network.timeout_floor"),
        ({"optimizer": {"step_wait_seconds": 1.0}, "network": {"timeout_floor": 2.0}}, "network.timeout_floor"),
    ],
)
def test_bad_routing_settings_are_rejected(data, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        RunConfig.from_dict(data)


def test_a_run_sets_max_wait_for_its_servers_and_a_servers_flag_overrides_it():
    from argparse import Namespace

    from peer.cli import max_wait

    assert RunConfig().network.max_wait is None
    config = RunConfig.from_dict({"network": {"max_wait": 1.5}})
    assert config.network.max_wait == 1.5
    assert max_wait(Namespace(max_wait=None), config) == 1.5
    assert max_wait(Namespace(max_wait=0.5), config) == 0.5
    assert max_wait(Namespace(max_wait=None), RunConfig()) is None  # the stage server's auto_max_wait
    assert RunConfig.from_dict({"network": {"max_wait": float("inf")}}).network.max_wait == float("inf")  # never


def test_a_published_config_with_settings_of_a_newer_version_is_used_without_them(caplog):
    from swarm.dht import load_identity
    from swarm.dht.records import SwarmRecords
    from swarm.dht.schemas import RunConfigRecord

    newer = RunConfig(run_id="newer").to_dict()
    newer["averaging"]["from_the_future"] = 1
    newer["a_new_section"] = {"x": 1}
    ignored: list[str] = []
    assert RunConfig.from_dict(newer, ignored) == RunConfig(run_id="newer")
    assert ignored == ["a_new_section", "averaging.from_the_future"]
    with pytest.raises(ConfigError, match="unknown key a_new_section"):
        RunConfig.from_dict(newer)  # a local file stays strict

    records = SwarmRecords(None, "newer", load_identity(None))  # only its parsing: no DHT is touched
    record = RunConfigRecord(run_id="newer", config_yaml=yaml.safe_dump(newer), coordinator_peer_id="x")
    with caplog.at_level("WARNING"):
        assert records._parse_run_config(record.to_wire()) == RunConfig(run_id="newer")
    assert "a_new_section, averaging.from_the_future" in caplog.text
