"""Whom a peer trusts when the coordinator changes identity, and what clocks that disagree do to records.

Real DHT nodes on 127.0.0.1. A peer's clock is skewed by patching the DHT time every loaded module
reads (hivemind's get_dht_time is time.time) while its DHT process is forked and while it writes:
the process keeps the skewed clock, as a machine whose clock is off would.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import hivemind
import pytest
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from swarm.config import MAX_RECORD_TTL, OptimizerConfig, RunConfig
from swarm.dht import (
    BackgroundLoop,
    RunConfigNotFound,
    RunInfo,
    ServerRecord,
    ServerState,
    SwarmDHTError,
    SwarmRecords,
    join_run,
    load_identity,
    peer_id,
    serve_run_info,
    start_dht,
    visible_maddrs,
)
from swarm.dht.keys import dht_key
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

RUN_ID = "trust-run"
CONFIG = RunConfig(run_id=RUN_ID, optimizer=OptimizerConfig(lr=3e-4))
JOIN_TIMEOUT = 30.0
REFUSED_JOIN_TIMEOUT = 6.0  # a join through a peer that vouches for a coordinator that is gone
PROPAGATION_TIMEOUT = 20.0
SHORT_TTL = 3.0


@contextlib.contextmanager
def clock_skewed_by(seconds: float) -> Iterator[None]:
    """Every loaded module's DHT time runs `seconds` ahead (behind, if negative) while inside."""
    real = time.time
    patched = [module for module in list(sys.modules.values()) if getattr(module, "get_dht_time", None) is real]
    for module in patched:
        module.get_dht_time = lambda: real() + seconds
    try:
        yield
    finally:
        for module in patched:
            module.get_dht_time = real


@pytest.fixture
def nodes():
    loop = BackgroundLoop("test-dht-trust").start()
    dhts: list[hivemind.DHT] = []
    try:
        yield loop, dhts
    finally:
        loop.stop()
        for dht in reversed(dhts):
            dht.shutdown()


def coordinator(dhts: list, loop: BackgroundLoop, identity, config: RunConfig = CONFIG, ttl: float = 60.0,
                initial_peers: list[str] = ()) -> tuple[hivemind.DHT, RunInfo]:
    """A coordinator's node as swarm-coordinator starts it: the signed config, run_info."""
    dht = start_dht(RUN_ID, identity, initial_peers=initial_peers)
    dhts.append(dht)
    assert SwarmRecords(dht, RUN_ID, identity).publish_run_config(config, ttl=ttl)
    info = RunInfo(RUN_ID, identity.owner_key, peer_id(dht))
    serve_run_info(dht, loop, info)
    return dht, info


def test_a_coordinator_restarted_with_a_new_identity_is_not_followed_and_says_so(nodes, tmp_path):
    loop, dhts = nodes
    identity_file = tmp_path / "coordinator.id"
    old_dht, old_info = coordinator(dhts, loop, load_identity(identity_file), ttl=SHORT_TTL)
    member = load_identity(None)
    member_dht, info, _ = join_run(visible_maddrs(old_dht), member, loop, timeout=JOIN_TIMEOUT)
    dhts.append(member_dht)
    assert info == old_info
    serve_run_info(member_dht, loop, info)  # as swarm-peer does: newcomers may join through it
    member_maddrs = visible_maddrs(member_dht)
    old_dht.shutdown()

    # restarted without its identity file: a new key, publishing another config for the same run id, in the
    # same DHT (as when someone lists the old swarm's peers and the new address as initial peers)
    new = load_identity(None)
    other_config = RunConfig(run_id=RUN_ID, optimizer=OptimizerConfig(lr=1.0))
    new_dht, new_info = coordinator(dhts, loop, new, other_config, initial_peers=member_maddrs)
    records = SwarmRecords(member_dht, RUN_ID, member)

    def refusal() -> RunConfigNotFound | None:
        try:
            records.fetch_run_config(info.coordinator_key)
        except RunConfigNotFound as e:
            return e if new.peer_id in e.others else None
        return None  # the old config has not expired yet

    refused = wait_until(refusal, SHORT_TTL + PROPAGATION_TIMEOUT, 0.2, "the old config to expire, the new to show")
    assert "new identity" in str(refused) and new.peer_id in str(refused) and "--identity" in str(refused)
    # a newcomer joining through the member, which vouches for the old coordinator, is refused and told why
    with pytest.raises(RunConfigNotFound, match="new identity") as joined:
        join_run(member_maddrs, load_identity(None), loop, timeout=REFUSED_JOIN_TIMEOUT)
    assert new.peer_id in str(joined.value)
    # one joining through the new coordinator's own address follows it
    newcomer_dht, newcomer_info, newcomer_config = join_run(visible_maddrs(new_dht), load_identity(None), loop,
                                                            timeout=JOIN_TIMEOUT)
    dhts.append(newcomer_dht)
    assert newcomer_info == new_info and newcomer_config == other_config

    # restarted with its identity file, the coordinator is the one the member trusts, as before
    coordinator(dhts, loop, load_identity(identity_file), initial_peers=member_maddrs)
    wait_until(lambda: _fetch(records, info.coordinator_key) == CONFIG, PROPAGATION_TIMEOUT, 0.2, "the old key back")


