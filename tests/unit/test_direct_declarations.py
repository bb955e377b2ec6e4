"""Matchmaking declarations sent straight to a stage's servers (swarm/averaging/direct.py), without a network."""

from __future__ import annotations

import asyncio
import time

import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from swarm.averaging import direct
from swarm.averaging.direct import MAX_KEYS, MIN_LOOKUP_INTERVAL, Declarations, DirectKeyManager, merged

pytestmark = pytest.mark.timeout(30)

PREFIX = "run_stage1_averaging"
KEY = f"{PREFIX}.0b0000000000000001"
HORIZON = 15.0
ME, A, B, STRANGER = (PeerID(bytes([0x12, 0x20]) + bytes([i]) * 32) for i in range(4))


def declarations(*expected: PeerID) -> Declarations:
    table = Declarations(PREFIX, HORIZON)
    table.expect(expected)
    return table


def soon(seconds: float = 2.0) -> float:
    return get_dht_time() + seconds


def test_a_declaration_from_an_expected_server_is_kept():
    table = declarations(A, B)
    expiration = soon()
    assert table.take(A, KEY, expiration, True)
    assert table.entries(KEY) == {A: (expiration, True)}
    assert table.taken == 1 and table.refused == 0


@pytest.mark.parametrize("sender, key, expiration, looking", [
    (STRANGER, KEY, "soon", True),  # not a server this round expects
    (A, "other_stage1_averaging.0b01", "soon", True),  # another averager's key
    (A, f"{PREFIX}.0b01x", "soon", True),  # not a group key
    (A, f"{PREFIX}.0b" + "1" * 300, "soon", True),  # too long
    (A, 7, "soon", True),
    (A, KEY, "soon", 1),  # looking must be a bool
    (A, KEY, 5, True),  # an expiration must be a float
    (A, KEY, float("nan"), True),
    (A, KEY, float("inf"), True),
    (A, KEY, "past", True),  # already expired
    (A, KEY, "far", True),  # beyond any round's matchmaking
])
def test_an_unbelievable_declaration_is_refused_and_changes_nothing(sender, key, expiration, looking):
    table = declarations(A, B)
    kept = soon()
    table.take(B, KEY, kept, True)
    expiration = {"soon": soon(), "past": get_dht_time() - 1.0, "far": soon(HORIZON + 60.0)}.get(expiration, expiration)
    assert not table.take(sender, key, expiration, looking)
    assert table.entries(KEY) == {B: (kept, True)}
    assert table.refused == 1


def test_the_later_expiration_wins_and_at_one_expiration_no_longer_looking_wins():
    table = declarations(A)
    first, later = soon(2.0), soon(3.0)
    table.take(A, KEY, later, True)
    table.take(A, KEY, first, True)  # an older declaration arriving late
    assert table.entries(KEY) == {A: (later, True)}
    table.take(A, KEY, later, False)  # it left matchmaking
    assert table.entries(KEY) == {A: (later, False)}
    table.take(A, KEY, later, True)  # a reordered "looking" of the same round does not bring it back
    assert table.entries(KEY) == {A: (later, False)}


def test_a_server_no_longer_expected_and_expired_entries_are_not_read(monkeypatch):
    table = declarations(A, B)
    table.take(A, KEY, soon(), True)
    table.take(B, KEY, soon(0.05), True)
    table.expect([B])
    monkeypatch.setattr(direct, "get_dht_time", lambda: get_dht_time() + 0.1)  # 0.1 s later
    assert table.entries(KEY) == {}


def test_the_table_keeps_at_most_max_keys_and_drops_the_one_that_expires_first():
    table = declarations(A)
    keys = [f"{PREFIX}.0b{i:016b}" for i in range(MAX_KEYS + 1)]
    for i, key in enumerate(keys):
        assert table.take(A, key, soon(2.0 + (0.1 if i else 0.0) + 0.01 * i), True)
    assert table.entries(keys[0]) == {}  # the shortest-lived went
    assert all(table.entries(key) for key in keys[1:])
    assert len(table._table) == MAX_KEYS


