"""Progress pushed between the servers of a stage: what a receiver believes, and what it drops."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.averaging.channel import ProgressChannel
from swarm.averaging.progress import ProgressRecord, round_of, sharing_priority
from swarm.averaging.tracker import StageProgressTracker
from swarm.protocol.framing import decode_metadata, encode_metadata

pytestmark = pytest.mark.timeout(30)

A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # base58 peer ids (hivemind parses them)
B = "QmPChd2hVbrJ6bfo3WBcTW4iZnpHm8TEzWkLHmLpXhF68A"


def record(peer: str, samples: int, updated: float, step: int = 3) -> ProgressRecord:
    made_by = round_of(step, [peer])
    return ProgressRecord(peer_id=peer, step=step, samples=samples, round_id=made_by, group=1,
                          priority=sharing_priority(step, 1, made_by, peer), updated=updated)


def tracker_knowing(*records: ProgressRecord) -> StageProgressTracker:
    """A tracker (no DHT, no thread) whose last DHT read returned `records`."""
    own = record("me", 0, 0.0)
    tracker = StageProgressTracker(None, "run_stage0_averaging", b"key", "me", period=1.0, request_timeout=1.0,
                                   own_record=lambda: own, on_update=lambda: None)
    tracker._merge({r.peer_id: (r, get_dht_time() + 60) for r in records})
    return tracker


def test_a_push_counts_only_from_a_known_server_about_itself_and_only_if_newer():
    tracker = tracker_knowing(record(A, 4, updated=10.0))
    assert not tracker.receive(record(B, 8, updated=11.0), B)  # not in the stage's DHT records
    assert not tracker.receive(record(B, 8, updated=11.0), A)  # A speaking for B
    assert not tracker.receive(record(A, 8, updated=9.0), A)  # older than what the DHT said
    assert [r.samples for r in tracker.others()] == [4]
    assert tracker.receive(record(A, 8, updated=11.0), A)
    assert [r.samples for r in tracker.others()] == [8]


def test_a_dht_read_older_than_a_push_keeps_the_push_and_drops_servers_gone_from_the_dht():
    tracker = tracker_knowing(record(A, 4, updated=10.0), record(B, 0, updated=10.0))
    assert tracker.receive(record(A, 12, updated=12.0), A)
    tracker._merge({A: (record(A, 4, updated=10.0), get_dht_time() + 60)})  # eventual consistency: an old copy
    assert [(r.peer_id, r.samples) for r in tracker.others()] == [(A, 12)]  # B left (its record is gone)
    tracker._merge(None)  # a failed read changes nothing
    assert [(r.peer_id, r.samples) for r in tracker.others()] == [(A, 12)]


def test_an_expired_record_stops_counting():
    tracker = tracker_knowing()
    tracker._merge({A: (record(A, 4, updated=10.0), get_dht_time() - 1)})
    assert tracker.others() == []


def handle(channel: ProgressChannel, metadata: bytes, sender: str) -> bool:
    context = SimpleNamespace(remote_id=PeerID.from_base58(sender))
    reply = asyncio.run(channel._handle(runtime_pb2.ExpertRequest(metadata=metadata), context))
    return decode_metadata(reply.metadata)["ok"]


def test_the_handler_answers_every_push_and_passes_on_only_well_formed_records_of_the_sender():
    taken = []
    channel = ProgressChannel(None, None, "run_stage0_averaging")
    channel._receive = lambda rec, sender: taken.append((rec.samples, sender)) or True
    good = record(A, 4, updated=1.0)
    assert handle(channel, encode_metadata(good.to_wire()), A)
    for metadata in (b"\xc1garbage", encode_metadata([1, 2]), encode_metadata({**good.to_wire(), "samples": -1}),
                     encode_metadata({"peer_id": A})):
        assert not handle(channel, metadata, A)
    assert not handle(channel, encode_metadata(good.to_wire()), B)  # B sending A's record
    assert taken == [(4, A)] and channel.received == 1


class FakeP2P:
    """Answers a push as the receiver would: taken or not, or fails."""

    def __init__(self, answer):
        self.answer = answer

    async def call_protobuf_handler(self, peer, name, request, reply_type):
        if isinstance(self.answer, Exception):
            raise self.answer
        return runtime_pb2.ExpertResponse(metadata=encode_metadata({"ok": self.answer}))


@pytest.mark.parametrize("answer, missed", [(True, False), (False, True), (ConnectionError("gone"), True)])
def test_a_push_that_was_not_taken_makes_the_tracker_publish_in_the_dht_before_the_period(answer, missed):
    # Pushes carry each change; the DHT is refreshed on its period unless one did not get through.
    channel = ProgressChannel(FakeP2P(answer), None, "run_stage0_averaging")
    tracker = tracker_knowing(record(A, 4, updated=10.0))
    woken = []
    channel.on_missed = lambda: woken.append(True)
    tracker._channel = channel
    tracker._nudged.set()
    channel._slots.acquire()  # (as push does before it sends)
    asyncio.run(channel._send(PeerID.from_base58(A), runtime_pb2.ExpertRequest()))
    assert channel.missed() is missed and bool(woken) is missed
    assert tracker._hurry() is missed
    channel.clear_missed()
    assert not tracker._hurry()


def test_without_a_channel_a_change_is_published_in_the_dht_before_the_period():
    tracker = tracker_knowing()
    assert not tracker._hurry()
    tracker._nudged.set()
    assert tracker._hurry()