def _fetch(records: SwarmRecords, key: bytes) -> RunConfig | None:
    try:
        return records.fetch_run_config(key)
    except RunConfigNotFound:
        return None


def test_a_peer_whose_clock_is_off_by_more_than_hivemind_allows_is_told_so(nodes):
    loop, dhts = nodes
    dht, _ = coordinator(dhts, loop, load_identity(None))
    with clock_skewed_by(MAX_DHT_TIME_DISCREPANCY_SECONDS + 7), pytest.raises(SwarmDHTError, match="clock") as e:
        start_dht(RUN_ID, load_identity(None), initial_peers=visible_maddrs(dht))
    assert "NTP" in str(e.value)


@pytest.mark.parametrize("skew", [MAX_DHT_TIME_DISCREPANCY_SECONDS - 0.5, -(MAX_DHT_TIME_DISCREPANCY_SECONDS - 0.5)])
def test_records_of_a_peer_whose_clock_is_a_few_seconds_off_live_their_ttl_give_or_take_the_skew(nodes, skew):
    loop, dhts = nodes
    dht, _ = coordinator(dhts, loop, load_identity(None))
    reader = SwarmRecords(dht, RUN_ID, load_identity(None))
    skewed = load_identity(None)
    with clock_skewed_by(skew):
        skewed_dht = start_dht(RUN_ID, skewed, initial_peers=visible_maddrs(dht))
    dhts.append(skewed_dht)
    writer = SwarmRecords(skewed_dht, RUN_ID, skewed)
    record = ServerRecord(peer_id=skewed.peer_id, stage=0, state=ServerState.ONLINE, throughput=1.0)
    longest = record.copy(update={"stage": 1})
    before = time.time()
    with clock_skewed_by(skew):
        assert writer.announce_server(record, ttl=SHORT_TTL)
        # the longest ttl a run may set is still taken from a clock that is ahead (the bound has a minute's slack)
        assert writer.announce_server(longest, ttl=MAX_RECORD_TTL)
    after = time.time()
    wait_until(lambda: reader.lookup_all_servers(2) == {0: [record], 1: [longest]}, PROPAGATION_TIMEOUT, 0.1,
               "the skewed peer's records")
    # on the reader's clock the record lives its ttl shifted by the skew: a renewal every announce_period
    # keeps it up as long as record_ttl - announce_period exceeds the skew (the default config leaves 20 s,
    # more than the 3 s hivemind lets peers differ by)
    [found] = dht.get(dht_key(RUN_ID, "stage0"), latest=True).value.values()
    assert before + SHORT_TTL + skew <= found.expiration_time <= after + SHORT_TTL + skew
    wait_until(lambda: reader.lookup_servers(0) == [], SHORT_TTL + skew + PROPAGATION_TIMEOUT, 0.1, "its expiry")
    assert reader.lookup_servers(1) == [longest]