def test_merged_takes_each_peer_s_latest_entry_and_leaves_out_those_not_looking_if_asked():
    dht = {A: (5.0, True), B: (5.0, True)}
    direct = {A: (6.0, True), B: (5.0, False)}
    assert sorted(merged(dht, direct, only_active=True)) == [(A, 6.0)]
    assert sorted(merged(dht, direct, only_active=False), key=lambda e: e[1]) == [(B, 5.0), (A, 6.0)]


# --- the key manager -------------------------------------------------------------------------------------


class FakeDHT:
    """What GroupKeyManager reads and writes in the DHT: `found` answers reads after `read_delay` seconds
    (None: never); stores never finish (a DHT round trip nobody should wait for)."""

    def __init__(self, found: dict[PeerID, float] | None = None, read_delay: float | None = 0.0,
                 fail: bool = False):
        self.peer_id = ME
        self.found, self.read_delay, self.fail = found or {}, read_delay, fail
        self.reads = self.stores = 0

    async def get(self, key, latest, return_future):
        self.reads += 1
        if self.read_delay is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.read_delay)
        if self.fail:
            raise RuntimeError("the DHT is down")
        return ValueWithExpiration({peer.to_bytes(): ValueWithExpiration(True, expiration)
                                    for peer, expiration in self.found.items()}, soon())

    async def store(self, **kwargs):
        self.stores += 1
        await asyncio.Event().wait()


class Sent:
    """Sends declarations: each is taken by every peer, unless `reached` is False."""

    def __init__(self, delay: float = 0.0, reached: bool = True):
        self.delay, self.reached, self.calls = delay, reached, []

    async def __call__(self, peers, key, expiration, looking):
        self.calls.append((sorted(peers, key=str), key, expiration, looking))
        await asyncio.sleep(self.delay)
        return self.reached


def manager(dht: FakeDHT, table: Declarations, send: Sent | None = None,
            lookup_timeout: float = 1.0) -> DirectKeyManager:
    base = GroupKeyManager(dht, PREFIX, "0000000000000001", target_group_size=2)
    return DirectKeyManager(base, table, send or Sent(), lookup_timeout=lookup_timeout)


def test_a_declaration_sent_to_us_is_found_without_waiting_for_the_dht():
    async def main():
        table = declarations(A)
        keys = manager(FakeDHT(read_delay=None), table)
        expiration = soon()
        table.take(A, KEY, expiration, True)
        started = time.monotonic()
        found = await keys.get_averagers(KEY, only_active=True)
        return found, time.monotonic() - started

    found, took = asyncio.run(main())
    assert found == [(A, pytest.approx(found[0][1]))] and took < 0.5


def test_with_nothing_new_a_read_waits_for_the_next_declaration_not_the_lookup_timeout():
    async def main():
        table = declarations(A)
        dht = FakeDHT(read_delay=None)
        keys = manager(dht, table, lookup_timeout=5.0)

        async def declare_once_the_read_waits():
            while dht.reads == 0:  # the read has found nothing yet and waits (its DHT read never answers)
                await asyncio.sleep(0)
            table.take(A, KEY, soon(), True)

        later = asyncio.create_task(declare_once_the_read_waits())
        started = time.monotonic()
        found = await keys.get_averagers(KEY, only_active=True)
        await later
        return found, time.monotonic() - started

    found, took = asyncio.run(main())
    assert [peer for peer, _ in found] == [A]  # declared only after the read began: the read waited for it
    assert took < 2.5  # woken by the declaration, well before the 5 s lookup timeout


def test_the_dht_s_averagers_are_merged_in():
    async def main():
        table = declarations(A, STRANGER)  # (one expected server has not declared to us: the DHT is read)
        dht = FakeDHT(found={B: soon(3.0)})
        keys = manager(dht, table)
        table.take(A, KEY, soon(), True)
        first = await keys.get_averagers(KEY, only_active=True)  # answered at once from the declaration
        await asyncio.wait_for(keys._lookups[KEY], 1.0)  # the DHT read lands
        second = await keys.get_averagers(KEY, only_active=True)
        return first, second

    first, second = asyncio.run(main())
    assert [peer for peer, _ in first] == [A]
    assert sorted(peer.to_bytes() for peer, _ in second) == sorted(p.to_bytes() for p in (A, B))


