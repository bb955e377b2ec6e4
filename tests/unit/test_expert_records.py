"""Expert host records: guarded at their key, stored and read back through SwarmRecords, listed in /status and /sd."""

from __future__ import annotations

import concurrent.futures
import json

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
from prometheus_client import CollectorRegistry

from coordinator.discovery import discovery_targets
from coordinator.node import Coordinator
from coordinator.status import SwarmGauges, build_status, expert_status
from coordinator.web import StatusHistory
from swarm.config import ModelConfig, MoEConfig, RunConfig
from swarm.dht import ExpertHostRecord, ServerRecord, SwarmRecords, load_identity
from swarm.dht.keys import EXPERTS_FIELD, RunRecordGuard, dht_key, make_validators, run_fields

RUN_ID = "expert-run"
ALICE, MALLORY = load_identity(None), load_identity(None)


def host(peer: str, experts: list[int], state: str = "ONLINE", throughput: float = 1.0, step: int = 0,
         addr: str | None = None) -> ExpertHostRecord:
    return ExpertHostRecord(peer_id=peer, experts=experts, state=state, throughput=throughput, step=step,
                            metrics_addr=addr)


def signed(signer: RSASignatureValidator, owner: bytes, value, field: str = EXPERTS_FIELD) -> DHTRecord:
    key = DHTID.generate(source=dht_key(RUN_ID, field)).to_bytes()
    unsigned = DHTRecord(key, MSGPackSerializer.dumps(owner), MSGPackSerializer.dumps(value), get_dht_time() + 30)
    return DHTRecord(key, unsigned.subkey, signer.sign_value(unsigned), unsigned.expiration_time)


def test_the_experts_key_is_guarded_like_the_others():
    assert EXPERTS_FIELD in run_fields()  # so RunRecordGuard knows the key
    alice_chain = CompositeValidator(make_validators(RUN_ID, ALICE.signing_key))
    mallory = RSASignatureValidator(MALLORY.signing_key)
    assert alice_chain.validate(signed(mallory, MALLORY.owner_key, host(MALLORY.peer_id, [0, 1]).to_wire()))
    # Mallory's signature naming Alice, or a record that does not fit the schema, is refused
    assert not alice_chain.validate(signed(mallory, MALLORY.owner_key, host(ALICE.peer_id, [0]).to_wire()))
    assert not alice_chain.validate(signed(mallory, MALLORY.owner_key,
                                           {**host(MALLORY.peer_id, [0]).to_wire(), "experts": [0, 0]}))
    unsigned = DHTRecord(DHTID.generate(source=dht_key(RUN_ID, EXPERTS_FIELD)).to_bytes(),
                         MSGPackSerializer.dumps(MALLORY.owner_key),
                         MSGPackSerializer.dumps(host(MALLORY.peer_id, [0]).to_wire()), get_dht_time() + 30)
    assert RunRecordGuard(RUN_ID).validate(unsigned) and not alice_chain.validate(unsigned)


class ValidatingDHT:
    """In-process stand-in for hivemind.DHT: each store goes through the signed chain every node runs."""

    def __init__(self, identity):
        self.chain = CompositeValidator(make_validators(RUN_ID, identity.signing_key))
        self.stored: dict[bytes, dict[bytes, ValueWithExpiration]] = {}

    def is_alive(self) -> bool:
        return True

    def store(self, key, subkey, value, expiration_time, return_future):
        record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                           MSGPackSerializer.dumps(value), expiration_time)
        record = DHTRecord(record.key, record.subkey, self.chain.sign_value(record), expiration_time)
        accepted = self.chain.validate(record)
        if accepted:
            self.stored.setdefault(record.key, {})[subkey] = ValueWithExpiration(value, expiration_time)
        return _done(accepted)

    def get(self, key, latest, return_future):
        found = self.stored.get(DHTID.generate(source=key).to_bytes())
        return _done(None if found is None else ValueWithExpiration(found, max(v.expiration_time
                                                                                for v in found.values())))


def _done(result) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(result)
    return future


def test_announce_and_lookup_expert_hosts():
    records = SwarmRecords(ValidatingDHT(ALICE), RUN_ID, ALICE)
    assert records.lookup_expert_hosts() == []
    mine = host(ALICE.peer_id, [2, 0], throughput=3.5, step=7, addr="10.0.0.2:9100")
    assert records.announce_expert_host(mine, ttl=30)
    assert records.lookup_expert_hosts() == [mine]
    assert not records.announce_expert_host(host(MALLORY.peer_id, [1]), ttl=30)  # not this peer's id
    assert records.lookup_expert_hosts() == [mine]


def test_status_lists_each_experts_hosts():
    hosts = [
        host("b", [0, 1], throughput=2.0, step=5),
        host("a", [1, 9], "JOINING"),  # 9: not an expert of this run
        host("c", [2], "OFFLINE"),  # leaving: not listed
        host("d", [3]),
    ]
    doc = build_status("run", {0: [ServerRecord(peer_id="s", stage=0, state="ONLINE", throughput=1.0)]}, [],
                       hosts, num_experts=4)
    assert doc["experts"] == [
        {"expert": 0, "hosts": [{"peer_id": "b", "state": "ONLINE", "throughput": 2.0, "step": 5, "reach": None}]},
        {"expert": 1, "hosts": [{"peer_id": "a", "state": "JOINING", "throughput": 1.0, "step": 0, "reach": None},
                                {"peer_id": "b", "state": "ONLINE", "throughput": 2.0, "step": 5, "reach": None}]},
        {"expert": 2, "hosts": []},
        {"expert": 3, "hosts": [{"peer_id": "d", "state": "ONLINE", "throughput": 1.0, "step": 0, "reach": None}]},
    ]
    assert doc["expert_hosts"] == 2 and doc["unhosted_experts"] == [2]
    assert doc["stages"][0]["online"] == 1
    assert doc["volunteers"] == 4  # the stage server and the expert servers not leaving (a, b, d)
    json.dumps(doc)