def test_a_dht_that_fails_at_once_is_not_read_in_a_busy_loop():
    async def main():
        dht = FakeDHT(fail=True)
        keys = manager(dht, declarations(A))
        started = time.monotonic()
        while time.monotonic() - started < 0.5:
            await keys.get_averagers(KEY, only_active=True)
        return dht.reads

    reads = asyncio.run(main())
    assert reads <= 0.5 / MIN_LOOKUP_INTERVAL + 2


def test_declaring_sends_to_the_expected_servers_and_never_waits_for_the_dht_store():
    async def main():
        table = declarations(A, B)
        dht, send = FakeDHT(), Sent(reached=False)  # (someone did not take it: the DHT must carry it)
        keys = manager(dht, table, send)
        expiration = soon()
        await asyncio.wait_for(keys.declare_averager(KEY, ME, expiration, looking_for_group=True), 1.0)
        slow = Sent(delay=10.0)
        keys._send = slow
        await asyncio.wait_for(keys.declare_averager(KEY, ME, expiration, looking_for_group=False), 1.0)
        await asyncio.sleep(0)
        return send.calls, slow.calls, dht.stores

    sent, leaving, stores = asyncio.run(main())
    assert sent == [(sorted([A, B], key=str), KEY, pytest.approx(sent[0][2]), True)]
    assert [call[3] for call in leaving] == [False]  # sent, in the background: leaving does not wait on it
    assert stores == 2  # both stored in the DHT, in the background (leaving overwrites the entry there)


@pytest.mark.parametrize("expected, reached, stores", [((A, B), True, 0), ((A, B), False, 2), ((), True, 2)])
def test_the_dht_carries_a_declaration_only_when_the_direct_way_did_not_reach_every_expected_server(
        expected, reached, stores):
    async def main():
        dht = FakeDHT()
        keys = manager(dht, declarations(*expected), Sent(reached=reached))
        expiration = soon()
        await asyncio.wait_for(keys.declare_averager(KEY, ME, expiration, looking_for_group=True), 1.0)
        await asyncio.wait_for(keys.declare_averager(KEY, ME, expiration, looking_for_group=False), 1.0)
        for _ in range(3):
            await asyncio.sleep(0)
        return dht.stores

    assert asyncio.run(main()) == stores


def test_the_dht_is_not_read_once_every_expected_server_declared_straight_to_us():
    async def main():
        table = declarations(A, B)
        dht = FakeDHT(found={STRANGER: soon(3.0)})
        keys = manager(dht, table)
        table.take(A, KEY, soon(), True)
        first = await keys.get_averagers(KEY, only_active=True)  # B has not declared yet: the DHT is asked
        await asyncio.wait_for(keys._lookups[KEY], 1.0)
        reads = dht.reads
        table.take(B, KEY, soon(), True)
        second = await keys.get_averagers(KEY, only_active=True)
        return reads, dht.reads, first, second

    reads_before, reads_after, first, second = asyncio.run(main())
    assert reads_before == 1 and reads_after == 1  # no read once A and B both declared to us
    assert {peer for peer, _ in first} == {A}
    assert {peer for peer, _ in second} == {A, B, STRANGER}  # (what the DHT said earlier still counts)


def test_with_every_expected_server_declared_a_read_with_nothing_new_returns_soon():
    # hivemind's matchmaking joins a leader only after a read that ends after it asked for one: a read may not
    # wait for the next declaration (which may never come) when there is no DHT read to wait for either
    async def main():
        table = declarations(A)
        keys = manager(FakeDHT(read_delay=None), table, lookup_timeout=5.0)
        table.take(A, KEY, soon(), True)
        await keys.get_averagers(KEY, only_active=True)
        started = time.monotonic()
        again = await keys.get_averagers(KEY, only_active=True)  # nothing new
        return again, time.monotonic() - started

    again, took = asyncio.run(main())
    assert [peer for peer, _ in again] == [A] and took < 1.0  # not the 5 s lookup timeout