def test_dense_runs_have_no_experts_section_and_empty_moe_runs_have_every_expert_unhosted():
    assert "experts" not in build_status("run", {}, [], [host("a", [0])])
    assert expert_status([], 3) == {"experts": [{"expert": e, "hosts": []} for e in range(3)], "expert_hosts": 0,
                                    "unhosted_experts": [0, 1, 2]}


class FakeRecords:
    def __init__(self, hosts: list[ExpertHostRecord]):
        self.hosts, self.fail = hosts, False

    def lookup_all_servers(self, num_stages: int):
        return {stage: [] for stage in range(num_stages)}

    def lookup_metrics(self):
        return []

    def lookup_expert_hosts(self):
        if self.fail:
            raise TimeoutError("DHT hiccup")
        return self.hosts


def coordinator(config: RunConfig, records: FakeRecords) -> Coordinator:
    # the status part of a Coordinator, without its DHT
    node = Coordinator.__new__(Coordinator)
    node.config, node.records = config, records
    node.history, node.gauges = StatusHistory(), SwarmGauges(CollectorRegistry())
    node._records, node._expert_hosts = ({}, []), []
    return node


def test_refresh_status_looks_up_expert_hosts_and_survives_a_failed_lookup():
    config = RunConfig(run_id=RUN_ID, model=ModelConfig(moe=MoEConfig(num_experts=2, expert_servers=True)))
    records = FakeRecords([host("a", [1])])
    node = coordinator(config, records)
    assert node.refresh_status()["unhosted_experts"] == [0]
    records.fail, records.hosts = True, []
    status = node.refresh_status()  # the last answer stands
    assert status["unhosted_experts"] == [0] and status["expert_hosts"] == 1 and status["run_id"] == RUN_ID
    records.fail = False
    assert node.refresh_status()["unhosted_experts"] == [0, 1]


def test_refresh_status_of_a_dense_run_does_not_look_up_expert_hosts():
    records = FakeRecords([])
    records.fail = True
    assert "experts" not in coordinator(RunConfig(run_id=RUN_ID), records).refresh_status()


def test_expert_hosts_are_discovery_targets():
    groups = discovery_targets(
        "run", {0: [ServerRecord(peer_id="s", stage=0, state="ONLINE", throughput=1.0, metrics_addr="10.0.0.1:1")]},
        [], expert_hosts=[host("e", [0], addr="10.0.0.2:1"), host("gone", [1], "OFFLINE", addr="10.0.0.3:1"),
                          host("dup", [1], addr="10.0.0.1:1"), host("quiet", [2])])
    assert groups == [
        {"targets": ["10.0.0.1:1"], "labels": {"role": "server", "stage": "0", "peer_id": "s", "run_id": "run"}},
        {"targets": ["10.0.0.2:1"], "labels": {"role": "expert", "peer_id": "e", "run_id": "run"}},
    ]


def test_an_expert_host_a_moment_ahead_of_the_run_s_records_is_looked_up_again(caplog):
    # Records are announced each on its own phase: in a run of several steps a second an honest host's step
    # can be past the bound the others' make (a test saw 72 against 71); a liar's stays past it
    import threading
    from types import SimpleNamespace

    from swarm.dht.schemas import ServerState
    from swarm.serving.expert import DONOR_LOOKUPS, ExpertServer

    def reads(host_steps, server_steps):
        server = object.__new__(ExpertServer)
        server.peer_id, server._stop = "me", threading.Event()
        server.config = SimpleNamespace(network=SimpleNamespace(announce_period=0.0),
                                        stages=SimpleNamespace(num_stages=2))
        online = ServerState.ONLINE.value
        hosts, servers = iter(host_steps), iter(server_steps)
        server.records = SimpleNamespace(
            lookup_expert_hosts=lambda: [SimpleNamespace(peer_id="host", state=online, step=next(hosts),
                                                         experts=[0])],
            lookup_all_servers=lambda num_stages: {0: [SimpleNamespace(peer_id=p, state=online, step=s)
                                                       for p, s in zip("ab", next(servers))]})
        return [r.step for r in server._donors_within_bound()]

    assert reads([72, 73], [(69, 69), (71, 72)]) == [73]  # the second read catches up
    assert reads([10**9] * DONOR_LOOKUPS, [(69, 69)] * DONOR_LOOKUPS) == []  # a liar, refused in the end
    assert "beyond step 71" in caplog.text


def test_a_host_seen_when_choosing_stays_a_donor_when_a_later_lookup_misses_it():
    # CI saw a joiner choose expert 0 beside its live host, then find no host of it and start it afresh
    import threading
    from types import SimpleNamespace

    from swarm.serving import ExpertServer

    server = object.__new__(ExpertServer)
    server.peer_id, server._stop = "me", threading.Event()
    server.config = SimpleNamespace(network=SimpleNamespace(announce_period=0.0), stages=SimpleNamespace(num_stages=2))
    lookups = iter([[], [host("a", [0, 1], step=5)]])
    server.records = SimpleNamespace(lookup_expert_hosts=lambda: next(lookups),
                                     lookup_all_servers=lambda num_stages: {0: [], 1: []})
    seen = [host("a", [0, 1], step=4), host("me", [2]), host("gone", [3], "OFFLINE")]
    assert [(r.peer_id, r.step) for r in server._donors_within_bound(seen)] == [("a", 4)]
    assert [(r.peer_id, r.step) for r in server._donors_within_bound(seen)] == [("a", 5)]  # the fresh record wins
